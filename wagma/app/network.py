"""Per-rank networks: every rank in a network namespace of its own, behind a link shaped to a rate (``rank_net``).

Ranks on one host exchange through loopback: every byte is copied by the same cores that compute, so communication
costs CPU and never wire time, and a global reduction is barely dearer than a pairwise exchange. With
``rank_net=RATE`` (``200mbit``) each rank runs in a network namespace of its own, joined by a veth pair to a Linux
bridge in the root namespace, and both ends of the veth are shaped with ``tbf`` to RATE: a rank's link is a
full-duplex RATE into a switch. Waiting on that wire costs the rank no CPU; with ``rank_cpus`` each rank is then a
device on a network.

Layout, from the job (:func:`wagma.app.quota.job_name`, hashed to 8 hex digits TAG):

- bridge ``wgbTAG`` in the root namespace, address ``198.18.N.1/24``: 198.18.0.0/15 is reserved for benchmarks
  (RFC 2544), never routed; N is drawn from TAG, the next /24 the host does not route yet when it is taken; its
  hardware address is fixed (:func:`mac_address`), so that it does not change when a rank's veth goes;
- per local rank R: namespace ``wagma-TAG-rR`` with ``lo`` up and ``wagma0`` at ``198.18.N.(R+2)/24`` (its hardware
  address fixed by TAG and R: a rank started again is the same host to its peers), the inner end of the veth whose
  root end ``wgvTAGrR`` is a port of the bridge; ``tbf`` on ``wagma0`` shapes what the rank sends,
  ``tbf`` on ``wgvTAGrR`` what it receives (:func:`tbf_burst` says how the bucket is sized).

Who: each rank makes its own (:class:`RankNetwork`), first thing in :func:`wagma.app.train.train`, before any socket
is opened, so it works alike under ``python train.py``, torchrun and the benchmarks. It creates its namespace and
veth (and the bridge, if it is the job's first) and enters the namespace under one host-wide lock; entering is
``setns(2)`` on the calling thread: the threads it starts later (gloo's, wagma's progress threads) are created in
the namespace. It then reaches torchrun's store at the bridge's address (the agent's store listens on every address
of the root namespace: ``MASTER_ADDR`` is pointed there) and gloo uses ``wagma0`` (``GLOO_SOCKET_IFNAME``). Forked
ranks (:func:`wagma.testing.run_workers`) make it before their process group with :func:`worker_setup`.

Cleanup, however the rank ends: with its namespace every rank starts a reaper, a small process (this file run as a
script: the module imports nothing but the standard library) in a session of its own that ignores SIGTERM, SIGINT
and SIGHUP. It waits inside the namespace for the rank's end of a pipe to close -- :meth:`RankNetwork.leave` closes
it, and so does the kernel when the rank dies, even by SIGKILL --, then until what the rank's sockets still hold
has reached its peers (a rank may end while its last message is on the wire; cut, its peer would wait for it until
its timeout), then removes the rank's namespace and veth, and the bridge once no rank of the job has a namespace
left. A launcher wraps a job in :func:`network_job`, which
removes what is left of the job after it (and turns SIGTERM into an exit that does so); a reaper killed outright
leaves a namespace no process is in, which :func:`remove_stale_networks` (run by every rank and launcher before it
sets up) removes: creating and entering a namespace happen under the lock, so outside it an empty one is stale.

Setting up needs root (CAP_NET_ADMIN), ``ip`` and ``tc`` (iproute2) and the ``tbf`` qdisc: :func:`check_rank_net`
names what is missing in one line. One host only: a job that spans nodes is refused.

One module, though a long one: it is one concept (a rank's own shaped network, from its rate to its removal), and
this file is also the reaper's script, run with the standard library alone (``python -I``). The reaper removes what
the set-up creates through the same names, lock and helpers, so neither half can move to another wagma module
without the reaper losing them (the few uses of wagma, :mod:`wagma.checks` among them, import inside functions).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# Standard library only: the reaper runs this file as a script (python -I network.py reap ...), without wagma.

__all__ = [
    "BURST_S",
    "INNER_IFNAME",
    "LATENCY",
    "MIN_BURST_BYTES",
    "NetworkError",
    "RankNetwork",
    "SUBNETS",
    "bridge_name",
    "check_rank_net",
    "current",
    "mac_address",
    "namespace_name",
    "network_job",
    "parse_rate",
    "rate_burst",
    "rate_name",
    "remove_job_networks",
    "remove_stale_networks",
    "tbf_burst",
    "unsent_bytes",
    "veth_name",
    "worker_setup",
]

#: The interface of a rank inside its namespace.
INNER_IFNAME = "wagma0"
#: The networks the bridges take their /24 from: 198.18.0.0/15, reserved for network benchmarks (RFC 2544).
SUBNETS = ipaddress.IPv4Network("198.18.0.0/15")
#: tbf's ``latency``: the longest a packet may wait in the shaper's queue before it is dropped.
LATENCY = "50ms"
#: The shaper's bucket in seconds of the rate (:func:`tbf_burst`).
BURST_S = 0.010
#: The shaper's smallest bucket in bytes (:func:`tbf_burst`): 10 ms of 52 Mbit/s, 31 ms of 17 Mbit/s.
MIN_BURST_BYTES = 64 * 1024
_NS_PREFIX = "wagma-"
_NETNS_DIR = Path("/run/netns")
_SYS_NET = Path("/sys/class/net")
_LOCK = Path("/run/wagma-net.lock")
_CLONE_NEWNET = 0x40000000
_RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", re.IGNORECASE)
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
#: Accepted forms of a rate, for error messages.
RATE_FORMS = "a number and kbit, mbit or gbit, e.g. 500kbit, 100mbit, 1gbit"
#: Seconds :meth:`RankNetwork.leave` waits for its reaper to remove the namespace.
REAP_S = 30.0


class NetworkError(RuntimeError):
    """A rank's network cannot be set up here (the message names the command and what it said, ``said``)."""

    def __init__(self, message: str, said: str | None = None) -> None:
        super().__init__(message)
        self.said = said if said is not None else message


def _fail(name: str, expected: str, found: object, advice: str = "") -> ValueError:
    """:func:`wagma.checks.fail`, imported here: the module imports nothing of wagma (its reaper runs it alone)."""
    from wagma.checks import fail

    return fail(name, expected, found, advice)


def _off(rate: object) -> bool:
    """Whether ``rate`` means no network of its own (null, 0, an empty string)."""
    from wagma.checks import is_number  # here: the module imports nothing of wagma (its reaper runs it alone)

    return rate is None or (is_number(rate) and rate == 0) or rate in ("", "0")


def parse_rate(rate: object) -> int | None:
    """``rate`` (``"200mbit"``) in bits per second; None for no network (null, 0, ``""``).

    Raises:
        ValueError: (one line) naming the accepted forms.
    """
    if _off(rate):
        return None
    match = _RATE.fullmatch(rate.strip()) if isinstance(rate, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise _fail("rank_net", f"null (no network) or a rate: {RATE_FORMS}", rate)
    bits = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bits < 8_000:
        raise _fail("rank_net", "at least 8kbit", rate, "a rank could not send one packet a second")
    return bits


def rate_name(rate: object) -> str | None:
    """``rate`` as summaries record it (``"200mbit"``, lower case), or None for no network."""
    if parse_rate(rate) is None:
        return None
    match = _RATE.fullmatch(str(rate).strip())
    assert match is not None
    return f"{float(match.group(1)):g}{match.group(2).lower()}"


def tbf_burst(bits_per_s: int) -> int:
    """The token bucket of a ``bits_per_s`` link, in bytes: what the link carries in :data:`BURST_S`, at least
    :data:`MIN_BURST_BYTES`.

    tbf releases packets from a timer, and on a loaded host that timer fires late: a bucket smaller than what the
    link carries meanwhile leaves the link idle, below its rate. Measured on the 2-core VM under load (P = 4,
    200 Mbit/s, gloo allreduce of 4 MB, model 240 ms): a bucket of 64 KiB (2.6 ms of the rate) took 1.37-1.56x the
    model, 128 KiB (5 ms) 1.11x, 256 KiB (10 ms) 1.04x. The bucket is also what a link sends at once after a pause,
    so it must stay small beside the messages it shapes: 10 ms of the rate, the most a message of 1 MB and more
    gains (a 1 MB pair exchange at 200 Mbit/s took 1.01-1.04x its 40 ms). Below 52 Mbit/s 10 ms is less than
    64 KiB, and there a small bucket loses rate on an idle host too (P = 8, 17 Mbit/s, 2 MB, two runs each: 10 ms,
    21 KB, took 1.12-1.21x the model for allreduce, groups and pairs, 64 KiB 1.06-1.12x; why is not isolated), so
    the bucket holds at least 64 KiB: 31 ms of 17 Mbit/s, 3 % of a 2 MB message.
    """
    return max(MIN_BURST_BYTES, round(bits_per_s * BURST_S / 8))


def rate_burst(rate: object) -> int | None:
    """The shaper's bucket for ``rank_net=rate`` in bytes (:func:`tbf_burst`), as summaries record it; None for none.

    A run's record keeps it beside the rate: below 52 Mbit/s the bucket is :data:`MIN_BURST_BYTES`, and how close a
    link comes to its rate there depends on it (:func:`tbf_burst`).
    """
    bits = parse_rate(rate)
    return None if bits is None else tbf_burst(bits)


def _tag(job: str) -> str:
    return hashlib.sha1(job.encode()).hexdigest()[:8]


def namespace_name(job: str, rank: int) -> str:
    """The network namespace of ``rank`` of ``job`` (``wagma-TAG-rR``)."""
    return f"{_NS_PREFIX}{_tag(job)}-r{rank}"


def veth_name(job: str, rank: int) -> str:
    """The root-namespace end of ``rank``'s veth (``wgvTAGrR``: interface names hold at most 15 characters)."""
    return f"wgv{_tag(job)}r{rank}"


def bridge_name(job: str) -> str:
    """The job's bridge in the root namespace (``wgbTAG``)."""
    return f"wgb{_tag(job)}"


def mac_address(job: str, rank: int | None = None) -> str:
    """The fixed hardware address of ``rank``'s interface inside its namespace, or (``rank`` None) of the job's bridge:
    ``02:TT:TT:TT:TT:RR`` (locally administered; TAG's 4 bytes, then the rank, or ``ff`` for the bridge).

    Fixed, so that a rank started again behind the same address has the same hardware address as its last life and a
    peer's neighbour (ARP) entry for it stays right, and so that the bridge (the gateway) keeps its address when a port
    goes: a Linux bridge otherwise takes its lowest port's, which changes when that rank's veth is removed. A peer
    that only sends to a changed address has its frames dropped until its entry ages out (30 s and more, measured),
    long enough to stall the survivors of a killed torchft replica in the quorum of its restart.
    """
    if rank is not None and not 0 <= rank <= 252:
        raise ValueError(f"rank: expected a local rank in [0, 252], found {rank}")
    return _mac(_tag(job), rank)


def _mac(tag: str, rank: int | None) -> str:
    return ":".join(["02", tag[0:2], tag[2:4], tag[4:6], tag[6:8], "ff" if rank is None else f"{rank:02x}"])


def _run(argv: list[str], stdin: str | None = None) -> str:
    """Run an iproute2 command; its stdout. Raises NetworkError naming the command and its first error line."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"{' '.join(argv[:3])} could not run: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
        what = " ".join(argv) + (f" <<< {stdin.strip().splitlines()[0]} ..." if stdin else "")
        raise NetworkError(f"{what}: {said}", said)
    return done.stdout


def _batch(tool: str, lines: list[str], netns: str | None = None, force: bool = False) -> None:
    """Run ``lines`` as one ``ip``/``tc`` batch (in ``netns``); ``force`` goes on past failed lines."""
    if lines:
        _run(
            [tool, *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"],
            "\n".join(lines) + "\n",
        )


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """The host-wide lock every creation and removal of rank networks holds (a flock, released by death too)."""
    with open(_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd`` (os.setns from Python 3.12 on)."""
    if hasattr(os, "setns"):
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def _our_namespaces(tag: str | None = None) -> list[str]:
    """The rank namespaces of job ``tag`` (of every job when None) that exist now."""
    prefix = f"{_NS_PREFIX}{tag}-r" if tag else _NS_PREFIX
    try:
        return sorted(n for n in os.listdir(_NETNS_DIR) if n.startswith(prefix))
    except OSError:
        return []


def _links(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(_SYS_NET) if n.startswith(prefix))
    except OSError:
        return []


def _inode(path: str | Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _live_namespaces() -> set[int]:
    """The network namespaces (nsfs inodes) some thread of some process is in now."""
    live: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if (ino := _inode(f"/proc/{pid}/task/{tid}/ns/net")) is not None:
                live.add(ino)
    return live


def _names_of(namespace: str) -> tuple[str, str]:
    """(tag, rank) of a rank namespace's name."""
    tag, _, rank = namespace[len(_NS_PREFIX) :].partition("-r")
    return tag, rank


def _remove_locked(namespaces: list[str], bridges: list[str], veths: list[str]) -> list[str]:
    """Remove rank namespaces (with their veths), further veths, then bridges; the names removed. Holds the lock."""
    gone = [n for n in namespaces if (_NETNS_DIR / n).exists()]
    links = [f"wgv{t}r{r}" for t, r in map(_names_of, gone)] + veths
    links = [v for v in [*dict.fromkeys(links), *bridges] if (_SYS_NET / v).exists()]
    # the veth first (its pair goes with it), then the name; -force: one failure does not stop the others
    with contextlib.suppress(NetworkError):  # what could not be removed stays, and is not named below
        _batch("ip", [f"link del {v}" for v in links] + [f"netns del {n}" for n in gone], force=True)
    return [n for n in gone + links if not ((_NETNS_DIR / n).exists() or (_SYS_NET / n).exists())]


def _unused_bridges_locked(tags: set[str] | None = None) -> list[str]:
    """The bridges (of jobs ``tags``, or all) that no rank namespace of their job is left for."""
    bridges = [b for b in _links("wgb") if (_SYS_NET / b / "bridge").is_dir()]
    return [b for b in bridges if (tags is None or b[3:] in tags) and not _our_namespaces(b[3:])]


def _stale_locked() -> list[str]:
    live = _live_namespaces()
    dead = [n for n in _our_namespaces() if _inode(_NETNS_DIR / n) not in live]
    removed = _remove_locked(dead, [], [])
    names = set(_our_namespaces())
    orphans = [
        v for v in _links("wgv") if (_SYS_NET / v).exists() and f"{_NS_PREFIX}{v[3:11]}-r{v[12:]}" not in names
    ]  # a veth whose namespace is gone
    return removed + _remove_locked([], _unused_bridges_locked(), orphans)


def remove_stale_networks() -> list[str]:
    """Remove the rank namespaces no process is in (and their veths), and the bridges no rank namespace is left for.

    A namespace is made and entered under the host lock, so outside it an empty one belongs to no rank: its rank
    ended and its reaper was killed before it could remove it. Called by every rank and launcher before it sets up.
    Returns the names removed (never raises for what it cannot remove).
    """
    if not _NETNS_DIR.is_dir() and not _links("wgb"):
        return []
    with _host_lock():
        return _stale_locked()


def remove_job_networks(job: str) -> list[str]:
    """Remove every namespace, veth and the bridge of ``job``, whoever is still in them (a launcher's cleanup once
    its ranks are gone). Returns the names removed."""
    tag = _tag(job)
    if not _our_namespaces(tag) and not _links(f"wgv{tag}") and not _links(f"wgb{tag}"):
        return []
    with _host_lock():
        return _remove_locked(_our_namespaces(tag), _links(f"wgb{tag}"), _links(f"wgv{tag}"))


@contextlib.contextmanager
def network_job(job: str, enabled: bool = True) -> Iterator[None]:
    """Wrap a launcher's start of a job whose ranks have networks of their own (``job`` as its ranks name it).

    Before: removes what jobs whose ranks and reapers were killed outright left (:func:`remove_stale_networks`).
    During: SIGTERM raises ``SystemExit(143)`` (:func:`wagma.app.procs.sigterm_exits`), so the launcher stops its
    ranks and this cleanup runs. After, however the job ended: removes what is left of ``job``'s networks (the
    ranks' reapers normally have). ``enabled=False`` does nothing.
    """
    if not enabled:
        yield
        return
    from wagma.app.procs import sigterm_exits  # here: the module imports nothing of wagma (its reaper runs it alone)

    remove_stale_networks()
    try:
        with sigterm_exits():
            yield
    finally:
        remove_job_networks(job)


def _host_routes() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks the host routes or has addresses in (the default route excepted)."""
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]) or "[]")
    addrs = json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]")
    nets = []
    for dst in [r.get("dst", "") for r in routes] + [
        f"{a['local']}/{a['prefixlen']}" for i in addrs for a in i.get("addr_info", [])
    ]:
        with contextlib.suppress(ValueError):
            if dst not in ("default", ""):
                nets.append(ipaddress.ip_network(dst, strict=False))
    return [n for n in nets if n.version == 4 and n.prefixlen > 0]


def _bridge_locked(tag: str) -> ipaddress.IPv4Interface:
    """The job's bridge (created when it is the first rank) and its address."""
    bridge = f"wgb{tag}"
    if (_SYS_NET / bridge).exists():
        info = json.loads(_run(["ip", "-j", "-4", "addr", "show", "dev", bridge]) or "[]")
        for a in info[0].get("addr_info", []) if info else []:
            return ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}")
        _batch("ip", [f"link del {bridge}"])  # a bridge without its address: half made, make it again
    used = _host_routes()
    subnets = list(SUBNETS.subnets(new_prefix=24))
    start = int(tag, 16) % len(subnets)
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(u) for u in used):
            break
    else:
        raise NetworkError(f"no free /24 in {SUBNETS} for a rank network: the host routes all of it")
    address = ipaddress.IPv4Interface(f"{net[1]}/24")
    try:
        # its hardware address set, not taken from a port: it must not change when a rank's veth goes (mac_address)
        commands = [f"link add {bridge} address {_mac(tag, None)} type bridge", f"addr add {address} dev {bridge}"]
        _batch("ip", [*commands, f"link set {bridge} up"])
    except NetworkError:
        _batch("ip", [f"link del {bridge}"], force=True)
        raise
    return address


class RankNetwork:
    """This rank in a network namespace of its own behind a link shaped to ``rate``, until :meth:`leave`.

    Creates (under the host lock) the job's bridge if need be, the rank's namespace and veth and their shapers,
    starts the rank's reaper and moves the calling thread into the namespace; then points ``MASTER_ADDR`` at the
    store's address seen from the namespace and ``GLOO_SOCKET_IFNAME`` at :data:`INNER_IFNAME`. Call it on the thread
    that will create the process group, before it does. One per process (:func:`current`).

    Args:
        rate: the link's rate, e.g. ``"200mbit"`` (:func:`parse_rate`).
        job: the job's name (:func:`wagma.app.quota.job_name`), the same on every rank.
        rank: this rank (on one host: its local rank too).
        wait_s: how long to wait while this rank's namespace is still in use (a restarted process whose previous
            life's reaper is still draining its sockets); 0: fail at once.

    Raises:
        NetworkError: it cannot be set up (the message names the command and what it said); nothing is left.
    """

    def __init__(self, rate: str, *, job: str, rank: int, wait_s: float = 0.0) -> None:
        global _current
        bits = parse_rate(rate)
        if bits is None:
            raise _fail("rate", "a rate such as 200mbit", rate)
        if _current is not None:
            raise NetworkError(f"this process is already in a rank network ({_current.namespace})")
        if not 0 <= rank <= 252:
            raise NetworkError(str(_fail("rank", "a local rank in [0, 252] (rank_net gives a host one /24)", rank)))
        self.rate: str = rate_name(rate) or ""
        self.bits_per_s, self.job, self.rank = bits, job, rank
        tag = _tag(job)
        self.namespace: str = namespace_name(job, rank)
        self.veth, self.bridge = veth_name(job, rank), bridge_name(job)
        self.mac: str = mac_address(job, rank)
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._env: dict[str, str | None] = {}
        self.joined = False
        deadline = time.monotonic() + max(0.0, wait_s)
        try:
            while not self._join(tag, rank):  # its namespace in use (a dead one was just swept)
                if time.monotonic() >= deadline:
                    waited = f" after {wait_s:g} s" if wait_s > 0 else ""
                    raise NetworkError(
                        f"rank {rank}: network namespace {self.namespace} is in use by another process{waited} "
                        "(another job with the same run directory?)"
                    )
                time.sleep(0.1)
        except BaseException:
            os.close(self._home)
            raise
        self.joined = True
        _current = self
        use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # torchrun's agent store listens on every address of the root namespace: the bridge's is one; without it
        # rank 0 hosts the store, in its own namespace.
        self.store_host = str(
            self.gateway.ip if use_agent_store or "MASTER_ADDR" not in os.environ else self.gateway.network[2]
        )
        self._set_env(
            {
                "GLOO_SOCKET_IFNAME": INNER_IFNAME,
                **({"MASTER_ADDR": self.store_host} if "MASTER_ADDR" in os.environ else {}),
            }
        )

    def _join(self, tag: str, rank: int) -> bool:
        """Under the host lock: make this rank's namespace and veth (and the bridge) and enter the namespace; False,
        with nothing made, while a process is in the namespace."""
        with _host_lock():
            _stale_locked()
            if self.namespace in _our_namespaces(tag):
                return False
            self.gateway = _bridge_locked(tag)
            self.address = ipaddress.IPv4Interface(f"{self.gateway.network[rank + 2]}/24")
            try:
                self._create_locked()
                ns_fd = os.open(_NETNS_DIR / self.namespace, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    self._reaper = _start_reaper(tag, rank, ns_fd)
                    try:
                        _setns(ns_fd)  # under the lock: no sweeper sees the namespace empty
                    except BaseException:
                        self._reaper.kill()
                        raise
                finally:
                    os.close(ns_fd)
            except BaseException:
                _remove_locked([self.namespace], [], [self.veth])
                _remove_locked([], _unused_bridges_locked({tag}), [])
                raise
        return True

    def _create_locked(self) -> None:
        burst, rate = tbf_burst(self.bits_per_s), f"{self.bits_per_s}bit"
        shaper = f"qdisc replace dev {{}} root tbf rate {rate} burst {burst} latency {LATENCY}"
        _batch(
            "ip",
            [
                f"netns add {self.namespace}",
                # the inner end's hardware address fixed: the same in every life of the rank (mac_address)
                f"link add {self.veth} type veth peer name {INNER_IFNAME} address {self.mac} netns {self.namespace}",
                f"link set {self.veth} master {self.bridge}",
                f"link set {self.veth} up",
            ],
        )
        # no IPv6 link-local address inside: gloo takes the interface's first address
        _batch(
            "ip",
            [
                "link set lo up",
                f"link set {INNER_IFNAME} addrgenmode none",
                f"addr add {self.address} dev {INNER_IFNAME}",
                f"link set {INNER_IFNAME} up",
            ],
            self.namespace,
        )
        _batch("tc", [shaper.format(self.veth)])  # what the rank receives
        _batch("tc", [shaper.format(INNER_IFNAME)], self.namespace)  # what it sends

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self._env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def leave(self) -> None:
        """Move the calling thread back to the namespace it came from, restore the environment, and have the reaper
        remove the rank's namespace and veth (and the bridge, when this was the job's last); waits for it at most
        :data:`REAP_S`. Idempotent, never raises."""
        global _current
        if not self.joined:
            return
        self.joined = False
        with contextlib.suppress(OSError):
            _setns(self._home)
        with contextlib.suppress(OSError):
            os.close(self._home)
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with contextlib.suppress(OSError):
            self._reaper.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._reaper.wait(timeout=REAP_S)
        if _current is self:
            _current = None

    def __enter__(self) -> RankNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


_current: RankNetwork | None = None


def current() -> RankNetwork | None:
    """The rank network this process is in (:class:`RankNetwork` made and not yet left), or None."""
    return _current


def worker_setup(rate: str, job: str) -> Callable[[int, int], str]:
    """For :func:`wagma.testing.run_workers`'s ``setup``: each forked rank makes its :class:`RankNetwork` before
    its process group and reaches the store at the bridge's address. The reaper removes it when the rank ends."""

    def setup(rank: int, _world_size: int) -> str:
        return RankNetwork(rate, job=job, rank=rank).store_host

    return setup


def _start_reaper(tag: str, rank: int, ns_fd: int) -> subprocess.Popen[bytes]:
    """Start the rank's reaper (in the root namespace: call it before entering), holding ``ns_fd``."""
    return subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), "reap", tag, str(rank), str(ns_fd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        pass_fds=(ns_fd,),
        start_new_session=True,
    )


#: TCP states (``/proc/net/tcp``'s ``st``) in which a socket may still hold data to send: ESTABLISHED, FIN_WAIT1,
#: CLOSE_WAIT, LAST_ACK, CLOSING.
_SENDING = frozenset({"01", "04", "08", "09", "0B"})
#: Of those, the states in which the socket has sent its FIN, which counts one in its unacknowledged sequence.
_FIN_SENT = frozenset({"04", "09", "0B"})


def unsent_bytes() -> int:
    """The bytes of data the TCP sockets of the calling thread's network namespace have not had acknowledged yet
    (a FIN not acknowledged is no data: the peer that would acknowledge it may be gone)."""
    total = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/thread-self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 4 and fields[3] in _SENDING:
                queued = int(fields[4].split(":")[0], 16)
                total += max(0, queued - 1) if fields[3] in _FIN_SENT else queued
    return total


def _drain(stall_s: float = 5.0, limit_s: float = 300.0, poll_s: float = 0.02) -> None:
    """Wait until the namespace's sockets have delivered what they hold, while they make progress.

    A rank's last messages may still be on its wire when it ends (gloo's send is done once the kernel has the
    bytes): removing its veth then would cut them off, and the peer waiting for them would hang until its timeout.
    Returns when nothing is left to send, when nothing moved for ``stall_s`` (the peer is gone), or after ``limit_s``.
    """
    deadline = time.monotonic() + limit_s
    last, moved = unsent_bytes(), time.monotonic()
    while last and time.monotonic() < min(deadline, moved + stall_s):
        time.sleep(poll_s)
        now = unsent_bytes()
        if now < last:
            moved = time.monotonic()
        last = now


def _reap(tag: str, rank: int, ns_fd: int) -> None:
    """The reaper: wait in the rank's namespace (so that no sweep takes it meanwhile) until the rank's pipe closes and
    what the rank sent has been delivered (:func:`_drain`), then remove its namespace (if it is still the one
    ``ns_fd`` holds: a restarted rank may have made a new one of the same name) and veth, and the bridge once no
    rank of the job has a namespace left."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    _setns(ns_fd)
    sys.stdin.buffer.read()  # returns at EOF: the rank left, or died
    _drain()
    _setns(home)  # back in the root namespace: the veth's root end and the bridge are there
    namespace = f"{_NS_PREFIX}{tag}-r{rank}"
    with _host_lock():
        mine = _inode(_NETNS_DIR / namespace) == os.fstat(ns_fd).st_ino
        os.close(ns_fd)
        _remove_locked([namespace] if mine else [], [], [])
        _remove_locked([], _unused_bridges_locked({tag}), [])


def _trial() -> str | None:
    """Try a bridge, a namespace, a veth into it and tbf on it; the first line of what failed, or None."""
    name = f"wgt{os.getpid() % 10**8}"  # apart from the rank networks' names: no sweep takes them
    netns = f"wgcheck-{os.getpid()}"
    steps = [
        ("a network namespace", ["ip", "netns", "add", netns]),
        ("a bridge", ["ip", "link", "add", f"{name}b", "type", "bridge"]),
        ("a veth pair", ["ip", "link", "add", f"{name}v", "type", "veth", "peer", "name", "t0", "netns", netns]),
        (
            "the tbf qdisc",
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                f"{name}v",
                "root",
                "tbf",
                "rate",
                "200mbit",
                "burst",
                "64kb",
                "latency",
                LATENCY,
            ],
        ),
    ]
    try:
        for what, argv in steps:
            try:
                _run(argv)
            except NetworkError as exc:
                return f"{what} could not be made ({exc.said})"
        return None
    finally:
        _batch("ip", [f"link del {name}v", f"link del {name}b", f"netns del {netns}"], force=True)


@functools.lru_cache(maxsize=1)
def _host_problem() -> str | None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"rank_net needs the {' and '.join(missing)} command(s) of iproute2, which this host does not have "
            "on PATH: install iproute2 or run without rank_net"
        )
    if os.geteuid() != 0:
        return (
            f"rank_net needs root (CAP_NET_ADMIN) to create network namespaces, veths and a bridge, and this "
            f"process runs as uid {os.geteuid()}: run as root or without rank_net"
        )
    with _host_lock():  # ranks checking at once: one trial at a time (the first may mount /run/netns)
        problem = _trial()
    if problem is not None:
        return f"rank_net: {problem}; this host cannot shape a rank's link: run without rank_net"
    return None


def check_rank_net(rate: object, local_ranks: int, world_size: int | None = None, device: str = "cpu") -> str | None:
    """The one-line reason ``rank_net=rate`` cannot run ``local_ranks`` ranks here, or None when it can.

    ``rate`` must be null/0 (no network) or a rate (:func:`parse_rate`); the job must fit one host (``world_size``
    ranks, all local) and a /24; the ranks must talk through sockets (gloo: not on ``device`` ``"cuda"``, whose NCCL
    goes through NVLink and shared memory); and the host must have ``ip``, ``tc``, root, and make a bridge, a
    namespace, a veth and ``tbf`` when tried (once per process, under the host lock).
    """
    try:
        name = rate_name(rate)
    except ValueError as exc:
        return str(exc)
    if name is None:
        return None
    if world_size is not None and local_ranks < world_size:
        return (
            f"rank_net={name} puts the ranks of one host on a network of their own, but this job spans more than "
            f"one host ({local_ranks} local of {world_size} ranks): run a multi-node job without rank_net"
        )
    if local_ranks > 253:
        return str(_fail(f"rank_net={name}", "at most 253 ranks on a host (one /24)", local_ranks))
    if device == "cuda":
        return (
            f"rank_net={name} shapes the ranks' sockets (gloo), and on CUDA devices they send through NCCL, "
            "which it cannot shape: use device=cpu with rank_net"
        )
    return _host_problem()


def _main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "reap":
        _reap(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print("usage: network.py reap TAG RANK NS_FD (started by wagma.app.network.RankNetwork)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
