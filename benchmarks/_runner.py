"""Launch one benchmark child under a memory cap and a timeout, and collect its result.

Memory cap, strongest mechanism available first:

1. a fresh memory cgroup per child (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; needs a
   writable ``/sys/fs/cgroup``): the kernel OOM-kills the child at the cap and the cgroup's
   ``oom_kill`` counter tells us so;
2. otherwise the parent polls the child's ``VmRSS`` every 0.2 s and kills it above the cap.

``RLIMIT_AS`` is not used (torch and jemalloc reserve far more address space than they touch).
The RSS poll runs in both cases and its maximum is reported next to the child's own ``ru_maxrss``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _child import MARKER


def median_s(fn, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up (in-process micro-benchmarks)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JEMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def find_jemalloc() -> str | None:
    """Path of libjemalloc.so.2 for ``LD_PRELOAD``, or ``None`` when it is not installed."""
    env = os.environ.get("TESSERA_JEMALLOC")
    for p in ([env] if env else []) + list(JEMALLOC_CANDIDATES):
        if p and Path(p).is_file():
            return p
    return None


def allocator_env(allocator: str, jemalloc: str | None) -> dict[str, str] | None:
    """Environment changes for ``allocator`` (``default`` = glibc malloc), ``None`` if unavailable."""
    if allocator == "default":
        return {"LD_PRELOAD": "", "MALLOC_CONF": ""}
    if allocator == "jemalloc":
        return None if jemalloc is None else {"LD_PRELOAD": jemalloc, "MALLOC_CONF": JEMALLOC_CONF}
    raise ValueError(f"unknown allocator {allocator!r}")


def thread_env(threads: int) -> dict[str, str]:
    """Environment of a benchmark child: ``threads`` for OpenMP, MKL, OpenBLAS and numba, this
    checkout first on ``PYTHONPATH``, unbuffered output."""
    t = str(threads)
    return {
        "OMP_NUM_THREADS": t,
        "MKL_NUM_THREADS": t,
        "OPENBLAS_NUM_THREADS": t,
        "NUMBA_NUM_THREADS": t,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        "PYTHONUNBUFFERED": "1",
    }


# ---------------------------------------------------------------------------------- tessera trees
def tessera_src_sha1(pkg: Path) -> str:
    """SHA-1 (12 hex digits) over a ``tessera`` package's ``.py`` files; the same digest as
    ``_peers._source_hash``, which every tessera child reports as ``versions.tessera_src_sha1``."""
    h = hashlib.sha1()
    for f in sorted(Path(pkg).rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def tree_pythonpath(tree: Path) -> str:
    """``PYTHONPATH`` for a child of another tessera tree: that tree first. ``sys.path`` entries
    from ``PYTHONPATH`` precede site-packages, and setuptools' editable finder for this checkout
    is appended to ``sys.meta_path`` after the path finder, so ``import tessera`` finds the tree's."""
    return os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))


_WHICH_TESSERA = "import json, tessera; print(json.dumps({'file': tessera.__file__}))"


def probe_tessera_tree(python: str, tree: Path, timeout: float = 120.0) -> dict[str, Any]:
    """Which ``tessera`` interpreter ``python`` imports with the tree's ``PYTHONPATH`` (run in the
    tree's ``benchmarks/``, the first ``sys.path`` entry of its ``_child.py``), the tree's source
    digest and git commit; ``error`` when the import fails."""
    env = {**os.environ, "PYTHONPATH": tree_pythonpath(tree)}
    out: dict[str, Any] = {"path": str(tree), "src_sha1": tessera_src_sha1(tree / "tessera")}
    try:
        r = subprocess.run(
            [python, "-c", _WHICH_TESSERA],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tree / "benchmarks",
            env=env,
        )
        if r.returncode != 0:
            out["error"] = (r.stderr.strip().splitlines() or ["?"])[-1]
        else:
            out["tessera_file"] = json.loads(r.stdout.strip().splitlines()[-1])["file"]
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        out["error"] = str(e)

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=tree, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    out["commit"] = git("rev-parse", "--short", "HEAD") or None
    out["tessera_dirty"] = bool(git("status", "--porcelain", "tessera"))
    return out


# ---------------------------------------------------------------------------------- cgroups
class CgroupCap:
    """A per-child memory cgroup with a hard limit (cgroup v2 or v1)."""

    def __init__(self, base: Path, version: int) -> None:
        self.base, self.version = base, version

    @staticmethod
    def detect() -> CgroupCap | None:
        """A usable cgroup hierarchy for memory limits, or ``None``."""
        candidates: list[tuple[Path, int]] = []
        if (CGROUP_ROOT / "cgroup.controllers").is_file():
            if "memory" in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
                candidates.append((CGROUP_ROOT, 2))
        if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").is_file():
            candidates.append((CGROUP_ROOT / "memory", 1))
        for base, version in candidates:
            probe = base / f"tessera_bench_probe_{os.getpid()}"
            try:
                probe.mkdir()
                ok = (probe / ("memory.max" if version == 2 else "memory.limit_in_bytes")).exists()
                probe.rmdir()
            except OSError:
                continue
            if ok:
                return CgroupCap(base, version)
        return None

    def create(self, tag: str, limit_bytes: int) -> Path:
        """A new cgroup named after ``tag`` limited to ``limit_bytes``."""
        d = self.base / f"tessera_bench_{os.getpid()}_{tag}"
        d.mkdir(exist_ok=True)
        if self.version == 2:
            (d / "memory.max").write_text(str(limit_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        else:
            (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
        return d

    def oom_killed(self, d: Path) -> bool:
        """Whether the kernel OOM-killed something in cgroup ``d``."""
        f = d / ("memory.events" if self.version == 2 else "memory.oom_control")
        try:
            for line in f.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill" and int(v) > 0:
                    return True
        except OSError:
            pass
        return False

    def max_usage_mib(self, d: Path) -> float | None:
        """Peak memory charged to ``d`` (page cache included), when the kernel reports it."""
        f = d / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        try:
            return int(f.read_text().strip()) / 2**20
        except (OSError, ValueError):
            return None

    @staticmethod
    def remove(d: Path) -> None:
        """Delete the (now empty) cgroup, retrying briefly while the kernel drains it."""
        for _ in range(50):
            try:
                d.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class CpuWeight:
    """A per-child cgroup with a raised CPU weight (v1 ``cpu.shares``, default 1024; v2
    ``cpu.weight``, default 100), so a child keeps its cores on a machine that other people's
    jobs share. Opt-in (``--cpu-shares``): it takes CPU time from every other process."""

    def __init__(self, base: Path, version: int, shares: int) -> None:
        self.base, self.version, self.shares = base, version, shares

    @staticmethod
    def detect(shares: int) -> CpuWeight | None:
        """A writable cpu controller, or ``None``."""
        candidates: list[tuple[Path, int]] = []
        if (CGROUP_ROOT / "cgroup.controllers").is_file():
            if "cpu" in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
                candidates.append((CGROUP_ROOT, 2))
        if (CGROUP_ROOT / "cpu" / "cpu.shares").is_file():
            candidates.append((CGROUP_ROOT / "cpu", 1))
        for base, version in candidates:
            probe = base / f"tessera_bench_cpuprobe_{os.getpid()}"
            try:
                probe.mkdir()
                ok = (probe / ("cpu.weight" if version == 2 else "cpu.shares")).exists()
                probe.rmdir()
            except OSError:
                continue
            if ok:
                return CpuWeight(base, version, shares)
        return None

    def describe(self) -> str:
        """e.g. ``cgroup v1 cpu.shares 16384 (default 1024)``."""
        if self.version == 2:
            return f"cgroup v2 cpu.weight {self._v2_weight()} (default 100)"
        return f"cgroup v1 cpu.shares {self.shares} (default 1024)"

    def _v2_weight(self) -> int:
        return max(1, min(10000, round(self.shares * 100 / 1024)))

    def create(self, tag: str) -> Path:
        """A new cgroup for one child with the raised weight."""
        d = self.base / f"tessera_bench_cpu_{os.getpid()}_{tag}"
        d.mkdir(exist_ok=True)
        if self.version == 2:
            (d / "cpu.weight").write_text(str(self._v2_weight()))
        else:
            (d / "cpu.shares").write_text(str(self.shares))
        return d


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of process ``pid`` in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _proc_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------- machine load
def _busy_s() -> float:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def machine_load(window_s: float = 1.0) -> float:
    """Cores kept busy by every process (this idle parent aside) over ``window_s`` seconds."""
    b0, t0 = _busy_s(), time.perf_counter()
    time.sleep(window_s)
    return max(0.0, _busy_s() - b0) / (time.perf_counter() - t0)


def wait_for_quiet(max_wait_s: float, threshold: float = 0.25) -> tuple[float, float]:
    """Sleep until other processes use fewer than ``threshold`` cores (1 s windows), at most
    ``max_wait_s``; returns ``(seconds waited, last load seen)``."""
    t0 = time.perf_counter()
    load = machine_load(0.5)
    while load >= threshold and time.perf_counter() - t0 < max_wait_s:
        load = machine_load(1.0)
    return time.perf_counter() - t0, load


# ---------------------------------------------------------------------------------- one run
@dataclass
class Launch:
    """What the parent needs to start one child."""

    python: str
    spec: dict[str, Any]
    env: dict[str, str]
    tag: str
    log_dir: Path
    timeout_s: float
    mem_cap_gib: float
    # another tessera tree's benchmarks/_child.py (and working directory); default: this tree's
    script: Path | None = None
    cwd: Path | None = None


# The shell writes its own pid into each cgroup named before "--", then becomes the child.
JOIN_CGROUPS = 'while [ "$1" != "--" ]; do echo $$ > "$1/cgroup.procs" || exit 97; shift; done; shift; exec "$@"'


def run_child(launch: Launch, cgroup: CgroupCap | None, cpu: CpuWeight | None = None) -> dict[str, Any]:
    """Run one child to completion (or cap / timeout) and return its result record, annotated
    with ``status`` (ok / oom / timeout / error), ``wall_s`` and the parent's view of its memory."""
    cap_bytes = int(launch.mem_cap_gib * 2**30)
    cmd = [launch.python, str(launch.script or HERE / "_child.py"), json.dumps(launch.spec)]
    cg = cgroup.create(launch.tag, cap_bytes) if cgroup else None
    cpu_cg = cpu.create(launch.tag) if cpu else None
    # cgroup v2 has one directory for both controllers
    dirs = list(dict.fromkeys(str(d) for d in (cg, cpu_cg) if d is not None))
    if dirs:
        cmd = ["sh", "-c", JOIN_CGROUPS, "sh", *dirs, "--", *cmd]
    env = {**os.environ, **launch.env}
    for k in ("LD_PRELOAD", "MALLOC_CONF"):
        if not env.get(k):
            env.pop(k, None)
    launch.log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = launch.log_dir / f"{launch.tag}.out", launch.log_dir / f"{launch.tag}.err"
    t0 = time.perf_counter()
    poll_peak, killed_for_mem, timed_out = 0.0, False, False
    busy0, child_cpu = _busy_s(), 0.0
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=launch.cwd or ROOT, start_new_session=True)
        try:
            while proc.poll() is None:
                child_cpu = _proc_cpu_s(proc.pid) or child_cpu
                rss = _proc_rss_mib(proc.pid)
                if rss is not None:
                    poll_peak = max(poll_peak, rss)
                    if cg is None and rss * 2**20 > cap_bytes:
                        killed_for_mem = True
                        _kill(proc)
                        break
                if time.perf_counter() - t0 > launch.timeout_s:
                    timed_out = True
                    _kill(proc)
                    break
                time.sleep(0.2)
        except BaseException:  # interrupted: take the child and its cgroups down with us
            _kill(proc)
            proc.wait()
            for d in {cg, cpu_cg} - {None}:
                CgroupCap.remove(d)
            raise
        rc = proc.wait()
    wall = time.perf_counter() - t0
    # cores used by everything but the child over its life (the child's last CPU sample is <= 0.2 s old)
    other_load = max(0.0, _busy_s() - busy0 - child_cpu) / max(wall, 1e-9)
    res = _parse(out_path)
    oom = killed_for_mem or (cg is not None and cgroup is not None and cgroup.oom_killed(cg))
    cg_peak = cgroup.max_usage_mib(cg) if (cg is not None and cgroup is not None) else None
    for d in {cg, cpu_cg} - {None}:
        CgroupCap.remove(d)
    if res is None:
        res = {k: launch.spec[k] for k in ("framework", "model", "allocator")}
        if oom or rc == -signal.SIGKILL and not timed_out:
            res["status"] = "oom"
            res["error"] = f"killed at the memory cap ({launch.mem_cap_gib:g} GiB)"
        elif timed_out:
            res["status"] = "timeout"
            res["error"] = f"no result within {launch.timeout_s:g} s (other processes used {other_load:.2f} cores)"
        else:
            res["status"] = "error"
            res["error"] = f"exit code {rc}: {_tail(err_path)}"
    res.update(
        {
            "rc": rc,
            "wall_s": round(wall, 1),
            "poll_peak_rss_mib": round(poll_peak, 1),
            "life_other_load": round(other_load, 2),
            "cgroup_peak_mib": None if cg_peak is None else round(cg_peak, 1),
            "cap": "cgroup" if cg is not None else "rss-poll",
            "graph_spec": launch.spec.get("graph_spec"),
            "log": str(err_path),
        }
    )
    return res


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parse(out_path: Path) -> dict[str, Any] | None:
    for line in reversed(out_path.read_text(errors="replace").splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    return None


def _tail(path: Path, n: int = 3) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-400:]
