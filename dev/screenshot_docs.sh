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
for page in "$@"; do
    name=${page%%#*}
    anchor=${page#"$name"}
    "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,${HPC_DDP_SHOT_HEIGHT:-2400} \
        --screenshot="$out/${name//\//_}.png" "file://$PWD/runs/site/$name/index.html$anchor" 2>/dev/null
    echo "$out/${name//\//_}.png"
done
