"""`make bench` (bench/run.py): the benchmark of `unbounded-nvidia-setup run`, one module a concern.

  run.py       entry point: arguments, checks, signals, where results go
  phases.py    the measured phases, in order, each alternating its runs
  profiler.py  `--profile`: where one cold run's time goes
  timing.py    timed runs, peak RSS, and the statistics, figures and targets from them
  host.py      the host: its description, free memory, other processes' CPU
  machine.py   the simulated machines, their payload, the baseline script, a reboot's reset
  proc.py      child processes bounded in time, the tmpfs and its mount namespace, paths
  report.py    results.json, results.md and the PASS/FAIL table, from the result data alone

Imports run one way, down this list: run; phases and profiler; timing and host; machine;
proc. report imports nothing of the benchmark (only run uses it). machine.py's
simgpu comes from tests/, put on sys.path here.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
