"""One time budget for a run (issue 16, point 2): whatever hangs (nvidia-ctk, ldconfig,
the rollback's ldconfig, staging that never comes, a lock held by a stuck process, all of
them at once) ends in the tool's own one-line error, with the previous root and spec kept,
an exit code systemd retries, within run_timeout_seconds; and the shipped defaults' worst
case fits in the unit's TimeoutStartSec with a margin.

The hang tests give the waits their shipped limits (minutes) and the run a budget of a few
seconds: only the budget can end them in time. invoke()'s own timeout ends a run that
ignores it soon after, so a regression fails in seconds, not minutes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from invariants import (
    product_argv,
    product_env,
    secure_after,  # noqa: F401  (fixture)
)
from test_branches import release
from test_resources import processes_under
from unbounded_nvidia_setup import budget, linker, metrics, run
from unbounded_nvidia_setup.budget import Budget, Limit, cap
from unbounded_nvidia_setup.config import Config, Machine

import simgpu
from conftest import Cli, Outcome, needs_root, needs_tool, stand_in_only
from test_failures import fails_cleanly, new_driver
from test_run import check_json, codes, root_of, snapshot

UNIT = Path(__file__).parent.parent / "units/unbounded-nvidia-setup.service"
# Between the run's worst case and systemd's kill: what no bound in the tool covers (a
# starved boot, a slow fsync after the last bounded wait) and room for error.
MARGIN = 30.0
# Before the budget starts: the interpreter and the imports (~0.1 s measured here).
STARTUP = 5.0

BUDGET = 6.0  # run_timeout_seconds of the hang tests
# What a run may take beyond its budget as a test sees it: the interpreter starting
# before the budget does, exiting, and this machine being busy with other tests.
SLACK = 4.0
# invoke()'s kill: a run that ignores its budget fails the test here, not in minutes.
PATIENCE = BUDGET + SLACK + 10

F = TypeVar("F", bound=Callable[..., None])


def on_a_machine(test: F) -> F:
    """A test on a simulated machine: needs root, and the security invariants hold on it
    afterwards (the arithmetic tests need neither)."""
    marked: F = needs_root(pytest.mark.usefixtures("secure_after")(test))
    return marked


# --------------------------------------------------------------------------------------
# The shipped defaults against the shipped unit


_SPAN_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "": 1.0, "s": 1.0,
               "sec": 1.0, "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0,
               "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hr": 3600.0, "hour": 3600.0,
               "hours": 3600.0}


def timespan(text: str) -> float:
    """A systemd time span (systemd.time(7)): `300`, `5min`, `1min 30s`, `infinity`."""
    if text.strip() == "infinity":
        return float("inf")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    assert parts and "".join(f"{n}{u}" for n, u in parts) == re.sub(r"\s", "", text), text
    return sum(float(n) * _SPAN_UNITS[u] for n, u in parts)


def unit_setting(unit: Path, key: str) -> str:
    """The last assignment of `key` in the unit's [Service] section (systemd's rule)."""
    section, value = "", None
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line.startswith(f"{key}="):
            value = line.split("=", 1)[1].strip()
    assert value is not None, f"{unit} sets no {key}="
    return value


def test_timespan_parses_what_units_say() -> None:
    assert [timespan(t) for t in ("300", "5min", "1min 30s", "90s", "2h", "500ms")] == [
        300, 300, 90, 90, 7200, 0.5]


def worst_case(config: Config) -> tuple[float, str]:
    """The longest a run with `config` can take, wait by wait, and how it adds up.

    Forward, in order: the lock; the staging; nvidia-ctk's generate with ldconfig beside
    it; after a failed generate `nvidia-ctk --version` and a generate without the hook
    flags; the end-state proof's `ldconfig -p`. All of that stops where the budget's
    reserve begins. Then the rollback's ldconfig, within its slice of the reserve; then the
    metrics file (its flock waits up to metrics._LOCK_WAIT). Each program killed (those
    six, and the early generate thrown away when the root changes) may add
    run.KILL_GRACE_SECONDS, reading its pipes after the kill."""
    ctk = config.nvidia_ctk_timeout_seconds
    forward_waits = (config.lock_timeout_seconds + config.staging_wait_seconds
                     + max(ctk, config.ldconfig_timeout_seconds) + 2 * ctk
                     + linker.CACHE_QUERY_SECONDS)
    total = config.run_timeout_seconds
    reserve = total * budget.RESERVE_SHARE
    forward = min(forward_waits, total - reserve)
    rollback = min(config.ldconfig_timeout_seconds, reserve * budget.ROLLBACK_LDCONFIG_SHARE)
    kills = 7 * run.KILL_GRACE_SECONDS
    worst = STARTUP + forward + rollback + kills + metrics._LOCK_WAIT
    how = (f"startup {STARTUP:g} + forward min({forward_waits:g} of waits, {total:g} - "
           f"{reserve:g} kept) + rollback ldconfig {rollback:g} + kills {kills:g} + metrics "
           f"{metrics._LOCK_WAIT:g} = {worst:g} s")
    return worst, how


def test_the_worst_case_of_the_defaults_fits_the_unit_timeout() -> None:
    """The shipped TimeoutStartSec against the shipped defaults: the run must always end
    in its own words, with MARGIN to spare, before systemd kills it."""
    timeout = timespan(unit_setting(UNIT, "TimeoutStartSec"))
    worst, how = worst_case(Config())
    assert worst + MARGIN <= timeout, f"{how}; + margin {MARGIN:g} > TimeoutStartSec {timeout:g}"
    # Work that is no wait (copying the driver) spends the same budget: the whole of it
    # must fit too, not only its waits.
    whole = STARTUP + Config().run_timeout_seconds + metrics._LOCK_WAIT
    assert whole + MARGIN <= timeout, (whole, timeout)


# --------------------------------------------------------------------------------------
# The arithmetic (pure)


def test_a_wait_gets_its_own_limit_or_what_is_left() -> None:
    assert cap(5, 10, 240) == Limit(5)
    assert cap(15, 10, 240) == Limit(10, by_budget=True, total=240)
    assert cap(None, 10, 240) == Limit(10, by_budget=True, total=240)  # "0": no own limit
    assert cap(5, -3, 240) == Limit(0, by_budget=True, total=240)  # spent: nothing left
    assert cap(0, 10, 240) == Limit(0)  # "don't wait" stays that


def test_the_reserve_is_kept_from_forward_waits_and_sliced_for_the_rollback() -> None:
    b = Budget.starting(240, start=1000)  # ends at 1240, keeps 30 s back
    assert b.left_at(1000) == 210
    assert b.left_at(1200) == 10 and b.left_at(1215) == -5
    # The rollback's ldconfig: half the reserve at most, and never into the other half.
    assert b.left_at(1000, rollback=True) == 15
    assert b.left_at(1215, rollback=True) == 10
    assert b.left_at(1226, rollback=True) == -1


def test_messages_name_the_budget_only_when_it_set_the_limit() -> None:
    own, cut = Limit(5), Limit(4.44, by_budget=True, total=6)
    assert (own.text(), own.because()) == ("5 s", "")
    assert cut.text() == "4.4 s"
    assert cut.because() == ": the run's time budget (run_timeout_seconds: 6) ran out"
    rollback = Budget.starting(6, time.monotonic()).limit(None, rollback=True)
    assert rollback.because() == (": the rollback's share of the run's time budget "
                                  "(run_timeout_seconds: 6) ran out")


def test_check_and_status_have_no_budget(tmp_path: Path) -> None:
    machine = Machine.create(tmp_path, Config(run_timeout_seconds=1))
    assert machine.budget is None and machine.limit(30) == Limit(30)


# --------------------------------------------------------------------------------------
# Each wait hung, on a real run


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config(run_timeout_seconds=BUDGET)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    """After one good run, with a newer driver staged: the next run swaps, so a failure
    must put the previous root back."""
    assert cli(m.root, "run").code == 0
    new_driver(m, m.root.parent)
    return m


class Timed:
    """A Cli like invoke() (PATIENCE, no traceback), remembering each outcome and how long
    the run took by its own clock: from its first line on stderr to its exit. Its budget
    starts before that line (cli.main), so this is never more than the run spent within
    it, and the interpreter's start, which depends on the machine, is left out."""

    def __init__(self, prefix: tuple[str, ...] = ()) -> None:
        self.prefix = prefix  # a program the run is started under (strace)
        self.runs: list[tuple[Outcome, float]] = []

    def __call__(self, root: Path | None, *args: str, env: dict[str, str] | None = None,
                 timeout: float = PATIENCE) -> Outcome:
        assert root is not None
        argv = [*self.prefix, *product_argv(root, *args)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True,
                              env=product_env(env)) as proc:
            assert proc.stderr is not None and proc.stdout is not None
            watchdog = threading.Timer(timeout, proc.kill)
            watchdog.start()
            try:
                first = proc.stderr.readline()
                began = time.monotonic()
                rest = proc.stderr.read()
                stdout = proc.stdout.read()
                code = proc.wait()
                ended = time.monotonic()
            finally:
                watchdog.cancel()
        assert code != -signal.SIGKILL, f"killed after {timeout} s: {first + rest}"
        out = Outcome(code, stdout, first + rest)
        assert "Traceback" not in out.stderr, out.stderr
        self.runs.append((out, ended - began))
        return out


def ends_in_budget(m: simgpu.SimMachine, code: int, expect: str,
                   env: dict[str, str] | None = None, *, others: tuple[int, ...] = ()) -> Outcome:
    """The run fails with one line of its own (no traceback: invoke), `code`, the live
    state as before and nothing left over (fails_cleanly), within the budget; nothing it
    started is still running (`others`: the test's own processes naming the root)."""
    timed = Timed()
    fails_cleanly(timed, m, code, expect, env)
    out, took = timed.runs[-1]
    assert took < BUDGET, f"took {took:.2f} s of a {BUDGET:g} s budget: {out.stderr}"
    assert [pid for pid in processes_under(m.root) if pid not in others] == []
    return out


def budget_said(out: Outcome) -> None:
    assert f"the run's time budget (run_timeout_seconds: {BUDGET:g}) ran out" in out.errors[0]


def hanging_ldconfig(directory: Path, works: int) -> Path:
    """A stand-in `ldconfig` (config key `ldconfig`): the first `works` calls are the real
    ldconfig, every later one hangs like one stuck on a directory of a hung network
    filesystem. It stays a shell (not exec'd) so its command line, which names the root,
    shows it still running."""
    directory.mkdir(exist_ok=True)
    real = shutil.which("ldconfig")
    assert real is not None
    count = directory / "calls"
    script = directory / "ldconfig"
    script.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0)
echo $((n + 1)) > {count}
[ "$n" -lt {works} ] && exec {real} "$@"
while :; do sleep 1; done
""")
    script.chmod(0o755)
    return script


@stand_in_only("hang on request")
@on_a_machine
def test_hung_nvidia_ctk_ends_within_the_budget(live: simgpu.SimMachine, cli: Cli) -> None:
    out = ends_in_budget(live, 1, "nvidia-ctk did not finish within",
                         env={"FAKE_NVIDIA_CTK_HANG": "1"})
    budget_said(out)
    assert cli(live.root, "run").code == 0


@on_a_machine
def test_hung_ldconfig_ends_within_the_budget(live: simgpu.SimMachine, cli: Cli,
                                              tmp_path: Path) -> None:
    """It hangs after the swap and again in the rollback: both are killed, the second
    within its slice of the reserve."""
    live.write_config(run_timeout_seconds=BUDGET,
                      ldconfig=str(hanging_ldconfig(tmp_path / "bin", works=0)))
    out = ends_in_budget(live, 1, "ldconfig did not finish within")
    budget_said(out)
    assert any("after rolling back:" in line and "did not finish within" in line
               for line in out.lines), out.lines
    live.write_config(run_timeout_seconds=BUDGET)
    assert cli(live.root, "run").code == 0


@on_a_machine
def test_ldconfig_hung_only_in_the_rollback_ends_within_the_budget(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path) -> None:
    """nvidia-ctk fails (an unknown mode), the previous root goes back, and the rollback's
    ldconfig, the run's second, hangs: killed within its slice of the reserve, while
    ldconfig_timeout_seconds (120 s) would have let it hang for two minutes."""
    live.write_config(run_timeout_seconds=BUDGET, nvidia_ctk_args=["--mode=bogus"],
                      ldconfig=str(hanging_ldconfig(tmp_path / "bin", works=1)))
    out = ends_in_budget(live, 1, "nvidia-ctk cdi generate failed")
    assert any("after rolling back:" in line and "did not finish within" in line
               for line in out.lines), out.lines


@on_a_machine
def test_ldconfig_hung_from_its_second_call_ends_within_the_budget(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path) -> None:
    """The first ldconfig (after the swap) works; the second is the end-state proof's
    `ldconfig -p`, which hangs (it had a fixed 30 s), and the third, the rollback's,
    hangs too."""
    live.write_config(run_timeout_seconds=BUDGET,
                      ldconfig=str(hanging_ldconfig(tmp_path / "bin", works=1)))
    out = ends_in_budget(live, 1, "[ldcache-stale]")
    budget_said(out)
    assert any("after rolling back:" in line for line in out.lines), out.lines


# --------------------------------------------------------------------------------------
# A child whose helper escaped the kill (issue 21, point 2)

CHILD_TIMEOUT = 2  # nvidia_ctk_timeout_seconds / ldconfig_timeout_seconds of these tests
# How long the helper lives: far beyond PATIENCE, so a run that waits for it is seen hung.
HELPER_SECONDS = 600


def leaving_a_helper(directory: Path, name: str, pids: Path) -> Path:
    """A stand-in `name` (config key `nvidia_ctk` or `ldconfig`) that starts a helper in a
    session of its own (setsid: out of reach of a kill of its process group), which
    inherits its stdout and stderr and sleeps, as a daemonised NVML helper or an
    nvidia-persistenced-style program would; then it hangs itself. Each helper's pid is
    appended to `pids` (the test's teardown kills them)."""
    directory.mkdir(exist_ok=True)
    script = directory / name
    script.write_text(f"""#!/bin/sh
echo "{name}: starting a helper" >&2
setsid sh -c 'echo $$ >> {pids}; exec sleep {HELPER_SECONDS}' &
while :; do sleep 1; done
""")
    script.chmod(0o755)
    return script


@pytest.fixture
def helpers(tmp_path: Path) -> Iterator[Path]:
    """The file the helpers' pids go to; afterwards each helper still running is killed,
    by its pid (checked to be the helper's sleep, not a process that reused the pid)."""
    pids = tmp_path / "helper-pids"
    yield pids
    for pid in alive(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pids: Path) -> list[int]:
    """The helpers listed in `pids` that are still running."""
    found = []
    for pid in (int(n) for n in pids.read_text().split()) if pids.exists() else ():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.split(b"\0")[:2] == [b"sleep", str(HELPER_SECONDS).encode()]:
            found.append(pid)
    return found


def ends_at_its_timeout(m: simgpu.SimMachine, expect: str, pids: Path, *, timeouts: int,
                        kills: int) -> None:
    """The run fails in its own words (one error line naming the timeout, exit 1, the
    previous state kept, no traceback: fails_cleanly), after the timeouts of the programs
    that hung (`timeouts` of them) and not held up by the helper: a run waiting for it
    would be killed at PATIENCE (far below HELPER_SECONDS). `kills`: how many programs
    were killed (each one's pipes are read for KILL_GRACE_SECONDS after). A helper really
    outlived the kill, holding the pipes (or the test proved nothing)."""
    timed = Timed()
    fails_cleanly(timed, m, 1, expect)
    out, took = timed.runs[-1]
    # Not before the timeouts; a run held up by the helper (HELPER_SECONDS) is killed at
    # PATIENCE and fails in Timed: no guess at this machine's speed in between.
    assert took >= timeouts * CHILD_TIMEOUT, f"took {took:.2f} s: {out.stderr}"
    assert alive(pids), "no helper outlived the kill: the test proved nothing"


@on_a_machine
def test_nvidia_ctk_whose_helper_keeps_the_pipes_open_ends_at_its_timeout(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path, helpers: Path) -> None:
    """The early generate (thrown away: the root changes) and the generate after the swap
    both leave a helper; the second hangs past nvidia_ctk_timeout_seconds. The run's
    budget is the shipped 240 s: only the timeout and the bounded read after the kill
    can end it in time."""
    live.write_config(nvidia_ctk_timeout_seconds=CHILD_TIMEOUT,
                      nvidia_ctk=str(leaving_a_helper(tmp_path / "bin", "nvidia-ctk", helpers)))
    ends_at_its_timeout(live, f"nvidia-ctk did not finish within {CHILD_TIMEOUT} s", helpers,
                        timeouts=1, kills=2)
    live.write_config()
    assert cli(live.root, "run").code == 0


@on_a_machine
def test_ldconfig_whose_helper_keeps_the_pipes_open_ends_at_its_timeout(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path, helpers: Path) -> None:
    """ldconfig hangs after the swap and again in the rollback, each leaving a helper:
    two timeouts, each ended with its bounded read (and the early generate, thrown away,
    is a third kill)."""
    live.write_config(ldconfig_timeout_seconds=CHILD_TIMEOUT,
                      ldconfig=str(leaving_a_helper(tmp_path / "bin", "ldconfig", helpers)))
    ends_at_its_timeout(live, f"ldconfig did not finish within {CHILD_TIMEOUT} s", helpers,
                        timeouts=2, kills=3)
    live.write_config()
    assert cli(live.root, "run").code == 0


@on_a_machine
def test_staging_that_never_comes_ends_within_the_budget(live: simgpu.SimMachine) -> None:
    """staging_wait_seconds is its shipped 60 s; the budget ends the wait first."""
    shutil.rmtree(live.root / "run/host-nvidia")
    out = ends_in_budget(live, 75, "driver staging is not ready after")
    budget_said(out)


@pytest.fixture
def held_lock(live: simgpu.SimMachine) -> Iterator[subprocess.Popen[str]]:
    """A stuck process (flock(1) running a shell that waits on its stdin) holding the
    machine's lock exclusively until its stdin closes; taken after `live`'s good run."""
    lock = live.root / "run/unbounded-nvidia-setup.lock"
    proc = subprocess.Popen(["flock", "--exclusive", str(lock), "sh", "-c", "echo held; read x"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    release(proc)


@on_a_machine
def test_lock_held_by_a_stuck_process_ends_within_the_budget(
        live: simgpu.SimMachine, held_lock: subprocess.Popen[str]) -> None:
    """lock_timeout_seconds is its shipped default; the budget ends the wait first."""
    out = ends_in_budget(live, 75, "holds", others=(held_lock.pid,))
    budget_said(out)


def kill_all_under(root: Path) -> None:
    """The run and what it started (in sessions of their own), by pid."""
    for pid in processes_under(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@stand_in_only("hang on request")
@on_a_machine
def test_everything_hung_at_once_ends_within_the_budget(
        live: simgpu.SimMachine, tmp_path: Path, held_lock: subprocess.Popen[str]) -> None:
    """The worst combination: the lock is let go only after the run waited for it, the
    staging comes only after the run waited for it, then nvidia-ctk hangs, ldconfig hangs
    beside it and again in the rollback. Each wait took part of the budget; together
    they still end within it."""
    live.write_config(run_timeout_seconds=BUDGET,
                      ldconfig=str(hanging_ldconfig(tmp_path / "bin", works=0)))
    staging, aside = live.root / "run/host-nvidia", tmp_path / "aside"
    shutil.move(staging, aside)
    before = snapshot(live)
    start = time.monotonic()
    proc = subprocess.Popen(product_argv(live.root, "run"), stderr=subprocess.PIPE, text=True,
                            env=product_env({"FAKE_NVIDIA_CTK_HANG": "1"}),
                            stdin=subprocess.DEVNULL)
    # A run that ignores its budget is ended here, not when its own limits would end it:
    # reading its stderr to the end waits for it.
    watchdog = threading.Timer(PATIENCE, kill_all_under, (live.root,))
    watchdog.start()
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        steps: list[tuple[str, Callable[[], object]]] = [
            ("Waiting for another run holding", lambda: release(held_lock)),
            ("Waiting for driver staging", lambda: shutil.move(aside, staging))]
        for step, (waiting, unblock) in enumerate(steps):
            for line in proc.stderr:
                if not seen:
                    start = time.monotonic()  # the run's first line: its budget runs
                seen.append(line)
                if line.startswith(waiting):
                    break
            else:
                pytest.fail(f"step {step}: the run never said {waiting!r}: {''.join(seen)}")
            time.sleep(1)  # let the wait take its part of the budget
            unblock()
        rest = proc.stderr.read()
        proc.wait(timeout=PATIENCE)
        took = time.monotonic() - start
    finally:
        watchdog.cancel()
        kill_all_under(live.root)
        proc.wait()
    text = "".join(seen) + rest
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, lines
    assert "nvidia-ctk did not finish within" in errors[0], errors
    assert f"(run_timeout_seconds: {BUDGET:g}) ran out" in errors[0], errors
    assert any("after rolling back:" in line for line in lines), lines
    assert took < BUDGET, took  # from its first line, the interpreter's start left out
    assert snapshot(live) == before
    assert not list(root_of(live).parent.glob(".driver.*"))
    assert processes_under(live.root) == []


def under_strace_delaying_copies(delay: float) -> Timed:
    """`run` under strace, each copy thread's first copy_file_range held up by `delay`
    seconds: a copy as slow as a failing disk, from outside the product."""
    return Timed(("strace", "-f", "-qq", "--seccomp-bpf", "-o", "/dev/null",
                  "-e", "trace=copy_file_range",
                  "-e", f"inject=copy_file_range:delay_enter={int(delay * 1e6)}:when=1"))


@on_a_machine
@needs_tool("strace")
def test_a_copy_that_outlasts_the_budget_changes_nothing(live: simgpu.SimMachine) -> None:
    """The build is no wait, but it spends the same budget: a copy still going when the
    forward part has run out is not swapped in (only to be rolled back at once)."""
    delay = BUDGET
    timed = under_strace_delaying_copies(delay)
    error = fails_cleanly(timed, live, 75, "ran out while building the new driver root")
    assert f"run_timeout_seconds: {BUDGET:g}" in error
    # The copy started within the budget and was held `delay` s in the kernel, which no
    # budget cuts short; the run ends as soon as it returns.
    assert timed.runs[-1][1] < BUDGET + delay, timed.runs


@on_a_machine
def test_the_budget_does_not_bound_check(live: simgpu.SimMachine, cli: Cli,
                                         tmp_path: Path) -> None:
    """A budget of 1 s and an ldconfig that takes 2 s: `check` (its `ldconfig -p`) and
    `status` are not cut short by it."""
    slow = tmp_path / "bin/ldconfig"
    slow.parent.mkdir()
    slow.write_text(f"#!/bin/sh\nsleep 2\nexec {shutil.which('ldconfig')} \"$@\"\n")
    slow.chmod(0o755)
    live.write_config(run_timeout_seconds=1, ldconfig=str(slow))
    report = check_json(cli, live)
    assert "ldcache-stale" not in codes(report), report
    assert "ldcache-stale" not in cli(live.root, "status").stdout
