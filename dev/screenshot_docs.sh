#!/usr/bin/env bash
# Look at the docs as a reader does: build the site, then screenshot pages in headless Chromium.
#   bash dev/screenshot_docs.sh faults submit#preflight     # -> runs/docs-shots/faults.png, submit.png
# Pages are names under docs/ without .md (an #anchor scrolls there). Needs chromium
# (apt-get install chromium). PNGs go to runs/docs-shots/ (git-ignored); open them and look.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${HPC_DDP_VENV:-.venv}/bin/python"
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "error: chromium not found; install it with: apt-get install chromium" >&2; exit 2; }
[ "$#" -gt 0 ] || { echo "usage: bash dev/screenshot_docs.sh PAGE[#anchor] ..." >&2; exit 2; }
out=runs/docs-shots
mkdir -p "$out"
"$python" -m mkdocs build --strict --quiet --site-dir runs/site
# headless Chromium ignores an #anchor for a screenshot, so a page with one is cut to start at that
# heading (a copy beside the page); without the flags below it may draw a blank page (it waits on
# its first-run and network services)
cut() {  # cut PAGE_HTML ANCHOR -> the copy's path
    "$python" - "$1" "$2" <<'PY'
import sys
from pathlib import Path
page, anchor = Path(sys.argv[1]), sys.argv[2]
html = page.read_text()
at = html.find(f'id="{anchor}"')
if at < 0:
    sys.exit(f"error: no heading #{anchor} in {page}")
start = html.rfind("<h", 0, at)
body = html.find(">", html.find("<article")) + 1
copy = page.with_name(f"shot-{anchor}.html")
copy.write_text(html[:body] + html[start:])
print(copy)
PY
}
for page in "$@"; do
    name=${page%%#*}
    anchor=${page#"$name"}
    target="$PWD/runs/site/$name/index.html"
    [ -z "$anchor" ] || target=$(cut "$target" "${anchor#\#}")
    "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="${TMPDIR:-/tmp}/hpc_ddp-chromium" --hide-scrollbars \
        --window-size=1280,${HPC_DDP_SHOT_HEIGHT:-2400} \
        --screenshot="$out/${name//\//_}.png" "file://$target" 2>/dev/null
    echo "$out/${name//\//_}.png"
done
