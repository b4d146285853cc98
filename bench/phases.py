"""The measured phases of `make bench`, in order, each alternating its runs.

Figures (all runs ALTERNATE, A B A B ..., and every ratio is a ratio of medians taken
in the same invocation):

  cold/baseline  `run` with no driver root, spec or ld.so.cache (what every boot does)
                 vs a shell script a user would write: `cp -a` of exactly the files and
                 links the tool puts in the root, the same nvidia-ctk stand-in with the
                 same arguments, `ldconfig -r`.
  warm/cold      `run` again with nothing changed vs cold.
  scan           cold with 30,000 staging entries vs cold with 3,000.
  cross-fs       the node's layout: staging on another filesystem than /run/nvidia (a
                 host directory bind-mounted into the machine, /run a tmpfs), made by a
                 second tmpfs mounted on <root>/run/nvidia for the sample. Linux refuses
                 copy_file_range across filesystems (EXDEV) and the tool copies with
                 sendfile; `cp -a` falls back to read/write. Cold runs and the baseline
                 alternate, each on one filesystem and across two (not a target:
                 reported).
  metrics        cold and warm runs with node_exporter's textfile directory present
                 (the tool writes its metrics file) vs absent, alternating; issue 10's
                 limit is 3% (reported, not a target).
  rss            peak RSS of the tool's own process in a cold run (VmHWM; see peak_rss),
                 at scale 1.0 and with the payload doubled (scale 2.0).
  version        `unbounded-nvidia-setup --version` vs `python -c pass`, same interpreter.
  payload growth cold and baseline at scale 1.0 and 2.0, alternating (not a target).

Everything stays warm the same way for both sides: staging, roots and specs are in RAM
(tmpfs); the interpreter, nvidia-ctk and ldconfig are in the page cache and every Python
child has a filled bytecode cache (see use_pycache) after untimed warm-up runs. The page
cache is never dropped. The benchmark also reports how much CPU other processes used
meanwhile: on 2 cores that moves the figures, cold/baseline most."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.host import busy_seconds, check_memory, machine_info
from bench.machine import (
    LARGE_STAGING,
    SMALL_STAGING,
    Bench,
    build_machine,
    metrics_dir,
    other_filesystem,
    prepare,
    prepare_cross_filesystem,
    remove_machine,
    set_metrics,
)
from bench.proc import (
    PYTHON,
    QUICK_TIMEOUT,
    TMPFS_SIZE,
    TOOL,
    BenchError,
    log,
    run,
    tmpfs,
    use_pycache,
)
from bench.timing import (
    Rss,
    Series,
    peak_rss,
    python_floor_rss,
    summarize,
    timed_baseline,
    timed_cold,
)

SERIES = ("version", "python_pass", "module_version", "cold", "warm", "baseline", "cold_30k",
          "cold_x1", "cold_x2", "baseline_x1", "baseline_x2", "cold_same_fs", "cold_xfs",
          "baseline_same_fs", "baseline_xfs", "cold_metrics_off", "cold_metrics_on",
          "warm_metrics_off", "warm_metrics_on")


def benchmark(pairs: int, pairs_x2: int, rounds_version: int,
              pairs_xfs: int, pairs_metrics: int) -> dict[str, Any]:
    check_memory(6.0)
    info = machine_info()
    if info["loadavg_start"] > 0.7:
        log(f"load average {info['loadavg_start']} at start: other work competes for the "
            "2 cores; alternation keeps the ratios fair, absolute times suffer")
    series: dict[str, Series] = {k: Series() for k in SERIES}
    payload: dict[str, int] = {}
    entries: dict[str, int] = {}
    started = time.monotonic()
    busy_start, ours_start = busy_seconds()

    with tmpfs(TMPFS_SIZE) as mnt:
        use_pycache(mnt / "pycache")
        scripts = mnt / "scripts"
        scripts.mkdir()
        version_phase(series, rounds_version)

        small = build_machine(mnt, "staging3k", 1.0, SMALL_STAGING)
        large = build_machine(mnt, "staging30k", 1.0, LARGE_STAGING)
        for bench in (small, large):
            prepare(bench, scripts)
        payload["x1"] = small.payload_bytes
        entries["small"], entries["large"] = small.staging_entries, large.staging_entries
        floor_kib = python_floor_rss(scripts)

        cold_warm_scan_phase(series, small, large, pairs)
        remove_machine(large)
        metrics_phase(series, small, pairs_metrics)
        cross_fs_phase(series, small, pairs_xfs)

        # Payload growth: the x1 machine again, alternating with one whose files are twice
        # as large (same names, same staging entries), so both sizes see the same load.
        double = build_machine(mnt, "scale2", 2.0, SMALL_STAGING)
        prepare(double, scripts)
        payload["x2"] = double.payload_bytes
        payload_phase(series, small, double, pairs_x2)
        rss = rss_phase(small, double, scripts)
        remove_machine(small)
        remove_machine(double)

    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    info["bench_seconds"] = round(time.monotonic() - started, 1)
    busy_end, ours_end = busy_seconds()
    other = (busy_end - busy_start) - (ours_end - ours_start)
    info["other_cpu_percent"] = round(
        max(0.0, 100 * other / (info["bench_seconds"] * info["nproc"])), 1)
    if info["other_cpu_percent"] > 10:
        log(f"other processes used {info['other_cpu_percent']}% of the CPUs during the "
            "benchmark: figures that rely on the second core (cold/baseline) suffer most")
    return summarize(info, series, rss, floor_kib, payload, entries,
                     {"pairs": pairs, "pairs_x2": pairs_x2, "rounds_version": rounds_version,
                      "pairs_xfs": pairs_xfs, "pairs_metrics": pairs_metrics})


def version_phase(series: dict[str, Series], rounds: int) -> None:
    """`--version`, `python -m ... --version` and `python -c pass`, alternating."""
    log(f"--version vs python -c pass: {rounds} alternating rounds")
    version_cmds = {
        "version": [str(TOOL), "--version"],
        "python_pass": [str(PYTHON), "-c", "pass"],
        "module_version": [str(PYTHON), "-m", "unbounded_nvidia_setup", "--version"],
    }
    for cmd in version_cmds.values():  # fill the bytecode and page caches
        run(cmd, timeout=QUICK_TIMEOUT)
    for _ in range(rounds):
        for key, cmd in version_cmds.items():
            series[key].samples.append(run(cmd, timeout=QUICK_TIMEOUT).seconds)


def cold_warm_scan_phase(series: dict[str, Series], small: Bench, large: Bench,
                         pairs: int) -> None:
    """Cold, warm and baseline on the 3k machine and cold on the 30k one, alternating."""
    log(f"cold / warm / baseline / cold with 30k entries: {pairs} alternating rounds")
    for i in range(pairs):
        series["cold"].samples.append(timed_cold(small))
        series["warm"].samples.append(run(small.tool_argv()).seconds)
        series["baseline"].samples.append(timed_baseline(small))
        series["cold_30k"].samples.append(timed_cold(large))
        log(f"  round {i + 1}: cold {series['cold'].samples[-1]:.2f} s, warm "
            f"{series['warm'].samples[-1]:.2f} s, baseline "
            f"{series['baseline'].samples[-1]:.2f} s, cold 30k "
            f"{series['cold_30k'].samples[-1]:.2f} s")


def metrics_phase(series: dict[str, Series], small: Bench, pairs: int) -> None:
    """Metrics on (node_exporter's directory exists) vs off (it does not: no file, no
    error), cold and warm, the order flipped every round; leaves metrics off."""
    log(f"metrics on / off: cold and warm, {pairs} alternating rounds")
    for i in range(pairs):
        for on in (False, True) if i % 2 == 0 else (True, False):
            set_metrics(small, on)
            key = "on" if on else "off"
            series[f"cold_metrics_{key}"].samples.append(timed_cold(small))
            series[f"warm_metrics_{key}"].samples.append(run(small.tool_argv()).seconds)
        log(f"  round {i + 1}: cold {series['cold_metrics_off'].samples[-1]:.3f} s / "
            f"{series['cold_metrics_on'].samples[-1]:.3f} s, warm "
            f"{series['warm_metrics_off'].samples[-1]:.3f} s / "
            f"{series['warm_metrics_on'].samples[-1]:.3f} s (metrics off / on)")
    if not any(metrics_dir(small).glob("*.prom")):
        raise BenchError("the tool wrote no metrics file with metrics on")
    set_metrics(small, False)


def cross_fs_phase(series: dict[str, Series], small: Bench, pairs: int) -> None:
    """Cold and baseline with /run/nvidia on the staging's filesystem and on another."""
    log(f"staging on another filesystem: cold and baseline, same-fs / cross-fs, "
        f"{pairs} alternating rounds")
    prepare_cross_filesystem(small)
    for i in range(pairs):
        series["cold_same_fs"].samples.append(timed_cold(small))
        with other_filesystem(small):
            series["cold_xfs"].samples.append(timed_cold(small))
        series["baseline_same_fs"].samples.append(timed_baseline(small))
        with other_filesystem(small):
            series["baseline_xfs"].samples.append(timed_baseline(small))
        log(f"  round {i + 1}: cold {series['cold_same_fs'].samples[-1]:.2f} s / "
            f"{series['cold_xfs'].samples[-1]:.2f} s, baseline "
            f"{series['baseline_same_fs'].samples[-1]:.2f} s / "
            f"{series['baseline_xfs'].samples[-1]:.2f} s (same-fs / cross-fs)")


def payload_phase(series: dict[str, Series], small: Bench, double: Bench, pairs: int) -> None:
    """Cold and baseline on the x1 machine and the x2 one, alternating."""
    log(f"payload x1 / x2: cold and baseline, {pairs} alternating rounds")
    for i in range(pairs):
        series["cold_x1"].samples.append(timed_cold(small))
        series["cold_x2"].samples.append(timed_cold(double))
        series["baseline_x1"].samples.append(timed_baseline(small))
        series["baseline_x2"].samples.append(timed_baseline(double))
        log(f"  round {i + 1}: cold {series['cold_x1'].samples[-1]:.2f} s / "
            f"{series['cold_x2'].samples[-1]:.2f} s, baseline "
            f"{series['baseline_x1'].samples[-1]:.2f} s / "
            f"{series['baseline_x2'].samples[-1]:.2f} s")


def rss_phase(small: Bench, double: Bench, scripts: Path) -> dict[str, list[Rss]]:
    """Peak RSS of three cold runs at x1 and x2, alternating."""
    rss: dict[str, list[Rss]] = {"x1": [], "x2": []}
    for _ in range(3):
        rss["x1"].append(peak_rss(small, scripts))
        rss["x2"].append(peak_rss(double, scripts))
    return rss
