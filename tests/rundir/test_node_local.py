"""Node-local storage that only the job's user can touch (hpc_ddp.rundir.node_local, issue 61): the run's secret,
private folders checked before use, no read or write through a planted link, records without the token ignored.
Another user's folder is played by chown to ``nobody`` where this runs as root (CI); elsewhere those cases skip."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.core.atomic import rewrite_in_place, write_atomic
from hpc_ddp.rundir import beats, compile_cache, jit_files, node_local, node_share

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting a folder owned by another user needs root (chown)")


@pytest.fixture(autouse=True)
def _umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # the usual umask: whatever hpc_ddp makes must still be private
    node_local._secret.cache_clear()
    yield
    os.umask(old)
    node_local._secret.cache_clear()


def test_the_run_secret_is_private_made_once_and_names_folders_nobody_else_can_compute(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = node_local.run_secret(run_dir)
    node_local._secret.cache_clear()
    assert node_local.run_secret(run_dir) == first and len(first) == node_local.SECRET_BYTES
    assert stat.S_IMODE((run_dir / ".hpc_ddp-secret").stat().st_mode) == 0o600
    folder = beats.node_dir(run_dir, "job-7-restart-0", 1, tmp_path / "shm")
    assert folder.parent.name.startswith(f"hpc_ddp-{os.getuid()}-") and first.hex()[:8] not in str(folder)
    # another run dir of the same path with another secret: another folder (the name is not the path's hash)
    (run_dir / ".hpc_ddp-secret").unlink()
    node_local._secret.cache_clear()
    assert beats.node_dir(run_dir, "job-7-restart-0", 1, tmp_path / "shm") != folder
    assert node_local.token(run_dir, "job-7-restart-0") != node_local.token(run_dir, "job-7-restart-1")


def test_a_secret_others_may_read_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at once: a writer may still be writing a short secret, but none narrows one open to others."""
    (tmp_path / ".hpc_ddp-secret").write_text("ab" * 32 + "\n")
    os.chmod(tmp_path / ".hpc_ddp-secret", 0o644)
    waits: list[float] = []
    monkeypatch.setattr(node_local.time, "sleep", waits.append)
    with pytest.raises(node_local.NodeLocalError, match=r"(?s)secret .*not a private file.*HINT: .*remove"):
        node_local.run_secret(tmp_path)
    assert waits == []  # no wait for a writer that cannot make it readable
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / ".hpc_ddp-secret").symlink_to(tmp_path / ".hpc_ddp-secret")
    with pytest.raises(node_local.NodeLocalError):
        node_local.run_secret(tmp_path / "link")
    assert waits == []


def test_a_run_dir_the_group_writes_shares_its_secret_with_the_group_and_no_one_else(tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    os.chmod(run_dir, 0o770)  # run_dir_mode: '0770': a teammate may resume it, so reads the secret too
    secret = node_local.run_secret(run_dir)
    assert stat.S_IMODE((run_dir / ".hpc_ddp-secret").stat().st_mode) == 0o640
    node_local._secret.cache_clear()
    assert node_local.run_secret(run_dir) == secret
    os.chmod(run_dir / ".hpc_ddp-secret", 0o644)  # everyone may read it: refused
    node_local._secret.cache_clear()
    with pytest.raises(node_local.NodeLocalError):
        node_local.run_secret(run_dir)


def test_a_launcher_hands_its_ranks_the_secret_of_their_run_dir_and_of_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59: the ranks a launcher starts take the run's secret from their environment (one read of the run
    dir for the step, not one per rank); a value meant for another run dir, or garbage, is ignored and the file
    is read, as a rank started without it does."""
    from hpc_ddp.rundir import secret_env

    run_dir, other = tmp_path / "run", tmp_path / "other"
    run_dir.mkdir()
    other.mkdir()
    handed = node_local.handed_secret(run_dir)
    secret = node_local.run_secret(run_dir)
    assert handed[secret_env.SECRET_VAR].endswith(":" + secret.hex())
    (run_dir / ".hpc_ddp-secret").unlink()  # a rank handed it never opens the file
    node_local._secret.cache_clear()
    monkeypatch.setenv(secret_env.SECRET_VAR, handed[secret_env.SECRET_VAR])
    assert node_local.run_secret(run_dir) == secret and not (run_dir / ".hpc_ddp-secret").exists()
    assert node_local.run_secret(other) != secret  # another run dir: its own file, made now
    assert (other / ".hpc_ddp-secret").exists()
    tag = secret_env.bound_to(run_dir)
    for garbage in (f"{tag}:zz", f"{tag}:{secret.hex()[:-2]}", ""):
        assert secret_env.handed(run_dir, {secret_env.SECRET_VAR: garbage}, node_local.SECRET_BYTES) is None
    # a rank takes it out of its environment at start: its children and the user's code never see it
    environ = {secret_env.SECRET_VAR: handed[secret_env.SECRET_VAR], "PATH": "/bin"}
    monkeypatch.setattr(secret_env, "_taken", None)
    secret_env.take(environ)
    assert environ == {"PATH": "/bin"}
    assert secret_env.handed(run_dir, {}, node_local.SECRET_BYTES) == secret


def test_folders_are_made_0700_under_umask_022_and_ours(tmp_path: Path) -> None:
    folder = beats.node_dir(tmp_path / "run", "job-1-restart-0", 0, tmp_path / "shm") / "jit"
    node_local.ensure(folder)
    for made in (folder, folder.parent, folder.parent.parent):
        info = made.lstat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), made


def test_a_planted_link_or_open_folder_is_refused_and_an_old_readable_one_of_ours_is_closed(tmp_path: Path) -> None:
    root = tmp_path / f"hpc_ddp-{os.getuid()}-planted"
    (tmp_path / "elsewhere").mkdir()
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(node_local.NodeLocalError, match="a symbolic link"):
        node_local.ensure(root / "job-1-restart-0-node-0")
    root.unlink()
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(node_local.NodeLocalError, match=r"(?s)writable by others.*drwxrwxrwx.*HINT: remove it"):
        node_local.ensure(root / "job-1-restart-0-node-0")
    os.chmod(root, 0o755)  # what an older hpc_ddp made: ours, readable by others, writable by nobody else
    node_local.ensure(root / "job-1-restart-0-node-0")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@as_root
def test_a_folder_of_another_user_is_refused_naming_its_owner(tmp_path: Path) -> None:
    root = tmp_path / f"hpc_ddp-{os.getuid()}-planted"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(node_local.NodeLocalError, match=rf"owned by uid {NOBODY}"):
        node_local.ensure(root / "job-1-restart-0-node-0")


def test_no_read_or_write_goes_through_a_planted_link_and_a_fifo_does_not_block(tmp_path: Path) -> None:
    victim = tmp_path / "model.pt"
    victim.write_bytes(b"weights")
    link = tmp_path / "rank-0.beat"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        rewrite_in_place(link, b"x" * 256)
    assert node_local.read(link) is None
    tmp_name = tmp_path / f".declared.json.tmp-{os.getpid()}-{__import__('threading').get_native_id()}"
    tmp_name.symlink_to(victim)  # the temporary name write_atomic would use, planted
    write_atomic(tmp_path / "declared.json", b"{}")
    assert victim.read_bytes() == b"weights" and (tmp_path / "declared.json").read_bytes() == b"{}"
    fifo = tmp_path / "rank-1.beat"
    os.mkfifo(fifo)
    assert node_local.read(fifo) is None  # no writer: a blocking open would hang here


@as_root
def test_a_file_of_another_user_is_not_believed(tmp_path: Path) -> None:
    planted = tmp_path / "offer-0.json"
    planted.write_text("{}")
    os.chown(planted, NOBODY, NOBODY)
    assert node_local.read(planted) is None
    assert node_local.read(planted, owner=None) == b"{}"


def test_records_without_the_attempts_token_are_ignored(tmp_path: Path) -> None:
    run_dir, tag = tmp_path / "run", "job-3-restart-0"
    folder = node_local.ensure(beats.node_dir(run_dir, tag, 0, tmp_path / "shm"))
    forged = beats.Beat(tag, 1, "evil", 99)
    (folder / "rank-1.beat").write_bytes(beats.encode(forged))
    assert beats.read(folder / "rank-1.beat", beats.local_tag(run_dir, tag), own=True) is None
    real = beats.Beat(beats.local_tag(run_dir, tag), 1, "n0", 5)
    (folder / "rank-1.beat").write_bytes(beats.encode(real))
    assert beats.read(folder / "rank-1.beat", beats.local_tag(run_dir, tag), own=True) == real
    # a planted copy of the config without the token: the node reads the run dir's own instead
    source = run_dir / "config.yaml"
    source.write_text("name: mine\n")
    (folder / "config.yaml").write_text("name: planted\n")
    assert node_share.read_once(source, folder, beats.local_tag(run_dir, tag), wait_s=0.1) == b"name: mine\n"
    # a planted offer for the survivors' snapshot: not this attempt's
    post = jit_files.Post(run_dir / "jit" / tag, folder / "jit", 0, 0, 0, 2, beats.local_tag(run_dir, tag))
    node_local.ensure(post.local)
    (post.local / "offer-1.json").write_text(json.dumps({"offer": {"rank": 1, "step": 99, "source": True}}))
    assert jit_files.jit_gather.local_offer(post, 1) is None


def test_the_node_compile_cache_is_private_and_copies_skip_links(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = node_local.ensure(compile_cache.node_folder(run_dir, {"TMPDIR": str(tmp_path / "tmp")}))
    assert stat.S_IMODE(local.stat().st_mode) == 0o700 and local.name.endswith("-compile")
    secret = tmp_path / "id_rsa"
    secret.write_text("private key")
    (local / "fxgraph").mkdir()
    (local / "fxgraph" / "entry").write_text("graph")
    (local / "fxgraph" / "stolen").symlink_to(secret)
    assert compile_cache.publish(local, run_dir) == 1
    assert sorted(p.name for p in (run_dir / "compile_cache" / "fxgraph").iterdir()) == ["entry"]
