"""The rendezvous store's ports: unguessable, one set per attempt, with fallbacks when one is taken
(issue 61).

torch's TCPStore listens on every interface of rank 0's node and asks no password (torch's
documentation: trusted networks only). A port derived from the job id (public, through ``squeue``)
let another user of the first node take it before rank 0 did: the job then failed, or its ranks
talked to the stranger's listener. So where neither the environment (``MASTER_PORT``) nor the config
(``dist.master_port``) names a port, each attempt's ports come from the run's secret
(:mod:`hpc_ddp.rundir.node_local`) and the attempt's tag: every rank computes the same :data:`TRIES`
candidates, nobody else can. Rank 0 serves the first one it can bind; a rank connects to the first
one and believes a store only if it holds the key only rank 0 can set (:func:`check_key`); where
rank 0 had to move on it says so in the run dir, and the others follow.

Pure: the secret and the tag come in, ports and names go out. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping

# the attempt's candidates, comma-separated (set by the worker for its rank)
PORTS_VAR = "HPC_DDP_STORE_PORTS"
# the key rank 0 sets in its store, proving the store is this attempt's
KEY_VAR = "HPC_DDP_STORE_KEY"
# [10000, 31999]: below Linux's ephemeral ports (32768-), so no outgoing connection holds one
BASE, SPAN = 10000, 22000
TRIES = 4


def candidates(secret: bytes, tag: str, tries: int = TRIES) -> tuple[int, ...]:
    """The attempt ``tag``'s ports, in the order rank 0 tries them: distinct, unguessable without
    ``secret``."""
    import hashlib  # here: OpenSSL's hashlib is ~3 ms of the login node's import budget (B1)
    import hmac

    found: list[int] = []
    counter = 0
    while len(found) < tries:
        digest = hmac.new(secret, f"store-port\0{tag}\0{counter}".encode(), hashlib.sha256).digest()
        port = BASE + int.from_bytes(digest[:4], "big") % SPAN
        if port not in found:
            found.append(port)
        counter += 1
    return tuple(found)


def check_key(token: str) -> str:
    """The store key whose presence says "this is the attempt's own store" (its name carries the
    token)."""
    return f"hpc_ddp/{token}/rendezvous"


def exported(secret: bytes, tag: str, token: str) -> dict[str, str]:
    """What the worker adds to its rank's environment: MASTER_PORT (the first candidate, what a
    script's ``env://`` uses), the candidates and the key."""
    ports = candidates(secret, tag)
    return {"MASTER_PORT": str(ports[0]), PORTS_VAR: ",".join(map(str, ports)),
            KEY_VAR: check_key(token)}


def from_environ(environ: Mapping[str, str],
                 master_port: int) -> tuple[tuple[int, ...], str | None]:
    """(the candidates, the key) this rank was given; ``(), None`` where the port was chosen by the
    user or derived from the job id (MASTER_PORT alone, and a store there is believed as it is)."""
    text, key = environ.get(PORTS_VAR, ""), environ.get(KEY_VAR) or None
    try:
        ports = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        ports = ()
    if not ports or not key or ports[0] != master_port or not all(0 < p < 65536 for p in ports):
        return (), None  # MASTER_PORT was set after (by hand, by a template): it wins, alone
    return ports, key
