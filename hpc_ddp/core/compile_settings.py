"""``train.compile`` and ``train.compile_cache``: what they may hold, and the torch.compile options
they mean.

``train.compile`` is ``false`` (eager), ``true`` (``torch.compile(model)`` with torch's defaults) or
a mapping of torch.compile's own keyword arguments (``mode``, ``dynamic``, ``fullgraph``,
``backend``, ``options``): the names are torch's, so its documentation applies unchanged.
``train.compile_cache`` says where the compiler's caches live (:mod:`hpc_ddp.rundir.compile_cache`):
``run`` (the run dir, the default), ``node`` (node-local, seeded from the run's copy), ``off`` (no
FX graph or AOTAutograd cache: every attempt compiles cold) or an absolute path. Pure: no torch, no
omegaconf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPTIONS = ("mode", "dynamic", "fullgraph", "backend", "options")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CACHE_PLACES = ("run", "node", "off")
COMPILE_EXPECTED = ("false, true, or a mapping of torch.compile options (mode, dynamic, fullgraph, "
                    "backend, options), e.g. {mode: max-autotune, dynamic: false}")
CACHE_EXPECTED = ("run (in the run dir), node (node-local, seeded from the run's copy), off, or an "
                  "absolute path")


def compile_options(value: Any) -> dict[str, Any] | None:
    """torch.compile's keyword arguments for a checked ``train.compile``; None: do not compile."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    return {key: (dict(v) if isinstance(v, Mapping) else v) for key, v in dict(value).items()}


def compile_problem(value: Any) -> tuple[str, Any, str] | None:
    """(what is wrong, the value found, what is expected) for a bad ``train.compile``, or None."""
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, Mapping):
        return f"train.compile is {type(value).__name__}", value, COMPILE_EXPECTED
    unknown = [k for k in value if k not in OPTIONS]
    glued = [k for k in unknown if isinstance(k, str) and k.partition(":")[0].strip() in OPTIONS
             and value[k] is None]
    # {mode:max-autotune}: YAML reads one string (a key with no value) without the space after ':'
    if glued:
        name, _, rest = glued[0].partition(":")
        return (f"train.compile has an unknown option {glued[0]!r}: YAML reads '{name}:{rest}' as "
                "one word "
                "without a space after the colon", dict(value),
                f"{{{name.strip()}: {rest.strip()}}}: write it with a space after the colon (on a "
                "command line quote "
                f"the override: \"train.compile={{{name.strip()}: {rest.strip()}}}\")")
    if unknown:
        return (f"train.compile has an unknown option {unknown[0]!r}", dict(value),
                f"torch.compile options: {', '.join(OPTIONS)}")
    checks = {
        "mode": (lambda v: v is None or v in MODES, f"one of {', '.join(MODES)}, or null"),
        "dynamic": (lambda v: v is None or isinstance(v, bool),
                    "true, false or null (torch decides)"),
        "fullgraph": (lambda v: isinstance(v, bool), "true or false"),
        "backend": (lambda v: isinstance(v, str) and bool(v.strip()),
                    "a backend name: inductor (the default), aot_eager, eager, cudagraphs, ..."),
        "options": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
                    "a mapping of inductor config names to values, e.g. {max_autotune: true}"),
    }
    for key, (ok, expected) in checks.items():
        if key in value and not ok(value[key]):
            return f"bad value for train.compile.{key}", value[key], expected
    # torch refuses both, even options: {} or mode: default
    if value.get("mode") is not None and "options" in value:
        return ("train.compile sets both mode and options, which torch.compile refuses",
                dict(value), "one of them (options: {max_autotune: true, triton.cudagraphs: true} "
                             "for a mode's parts)")
    return None


def cache_place(value: Any) -> Any:
    """``off`` as YAML 1.1 reads it: ``compile_cache: off`` (and ``=off`` on the command line) is
    the boolean False, which the string field holds as ``"False"``: it means off."""
    return "off" if value in ("False", False) else value


def cache_ok(value: Any) -> bool:
    """``train.compile_cache`` is a place or an absolute path."""
    return isinstance(value, str) and (value in CACHE_PLACES
                                       or (value.startswith("/") and "\n" not in value))
