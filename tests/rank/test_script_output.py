"""Reading rank 0's script output: progress lines, and whether the script went on after a stop (pure)."""

from __future__ import annotations

import io
import re

import pytest

from hpc_ddp.core.config import RunConfig
from hpc_ddp.rank.script.output import IGNORED_AFTER, Progress, relay

DEFAULT = re.compile(RunConfig().train.script_progress)


def test_progress_lines_give_the_step_and_other_lines_are_passed_over() -> None:
    progress = Progress(DEFAULT)
    for text in ("loading data\n", "step 3 loss 2.1\n", "Step: 4\n", "saved to step_dir\n"):
        progress.feed(text)
    assert (progress.step, progress.lines, progress.line) == (4, 2, "Step: 4")


def test_a_pattern_whose_group_is_not_a_number_or_that_has_no_group_reads_no_step() -> None:
    words, no_group = Progress(re.compile(r"step (\w+)")), Progress(re.compile(r"step \d+"))
    words.feed("step five\n")
    no_group.feed("step 5\n")
    assert (words.step, words.lines, no_group.step, no_group.lines) == (None, 0, None, 0)


def test_one_line_after_the_stop_is_the_step_in_flight_two_mean_the_script_went_on() -> None:
    progress = Progress(DEFAULT)
    progress.feed("step 10\n")
    assert not progress.ignored  # no stop forwarded yet
    progress.stop_forwarded()
    progress.feed("step 11\n")
    assert not progress.ignored and progress.after_stop == 1
    for step in range(12, 11 + IGNORED_AFTER):
        progress.feed(f"step {step}\n")
    assert progress.ignored
    assert progress.went_on("SIGUSR2") == (f"the script went on after SIGUSR2: {IGNORED_AFTER} progress lines "
                                           f"since (step 10 -> {10 + IGNORED_AFTER})")


def test_relay_passes_every_byte_on_and_reads_the_lines() -> None:
    """A progress bar redraws with \\r and no newline: its bytes pass on as they come, and \\r ends a line."""
    data = b"step 1\n\xffbinary\r 40%| step 2 \r 80%| step 3 \rlast words, step 4"
    source, sink, progress = io.BytesIO(data), io.BytesIO(), Progress(DEFAULT)
    relay(source, sink, progress)
    assert sink.getvalue() == data and progress.step == 4 and progress.lines == 4


def test_the_quiet_time_is_watched_from_the_second_line_and_a_slow_printer_gets_3_x_its_gap() -> None:
    """A script that prints once per long epoch is not hung after dist.timeout_s of quiet: the limit is 3 x its
    longest gap between progress lines when that is longer. Before its second line nothing says how often
    it prints, so the start-up and the first interval are not watched."""
    progress = Progress(DEFAULT)
    assert progress.quiet_for(now=1e9) is None  # start-up (imports, data loading)
    progress.feed("step 1\n")
    assert progress.quiet_for(now=1e9) is None  # the first interval
    progress.seen_at -= 1200  # the first epoch took 20 minutes
    progress.feed("step 2\n")
    assert progress.longest_gap >= 1200 and progress.quiet_for(now=progress.seen_at + 7.5) == 7.5
    assert progress.hang_limit(600) >= 3600 and Progress(DEFAULT).hang_limit(600) == 600


@pytest.mark.parametrize(("line", "step"), [
    ("iter 12: loss 3.1234, time 12.30ms, mfu -100.00%", 12),  # nanoGPT, every log_interval
    ("step 20: train loss 3.3125, val loss 3.2661", 20),  # nanoGPT's evaluation
    ("iteration 5: loss 2.0", 5),
    ("Step 7/100 loss 1.0", 7),
    ("step: 5", 5),
    ("{'loss': 1.9, 'step': 10}", 10),
    ("[GPU0] Epoch 3 | Batchsize: 32 | Steps: 64", None),  # the torchrun tutorial: a count of batches
    ("[RANK0] Epoch 1 | Iter 0 | Train Loss 2.10", None),  # minGPT: Iter starts again every epoch
    ("Overriding: max_iters = 40", None),  # nanoGPT's configurator
    ("tokens per iteration will be: 8,192", None),
    ("eval_iters = 200", None),
    ("  Total optimization steps = 100", None),  # HF Trainer's banner
    ("{'loss': 1.9, 'learning_rate': 5e-05, 'epoch': 0.5}", None),  # HF Trainer's log line
    ("TrainOutput(global_step=100, training_loss=2.0)", None),
    (" 12%|#2 | 12/100 [00:01<00:10, 8.0it/s]", None),  # tqdm
])
def test_the_default_progress_regex_reads_step_and_nanogpts_iter_and_no_count(line: str, step: int | None) -> None:
    progress = Progress(re.compile(RunConfig().train.script_progress))
    progress.feed(line + "\n")
    assert progress.step == step
