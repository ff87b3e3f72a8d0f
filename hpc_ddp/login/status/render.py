"""``status``'s text view of one run: :func:`render` turns what
:func:`hpc_ddp.login.status.read.collect` read into lines (the state, progress, the attempts table
and a note per attempt that needs one).

Apart from the command line (:mod:`hpc_ddp.login.status.cli`): tests and the rehearsal trials call
it on their own, and it is the longest part of the view. No torch.
"""

from __future__ import annotations

import time
from typing import Any

from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.nccl_net import summary
from hpc_ddp.core.timeline import last_timeline, lines as timeline_lines
from hpc_ddp.login.status.read import duration


def _shape(attempt: dict[str, Any], tasks_per_node: int | None = None) -> str:
    """'2x2 accum 2': nodes x tasks per node (or the world size) and accumulation, said only where
    there is some (a column of '2x2' beside '2x2 accum 1' read as two shapes). A failed attempt's
    line has no world size (its ranks never reported): its hosts times the config's tasks per
    node; '-' when neither is known."""
    world, nodes = attempt.get("world_size"), attempt.get("nodes")
    if not world:
        hosts = attempt.get("hosts")
        if not hosts or not tasks_per_node:
            return "-"
        from hpc_ddp.core.hostlist import expand_hostlist

        try:
            return f"{len(expand_hostlist(str(hosts)))}x{tasks_per_node}"
        except HpcDdpError:
            return "-"
    shape = f"{nodes}x{world // nodes}" if nodes and world % nodes == 0 else f"{world} ranks"
    accum = attempt.get("grad_accum")
    return shape + (f" accum {accum}" if isinstance(accum, int) and accum > 1 else "")


def done_line(done: dict[str, Any]) -> str:
    """DONE.json in a line, whichever program wrote it: a loop or task (step, params_sha256) or a
    script (its exit code, and no step: a script's steps are its own)."""
    parts = [f"step {done['step']}"] if "step" in done else []
    if "script" in done:
        parts.append(f"script {done['script']} exited {done.get('exit_code', '?')}")
    if done.get("params_sha256"):
        parts.append(f"params_sha256 {str(done['params_sha256'])[:16]}")
    return "  ".join(parts) or "(DONE.json holds no step)"


def _progress(info: dict[str, Any]) -> list[str]:
    """The step, time and logged-metrics lines."""
    out: list[str] = []
    progress = info["progress"]
    if progress.get("step") is not None:
        line = f"step    {progress['step']}"
        if progress.get("max_steps"):
            line += f"/{progress['max_steps']}"
        if isinstance(progress.get("loss"), (int, float)):
            line += f"  loss {progress['loss']:.6g}"
        if progress.get("samples_per_s"):
            line += f"  {progress['samples_per_s']} samples/s"
        out.append(line)
    if progress.get("time_used_s") or progress.get("eta_s") is not None:
        count = progress.get("attempts") or len(info["attempts"]) or 1
        line = f"time    {duration(progress.get('time_used_s', 0))} used over {count} attempt(s)"
        if progress.get("untimed"):
            line += f" ({progress['untimed']} of them with no recorded start: not counted)"
        if progress.get("eta_s") is not None:
            line += (f"; about {duration(progress['eta_s'])} left at {progress['steps_per_s']} "
                     "steps/s")
        out.append(line)
    if info.get("logged"):
        out.append("metrics " + "  ".join(f"{key} {_number(value)}"
                                          + ("" if step == progress.get("step") else
                                                                      f" (step {step})")
                                          for key, (value, step) in info["logged"].items()))
    return out


def _notes(info: dict[str, Any]) -> list[tuple[int, str]]:
    """Every attempt's notes, by attempt, unsorted."""
    notes = [(i, a["note"]) for i, a in enumerate(info["attempts"]) if a.get("note")]
    notes += [(i, healed_note(a)) for i, a in enumerate(info["attempts"]) if a.get("healed")]
    notes += [(i, lost_ranks_note(a)) for i, a in enumerate(info["attempts"])
              if a.get("lost_ranks") and a.get("message")]
    notes += [(i, broken_stop_note(a["stopped_mid_step"])) for i, a in enumerate(info["attempts"])
              if isinstance(a.get("stopped_mid_step"), dict)]
    notes += [(i, slow_note(a["slow_nodes"])) for i, a in enumerate(info["attempts"])
              if isinstance(a.get("slow_nodes"), dict) and a["slow_nodes"]]
    notes += [(i, health_note(a["health"])) for i, a in enumerate(info["attempts"])
              if isinstance(a.get("health"), dict) and a["health"].get("sick")]
    notes += list(info.get("hangs", {}).items())
    notes += [(int(i), lost_note(entry)) for i, entry in info.get("steps_lost", {}).items()
              if "lost" in entry]
    return notes


def render(info: dict[str, Any]) -> str:
    out = [f"run     {info['run_dir']}", f"job     {info['job_id'] or '-'}  state "
                                         f"{info['state'] or 'unknown'}"]
    if len(info.get("jobs") or []) > 1:
        out.append(chain_line(info["jobs"], info["state"]))
    if info.get("profile"):
        out.append(f"profile {info['profile']} (cluster profile merged under the run's config)")
    if info.get("pending_reason"):
        from hpc_ddp.login.partition import explain_reason

        out.append(f"waiting {explain_reason(info['pending_reason'])}")
    out += _progress(info)
    if info["done"]:
        out.append(f"done    {done_line(info['done'])}")
    out.append("snapshot newest committed step: "
               f"{info['newest_snapshot'] if info['newest_snapshot'] else '-'}")
    out.extend(network_line(info["attempts"]))
    if info.get("slow_now"):
        out.append(f"now: {slow_note(info['slow_now'])}")
    if info["attempts"]:
        out.append("attempts:")
        out.append("  #  job      restart  ended for        steps          geometry     resumed "
                   "from")
        for i, a in enumerate(info["attempts"]):
            first, last = a.get("first_step"), a.get("last_step")
            steps = "-" if last is None else f"{first or 0}->{last}"
            reason = a.get("reason", "?") + (" (cap)" if a.get("capped") else "")
            if a.get("reason") in ("failed", "error",
                                   "hung") and not last and not info["progress"].get("step"):
                steps = "before step 1"
            restart = f"{a.get('restart_count', '-')}" + (f"+{a['in_job']}" if a.get("in_job")
                                                          else "")
            out.append(f"  {i:<2} {str(a.get('job_id')):<8} {restart:<8} {reason:<16} "
                       f"{steps:<14} {_shape(a, info.get('tasks_per_node')):<12} "
                       f"{a.get('resumed_from') if a.get('resumed_from') is not None else '-':<12} "
                       f"{compile_note(a.get('compile'))}".rstrip())
    notes = _notes(info)
    notes.sort(key=lambda item: item[0])
    if notes:
        out.append("notes:")
        out.extend(f"  #{i}: {note}" for i, note in notes)
    # the newest heal's or requeue's, phase by phase (core/timeline.py)
    last = last_timeline(info["attempts"])
    if last is not None:
        out.extend(timeline_lines(last[1], last[0]))
    if info.get("last_errors"):
        out.append("last errors:")
        out.extend(f"  {line}" for line in info["last_errors"])
    return "\n".join(out)


def compile_note(record: Any) -> str:
    """An attempt's ledger ``compile`` field, short: 'compile miss 59.1 s, 2 graph(s)'; '' for
    none."""
    if not isinstance(record, dict) or not record.get("cache"):
        return ""
    seconds = f" {float(record['s']):.1f} s" if isinstance(record.get("s"), (int, float)) else ""
    graphs = f", {record['graphs']} graph(s)" if isinstance(record.get("graphs"), int) else ""
    return f"compile {record['cache']}{seconds}{graphs}"


def network_line(attempts: list[dict[str, Any]]) -> list[str]:
    """'network NCCL IB (...) between nodes, attempt #3': what the newest NCCL attempt across nodes
    used."""
    found = next(((i, a["nccl_net"]) for i, a in reversed(list(enumerate(attempts)))
                  if isinstance(a.get("nccl_net"), dict) and a["nccl_net"].get("network")), None)
    if found is None:
        return []
    i, net = found
    return [f"network NCCL {summary(net)} between nodes (attempt #{i})"
            + (f"\n        WARNING: {net['warning']}" if net.get("warning") else "")]


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def chain_line(jobs: list[str], state: str | None) -> str:
    """The jobs of a run that chained its own successors (Slurm refused requeue): one run, several
    job ids."""
    last = jobs[-1]
    end = "" if state in ("FINISHED", None) or str(state).split()[0] in ("COMPLETED", "FAILED",
                                                                         "CANCELLED") else (
        f"; scancel {last} ends the chain")
    return (f"jobs    {' -> '.join(jobs)}  (a chain: each job submitted the next with "
            "--dependency=afterany, "
            f"as Slurm refuses requeue here{end})")


def lost_note(entry: dict[str, Any]) -> str:
    """What a failure cost: the steps since the snapshot the run resumed (or will resume) from."""
    start = entry["resumed_from"] if entry["resumed_from"] is not None else "the start"
    why = entry.get("why") or ""
    stale = entry.get("per_rank_from") or {}
    buddies = dict(sorted((entry.get("buddies") or {}).items(),
                          key=lambda item: (len(str(item[0])), str(item[0]))))
    steps = sorted(set(stale.values()))
    return (f"lost {entry['lost']} step(s): got to step {entry['last_step']}, "
            f"{'will resume' if entry['pending'] else 'resumed'} from {start}"
            + (f"; no survivors' snapshot: {why[:200]}{'...' if len(why) > 200 else ''}" if why
               else "")
            + (f"; per-rank state of {len(stale)} rank(s) from step "
               f"{', '.join(map(str, steps))} (per_rank(..., mirror=N))" if stale else "")
            + (f"; per-rank state of rank(s) {', '.join(map(str, buddies))} from their buddies' "
               f"mirror (rank(s) {', '.join(str(buddies[r]) for r in buddies)})" if buddies
               else ""))


def broken_stop_note(entry: dict[str, Any]) -> str:
    """One line on a stop whose last step broke (rank/stop/broken_step.py): what broke it and what
    it cost."""
    held, saved = entry.get("held"), entry.get("snapshot")
    cost = ("kept the step every rank held" if held is not None and saved == held else
            f"resumes from {'step ' + str(saved) if saved is not None else 'the start'}"
            + (f" ({held - saved} step(s) lost)" if isinstance(held, int) and isinstance(saved, int)
               else ""))
    fix = ("; give each DataLoader worker_init_fn=hpc_ddp.worker_init()"
           if entry.get("child_killed") else "")
    return f"the stop signal broke a step ({entry.get('error')}): {cost}{fix}"


def lost_ranks_note(attempt: dict[str, Any]) -> str:
    """Which ranks a failed attempt lost, how it was noticed and by whom (the ledger's message),
    and when they were declared."""
    at = attempt.get("lost_at")
    when = (f"at {time.strftime('%H:%M:%S', time.localtime(float(at)))}: "
            if isinstance(at, (int, float)) else "")
    return f"{when}{attempt['message']}"


def slow_note(slow: dict[str, Any]) -> str:
    """Which nodes an attempt named slow (rank/loop/pace.py), by how much, from which step."""
    parts = []
    for host, named in slow.items():
        named = named if isinstance(named, dict) else {}
        until = named.get("until_step")
        parts.append(f"{host} (node {named.get('node')}): busy {named.get('x')} x the other nodes' "
                     f"median per step from step {named.get('since_step')}"
                     + (f" to step {until}" if until is not None else "")
                     + (f" (kept: {named['kept']})" if named.get("kept") else ""))
    return "slow node(s): " + "; ".join(parts)


def health_note(health: dict[str, Any]) -> str:
    """The nodes an attempt's health check found sick (rank/attempt/health.py), and why."""
    sick = health.get("sick") if isinstance(health.get("sick"), dict) else {}
    kept = f" (kept: {health['kept']})" if health.get("kept") else ""
    return (f"health check ({health.get('checks')}, {health.get('seconds')}s): sick: "
            + "; ".join(f"{host}: {why}" for host, why in sick.items()) + kept)


def healed_note(attempt: dict[str, Any]) -> str:
    """One line on an in-job restart: after what, how, on which nodes, and what was left out and
    why."""
    healed = attempt["healed"]
    left_out = "; ".join(f"{node}: {why}" for node, why in (healed.get("excluded") or {}).items())
    return (f"in-job restart {attempt.get('in_job')} after a {healed.get('after')} step on "
            f"{healed.get('nodes_before')}: {healed.get('how')}, now on {attempt.get('hosts')}"
            + (f" (left out {left_out})" if left_out else ""))
