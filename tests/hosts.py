"""Emulated hosts on one machine: network namespaces on one bridge, one torchrun node in each.

Each host is a network namespace ``<prefix>-h<i>`` whose ``eth0`` is one end of a veth pair; the
other end sits in a namespace of its own, ``<prefix>-br``, attached to the bridge ``br0`` there,
so nothing is added to the root namespace's interfaces or routes. Hosts get ``10.A.B.(i+1)/24``
from a private subnet that no route of the root namespace covers, and ``lo`` up. With ``rate``
set, a ``tbf`` qdisc caps both ends of every veth (a host's upload and download).

A host's torchrun runs under ``ip netns exec`` inside its own UTS namespace with the hostname
``h<i>``: tessera groups ranks into hosts by host name and boot id
(``tessera.comm.shared_arrays.host_writers``), so each namespace is a host of its own to it.
``GLOO_SOCKET_IFNAME=eth0`` makes gloo use the veth (the host names resolve to nothing). Every
namespace is new, so its port space is empty and the rendezvous port needs no search.

:meth:`EmulatedHosts.close` (also on leaving the ``with`` block, however it is left) kills every
process left in the namespaces and deletes them, which removes the veths and the bridge too.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[1]
#: the rendezvous port on host 0 (its namespace is new: nothing else can hold it)
RDZV_PORT = 29400
#: seconds the other hosts get to finish once one host's torchrun has failed
FAILED_GRACE_S = 15.0
_PREFIX = "tsh"  # every namespace this module makes starts with it, then a random suffix
_DEVICE = "eth0"


@dataclass
class HostRun:
    """One host's torchrun: its exit status (``None`` if it was killed at the timeout) and output."""

    host: str
    returncode: int | None
    stdout: str
    stderr: str


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (not root, no iproute2 or unshare, namespaces
    refused), or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veths, a bridge)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"emulated hosts need {tool} ({package}) on PATH"
    if not Path(sys.executable).with_name("torchrun").exists():
        return f"no torchrun beside {sys.executable}"
    probe = f"{_PREFIX}{secrets.token_hex(4)}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A random ``10.A.B.0/24`` that no route of the root namespace overlaps."""
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    taken = []
    for line in out.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable"):
            dest = line.split()[1] if len(line.split()) > 1 else ""
        try:
            taken.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            continue
    rng = random.SystemRandom()
    for _ in range(256):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for emulated hosts")


def _rate_bytes(rate: str) -> int:
    """Bytes per second of a tc rate such as ``100mbit`` or ``1gbit``."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"link rate {rate!r} is not <number>kbit|mbit|gbit")


class EmulatedHosts:
    """``n`` emulated hosts on one bridge, links capped at ``rate`` (a tc rate, e.g. ``100mbit``,
    or ``None`` for uncapped); a context manager that always removes them."""

    def __init__(self, n: int, rate: str | None = None) -> None:
        self.n = n
        self.rate = rate
        self.prefix = f"{_PREFIX}{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-h{i}" for i in range(n)]
        self.hostnames = [f"h{i}" for i in range(n)]
        self.subnet = _free_subnet()
        self.addresses = [str(self.subnet.network_address + i + 1) for i in range(n)]
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> EmulatedHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _create(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", f"p{i}", "type", "veth", "peer", "name", _DEVICE, "netns", ns)
            _ip("-n", br, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/{self.subnet.prefixlen}", "dev", _DEVICE)
            _ip("-n", ns, "link", "set", _DEVICE, "up")
            if self.rate is not None:
                # a burst of 10 ms at the rate (at least 64 KiB, so that one GSO segment passes)
                burst = max(64 * 1024, _rate_bytes(self.rate) // 100)
                for where, dev in ((ns, _DEVICE), (br, f"p{i}")):
                    _tc("-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                        "burst", str(burst), "latency", "100ms")  # fmt: skip

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``: in its network namespace and its own UTS namespace,
        under its host name."""
        return [
            "ip", "netns", "exec", self.namespaces[host],
            "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[host], *argv,
        ]  # fmt: skip

    def torchrun(self, host: int, nproc_per_node: int, args: Sequence[str], max_restarts: int = 0) -> list[str]:
        """The torchrun command line of ``host`` (c10d rendezvous at host 0) running ``args``,
        restarting the job's workers up to ``max_restarts`` times after a failure. The
        rendezvous numbers the nodes (``--node-rank`` is ignored there); host 0 has got the lowest
        ranks in every run seen, but nothing here relies on it."""
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [
            torchrun,
            f"--nnodes={self.n}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.addresses[0]}:{RDZV_PORT}",
            f"--rdzv-id={self.prefix}",
            f"--rdzv-conf=is_host={'true' if host == 0 else 'false'}",
            f"--local-addr={self.addresses[host]}",
            f"--max-restarts={max_restarts}",
            *args,
        ]

    def run(
        self,
        args: Sequence[str],
        nproc_per_node: int,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        grace_s: float = FAILED_GRACE_S,
    ) -> list[HostRun]:
        """Run ``torchrun ... ARGS`` on every host at once (``args`` as after torchrun's own
        options, e.g. ``["-m", "tessera", "train", ...]``); each host's status and output, once
        all have exited or ``timeout_s`` has passed, or ``grace_s`` after one failed (then the rest
        are killed). The output is also
        kept in ``log_dir/h<i>.out`` and ``.err`` (default: a new temporary folder)."""
        base = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": _DEVICE,
            **(env or {}),
        }
        logs = log_dir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-logs-"))
        logs.mkdir(parents=True, exist_ok=True)
        files = []
        procs = []
        try:
            for host in range(self.n):
                out = open(logs / f"{self.hostnames[host]}.out", "w+")
                err = open(logs / f"{self.hostnames[host]}.err", "w+")
                files.append((out, err))
                p = subprocess.Popen(
                    self.command(host, self.torchrun(host, nproc_per_node, args)),
                    env=base,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                procs.append(p)
                self._procs.append(p)
            codes = _wait(procs, timeout_s, grace_s)
        finally:
            self._kill()
        runs = []
        for host, (code, (out, err)) in enumerate(zip(codes, files)):
            out.seek(0)
            err.seek(0)
            runs.append(HostRun(self.hostnames[host], code, out.read(), err.read()))
            out.close()
            err.close()
        return runs

    def _kill(self) -> None:
        """SIGKILL to this object's torchruns' sessions and to every process left in its namespaces."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in [*self.namespaces, self.bridge_ns]:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace with this object's prefix."""
        self._kill()
        delete_namespaces(self.prefix)


def _wait(procs: Sequence[subprocess.Popen], timeout_s: float, grace_s: float) -> list[int | None]:
    """Each process's exit status once all have exited, or ``None`` for those still running at
    ``timeout_s``, or ``grace_s`` after one failed (torchrun's agents wait for their peers at an
    exit barrier long after a peer has gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    return [p.poll() for p in procs]


def delete_namespaces(prefix: str) -> list[str]:
    """Delete every network namespace whose name starts with ``prefix`` (with its veths and
    bridge); the names deleted."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return names
