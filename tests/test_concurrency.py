"""Concurrency (issue 4, item 4): 8 `run` at once on one machine, `run` racing `check`
and `clean`, and runs that must swap (the staging alternates between two drivers from one
batch to the next) racing `check` and a lock-free reader.

Serialized is shown, not assumed: nvidia-ctk and ldconfig are wrapped by a script that
logs when each call starts and ends and which run made it; the spans of different runs
(first start to last end of the programs each run ran) never overlap.

Torn, precisely: a driver root that is neither absent nor exactly one complete generation
(the manifest a good run makes for one of the drivers), or a spec file that is neither
absent nor exactly one good spec. A complete spec naming the files of the other
generation is not torn: a run swaps the root, then installs the spec, and a reader without
the lock can see the moment in between (the next step fixes it; a killed run is fixed by
the next run). So:

* a `check` that got the lock (shared; `setup_running` false) sees only whole states: its
  problems are none, or exactly those of "whole but for the other driver" (the staging
  moved on, the run that follows it has not come yet), or exactly "nothing there" after
  a clean; the libraries it lists are all of one generation, never a mix or a part;
* a `check` that found a run or clean holding the lock does not wait (issue 11): it reads
  without the lock, says `setup_running`, and whatever it sees half done, its verdict is
  "ready" or "not-ready-yet", never "broken". Racing six runs, most checks are of this
  kind; the counts are printed;
* a reader that takes no lock (the device plugin starting a pod) always finds the root
  (once made), its library dir exactly one generation, the spec exactly one good spec.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from check_schema import check_report
from invariants import (
    run_cli,
    secure_after,  # noqa: F401  (fixture)
)
from test_crash import Swapper, assert_whole, swapper

import simgpu
from conftest import FAKE_CTK, needs_root
from test_run import root_of, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
ABSENT = {"root-missing", "spec-missing", "ldconf-missing"}


def wrap_programs(m: simgpu.SimMachine, tmp_path: Path, **config: object) -> Path:
    """nvidia-ctk and ldconfig behind a wrapper logging `start|end <run pid> <time>`."""
    log = tmp_path / "calls.log"
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    for tool, real in (("nvidia-ctk", str(FAKE_CTK)), ("ldconfig", ldconfig)):
        wrapper = tmp_path / f"wrap-{tool}"
        # `ldconfig -p` only reads the cache: checks, which share the lock, may all do
        # it at once.
        wrapper.write_text(
            "#!/bin/sh\n"
            f'[ "$1" = -p ] && exec "{real}" "$@"\n'
            f'echo "start $PPID $(date +%s.%N)" >> {log}\n'
            f'"{real}" "$@"\nrc=$?\n'
            f'echo "end $PPID $(date +%s.%N)" >> {log}\n'
            "exit $rc\n")
        wrapper.chmod(0o755)
    m.write_config(nvidia_ctk=str(tmp_path / "wrap-nvidia-ctk"),
                   ldconfig=str(tmp_path / "wrap-ldconfig"), **config)
    return log


def assert_serialized(log: Path) -> int:
    """The programs of different runs never ran at the same time. Returns how many runs
    ran programs."""
    spans: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        _, pid, when = line.split()
        span = spans.setdefault(pid, [float("inf"), 0.0])
        span[0] = min(span[0], float(when))
        span[1] = max(span[1], float(when))
    ordered = sorted(spans.values())
    for (_, end), (start, _) in itertools.pairwise(ordered):
        assert end <= start, "two runs ran nvidia-ctk/ldconfig at the same time"
    return len(spans)


def libraries(have: Mapping[str, object]) -> list[str]:
    """The library list `check --json` gives for a root with this manifest."""
    return sorted(k.rsplit("/", 1)[1] for k, v in have.items()
                  if k.startswith(f"lib/{MA}/") and isinstance(v, tuple) and v[0] == "f")


def test_eight_concurrent_runs(tmp_path: Path) -> None:
    """All succeed, one after the other; the first builds, the other seven find the root
    already there."""
    m = simgpu.make_machine(tmp_path / "root")
    log = wrap_programs(m, tmp_path)
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda _: run_cli(m.root, "run"), range(8)))
    for out in outs:
        assert out.code == 0, out.stderr
    built = [out for out in outs if "now holds driver" in out.stderr]
    assert len(built) == 1
    assert sum("not rebuilt" in out.stderr for out in outs) == 7
    assert assert_serialized(log) == 8
    assert check_report(run_cli(m.root, "check", "--json"))["ok"] is True


def test_runs_race_checks_and_cleans(tmp_path: Path) -> None:
    """6 runs, 4 checks, 3 cleans at once, three times over: every command finishes, the
    programs of the runs never overlap, and each check sees either everything whole and
    in order or nothing at all."""
    m = simgpu.make_machine(tmp_path / "root")
    log = wrap_programs(m, tmp_path)
    assert run_cli(m.root, "run").code == 0
    full = check_report(run_cli(m.root, "check", "--json"))["driver_root"]["libraries"]
    commands = ["run"] * 6 + ["check"] * 4 + ["clean"] * 3
    rng = random.Random(4)
    seen = {"whole": 0, "absent": 0, "busy": 0}
    for _ in range(3):
        rng.shuffle(commands)
        with ThreadPoolExecutor(max_workers=len(commands)) as pool:
            outs = list(pool.map(lambda c: (c, run_cli(m.root, c, *(
                ["--json"] if c == "check" else []))), commands))
        for command, out in outs:
            if command != "check":
                assert out.code == 0, (command, out.stderr)
                continue
            report = check_report(out)
            codes = {p["code"] for p in report["problems"]}
            if report["setup_running"]:
                # It read without the lock, mid-run: anything but "broken" may be seen.
                assert report["verdict"] in ("ready", "not-ready-yet"), report
                seen["busy"] += 1
            elif report["ok"]:
                assert report["driver_root"]["libraries"] == full
                seen["whole"] += 1
            else:
                assert codes == ABSENT, codes
                seen["absent"] += 1
        assert_serialized(log)
    print(f"CONCURRENCY race-check-clean: checks saw whole={seen['whole']} "
          f"absent={seen['absent']}, torn=0; during a run (not broken) {seen['busy']}")
    assert run_cli(m.root, "run").code == 0
    assert check_report(run_cli(m.root, "check", "--json"))["ok"] is True


@dataclass
class Observer:
    """Reads the live root and spec in a loop, without the lock, like a pod starting."""

    root: Path
    spec: Path
    generations: set[frozenset[str]]
    specs: set[bytes]
    samples: int = 0
    torn: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        while not self.stop.is_set():
            self.samples += 1
            try:
                names = frozenset(os.listdir(self.root / "lib" / MA))
            except OSError as e:
                self.torn.append(f"root: {e}")
                continue
            if names not in self.generations:
                self.torn.append(f"root of {len(names)} entries: not one generation")
            try:
                if self.spec.read_bytes() not in self.specs:
                    self.torn.append("spec is not one good spec")
            except OSError as e:
                self.torn.append(f"spec: {e}")
            time.sleep(0.002)


def lib_names(have: Mapping[str, object]) -> frozenset[str]:
    return frozenset(k.split("/")[2] for k in have if k.startswith(f"lib/{MA}/"))


def test_swapping_runs_race_checks_and_a_lock_free_reader(tmp_path: Path) -> None:
    """Five batches of 6 runs and 2 checks at once; before each batch the staging moves
    to the other driver (one rename each way), so the first run of a batch swaps."""
    s: Swapper = swapper(tmp_path)
    s.learn()
    log = wrap_programs(s.m, tmp_path)
    full = {v: libraries(have) for v, (have, _) in s.good.items()}
    # What check reports for a whole root of one driver while staging holds the other.
    stale: dict[str, set[str]] = {}
    for _ in range(2):
        s.use(s.other())
        report = check_report(run_cli(s.m.root, "check", "--json"))
        stale[s.current] = {p["code"] for p in report["problems"]}
        assert stale[s.current] and not stale[s.current] & ABSENT
        assert run_cli(s.m.root, "run").code == 0
    observer = Observer(root_of(s.m), spec_of(s.m),
                        {lib_names(have) for have, _ in s.good.values()},
                        {spec for _, spec in s.good.values()})
    reader = threading.Thread(target=observer.loop)
    reader.start()
    checks = {"whole": 0, "stale": 0, "busy": 0}
    try:
        for _ in range(5):
            s.use(s.other())
            commands = ["run"] * 6 + ["check"] * 2
            random.Random(len(observer.torn)).shuffle(commands)
            with ThreadPoolExecutor(max_workers=len(commands)) as pool:
                outs = list(pool.map(lambda c: (c, run_cli(s.m.root, c, *(
                    ["--json"] if c == "check" else []))), commands))
            swaps = 0
            for command, out in outs:
                if command == "run":
                    assert out.code == 0, out.stderr
                    swaps += "now holds driver" in out.stderr
                    continue
                report = check_report(out)
                codes = {p["code"] for p in report["problems"]}
                if report["setup_running"]:
                    assert report["verdict"] in ("ready", "not-ready-yet"), report
                    checks["busy"] += 1
                    continue
                assert report["driver_root"]["libraries"] in full.values()
                if report["ok"]:
                    checks["whole"] += 1
                else:
                    assert codes == stale[s.current], codes
                    checks["stale"] += 1
            assert swaps == 1
            assert assert_whole(s, may_be_absent=False) == s.current
    finally:
        observer.stop.set()
        reader.join()
    assert_serialized(log)
    print(f"CONCURRENCY swap-race: checks whole={checks['whole']} stale={checks['stale']} "
          f"during a run (not broken) {checks['busy']}; "
          f"lock-free reads {observer.samples}, torn {len(observer.torn)}")
    assert observer.torn == []
    assert observer.samples > 100
