"""`bench/run.py --profile`: where one cold run's time goes (timeline, imports, cProfile, parts).

`--profile` instead runs one cold run with a timeline of its log lines, one under
`python -X importtime`, one under cProfile, and times the parts (interpreter start,
nvidia-ctk, ldconfig, the bare copy) on their own.

Not named profile.py: bench/ is the script's sys.path[0], where that name would shadow the
standard library's `profile` (which cProfile imports)."""

from __future__ import annotations

import io
import os
import pstats
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import Bench, build_machine, prepare, reset
from bench.proc import (
    PYTHON,
    QUICK_TIMEOUT,
    RUN_TIMEOUT,
    TMPFS_SIZE,
    TOOL,
    child_env,
    kill,
    ldconfig_path,
    run,
    tmpfs,
    use_pycache,
)
from bench.timing import run_in_process, timed_baseline, timed_cold


def timeline(bench: Bench) -> list[str]:
    """One cold run with each log line stamped with when it arrived."""
    reset(bench)
    lines: list[str] = []
    start = time.perf_counter()
    proc = subprocess.Popen(bench.tool_argv(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=child_env())
    timer = threading.Timer(RUN_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.decode(errors="replace").rstrip()
            lines.append(f"  +{time.perf_counter() - start:6.3f} s  {text}")
        proc.wait()
    finally:
        timer.cancel()
        kill(proc)
    lines.append(f"  +{time.perf_counter() - start:6.3f} s  (exit {proc.returncode})")
    return lines


_IMPORT = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def _imports(output: str) -> list[tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) per `-X importtime` line."""
    rows = []
    for line in output.splitlines():
        m = _IMPORT.match(line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    return rows


def import_costs(bench: Bench, top: int) -> list[str]:
    reset(bench)
    rows = _imports(run([str(PYTHON), "-X", "importtime", str(TOOL), "--root", str(bench.root),
                         "run"]).output)
    startup = _imports(run([str(PYTHON), "-X", "importtime", "-c", "pass"],
                           timeout=QUICK_TIMEOUT).output)
    version = _imports(run([str(PYTHON), "-X", "importtime", str(TOOL), "--version"],
                           timeout=QUICK_TIMEOUT).output)
    before = {r[3] for r in startup}
    out = [f"  cold run: all imports {sum(r[0] for r in rows) / 1000:.1f} ms ({len(rows)} "
           f"modules); `python -c pass` imports {sum(r[0] for r in startup) / 1000:.1f} ms",
           "  top-level imports of the run by cumulative time:"]
    outer = sorted((r for r in rows if r[2] == 1), key=lambda r: -r[1])[:top]
    out += [f"    {r[1] / 1000:7.1f} ms  {r[3]}" for r in outer]
    out.append("  any depth, by cumulative time (nested imports are part of their parent):")
    out += [f"    {r[1] / 1000:7.1f} ms  {'  ' * (r[2] - 1)}{r[3]}"
            for r in sorted(rows, key=lambda r: -r[1])[:top]]
    out.append("  modules by self time:")
    out += [f"    {r[0] / 1000:7.1f} ms  {r[3]}" for r in sorted(rows, key=lambda r: -r[0])[:top]]
    extra = [r for r in version if r[3] not in before]
    out.append(f"  `unbounded-nvidia-setup --version` imports beyond `python -c pass`: "
               f"{sum(r[0] for r in extra) / 1000:.1f} ms")
    out += [f"    {r[0] / 1000:7.1f} ms self  {r[1] / 1000:7.1f} ms cum  {'  ' * (r[2] - 1)}"
            f"{r[3]}" for r in extra]
    return out


def cprofile_costs(bench: Bench, scratch: Path, top: int) -> list[str]:
    # Not `python -m cProfile`: it writes its file after the program returns, which the
    # command never does.
    prof = scratch / "cold.prof"
    run_in_process(bench, prof, """
        profiler.disable()
        profiler.dump_stats(out)
    """, setup="import cProfile\nprofiler = cProfile.Profile()", start="profiler.enable()")
    stats = pstats.Stats(str(prof))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = (
        stats.stats)  # type: ignore[attr-defined]
    out = ["  the product's functions by cumulative time (main thread only: copies on worker "
           "threads show as the wait in the function that waits for them):"]
    mine = sorted(((cum, calls, path, line, name)
                   for (path, line, name), (_cc, calls, _tt, cum, _callers) in raw.items()
                   if f"{os.sep}unbounded_nvidia_setup{os.sep}" in path),
                  key=lambda r: -r[0])
    out += [f"    {cum * 1000:8.1f} ms  {os.path.basename(path)}:{line}({name}) x{calls}"
            for cum, calls, path, line, name in mine[:top]]
    for sort, label in (("cumulative", "by cumulative time"), ("tottime", "by own time")):
        buf = io.StringIO()
        pstats.Stats(str(prof), stream=buf).strip_dirs().sort_stats(sort).print_stats(top)
        body = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(body) if ln.lstrip().startswith("ncalls")), 0)
        out.append(f"  cProfile, top {top} {label}:")
        out += ["    " + ln for ln in body[start:]]
    return out


def components(bench: Bench, scratch: Path, repeat: int) -> list[str]:
    """The parts of a cold run timed on their own (median of `repeat`)."""
    sim = bench.sim
    reset(bench)
    run(bench.tool_argv())  # a live root for nvidia-ctk and ldconfig to work on
    copy_dest = scratch / "copy-dest"
    copy_script = scratch / "copy-only.sh"
    copy_script.write_text("\n".join(["#!/bin/sh", "set -eu",
                                      f"D={shlex.quote(str(copy_dest))}",
                                      *bench.copy_lines]) + "\n")
    ctk_out = scratch / "ctk.yaml"
    ctk = [a if not a.startswith("--output=") else f"--output={ctk_out}"
           for a in bench.ctk_argv]

    def copy_only() -> float:
        reset(bench)  # room on the tmpfs, and freshly freed memory as for the other runs
        if copy_dest.exists():
            shutil.rmtree(copy_dest)
        return run(["/bin/sh", str(copy_script)]).seconds

    parts: list[tuple[str, Callable[[], float]]] = [
        ("python -c pass", lambda: run([str(PYTHON), "-c", "pass"]).seconds),
        ("unbounded-nvidia-setup --version", lambda: run([str(TOOL), "--version"]).seconds),
        ("python -c 'import unbounded_nvidia_setup.cli, .reconcile' (eager imports)",
         lambda: run([str(PYTHON), "-c", "import unbounded_nvidia_setup.cli, "
                      "unbounded_nvidia_setup.reconcile"]).seconds),
        ("nvidia-ctk --version", lambda: run([bench.ctk_argv[0], "--version"]).seconds),
        ("nvidia-ctk cdi generate (same args)", lambda: run(ctk).seconds),
        ("ldconfig -r R", lambda: run([ldconfig_path(), "-r", str(sim.root)]).seconds),
        ("warm run", lambda: run(bench.tool_argv()).seconds),
        ("cp -a of the driver files only", copy_only),
        ("cold run", lambda: timed_cold(bench)),
        ("baseline script", lambda: timed_baseline(bench)),
    ]
    out = [f"  each part alone, median of {repeat} (ms):"]
    for label, measure in parts:
        samples = [measure() for _ in range(repeat)]
        out.append(f"    {statistics.median(samples) * 1000:8.1f}  {label}")
        if copy_dest.exists():
            shutil.rmtree(copy_dest)
    return out


def profile(top: int, repeat: int, entries: int, scale: float) -> None:
    with tmpfs(TMPFS_SIZE) as mnt:
        use_pycache(mnt / "pycache")
        scripts = mnt / "scripts"
        scripts.mkdir()
        bench = build_machine(mnt, f"staging{entries}", scale, entries)
        prepare(bench, scripts)
        sections: list[tuple[str, Callable[[], list[str]]]] = [
            ("timeline of one cold run (log lines as they arrive)", lambda: timeline(bench)),
            ("python -X importtime, one cold run", lambda: import_costs(bench, top)),
            ("cProfile, one cold run", lambda: cprofile_costs(bench, scripts, top)),
            ("components", lambda: components(bench, scripts, repeat)),
        ]
        for title, make in sections:
            print(f"\n== {title}", flush=True)
            print("\n".join(make()), flush=True)
        reset(bench)
