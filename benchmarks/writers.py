"""One writer thread or two for a snapshot file: does this filesystem reward writing one file from two threads?

A node file is written the way ``hpc_ddp.rundir.snapshot`` writes it: chunks of 32 MiB, each hashed
(sha256) while it is written, then fsync. ``one``: one thread writes the chunks in order, the hash in a
helper thread (what the snapshot does). ``two``: two threads each write every other chunk at its offset
(``pwrite``) and hash it, then one fsync. ``dd``: ``dd conv=fsync`` of the same size, the disk's reference.
Rounds are interleaved; the figure is the median of the per-round ratios two / one (below 1: two win).

On ext4 a buffered write takes the file's inode lock, so two threads writing one file mostly take turns;
a parallel filesystem or an NVMe array may differ. ``dev/gpu_check.sh`` runs this on a lent GPU machine.
Usage: ``python -m benchmarks.writers [MEGABYTES] [ROUNDS]`` (default 512 MB, 7 rounds).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved, median, per_round, wall

CHUNK = 32 << 20


def _one(path: Path, data: memoryview) -> float:
    start = time.perf_counter()
    with open(path, "wb") as out, ThreadPoolExecutor(1) as pool:
        digest = hashlib.sha256()
        for at in range(0, data.nbytes, CHUNK):
            hashed = pool.submit(digest.update, data[at:at + CHUNK])
            out.write(data[at:at + CHUNK])
            hashed.result()
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - start


def _two(path: Path, data: memoryview) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        def write(first: int) -> None:
            for at in range(first * CHUNK, data.nbytes, 2 * CHUNK):
                hashlib.sha256(data[at:at + CHUNK])
                os.pwrite(fd, data[at:at + CHUNK], at)
        threads = [threading.Thread(target=write, args=(k,)) for k in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def writer_threads(directory: Path, megabytes: int, rounds: int) -> dict[str, Any]:
    """Seconds of ``one``, ``two`` and ``dd`` per round, and the per-round ratios."""
    data = memoryview(os.urandom(1 << 20) * megabytes)
    path = directory / "writers.bin"

    def timed(write: Any) -> Any:
        def run() -> float:
            took = write(path, data)
            path.unlink()
            return float(took)
        return run

    def dd() -> float:
        took = wall(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={megabytes // 4}", "conv=fsync"])
        path.unlink()
        return took

    timed(_one)()  # the first large write of a process is slower: not counted
    samples = interleaved({"one_s": timed(_one), "two_s": timed(_two), "dd_s": dd}, rounds)
    two, iqr = per_round(samples, "two_s", "one_s")
    one_dd = per_round(samples, "dd_s", "one_s")[0]
    return {"megabytes": megabytes, "rounds": rounds, **{k: round(median(v), 4) for k, v in samples.items()},
            "two_vs_one": round(two, 3), "two_vs_one_iqr": iqr, "one_vs_dd": round(one_dd, 3),
            "verdict": "two threads win" if iqr[1] < 1 else "one thread is as fast (kept)"}


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    megabytes, rounds = (given + ["512", "7"][len(given):])[:2]
    with tempfile.TemporaryDirectory(dir=os.environ.get("HPC_DDP_BENCH_DIR")) as tmp:
        print(json.dumps(writer_threads(Path(tmp), int(megabytes), int(rounds)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
