#!/usr/bin/env bash
# dev/gpu_check.sh's mingpt part: pytorch/examples' minGPT-ddp (.gpu/mingpt, from dev/gpu_prepare.sh) through
# `hpc_ddp.submit --local` at world size 1 on the machine's one GPU, as a newcomer would run it (docs/cluster.md,
# "Someone else's script on the first day"):
#   1. unmodified: it wants 2 GPUs, prints "Unable to locate sufficient 2 gpus ... Exiting." and exits 0; hpc_ddp
#      must record that it trained nothing (the note status shows), not a finished run that says nothing;
#   2. a copy whose one change is that minimum (1), one epoch on 1 % of the text: it must train (Epoch lines,
#      finished).
# Writes both runs' `status` into OUT_FILE; exits 1 when either expectation fails.
set -u
report=${1:?usage: dev/gpu_mingpt.sh OUT_FILE}
py=${PYTHON:-python3}
src=$PWD/.gpu/mingpt
work=$(mktemp -d /tmp/mingpt-XXXX)
cp -r "$src" "$work/unmodified"
cp -r "$src" "$work/one-gpu"
sed -i 's/_min_gpu_count = 2/_min_gpu_count = 1/' "$work/one-gpu/main.py"
grep -q "_min_gpu_count = 1" "$work/one-gpu/main.py" || { echo "minGPT's main.py changed: no _min_gpu_count = 2"; exit 1; }
rc=0
for variant in unmodified one-gpu; do
    cat >"$work/$variant.yaml" <<EOF
name: mingpt-$variant
run_dir: $work/run-$variant
train:
  script: $work/$variant/main.py
  script_progress: 'Epoch (\d+)'
  args:
    - data_config.path=$work/$variant/data/input.txt
    - data_config.truncate=0.01
    - trainer_config.max_epochs=1
    - trainer_config.batch_size=64
    - trainer_config.data_loader_workers=1
    - trainer_config.snapshot_path=\${run_dir}/snapshot.pt
slurm:
  nodes: 1
  tasks_per_node: 1
EOF
    (cd "$work" && timeout 70 "$py" -m hpc_ddp.submit "$variant.yaml" --local) >"$work/$variant.out" 2>&1
    echo "== $variant: submit --local rc $?" >>"$report"
    tail -15 "$work/$variant.out" >>"$report"
    "$py" -m hpc_ddp.status "$work/run-$variant" >>"$report" 2>&1
done
grep -q "printed no line matching" "$work/unmodified.out" \
    || { echo "unmodified minGPT: hpc_ddp did not say that it trained nothing"; rc=1; }
grep -q "Epoch 0" "$work/one-gpu.out" && ! grep -q "printed no line matching" "$work/one-gpu.out" \
    || { echo "one-GPU minGPT: it did not train (no 'Epoch 0' line)"; rc=1; }
cat "$report"
exit $rc
