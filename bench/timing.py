"""Timed runs (cold, baseline, peak RSS) and the statistics, figures and targets from them."""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.machine import Bench, reset
from bench.proc import PYTHON, QUICK_TIMEOUT, BenchError, Done, run

MB = 1_000_000  # RSS is reported in MB = 10^6 bytes (stricter than MiB against "48 MB")

# (key, label, limit): figures[key] must be <= limit.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("cold_baseline", "cold/baseline", 1.0),
    ("warm_cold", "warm/cold", 0.5),
    ("scan", "scan (30k/3k entries)", 1.1),
    ("rss_mb", "peak RSS, MB", 48.0),
    ("rss_x2_mb", "peak RSS x2 payload, MB", 48.0),
    ("rss_growth", "RSS x2/x1 (flat)", 1.05),
    ("version", "--version / python -c pass", 1.5),
)


@dataclass
class Series:
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


# Every timed cold or baseline run starts by deleting the root its machine's previous run
# left, right before it. This VM reports freed memory to its host (virtio-balloon free
# page reporting), so memory freed seconds earlier costs host page faults to touch again,
# while memory freed just now does not: without this symmetry the order of the runs
# would decide the figures.
def timed_cold(bench: Bench) -> float:
    reset(bench)
    return run(bench.tool_argv()).seconds


def timed_baseline(bench: Bench) -> float:
    reset(bench)
    assert bench.baseline is not None
    return run(["/bin/sh", str(bench.baseline)]).seconds


# The command's entry point run inside `python -c`, with `before_exit` (Python, using
# `out`, the file to write) run in a hook on os._exit: the command ends there, never
# returning from main() or running atexit handlers. `setup` and `start` run before it.
_IN_PROCESS = """\
import os, sys
out = sys.argv.pop(1)
sys.argv[0] = "unbounded-nvidia-setup"
real_exit = os._exit
{setup}


def hooked_exit(code):
{before_exit}
    real_exit(code)


os._exit = hooked_exit
{start}
from unbounded_nvidia_setup.__main__ import main
main()
"""


def run_in_process(bench: Bench, out: Path, before_exit: str, *, setup: str = "",
                   start: str = "", poll_hwm: bool = False) -> Done:
    """A cold run of `bench` through _IN_PROCESS; `out` must have been written."""
    reset(bench)
    out.unlink(missing_ok=True)
    code = _IN_PROCESS.format(setup=setup, start=start,
                              before_exit=textwrap.indent(textwrap.dedent(before_exit), "    "))
    done = run([str(PYTHON), "-c", code, str(out), "--root", str(bench.root), "run"],
               poll_hwm=poll_hwm)
    if not out.exists():
        raise BenchError(f"the in-process wrapper wrote nothing to {out}: does the command "
                         "still end in os._exit? adjust _IN_PROCESS in bench/timing.py")
    return done


@dataclass(frozen=True)
class Rss:
    kib: int  # VmHWM at the end of the run, read by the process itself
    polled_kib: int  # highest VmHWM the benchmark saw from outside (a lower bound)
    seconds: float


def peak_rss(bench: Bench, scratch: Path) -> Rss:
    """VmHWM of the command's own process: the peak resident set of this address space
    only. Children (nvidia-ctk, ldconfig) have their own and do not count; the copy
    threads share it and do. ru_maxrss is NOT used: Linux folds the pre-exec address space
    (the forking benchmark's) into it at execve."""
    out = scratch / "rss"
    done = run_in_process(bench, out, """
        with open("/proc/self/status") as f:
            hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
        with open(out, "w") as f:
            f.write(str(hwm))
    """, poll_hwm=True)
    return Rss(int(out.read_text()), done.hwm_kib, done.seconds)


def python_floor_rss(scratch: Path) -> int:
    out = scratch / "rss"
    code = ("import sys\nwith open('/proc/self/status') as f:\n"
            "    h = next(l.split()[1] for l in f if l.startswith('VmHWM:'))\n"
            "open(sys.argv[1], 'w').write(h)\n")
    run([str(PYTHON), "-c", code, str(out)], timeout=QUICK_TIMEOUT)
    return int(out.read_text())


def summarize(info: dict[str, Any], series: dict[str, Series], rss: dict[str, list[Rss]],
              floor_kib: int, payload: dict[str, int], entries: dict[str, int],
              rounds: dict[str, int]) -> dict[str, Any]:
    med = {k: s.median for k, s in series.items()}
    rss_x1 = statistics.median(r.kib for r in rss["x1"]) * 1024 / MB
    rss_x2 = statistics.median(r.kib for r in rss["x2"]) * 1024 / MB
    figures = {
        "cold_baseline": med["cold"] / med["baseline"],
        "warm_cold": med["warm"] / med["cold"],
        "scan": med["cold_30k"] / med["cold"],
        "rss_mb": rss_x1,
        "rss_x2_mb": rss_x2,
        "rss_growth": rss_x2 / rss_x1,
        "version": med["version"] / med["python_pass"],
    }
    grown_gb = (payload["x2"] - payload["x1"]) / 1e9
    cold_per_gb = (med["cold_x2"] - med["cold_x1"]) / grown_gb
    extra = {
        "cold_baseline_x1_phase2": med["cold_x1"] / med["baseline_x1"],
        "cold_baseline_x2": med["cold_x2"] / med["baseline_x2"],
        "module_version_ratio": med["module_version"] / med["python_pass"],
        "cold_x2_over_x1": med["cold_x2"] / med["cold_x1"],
        "baseline_x2_over_x1": med["baseline_x2"] / med["baseline_x1"],
        "cold_seconds_per_gb": cold_per_gb,
        "baseline_seconds_per_gb": (med["baseline_x2"] - med["baseline_x1"]) / grown_gb,
        "cold_fixed_seconds": med["cold_x1"] - payload["x1"] / 1e9 * cold_per_gb,
        "scan_ms_per_1000_entries": (med["cold_30k"] - med["cold"]) * 1000
        / ((entries["large"] - entries["small"]) / 1000),
        "python_floor_rss_mb": floor_kib * 1024 / MB,
        "per_pair_cold_baseline": statistics.median(
            c / b for c, b in zip(series["cold"].samples, series["baseline"].samples,
                                  strict=True)),
        "cold_xfs_over_same_fs": med["cold_xfs"] / med["cold_same_fs"],
        "baseline_xfs_over_same_fs": med["baseline_xfs"] / med["baseline_same_fs"],
        "cold_baseline_same_fs_phase": med["cold_same_fs"] / med["baseline_same_fs"],
        "cold_baseline_xfs": med["cold_xfs"] / med["baseline_xfs"],
        "cold_metrics_on_over_off": med["cold_metrics_on"] / med["cold_metrics_off"],
        "warm_metrics_on_over_off": med["warm_metrics_on"] / med["warm_metrics_off"],
    }
    targets = [{"key": key, "label": label, "value": round(figures[key], 4), "limit": limit,
                "pass": figures[key] <= limit} for key, label, limit in TARGETS]
    line = (f"cold/baseline {figures['cold_baseline']:.2f} ({med['cold']:.2f} s / "
            f"{med['baseline']:.2f} s) warm/cold {figures['warm_cold']:.2f} "
            f"({med['warm']:.2f} s) scan {figures['scan']:.2f} ({med['cold_30k']:.2f} s / "
            f"{med['cold']:.2f} s) rss {rss_x1:.1f} MB (x2 payload {rss_x2:.1f} MB) "
            f"version {figures['version']:.2f}x ({med['version'] * 1000:.1f} ms / "
            f"{med['python_pass'] * 1000:.1f} ms) cross-fs cold/baseline "
            f"{extra['cold_baseline_xfs']:.2f} ({med['cold_xfs']:.2f} s / "
            f"{med['baseline_xfs']:.2f} s; same-fs in those rounds "
            f"{extra['cold_baseline_same_fs_phase']:.2f}) metrics on/off cold "
            f"{extra['cold_metrics_on_over_off']:.3f} warm "
            f"{extra['warm_metrics_on_over_off']:.3f}")
    return {
        "summary": line,
        "machine": info,
        "rounds": rounds,
        "staging_entries": entries,
        "payload_bytes": payload,
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "extra": {k: round(v, 4) for k, v in extra.items()},
        "targets": targets,
        "medians_seconds": {k: round(v, 4) for k, v in med.items()},
        "samples_seconds": {k: [round(x, 4) for x in s.samples] for k, s in series.items()},
        "rss_kib": {k: [{"vmhwm": r.kib, "polled": r.polled_kib, "seconds": round(r.seconds, 3)}
                        for r in v] for k, v in rss.items()},
    }
