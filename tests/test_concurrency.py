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
  (once made) exactly one generation (names, types, sizes, mtimes, modes, link targets of
  everything in it), the spec exactly one good spec.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from check_schema import check_report
from invariants import (
    run_cli,
    secure_after,  # noqa: F401  (fixture)
    traced,
)
from test_crash import Swapper, assert_whole, held_nvidia_ctk, swapper
from unbounded_nvidia_setup import state, tree
from unbounded_nvidia_setup.config import Machine, load_config
from unbounded_nvidia_setup.plan import Manifest

import simgpu
from conftest import NVIDIA_CTK, Outcome, needs_root, needs_tool
from test_run import root_of, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
ABSENT = {"root-missing", "spec-missing", "ldconf-missing"}


def wrap_programs(m: simgpu.SimMachine, tmp_path: Path, **config: object) -> Path:
    """nvidia-ctk and ldconfig behind a wrapper logging `start|end <run pid> <time>`."""
    log = tmp_path / "calls.log"
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    for tool, real in (("nvidia-ctk", str(NVIDIA_CTK)), ("ldconfig", ldconfig)):
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


@needs_tool("strace")
def test_a_check_during_a_run_answers_at_once_not_ready_yet(tmp_path: Path) -> None:
    """A run held at nvidia-ctk (test_crash.held_nvidia_ctk) with its root and drop-in
    made and its spec not: a `check` started then does not wait for the lock (issue 11: a
    host agent asks while the unit is activating). It answers while the run is still
    held, says `setup_running`, and its verdict is not-ready-yet, not broken. The run is
    let go only after the check answered, so no guess at how long a check takes: a check
    that waited would answer only once the wrapper gave up (60 s) and the spec was made."""
    m = simgpu.make_machine(tmp_path / "root")
    wrapper, go = held_nvidia_ctk(tmp_path)
    m.write_config(nvidia_ctk=str(wrapper))
    seen: list[Outcome] = []

    def check_while_held() -> None:
        deadline = time.monotonic() + 60
        while not os.path.lexists(root_of(m)):
            assert time.monotonic() < deadline, "the run never made the root"
            time.sleep(0.01)
        assert not spec_of(m).exists(), "the run did not stop in between"
        seen.append(run_cli(m.root, "check", "--json"))
        held = not spec_of(m).exists()
        go.touch()
        assert held, "the check waited for the run"

    tr = traced(m.root, "run", during=check_while_held)
    assert tr.outcome.code == 0, tr.outcome.stderr
    [check] = seen
    report = check_report(check)
    assert report["setup_running"] is True and report["verdict"] == "not-ready-yet", report
    assert "Waiting for another run" not in check.stderr, check.stderr
    after = check_report(run_cli(m.root, "check", "--json"))
    assert after["verdict"] == "ready" and after["setup_running"] is False


# What a `check` may report while a run or clean holds the lock: each part (root,
# drop-in, linker cache, spec) is replaced or removed in one step, so a lock-free read
# sees each whole or missing, never half made.
IN_BETWEEN = {*ABSENT, "ldcache-stale", "setup-running"}
# A clean removes the root first, then the spec: in between, a whole spec names files of
# a root that is gone. A lock-free read is no snapshot either: the root can go between the
# read of the root and the read of the spec.
MID_CLEAN = {"spec-missing-host-path", "spec-missing-library", "spec-missing-helper"}


def test_runs_race_checks_and_cleans(tmp_path: Path) -> None:
    """6 runs, 4 checks, 3 cleans at once, three times over: every command finishes, the
    programs of the runs never overlap, and each check sees either everything whole and
    in order or nothing at all; one that read without the lock while a run or clean held
    it (setup_running) may see some parts missing, but each part it sees is whole (the
    full library list), and it never says broken. A check breaking a rule is torn."""
    m = simgpu.make_machine(tmp_path / "root")
    log = wrap_programs(m, tmp_path)
    assert run_cli(m.root, "run").code == 0
    full = check_report(run_cli(m.root, "check", "--json"))["driver_root"]["libraries"]
    commands = ["run"] * 6 + ["check"] * 4 + ["clean"] * 3
    rng = random.Random(4)
    seen = {"whole": 0, "absent": 0, "busy": 0}
    torn: list[str] = []
    for _ in range(3):
        rng.shuffle(commands)
        with ThreadPoolExecutor(max_workers=len(commands)) as pool:
            outs = list(pool.map(lambda c: (c, run_cli(m.root, c, *(
                ["--json"] if c == "check" else []))), commands))
        for command, out in outs:
            if command != "check":
                continue
            report = check_report(out)
            codes = {p["code"] for p in report["problems"]}
            root = (report.get("driver_root") or {}).get("libraries")
            if report["setup_running"]:
                # It read without the lock, mid-run or mid-clean: parts may be missing.
                # Only setup-running: its walk met a generation being deleted (check.py
                # collect_beside). Otherwise each part seen is whole: no problem but
                # missing parts, and a root seen has the full library list.
                whole_parts = codes <= IN_BETWEEN | MID_CLEAN and root in (None, [], full)
                kind = ("busy" if report["verdict"] in ("ready", "not-ready-yet") and whole_parts
                        else "torn")
            elif report["ok"]:
                kind = "whole" if root == full else "torn"
            else:
                kind = "absent" if codes == ABSENT else "torn"
            if kind == "torn":
                torn.append(f"setup_running={report['setup_running']} "
                            f"{report['verdict']} {sorted(codes)}")
            else:
                seen[kind] += 1
        for command, out in outs:
            if command != "check":
                assert out.code == 0, (command, out.stderr, torn)
        assert_serialized(log)
    print(f"CONCURRENCY race-check-clean: checks saw whole={seen['whole']} "
          f"absent={seen['absent']}, torn={len(torn)}; during a run (not broken) "
          f"{seen['busy']}")
    assert torn == [], torn
    assert sum(seen.values()) == 3 * commands.count("check"), seen  # every check counted
    assert run_cli(m.root, "run").code == 0
    assert check_report(run_cli(m.root, "check", "--json"))["ok"] is True


def test_a_clean_between_the_walk_and_the_library_check_is_no_broken_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window test_runs_race_checks_and_cleans once met at random, made certain: a
    clean renames the root away after a lock-free check walked it and before it read the
    libraries' links and SONAMEs. That check says a setup is changing the state; it
    never names files missing from a root that is simply gone."""
    m = simgpu.make_machine(tmp_path / "root")
    assert run_cli(m.root, "run").code == 0
    config, _ = load_config(m.root, None)
    machine = Machine.create(m.root, config)
    walk = tree.manifest

    def walk_then_clean(root: Path) -> Manifest | None:
        have = walk(root)
        if root == machine.driver_root:
            tree.unswap(root, None)
        return have

    monkeypatch.setattr(tree, "manifest", walk_then_clean)
    report = state.collect_beside(machine, busy=True)
    assert [p.code for p in report.problems] == ["setup-running"], report.problems
    assert report.verdict == "not-ready-yet"


def _walk(dirfd: int, prefix: str, out: dict[str, tuple[object, ...]]) -> None:
    for name in os.listdir(dirfd):
        key = prefix + name
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            out[key] = ("l", os.readlink(name, dir_fd=dirfd))
        elif stat.S_ISDIR(st.st_mode):
            out[key] = ("d",)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
            try:
                _walk(sub, key + "/", out)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            out[key] = ("f", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
        else:
            out[key] = ("?", str(stat.S_IFMT(st.st_mode)))


def read_root(root: Path) -> tuple[dict[str, tuple[object, ...]] | None, bool]:
    """What a reader finds at `root`, in the form of a Manifest, read through one open
    directory (all of it from one generation), and whether `root` still named that
    directory afterwards. When it did not, a swap happened during the read: the sample
    says nothing (the old generation may already be being deleted). None on an error."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    found: dict[str, tuple[object, ...]] = {}
    try:
        st = os.fstat(fd)
        try:
            _walk(fd, "", found)
            complete = True
        except OSError:
            complete = False
    finally:
        os.close(fd)
    now = os.stat(root)
    return (found if complete else None), (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


@dataclass
class Observer:
    """Reads the live root and spec in a loop, without the lock, like a pod starting."""

    root: Path
    spec: Path
    generations: list[Manifest]
    specs: set[bytes]
    samples: int = 0
    void: int = 0  # reads a swap happened during
    torn: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        while not self.stop.is_set():
            self.samples += 1
            try:
                found, steady = read_root(self.root)
            except OSError as e:
                self.torn.append(f"root: {e}")
                continue
            if not steady:
                self.void += 1
            elif found is None:
                self.torn.append("root: an entry vanished while the root was live")
            elif found not in self.generations:
                self.torn.append(f"root of {len(found)} entries: not one generation: "
                                 f"{differences(found, self.generations)}")
            try:
                if self.spec.read_bytes() not in self.specs:
                    self.torn.append("spec is not one good spec")
            except OSError as e:
                self.torn.append(f"spec: {e}")
            time.sleep(0.002)


def differences(found: Mapping[str, object], generations: list[Manifest]) -> str:
    """How `found` differs from the generation closest to it (for the failure message)."""
    def diff(want: Manifest) -> list[str]:
        return sorted(k for k in set(found) | set(want) if found.get(k) != want.get(k))
    return ", ".join(min((diff(g) for g in generations), key=len)[:3])


# What `check` reports for a whole root of one driver (`held`) while the kernel module and
# the staging are another (`staged`): the module's libcuda and libnvidia-ml are not in
# the root (one root-missing-library each), the root holds another driver than the
# module (root-version-mismatch), it differs from what staging calls for (root-out-of-
# date), and the spec mounts the old libraries, not the module's (one
# spec-missing-library each). The root is whole: its links, modes and files are its own,
# so no other problem. Stated here, from docs/problems.md, not learned from `check`.
def stale_problems(held: str, staged: str) -> list[tuple[str, tuple[str, ...]]]:
    """(code, words its message names) of every problem, in code order."""
    libs = (f"libcuda.so.{staged}", f"libnvidia-ml.so.{staged}")
    return sorted([*(("root-missing-library", (lib,)) for lib in libs),
                   ("root-version-mismatch", (held, staged)),
                   ("root-out-of-date", ("staging",)),
                   *(("spec-missing-library", (lib,)) for lib in libs)])


def assert_stale(report: Mapping[str, Any], held: str, staged: str) -> None:
    problems = sorted((p["code"], p["message"]) for p in report["problems"])
    want = stale_problems(held, staged)
    assert [code for code, _ in problems] == [code for code, _ in want], problems
    for (code, message), (_, words) in zip(problems, want, strict=True):
        assert all(w in message for w in words), (code, message, words)


def test_swapping_runs_race_checks_and_a_lock_free_reader(tmp_path: Path) -> None:
    """Five batches of 6 runs and 2 checks at once; before each batch the staging moves
    to the other driver (one rename each way), so the first run of a batch swaps."""
    s: Swapper = swapper(tmp_path)
    s.learn()
    log = wrap_programs(s.m, tmp_path)
    full = {v: libraries(have) for v, (have, _) in s.good.items()}
    # The stale report, first with nothing racing it.
    for _ in range(2):
        s.use(s.other())
        report = check_report(run_cli(s.m.root, "check", "--json"))
        assert_stale(report, held=s.other(), staged=s.current)
        assert run_cli(s.m.root, "run").code == 0
    observer = Observer(root_of(s.m), spec_of(s.m), [have for have, _ in s.good.values()],
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
                if report["setup_running"]:
                    assert report["verdict"] in ("ready", "not-ready-yet"), report
                    checks["busy"] += 1
                    continue
                if report["ok"]:
                    assert report["driver_root"]["libraries"] == full[s.current]
                    checks["whole"] += 1
                else:
                    # Before the batch's first run: the other driver's root, whole.
                    assert report["driver_root"]["libraries"] == full[s.other()]
                    assert_stale(report, held=s.other(), staged=s.current)
                    checks["stale"] += 1
            assert swaps == 1
            assert assert_whole(s, may_be_absent=False) == s.current
    finally:
        observer.stop.set()
        reader.join()
    assert_serialized(log)
    print(f"CONCURRENCY swap-race: checks whole={checks['whole']} stale={checks['stale']} "
          f"during a run (not broken) {checks['busy']}; "
          f"lock-free reads {observer.samples} ({observer.void} during a swap), "
          f"torn {len(observer.torn)}")
    assert observer.torn == []
    assert observer.samples - observer.void > 100
