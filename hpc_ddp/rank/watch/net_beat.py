"""The node's beat over the training network (issue 60): how a node's watcher tells a partitioned
node from a slow file server, and a frozen or powered-off node from a slow one, in seconds.

The beats in the run dir (:mod:`hpc_ddp.rundir.beats`) go through the file server: a node whose
training link is down still writes them (a partition was never seen), and a file server that stalls
one node's writes looks like its death (so ``dist.liveness_s`` stays 30 s).

Each watcher (:mod:`hpc_ddp.rank.watch.node_watch`) therefore also pings the node it watches,
every tick, over UDP from the address it reaches ``MASTER_ADDR`` from (its training network), at
the address that node's watcher published in its beat in the run dir; the watched watcher answers
each ping. :class:`NetJudge` keeps the silence of the answers, by the watcher's own clock:

- no answer for :data:`NET_SILENT_S` once answers came, while this watcher pinged all along (a
  watcher whose own pings stopped has no evidence): the node is lost (frozen, powered off,
  partitioned), whatever its beats in the run dir say; a watcher that finds its own link down
  (:func:`link_down`) is the one cut off, and declares no other node (itself, once its link has
  stayed down a while: :mod:`hpc_ddp.rank.watch.node_watch`);
- the run dir's beats silent for ``dist.liveness_s`` while the answers come: not a loss (its file
  server is slow), a warning once;
- no answer ever (UDP blocked between nodes, no watcher there): the run dir's beats alone.

Datagrams carry the attempt and an HMAC with a key made from the attempt's node-local token, so
another user on the network can neither answer for a dead node nor make a live one look dead (a
replayed answer is older than the last one heard, and ignored). No torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from hpc_ddp.rank.watch.net_link import interface_of, link_down, own_address

log = logging.getLogger("hpc_ddp.liveness")
# a watched node that answered before and is silent this long on the network is lost: pings go
# every tick (0.5 s), so six in a row went unanswered
NET_SILENT_S = 3.0
# a gap this long between two runs of the pinging thread: this watcher was stopped, not its peer
STALL_S = 1.5
MAC_BYTES = 16


def key(local_tag: str) -> bytes:
    """The attempt's key for its datagrams: from its node-local tag, which carries the attempt's
    token (made from the run's secret)."""
    return hmac.new(local_tag.encode(), b"net-beat", hashlib.sha256).digest()


def encode(secret: bytes, tag: str, node: int, kind: str, count: int) -> bytes:
    body = json.dumps({"a": tag, "n": node, "k": kind, "c": count}).encode()
    return hmac.new(secret, body, hashlib.sha256).digest()[:MAC_BYTES] + body


def decode(secret: bytes, tag: str, raw: bytes) -> tuple[int, str, int] | None:
    """(node, kind, count) of a datagram of this attempt with a good MAC; None for anything else."""
    mac, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()[:MAC_BYTES]):
        return None
    try:
        record = json.loads(body)
        if record["a"] != tag:
            return None
        return int(record["n"]), str(record["k"]), int(record["c"])
    except (ValueError, KeyError, TypeError):
        return None


class NetJudge:
    """The answers of one watched node, by this watcher's clock. Pure: given the time."""

    def __init__(self, silent_s: float = NET_SILENT_S, stall_s: float = STALL_S) -> None:
        self.silent_s, self.stall_s = silent_s, stall_s
        self.count = -1
        self.heard_at: float | None = None
        self.awake_at: float | None = None
        self.unanswered = 0  # pings sent since the last answer (said in a declaration)

    def heard(self, count: int, now: float) -> bool:
        """An answer numbered ``count``; True for the first (the silence counts from now on)."""
        first = self.heard_at is None
        if count > self.count:  # a replayed or reordered answer is no news
            # either thread hears (a tick's clock may be older than the thread's): never back
            self.count, self.heard_at = count, now if first else max(self.heard_at, now)
            self.unanswered = 0
        return first

    def awake(self, now: float) -> None:
        """The pinging side ran at ``now``. A gap since its last run longer than ``stall_s`` (this
        watcher was stopped: ``scontrol suspend`` stops every node) starts the count again."""
        if self.awake_at is not None and now - self.awake_at > self.stall_s \
                and self.heard_at is not None:
            self.heard_at = max(self.heard_at, now)
        self.awake_at = now if self.awake_at is None else max(self.awake_at, now)
        self.unanswered += 1

    def silence(self, now: float) -> float | None:
        """Seconds without an answer, once one came; None before."""
        return None if self.heard_at is None else now - self.heard_at

    def lost(self, now: float) -> float | None:
        """The silence once it reaches ``silent_s``, while this side pings: a silence since its
        last ping longer than ``stall_s`` is this side's (its pings stopped), not the other's."""
        silent = self.silence(now)
        if silent is None or silent < self.silent_s:
            return None
        return None if self.awake_at is None or now - self.awake_at > self.stall_s else silent


class NetBeat:
    """One watcher's socket: it answers the pings of the node that watches it and pings the node it
    watches. The socket and the clock's readings are its only side effects.

    :meth:`serve` pings and answers from a thread of its own, which touches no file: a watcher
    whose tick waits on a stalled file server (its beat into the run dir) still pings and answers on
    time, so a slow file server never reads as a silent node, on either side. Its tick says whom to
    ping (:meth:`aim`), reads the verdict, and does the thread's work once too (all of it without
    the thread: the tests' hand-ticked watchers), so a stuck thread silences nobody."""

    def __init__(self, local_tag: str, tag: str, node: int, toward: str,
                 silent_s: float = NET_SILENT_S, stall_s: float = STALL_S) -> None:
        self.secret, self.tag, self.node = key(local_tag), tag, node
        address = own_address(toward)
        self.interface = interface_of(address)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.sock.setblocking(False)
        # the tick's own reads: never a wait (the thread's socket object waits out its timeout in
        # poll() before any read, MSG_DONTWAIT or not: a tick that read through it took 0.5 s more
        # each time, and B16's frozen rank was found in up to 6 s, not 2.4)
        self.reader = self.sock.dup()
        self.reader.settimeout(0.0)
        self.endpoint = f"{address}:{self.sock.getsockname()[1]}"
        self.judge, self.watched, self.target = NetJudge(silent_s, stall_s), -1, None
        self.count = 0
        self.silent_s, self.stall_s = silent_s, stall_s
        self.lock, self.serving, self.every_s = threading.Lock(), False, 0.5
        self.news: list[str] = []  # what the thread heard that the tick says

    def serve(self, clock: Callable[[], float] = time.monotonic, every_s: float = 0.5) -> None:
        """Ping every ``every_s``, answer pings and hear answers as they come, from a daemon
        thread."""
        self.serving, self.every_s = True, every_s
        threading.Thread(target=self._serve, args=(clock, every_s), name="net-beat",
                         daemon=True).start()

    def aim(self, watched: int, endpoint: str | None) -> None:
        """Ping node ``watched`` at ``endpoint`` from now on (another node than before: a fresh
        judge; None: ping nobody)."""
        with self.lock:
            if watched != self.watched:
                self.watched, self.judge = watched, NetJudge(self.silent_s, self.stall_s)
            self.target = endpoint

    def tick(self, watched: int, endpoint: str | None, now: float) -> None:
        """:meth:`aim`, and the thread's work once: answer and hear what waits on the socket, and
        ping where the thread has not lately. Each thread stands in for the other: an answer never
        waits on one thread alone (ci47-ci48: a node's answers paused for 3-4 s at a compile's
        start, and its neighbour declared it)."""
        self.aim(watched, endpoint)
        self._drain(now)
        with self.lock:
            stale = self.judge.awake_at is None or now - self.judge.awake_at > 2 * self.every_s
        if not self.serving or stale:  # the thread missed a ping (or there is none)
            self._ping(now)
        with self.lock:
            news, self.news = self.news, []
        for line in news:  # said here: the thread writes nothing (a blocked stderr would stop it)
            log.info(line)

    def lost(self, now: float) -> float | None:
        with self.lock:
            return self.judge.lost(now)

    def unanswered(self) -> int:
        """Pings sent since the watched node's last answer."""
        with self.lock:
            return self.judge.unanswered

    def silence(self, now: float) -> float | None:
        with self.lock:
            return self.judge.silence(now)

    def cut_off(self) -> bool:
        """This node's own link is down: it is the one partitioned."""
        return link_down(self.interface)

    def close(self) -> None:
        self.serving = False
        self.reader.close()
        self.sock.close()

    def _ping(self, now: float) -> None:
        with self.lock:
            self.judge.awake(now)
            target = self.target
            self.count += 1
            count = self.count
        if target:
            self._send(encode(self.secret, self.tag, self.node, "ping", count), target)

    def _serve(self, clock: Callable[[], float], every_s: float) -> None:
        due = clock()
        while self.serving:
            now = clock()
            if now >= due:
                self._ping(now)
                due = now + every_s
            try:
                self.sock.settimeout(max(0.01, due - clock()))
                raw, source = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self._take(raw, source, clock())

    def _drain(self, now: float) -> None:
        while True:
            try:  # never waits: the reader's timeout is 0
                raw, source = self.reader.recvfrom(2048)
            except OSError:  # nothing more (BlockingIOError), or closed
                return
            self._take(raw, source, now)

    def _take(self, raw: bytes, source: tuple[str, int], now: float) -> None:
        """A ping answered; an answer of the watched node heard."""
        heard = decode(self.secret, self.tag, raw)
        if heard is None:
            return
        node, kind, count = heard
        if kind == "ping":
            self._send(encode(self.secret, self.tag, self.node, "pong", count),
                       f"{source[0]}:{source[1]}")
        elif kind == "pong":
            with self.lock:
                if node == self.watched and self.judge.heard(count, now):
                    self.news.append(f"node {self.node}'s watcher: node {node} answers over the "
                                     f"training network ({source[0]}:{source[1]}): a silence of "
                                     f"{self.silent_s:g}s declares it from now on")

    def _send(self, data: bytes, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        try:
            self.sock.sendto(data, (host, int(port)))
        except (OSError, ValueError):
            pass  # a link down, a node gone: the silence says it


def start(local_tag: str, tag: str, node: int, toward: str, silent_s: float = NET_SILENT_S,
          stall_s: float = STALL_S) -> NetBeat | None:
    """The watcher's socket on the training network; None where none can be bound (the run dir's
    beats alone, as before)."""
    try:
        return NetBeat(local_tag, tag, node, toward, silent_s, stall_s)
    except OSError as err:
        log.warning("node %d's watcher: no beat over the training network (%s): the run dir's "
                    "beats alone tell its neighbours it lives", node, err)
        return None


def noticed(silent: float, age: float | None, period_s: float, ping_s: float = 0.5,
            unanswered: int | None = None) -> str:
    """How a node silent on the training network was noticed, and what its run-dir beats said:
    written every ``period_s`` and read as often, a beat newer than the last answer by more than a
    period and a ping shows a node that lives on (cut off); none since shows one that stopped, when
    the silence is long enough to have seen one. ``unanswered``: the pings sent in the silence."""
    head = f"no answer over the training network for {silent:.0f}s"
    tail = "" if unanswered is None else f" ({unanswered} pings unanswered)"
    if age is not None and age + period_s + ping_s < silent:
        return (f"{head}, while its beats in the run dir still came ({age:.0f}s ago): its link is "
                f"down{tail}")
    if silent > 2 * period_s + ping_s:
        return (f"{head}, nor a new beat in the run dir: frozen, powered off or hung in its "
                f"kernel{tail}")
    last = "" if age is None else f" {age:.0f}s ago"
    return (f"{head}; its last beat in the run dir came{last} (one every {period_s:g}s, too seldom "
            f"to tell a frozen node from a cut-off one){tail}")
