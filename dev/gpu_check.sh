#!/usr/bin/env bash
# The checks a lent GPU machine runs (the device tool's `run`), each with its own time limit, each writing into
# OUTDIR as it goes, so a part that runs long costs only itself.
#   tests   tests/gpu: NCCL at world size 1, CUDA RNG restore, pinned staging, bf16, the hang and crash paths on
#           NCCL, the mirror with a CUDA tensor. Seen on an H200 machine (2026-11-26): the first 7 tests took
#           170 s; the hang test waits up to 100 s and the crash test up to 90 s. Limit: 360 s.
#   mirror  B2-MIRROR on that machine's 16 CPU cores (gloo, 2 ranks: more cores than ranks). About 11 s per round
#           of 100 steps there. Limit: 30 s + 15 s per round. Its JSON goes into benchmarks/results.json by hand,
#           as B2-MIRROR-DEVICE with a "machine" line (the table in docs/performance.md shows it).
#   gpu     B2-GPU (benchmarks/gpu.py): over 170 s at 5 rounds there (with its 2048 MB snapshot figures); give it a
#           call of its own. Limit: 540 s.
#   pipeline  the snapshot's device-to-host pipeline (hpc_ddp/rank/state/pipeline.py): its two tests in tests/gpu
#           (a CUDA state through reused pinned memory resumes bit-identically; an async snapshot does not wait for
#           the GPU and holds its boundary's state), then B2-GPU-PIPELINE (`python -m benchmarks.gpu --pipeline`:
#           a 2048 MB CUDA state, sync GB/s against dd, async blocking, the first snapshot, one writer thread
#           against two on that disk). Not run on a GPU yet: about 2 minutes expected. Limits: 150 s + 300 s.
#   nccl    dev/nccl_net_check.py: NCCL at world size 1, one all_reduce, and which network the parser read from
#           NCCL's own INIT/NET lines (hpc_ddp.rank.group.nccl_report). Limit: 120 s.
# A session has 15 minutes of device time in all and a machine starts in about 30 s: run `tests,mirror` in one
# call and `gpu` in another, or fewer rounds; `pipeline` alone fits one short call.
# Usage, from the repository root on the device (carry .whl, which holds the omegaconf and submitit wheels):
#   bash dev/gpu_check.sh "$OUT" [PARTS, default tests,mirror,nccl] [mirror rounds, default 8] [gpu rounds, default 3]
set -u
out=${1:?usage: dev/gpu_check.sh OUTDIR [tests,mirror,gpu,pipeline,nccl] [mirror_rounds] [gpu_rounds]}
parts=,${2:-tests,mirror,nccl},
mrounds=${3:-8}
grounds=${4:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/deps/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ date; nproc; lscpu | grep -E 'Model name|Thread|Core|Socket'; nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'; } \
    >"$out/machine.txt" 2>&1
if [[ $parts == *,tests,* ]]; then
    start=$SECONDS
    timeout 360 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu-tests.log" | tail -40
    echo "tests/gpu: $((SECONDS - start)) s"
fi
if [[ $parts == *,mirror,* ]]; then
    start=$SECONDS
    timeout $((30 + 15 * mrounds)) python3 -c "import json, sys; from benchmarks.run import b2_mirror
json.dump(b2_mirror($mrounds, 100), sys.stdout, indent=1)" >"$out/b2-mirror.json" 2>"$out/b2-mirror.err"
    echo "B2-MIRROR ($mrounds rounds of 100 steps): rc $?, $((SECONDS - start)) s"; cat "$out/b2-mirror.json"
fi
if [[ $parts == *,gpu,* ]]; then
    start=$SECONDS
    timeout 540 python3 -c "import json, sys; from benchmarks.gpu import figures
json.dump(figures($grounds, 400, 50, 2048, smoke=False), sys.stdout, indent=1)" >"$out/b2-gpu.json" 2>"$out/b2-gpu.err"
    echo "B2-GPU ($grounds rounds): rc $?, $((SECONDS - start)) s"; cat "$out/b2-gpu.json"
fi
if [[ $parts == *,pipeline,* ]]; then
    start=$SECONDS
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "through_the_pipeline or boundary_s_state" 2>&1 \
        | tee "$out/pipeline-tests.log" | tail -30
    timeout 300 python3 -m benchmarks.gpu --pipeline >"$out/b2-gpu-pipeline.json" 2>"$out/b2-gpu-pipeline.err"
    echo "B2-GPU-PIPELINE: rc $?, $((SECONDS - start)) s"; cat "$out/b2-gpu-pipeline.json"
fi
if [[ $parts == *,nccl,* ]]; then
    start=$SECONDS
    timeout 120 python3 dev/nccl_net_check.py 2>&1 | tee "$out/nccl-net.log" | tail -30
    echo "nccl_net_check: $((SECONDS - start)) s"
fi
