"""``status --plot``: a run's loss curve, and below it one panel per other number the run logged (an
eval metric, the learning rate, samples/s), with where each attempt resumed; matplotlib (the
``plot`` extra), imported only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.login.status.read import read_config
from hpc_ddp.rundir import metrics_file
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.rundir.ledger import read_attempts


def _log_scale(ax: Any, span: float) -> None:
    """A log axis labelled 0.5, 2 rather than 5x10^-1; minor ticks are labelled only within one
    decade, where there are few of them (over several decades their labels overlap)."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g") if span < 10 else NullFormatter())


def plot(run_dir: Path, out: Path) -> str:
    """Write the loss curve of ``run_dir`` to ``out``: each step once, with the value of the newest
    attempt that logged it (:mod:`hpc_ddp.rundir.metrics_file`), and a dotted line where each
    requeued attempt resumed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # login nodes have no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpcDdpError(explain("--plot needs matplotlib, which is not installed",
                                  hint="pip install 'hpc_ddp[plot]' (or pip install matplotlib)"),
                          key="--plot") from None
    cfg = read_config(run_dir)
    every = metrics_file.read(run_dir)
    metrics = [m for m in every if isinstance(m.get("loss"), (int, float))]
    if not metrics:
        raise HpcDdpError(explain(f"nothing to plot: {run_dir / 'metrics.jsonl'} has no loss yet",
                                  hint=_no_loss_hint(
            cfg)), key="--plot")
    others = other_keys(every)
    fig, axes = plt.subplots(1 + len(others), 1, figsize=(8, 4.5 + 2.2 * len(others)), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2, label="loss")
    attempts = read_attempts(run_dir)
    for number, attempt in enumerate(attempts[1:], start=1):
        # where a requeued attempt resumed, and why the one before ended
        if attempt.get("first_step"):
            for row in axes:
                row[0].axvline(attempt["first_step"], color="grey", ls=":", lw=1)
            ax.annotate(f"#{number} after {attempts[number - 1].get('reason', '?')}",
                        (attempt["first_step"], 1),
                        xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                        fontsize=8,
                        color="dimgrey")
    # only the Trainer averages over ranks
    trainer = cfg is None or not (cfg.train.loop or cfg.train.script)
    ax.set(xlabel="" if others else "step", ylabel="loss (mean over ranks)" if trainer
           else "loss (as rank 0 logged it)",
           title=f"{run_dir.name if cfg is None else cfg.name}: loss"
           + (" and logged metrics" if others else ""))
    losses = [m["loss"] for m in metrics]
    if min(losses) > 0:
        _log_scale(ax, max(losses) / min(losses))
    _panels([row[0] for row in axes[1:]], every, others)
    axes[-1][0].set(xlabel="step")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    also = f"; also {', '.join(others)}" if others else ""
    return (f"wrote {out}: {len(metrics)} points, steps "
            f"{metrics[0]['step']}..{metrics[-1]['step']}{also}")


def _panels(axes: list[Any], metrics: list[dict[str, Any]], keys: list[str]) -> None:
    """One panel per logged key; an eval metric is logged at fewer steps, so markers show each
    one."""
    for ax, key in zip(axes, keys):
        points = [(m["step"], m[key]) for m in metrics if _is_number(m.get(key))]
        ax.plot(*zip(*points), lw=1.2, marker="." if len(points) < 50 else None)
        ax.set(ylabel=key)


NOT_PLOTTED = ("step", "time", "loss", "epoch", "max_steps")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def other_keys(metrics: list[dict[str, Any]], limit: int = 8) -> list[str]:
    """The numeric keys logged besides the loss (an eval metric, lr, samples/s), in first-logged
    order, at most ``limit`` (each is a panel)."""
    keys: list[str] = []
    for record in metrics:
        keys += [k for k, v in record.items() if k not in NOT_PLOTTED and k not in keys
                 and _is_number(v)]
    return keys[:limit]


def _no_loss_hint(cfg: Any) -> str:
    if cfg is not None and cfg.train.script:
        return ("a train.script run writes no metrics of its own (hpc_ddp sees only its output); "
                "to plot one, log "
                "from the script: `with hpc_ddp.session() as run:` ... `run.log_metrics(step, "
                "loss=...)`")
    if cfg is not None and cfg.train.loop:
        return "wait for the loop's first run.log_metrics(step, loss=...) call (rank 0 writes it)"
    return "wait for the first log step (train.log_every)"
