#!/usr/bin/env bash
# What a lent GPU machine needs and cannot fetch (nothing outside it can be reached): run here, before the device
# tool's `run`, then name `.gpu` in its `carry`. Makes (ignored by git, a few MB):
#   .gpu/wheels/   omegaconf (and antlr4 4.9.3, built here: it has no wheel), submitit, cloudpickle, hydra-core
#                  and boto3 (minGPT's), at the versions this checkout's .venv has where it has them
#   .gpu/mingpt/   pytorch/examples' distributed/minGPT-ddp/mingpt, unmodified, from a local snapshot of that
#                  repository (the `fetch` tool's, or any clone): bash dev/gpu_prepare.sh [EXAMPLES_GIT_DIR]
# torch is on the device machine already; dev/gpu_check.sh installs the wheels with --no-deps into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
examples=${1:-/work/.mirror/pytorch+examples/repo}
py=.venv/bin/python
[ -x "$py" ] || py=python3
pin() {  # NAME: NAME==VERSION as this checkout's venv has it, else NAME
    local v
    v=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) || v=
    [ -n "$v" ] && echo "$1==$v" || echo "$1"
}
rm -rf .gpu/wheels && mkdir -p .gpu/wheels
"$py" -m pip wheel -q --no-deps -w .gpu/wheels "$(pin omegaconf)" "antlr4-python3-runtime==4.9.3" \
    "$(pin submitit)" "$(pin cloudpickle)" hydra-core
"$py" -m pip wheel -q -w .gpu/wheels boto3  # minGPT's trainer.py imports it (with its own dependencies)
if git --git-dir="$examples" rev-parse -q --verify HEAD >/dev/null 2>&1 || git -C "$examples" rev-parse HEAD >/dev/null 2>&1; then
    rm -rf .gpu/mingpt && mkdir -p .gpu/mingpt
    { git --git-dir="$examples" archive HEAD distributed/minGPT-ddp/mingpt 2>/dev/null \
        || git -C "$examples" archive HEAD distributed/minGPT-ddp/mingpt; } \
        | tar -x -C .gpu/mingpt --strip-components=3
    echo "minGPT-ddp from $examples: $(ls .gpu/mingpt | tr '\n' ' ')"
else
    echo "no pytorch/examples snapshot at $examples: the mingpt part of dev/gpu_check.sh will say so" >&2
fi
ls -l .gpu/wheels
du -sh .gpu
