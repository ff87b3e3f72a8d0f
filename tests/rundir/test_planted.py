"""Another user plants what a victim's run would read or write on the node (issue 61), with two real user ids.

The attacker (``nobody``, through ``setpriv``, a plain shell and no capability) pre-creates, open to everyone,
every node-local folder and file a victim's 1 x 2 rehearsal would use under the names it can compute (the
uid, the run dir's path and the rehearsal's job id are public): a config whose ``train.script`` is the
attacker's, a ledger at its caps, a declaration that a rank is lost, beats that are links to a victim's file,
offers and a memo for the survivors' snapshot. The victim (uid 1000) then rehearses. Its run must end as an
undisturbed one does (the same final parameters), the attacker's script never runs, no victim file is written
through a link, and every folder hpc_ddp makes under /dev/shm or /tmp during the run is 0700 and the victim's.

The victim's interpreter may live where uid 1000 cannot reach it (pyenv under a 0700 /root): the victim then
keeps CAP_DAC_READ_SEARCH (reading and searching folders only; it writes as uid 1000). The attacker keeps no
capability: with one it could read the victim's run dir, which is the secret this design rests on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

VICTIM, ATTACKER = 1000, 65534
REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def _setpriv(uid: int, *caps: str) -> list[str]:
    extra = [f"--inh-caps=+{','.join(caps)}", f"--ambient-caps=+{','.join(caps)}"] if caps else []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *extra]


def _can_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root to act as two other users (setpriv)"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to act as two other users"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_can_run() is not None, reason=_can_run() or "")]


@pytest.fixture()
def home() -> Iterator[Path]:
    """A folder both users can reach (pytest's own tmp_path is root's, 0700), the victim's own inside."""
    top = Path(tempfile.mkdtemp(prefix="hpc_ddp-planted-test-", dir="/tmp"))
    os.chmod(top, 0o755)
    victim = top / "victim"
    victim.mkdir()
    os.chown(victim, VICTIM, VICTIM)
    yield top
    shutil.rmtree(top, ignore_errors=True)
    planted = [SHM / f"hpc_ddp-{VICTIM}", Path(f"/tmp/hpc_ddp-compile-{VICTIM}")]  # the attacker's, and the victim's:
    for entry in [*planted, *SHM.glob(f"hpc_ddp-{VICTIM}-*"), *Path("/tmp").glob(f"hpc_ddp-{VICTIM}-*")]:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_symlink() or entry.exists():
            entry.unlink()


def _victim_run(home: Path, name: str, watch: list[tuple[str, int, int]] | None = None) -> dict[str, object]:
    run_dir = home / "victim" / name
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home / "victim"), "USER": "victim",
           "LOGNAME": "victim", "TMPDIR": "/tmp", "PYTHONPATH": str(REPO)}
    command = [*_setpriv(VICTIM, "dac_read_search"), "env", "-i", *(f"{k}={v}" for k, v in env.items()),
               sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", "slurm.nodes=1",
               "slurm.tasks_per_node=2", "train.max_steps=30", f"run_dir={run_dir}"]
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(watch, stop), daemon=True) if watch is not None else None
    if watcher:
        watcher.start()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, umask=0o022)
    finally:
        stop.set()
        if watcher:
            watcher.join()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((run_dir / "DONE.json").read_text())


def _watch(seen: list[tuple[str, int, int]], stop: threading.Event) -> None:
    """Every folder the victim has under /dev/shm or /tmp while it runs: (path, mode, owner)."""
    while not stop.wait(0.02):
        for base in (SHM, Path("/tmp")):
            for top in base.glob(f"hpc_ddp-{VICTIM}-*"):
                for root, dirs, _ in os.walk(top):
                    for folder in [root, *(os.path.join(root, d) for d in dirs)]:
                        try:
                            info = os.lstat(folder)
                        except OSError:
                            continue
                        if info.st_uid != ATTACKER:
                            seen.append((folder, stat.S_IMODE(info.st_mode), info.st_uid))


def _plant(home: Path, run_dir: Path) -> tuple[Path, Path]:
    """The attacker's shell script: every name it can compute, for the job ids of the next four minutes."""
    att = home / "attacker"
    att.mkdir()
    os.chown(att, ATTACKER, ATTACKER)
    marker = att / "pwned"
    precious = home / "victim" / "precious.pt"
    precious.write_bytes(b"the victim's weights")
    os.chown(precious, VICTIM, VICTIM)
    key = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    now = int(time.time()) % 10**6
    config = f"run_dir: {run_dir}\ntrain:\n  script: {att}/evil.py\n"
    ledger = "".join(json.dumps({"job_id": 1, "restart_count": i, "reason": "preempted"}) + "\n" for i in range(50))
    lines = [f"chmod 777 {att}",
             f"printf 'open(\"{marker}\", \"w\").write(\"ran\")\\n' > {att}/evil.py",
             f"printf '%s' '{config}' > {att}/config.yaml", f"printf '%s' '{ledger}' > {att}/attempts.jsonl",
             f"mkdir -m 777 -p /tmp/hpc_ddp-compile-{VICTIM} {SHM}/hpc_ddp-{VICTIM} {SHM}/hpc_ddp-{VICTIM}-{key}",
             f"chmod 777 /tmp/hpc_ddp-compile-{VICTIM} {SHM}/hpc_ddp-{VICTIM} {SHM}/hpc_ddp-{VICTIM}-{key}"]
    for job in range(now - 5, now + 240):
        tag = f"job-{job}-restart-0"
        folder = SHM / f"hpc_ddp-{VICTIM}-{key}" / f"{tag}-node-0"
        declared = json.dumps({"attempt": tag, "rank": 1, "ranks": [1], "by_rank": 0, "host": "x"}).ljust(1023)
        offer = json.dumps({"rank": 1, "step": 29, "source": True, "node": 0})
        lines += [f"mkdir -m 777 -p {folder}/jit", f"chmod 777 {folder} {folder}/jit",
                  f"cp {att}/config.yaml {att}/attempts.jsonl {folder}/",
                  f"printf '%s\\n' '{declared}' > {folder}/declared.json",
                  f"ln -s {precious} {folder}/rank-0.beat", f"ln -s {precious} {folder}/rank-1.beat",
                  f"printf '%s' '{offer}' > {folder}/jit/offer-1.json",
                  f"printf '%s' '{{\"newest\": {{\"value\": 29, \"at\": 9e9}}}}' > {folder}/jit/memo.json",
                  f"chmod -R a+rw {folder}"]
    script = home / "plant.sh"
    script.write_text("set -e\n" + "\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    subprocess.run([*_setpriv(ATTACKER), "sh", str(script)], check=True, timeout=120)
    return marker, precious


def test_nothing_another_user_plants_on_the_node_is_read_run_or_written_through(home: Path) -> None:
    reference = _victim_run(home, "reference")  # undisturbed, the same config
    run_dir = home / "victim" / "attacked"
    marker, precious = _plant(home, run_dir)
    seen: list[tuple[str, int, int]] = []
    attacked = _victim_run(home, "attacked", seen)
    assert attacked["params_sha256"] == reference["params_sha256"] and attacked["step"] == 30
    assert not marker.exists(), "the attacker's train.script ran as the victim"
    assert precious.read_bytes() == b"the victim's weights", "a beat was written through a planted link"
    ledger = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [line["reason"] for line in ledger] == ["finished"], ledger  # no planted cap, no declared loss
    assert seen, "the victim made no folder on node-local storage: this test would see nothing"
    loose = sorted({(path, oct(mode), uid) for path, mode, uid in seen if mode != 0o700 or uid != VICTIM})
    assert not loose, f"folders not private to the victim: {loose[:5]}"
