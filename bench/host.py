"""The host: its description, its free memory, and the CPU other processes used meanwhile."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
from typing import Any

from bench.proc import PYTHON, QUICK_TIMEOUT, REPO, TMPFS_SIZE, TOOL, BenchError, run


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    def first_line(argv: list[str]) -> str:
        try:
            done = run(argv, timeout=QUICK_TIMEOUT, check=False)
        except (BenchError, OSError):
            return "unknown"
        return done.output.strip().splitlines()[0] if done.output.strip() else "unknown"

    commit = first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--", "guest"],
                timeout=QUICK_TIMEOUT, check=False).output.strip()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model,
        "memory": mem,
        "kernel": platform.release(),
        "os": _os_release(),
        "python": first_line([str(PYTHON), "--version"]),
        "cp": first_line(["cp", "--version"]),
        "ldconfig": first_line(["ldconfig", "--version"]),
        "filesystem": f"tmpfs (size={TMPFS_SIZE}, mounted by the benchmark)",
        "product": first_line([str(TOOL), "--version"]),
        "commit": commit + (" + uncommitted changes in guest/" if dirty else ""),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }


def _os_release() -> str:
    with contextlib.suppress(OSError), open("/etc/os-release") as f:
        for line in f:
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return "unknown"


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds all CPUs spent busy since boot, CPU seconds of this process and its
    waited-for descendants): their difference over a period is other people's load."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    ours = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return busy, ours


def check_memory(need_gib: float) -> None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) / (1 << 20)
                if have < need_gib:
                    raise BenchError(f"needs about {need_gib:g} GiB of free memory for its "
                                     f"tmpfs, {have:.1f} GiB available")
