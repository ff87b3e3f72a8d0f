#!/usr/bin/env bash
# The torch range that is tested is the range declared (issue 57): run the tests that lean on torch
# under another torch release, in a venv of its own, .venv-torch-VERSION in the checkout.
#
#   bash dev/torch_matrix.sh 2.15.0        # the venv is kept: a second run reinstalls nothing
#   bash dev/torch_matrix.sh 2.14.1 -x     # extra arguments go to both pytest runs
#
# The venv comes from dev/setup.sh (HPC_DDP_VENV, TORCH_SPEC; no --slurm) with pip's config files
# ignored (PIP_CONFIG_FILE=/dev/null): a machine's constraint file may cap torch below VERSION.
# PIP_* variables still count, e.g. PIP_EXTRA_INDEX_URL for a local mirror. Two tiers, on the
# local machine only (no Slurm cluster is started; the tests marked cluster are left out):
#   unit:      tests/core rundir login shell rank, -m "not cluster and not slow and not compile"
#   rehearsal: the whole runs listed in REHEARSAL below (a stop, a heal, a survivors' snapshot...)
# The last line says `torch X: unit N passed ..., rehearsal M passed ...`; the exit code is
# non-zero when the install or any test failed. CI runs torch 2.13.0 through dev/test.sh.
# The tests run this checkout's files as they are: a change half made meanwhile fails them.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$#" -lt 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    [ "$#" -ge 1 ] && exit 0
    exit 2
fi
version="$1"; shift
venv=".venv-torch-$version"
python="$venv/bin/python"

UNIT=(tests/core tests/rundir tests/login tests/shell tests/rank)
UNIT_MARKS="not cluster and not slow and not compile"
REHEARSAL=(
    # stops with exact resume: preempted twice and timed out mid-epoch (loader workers, split
    # snapshots), ends bit-identical to the run never stopped
    "tests/rehearsal/test_resume.py::test_three_stops_mid_epoch_give_bit_identical_results"
    # a node lost at 2 x 2, healed on the spare: the survivors' snapshot of the step in flight
    # (Held's optimizer hooks), the run ends bit-identical
    "tests/rank/test_jit.py::test_a_lost_node_costs_no_step_and_the_run_ends_bit_identical"
    # BatchNorm's buffers at 2 x 2 (DDP's broadcast_buffers, _sync_buffers) whichever node is lost
    "tests/rank/test_jit.py::test_a_batchnorm_model_ends_bit_identical_whichever_node_is_lost"\
"_and_after_a_periodic_snapshot"
    # torch.compile stopped and resumed warm from the run dir's inductor cache (its settings)
    "tests/rank/test_compile.py::test_a_compiled_run_stopped_once_resumes_warm_bit_identical"\
"_and_loads_uncompiled"
    # a hang named by the watchdog from the flight recorder's dumps (its variables, its JSON)
    "tests/rehearsal/test_faults.py::test_a_stuck_rank_is_named_by_the_watchdog_with_its_stack"
)

install_log="$(mktemp)"
trap 'rm -f "$install_log" "$install_log".*' EXIT
echo "== torch $version: installing into $venv (pip's messages are shown if it fails)"
if ! PIP_CONFIG_FILE=/dev/null HPC_DDP_VENV="$venv" TORCH_SPEC="torch==$version" \
        bash dev/setup.sh >"$install_log" 2>&1; then
    cat "$install_log" >&2
    echo "error: pip could not install torch==$version into $venv (pip said the above)" >&2
    exit 1
fi
installed="$("$python" -c 'import torch; print(torch.__version__)')"
case "$installed" in
    "$version"|"$version"+*) ;;
    *) echo "error: $venv has torch $installed, not $version" >&2; exit 1 ;;
esac

# one pytest run, shown as it goes; its summary line ("1017 passed, 69 deselected in 220.59s") into
# $summary
tier() {
    local name="$1" out="$install_log.$1"; shift
    echo "== torch $version: $name tier"
    local rc=0
    "$python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out" || rc=$?
    local line='^=* ?[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran'
    summary="$(grep -E "$line" "$out" | tail -1 | sed 's/^=* *//; s/ *=*$//')"
    return "$rc"
}
failed=0
tier unit -m "$UNIT_MARKS" "${UNIT[@]}" "$@" || failed=1
unit="$summary"
tier rehearsal "${REHEARSAL[@]}" "$@" || failed=1
rehearsal="$summary"
echo "torch $installed: unit ${unit:-no summary}, rehearsal ${rehearsal:-no summary}"
exit "$failed"
