"""What ``run.resume(...)`` may track, and the state that differs by rank.

Most of what a loop tracks is **replicated**: a DDP model, its optimizer and schedulers,
and the sampler's global position hold the same values on every rank after each
optimizer step, so a snapshot keeps one copy (split across nodes) and every rank gets
that copy back. Some state is **per rank**: a batch each rank prefetched from its own
RNG, a per-rank counter, a module that is not wrapped in DDP, a ``torch.Generator``.
One copy of that would give every rank one rank's value, so it is tracked with
:func:`per_rank` and saved like the RNG states: each rank's value in its node's file,
back to the same rank on resume.

At another world size a rank's saved value has no owner. :func:`per_rank`'s
``elastic`` says what then: ``"refuse"`` (the default) stops the resume with the
reason; ``"fresh"`` keeps the value the loop built in this attempt, with a warning.

Such a run cannot resume on fewer nodes, so every snapshot's manifest says so
(:func:`resize_refusal`, read without torch by
:func:`hpc_ddp.rundir.snapshot.steps.refuses_resize`): the batch shell then never heals a failure by
shrinking it. The resume's side (each rank's value back, or the refusal, a failure on an attempt
nobody asked for) is :mod:`hpc_ddp.rank.state.per_rank_resume`.
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from hpc_ddp.rank.state.checkpointer import stage
from hpc_ddp.core.errors import UsageError, a_type, explain
from hpc_ddp.rundir.snapshot.steps import PER_RANK_REASON, REASONS_JOIN

if TYPE_CHECKING:
    from hpc_ddp.core.config import TrainConfig

ELASTIC = ("refuse", "fresh")
# how a per_rank object survives its rank's loss: sent to a buddy at every boundary, or rebuilt by
# the loop from what every snapshot holds (the data position, the seeds) and never sent
MIRROR = ("every_step", "derive")


class RunUsageError(UsageError):
    """The loop used the run API the wrong way (boundary before resume, a step not rising, an object
    that cannot be tracked): exit 2, recorded once, never requeued."""


def unwrap(model: object) -> Any:
    """The module under DDP (and torch.compile): snapshots and model.pt hold plain parameter
    names."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


@dataclass(frozen=True)
class PerRank:
    """A tracked object whose value differs by rank (made by :func:`per_rank`)."""

    obj: Any  # the user's object: a dict, a torch.Generator, or anything with state_dict()
    elastic: str = "refuse"
    mirror: str | int = "every_step"  # or N: sent every N steps


def per_rank(obj: object, elastic: str = "refuse", mirror: str | int = "every_step") -> PerRank:
    """Mark ``obj`` for ``run.resume`` as per-rank state: saved and restored per rank, like the RNG.

    ``obj``: a dict (of tensors, numbers, strings, lists; restored in place), a
    ``torch.Generator``, or anything with ``state_dict()``/``load_state_dict()`` that is
    not a DDP model (a DDP model is replicated: track it plainly). ``elastic``: what a
    resume at another world size (or with this rank's file damaged) does with it:
    ``"refuse"`` stops with the reason, ``"fresh"`` keeps what the loop built in this attempt.

    ``mirror``: how it survives its rank's loss in a survivors' snapshot. ``"every_step"`` (the
    default) sends it to a buddy rank on the next node at every boundary: exact, at a cost per step
    that grows with its size (docs/performance.md, B2-MIRROR-NODES). ``"derive"`` never sends it:
    every snapshot taken at a boundary still holds it, but a survivors' snapshot does not, and after
    one every rank keeps the value its loop builds when it resumes. Choose it for state the loop
    rebuilds from what the snapshot holds (a batch prefetched from the sampler's position with the
    step's seeds): exact when the rebuild is, and free per step. An int ``N`` copies and sends it
    at a boundary only when it is at least N steps past the last one that did (about every N
    steps; the copy is most of what the mirror costs): a survivors' snapshot then holds each rank's
    copy from that boundary, up to N - 1 steps back (a lost rank's up to 2 N - 1), not exact, and
    the ledger's ``jit_snapshot.per_rank_stale`` names each rank and its step (docs/faults.md).
    Snapshots at a boundary (periodic, a stop's) hold it as it is. A rank's mirrored objects travel
    together, so the mirror goes at the smallest cadence among them (``"every_step"`` is 1), agreed
    by every rank.
    """
    if elastic not in ELASTIC:
        raise RunUsageError(explain(f"hpc_ddp.per_rank(..., elastic={elastic!r})",
                                    expected=" or ".join(
            repr(e) for e in ELASTIC), hint="'refuse' stops a resume at another world size; "
                                            "'fresh' keeps the "
            "value built in that attempt"))
    _check_mirror(mirror)
    if isinstance(obj, DistributedDataParallel):
        raise RunUsageError(explain("hpc_ddp.per_rank() got a DDP model, whose parameters are the "
                                    "same on every rank",
                                 hint="track it plainly (run.resume(model=model)); per_rank is for "
                                      "state that "
                                 "differs by rank"))
    if not isinstance(obj, (dict, torch.Generator)) and not _has_state_dict(obj):
        raise RunUsageError(explain(f"hpc_ddp.per_rank() got {a_type(obj)}, which has no "
                                 "state_dict()/load_state_dict()",
                                    hint="pass a dict (restored in place), a "
                                 "torch.Generator, or a module/object with state_dict()"))
    return PerRank(obj, elastic, mirror)


def _check_mirror(mirror: object) -> None:
    """Refuse a ``per_rank(..., mirror=...)`` policy it does not take, with what it takes."""
    if isinstance(mirror, int) and not isinstance(mirror, bool):
        if mirror < 1:
            raise RunUsageError(explain(f"hpc_ddp.per_rank(..., mirror={mirror})",
                                        expected="a cadence of 1 step or more",
                                        hint="mirror=10 sends the object about every 10 steps; "
                                             "mirror='derive' never sends it"))
    elif mirror not in MIRROR:
        near = difflib.get_close_matches(str(mirror), MIRROR, n=1)
        raise RunUsageError(explain(f"hpc_ddp.per_rank(..., mirror={mirror!r})",
                                    expected=" or ".join(repr(m) for m in MIRROR)
                                    + " or a number of steps (mirror=10)",
                                    hint=(f"did you mean mirror={near[0]!r}? " if near else
                                          f"did you mean mirror={str(mirror).strip()} (a number, "
                                          "not a "
                                          "string)? " if str(mirror).strip().isdigit() else "")
                                    + "'every_step' sends the object to a buddy at every boundary "
                                      "(exact after a survivors' snapshot); 'derive' never sends "
                                      "it and keeps what the loop rebuilds after one; an int N "
                                      "copies it about every N steps (a survivors' snapshot's may "
                                      "be older)"))


def mirrored(objects: Mapping[str, PerRank]) -> dict[str, PerRank]:
    """The per_rank objects a buddy keeps (all but ``mirror="derive"``'s): what a survivors'
    snapshot needs of every rank."""
    return {name: p for name, p in objects.items() if p.mirror != "derive"}


def cadence(objects: Mapping[str, PerRank]) -> int:
    """How often the mirror sends this rank's kept objects (they travel together): the smallest
    cadence among them, 1 for ``"every_step"``; 0 when none is kept (all ``"derive"``)."""
    return min((1 if p.mirror == "every_step" else int(p.mirror)
                for p in mirrored(objects).values()), default=0)


def _has_state_dict(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict",
                                                                           None))


def check_trackable(name: str, obj: object) -> None:
    """Refuse what run.resume cannot save and restore, with what to track instead."""
    if isinstance(obj, DistributedSampler):
        raise RunUsageError(explain(
            f"run.resume({name}=...) got torch's DistributedSampler, which keeps no position "
            "within an epoch: a "
            "resume would replay the epoch from its start",
            hint="use hpc_ddp.ShardSampler(len(data), run.rank, "
            "run.world_size, seed=...) and take the batches with `for batch in "
            "sampler.iterate(loader)`"), key=name)
    if isinstance(obj, PerRank) or isinstance(obj, dict) or _has_state_dict(obj):
        return
    raise RunUsageError(explain(f"run.resume({name}=...) got {a_type(obj)}, which has no "
                             "state_dict()/load_state_dict()",
                                hint="track a model, optimizer, scheduler, scaler, "
                             "sampler, a dict of your own counters (restored in place), or "
                             "per-rank state with "
                             "hpc_ddp.per_rank(obj)"), key=name)


def state_of(obj: object) -> Any:
    """What a snapshot keeps of one tracked object."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, dict):
        return dict(obj)
    return unwrap(obj).state_dict()


def load_into(obj: object, state: Any, device: torch.device | None = None) -> None:
    """Put a saved state back into ``obj`` in place (a dict's tensors go where the built one's
    were)."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, dict):
        places = {k: v.device for k, v in obj.items() if isinstance(v, torch.Tensor)}
        obj.clear()
        obj.update({k: v.to(places.get(k, device or v.device)) if isinstance(v, torch.Tensor) else v
                    for k, v in state.items()})
    else:
        unwrap(obj).load_state_dict(state)


def pack(state: Mapping[str, Any]) -> bytes:
    """Per-rank states (:func:`staged`) as bytes: they travel with the rank's RNG state to the
    node's writer."""
    buffer = io.BytesIO()
    serialize(state, buffer)
    return buffer.getvalue()


def staged(objects: Mapping[str, PerRank], cuda: bool = False) -> dict[str, Any]:
    """The per-rank states as they are now, to be serialized or copied at once: tensors on the CPU
    and compact (a view would save its whole storage). A compact CPU tensor is not copied: what uses
    it right away (a snapshot's :func:`pack`, the mirror's message) needs no copy of its own.
    ``cuda``: CUDA tensors stay where they are, for the mirror, which enqueues their copies into a
    pinned message instead of waiting for the GPU at every boundary (a ``.cpu()`` here would sync
    the host with the GPU once per step)."""
    return {name: _compact(state_of(p.obj), cuda) for name, p in objects.items()}


def serialize(state: object, out: BinaryIO) -> None:
    """The per-rank format: torch's pickle format, not its zip one (packed at every boundary for the
    mirror, it is 2.5 x faster, 50 us against 127 for a batch and a counter, and a third of the
    size); torch.load reads either, ``weights_only``."""
    torch.save(state, out, _use_new_zipfile_serialization=False)


def _compact(value: object, cuda: bool = False) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if cuda and value.is_cuda:
            return value
        whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
        if (value.device.type == "cpu" and whole and value.storage_offset() == 0
                and value.is_contiguous()):
            return value
        return stage(value)
    if isinstance(value, dict):
        return {k: _compact(v, cuda) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_compact(v, cuda) for v in value)
    return value


def unpack(blob: bytes) -> dict[str, Any]:
    """The inverse of :func:`pack`; ``weights_only`` like every snapshot load."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def unloadable(objects: Mapping[str, PerRank]) -> str | None:
    """Checked at the first boundary: per-rank state that a resume could not load back is refused
    now, not then."""
    for name, p in objects.items():
        try:
            unpack(pack(staged({name: p})))
        except Exception as err:  # noqa: BLE001 - the unpickler names the type it refused
            return explain(f"the per-rank state {name} holds something a snapshot cannot load back "
                           f"({str(err).splitlines()[0]})",
                           hint="keep tensors, numbers, strings, lists and dicts "
                           "in it")
    return None


def resize_refusal(objects: Mapping[str, PerRank], train: TrainConfig) -> str | None:
    """Why a resume of this run at another world size would be refused, or None: the per-rank state
    tracked with ``elastic="refuse"`` (named), and a global batch that follows the world size.
    Recorded in every snapshot's manifest for the batch shell
    (:func:`hpc_ddp.rundir.snapshot.steps.refuses_resize`)."""
    reasons = []
    refusing = [name for name, p in objects.items() if p.elastic == "refuse"]
    if refusing:
        reasons.append(f"{PER_RANK_REASON}{', '.join(map(repr, refusing))} is tracked with "
                       "hpc_ddp.per_rank(..., "
                       "elastic='refuse'): a rank's saved value has no owner at another world size")
    if getattr(train, "global_batch_size", None) is None and not getattr(train, "script", None):
        reasons.append("train.global_batch_size is unset: the global batch would change with the "
                       "world size")
    return REASONS_JOIN.join(reasons) or None
