#!/usr/bin/env bash
# The one prepared GPU check (issue 58): what only a GPU can show, run on a lent machine by the device tool's
# `run`, each part with its own time limit, inside one budget, writing what it saw under OUTDIR as it goes (at most
# 8 files come back: machine.txt, summary.txt, log.txt, figures.json, b15.json, mingpt.txt).
#
# Before it, here: `bash dev/gpu_prepare.sh` (the wheels and minGPT-ddp the machine cannot fetch, in .gpu/). Then:
#   run(command='bash dev/gpu_check.sh "$OUT"', carry=['.gpu'], timeout_s=590)
# Without a GPU (or without torch) every part says that it needs one, in a second or two, and nothing runs.
#
# Parts, in the order they run (PARTS picks and orders them; a part whose limit no longer fits the budget is
# listed as not run, for the next lent GPU; the rest of tests/gpu comes third: its 360 s limit fits only early):
#   survivor  the survivors' snapshot at world size 1 while a long torch.cuda._sleep wedges the update stream:
#             step k held, copied on a side stream and written bit for bit before the stream is free; and the
#             device's events said without a wait (tests/gpu: two tests). Limit 90 s.
#   pair      two ranks on the one GPU (gloo group, CUDA model with BatchNorm, per-rank CUDA batch): no sync in
#             any run.boundary after the first (tests/gpu/sync_free_pair.py). Limit 150 s.
#   tests     the rest of tests/gpu (NCCL resume, RNG, staging, the hang and crash paths, the mirror). Limit 360 s.
#   b15       B15 on CUDA: run.boundary alone, GPT own loop and Trainer, world size 1 (benchmarks/boundary.py).
#             Limit 200 s.
#   nccl      dev/nccl_net_check.py: the network NCCL says it uses, parsed from its own lines. Limit 90 s.
#   pipeline  tests/gpu's two pipeline tests, then B2-GPU-PIPELINE (2048 MB CUDA state vs dd). Limit 90 + 240 s.
#   gpu       B2-GPU (own loop vs raw, sync/async snapshots) at GPU_ROUNDS rounds (default 2). Limit 300 s.
#   mingpt    pytorch/examples' minGPT-ddp, unmodified, at world size 1 through hpc_ddp.submit --local: it refuses
#             one GPU ("Unable to locate sufficient 2 gpus") and hpc_ddp must say it trained nothing; then a copy
#             whose only change is that minimum (1), one epoch on 1 % of the text, which must train. Limit 150 s.
#   mirror    B2-MIRROR on the machine's CPU cores (gloo, 2 ranks). Limit 30 + 15 s a round (MIRROR_ROUNDS, 4).
# Usage: bash dev/gpu_check.sh OUTDIR [PARTS, default survivor,pair,tests,b15,nccl,pipeline,mingpt,gpu]
#        [BUDGET_S, default 540: one call of the device tool (at most 600 s), with the wheels' install]
set -u
out=${1:?usage: dev/gpu_check.sh OUTDIR [survivor,pair,tests,b15,nccl,pipeline,mingpt,gpu,mirror] [BUDGET_S]}
parts=${2:-survivor,pair,tests,b15,nccl,pipeline,mingpt,gpu}
budget=${3:-540}
py=${PYTHON:-python3}
mkdir -p "$out"
summary="$out/summary.txt" log="$out/log.txt"
: >"$summary"
: >"$log"
say() { echo "$*" | tee -a "$summary"; }

if ! why=$("$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")' 2>&1); then
    [ -n "$why" ] || why="no CUDA device"
    case $why in *ModuleNotFoundError*|*ImportError*) why="$py cannot import torch";; *) why=$(tail -1 <<<"$why");; esac
    for part in ${parts//,/ }; do say "$part: needs a GPU ($why): not run"; done
    exit 0
fi
if [ -d .gpu/wheels ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/wheels/*.whl >>"$log" 2>&1 || { say "setup: the wheels of .gpu/wheels did not install (log.txt)"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
    say "setup: no .gpu/wheels (run dev/gpu_prepare.sh here and carry .gpu): parts that need omegaconf will fail"
fi
export PYTHONUNBUFFERED=1
{ date; nproc; lscpu | grep -E 'Model name|Thread|Core|Socket'; nvidia-smi -L
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
} >"$out/machine.txt" 2>&1
started=$SECONDS

# part NAME LIMIT_S COMMAND...: runs it under its limit when the budget still holds it; its output goes to log.txt
part() {
    local name=$1 limit=$2 begin rc
    shift 2
    if (( SECONDS - started + limit > budget )); then
        say "$name: not run (its limit, ${limit} s, is past what is left of the ${budget} s budget)"
        return
    fi
    begin=$SECONDS
    echo "===== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    rc=$?
    say "$name: rc $rc$([ $rc = 124 ] && echo ' (timed out)') in $((SECONDS - begin)) s"
    tail -4 "$log" | sed "s/^/    /" | tee -a "$summary" >/dev/null
}
figure() {  # NAME JSON_FILE: merged into figures.json under NAME
    "$py" - "$out/figures.json" "$1" "$2" <<'EOF' >>"$log" 2>&1
import json, os, sys
path, name, part = sys.argv[1:]
figures = json.load(open(path)) if os.path.exists(path) else {}
try:
    figures[name] = json.load(open(part))
except (OSError, ValueError) as err:
    figures[name] = {"error": repr(err)}
json.dump(figures, open(path, "w"), indent=1)
EOF
}
pytest_gpu=("$py" -m pytest -q -p no:cacheprovider tests/gpu)

for name in ${parts//,/ }; do
    case $name in
    survivor) part survivor 90 "${pytest_gpu[@]}" -k "survivor_writes or gpu_has_not_finished" ;;
    pair) part pair 150 "${pytest_gpu[@]}" -k world_size_two ;;
    b15) part b15 200 "$py" -m benchmarks.boundary "$out/b15.json" --calls 1000 --cases gpt:1:cuda,trainer:1:cuda ;;
    nccl) part nccl 90 "$py" dev/nccl_net_check.py ;;
    pipeline)
        part pipeline-tests 90 "${pytest_gpu[@]}" -k "through_the_pipeline or boundary_s_state"
        part pipeline 240 sh -c "$py -m benchmarks.gpu --pipeline > /tmp/pipeline.json"
        figure B2-GPU-PIPELINE /tmp/pipeline.json ;;
    gpu)
        part gpu 300 "$py" -c "import json; from benchmarks.gpu import figures
json.dump(figures(${GPU_ROUNDS:-2}, 400, 50, 2048, smoke=False), open('/tmp/b2-gpu.json', 'w'), indent=1)"
        figure B2-GPU /tmp/b2-gpu.json ;;
    mingpt)
        if [ -f .gpu/mingpt/main.py ]; then
            part mingpt 150 bash dev/gpu_mingpt.sh "$out/mingpt.txt"
        else
            say "mingpt: not run (no .gpu/mingpt: run dev/gpu_prepare.sh here and carry .gpu)"
        fi ;;
    tests) part tests 360 "${pytest_gpu[@]}" -k "not survivor_writes and not gpu_has_not_finished and not world_size_two" ;;
    mirror)
        part mirror $((30 + 15 * ${MIRROR_ROUNDS:-4})) "$py" -c "import json; from benchmarks.run import b2_mirror
json.dump(b2_mirror(${MIRROR_ROUNDS:-4}, 100), open('/tmp/b2-mirror.json', 'w'), indent=1)"
        figure B2-MIRROR-DEVICE /tmp/b2-mirror.json ;;
    *) say "$name: unknown part (known: survivor pair b15 nccl pipeline gpu mingpt tests mirror)" ;;
    esac
done
say "all: $((SECONDS - started)) s of the ${budget} s budget"
