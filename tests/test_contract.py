"""The host agent's interface (issue 11): `check`'s verdict, derived from the live state
and the lock, on simulated machines under --root (where systemd is never asked; the boot
suite shows the unit's part)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from invariants import secure_after  # noqa: F401  (fixture)

import simgpu
from conftest import Cli, needs_root
from test_run import check_json, codes, root_of, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
LOCK = "run/lock/unbounded-nvidia-setup.lock"


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    # A lock timeout far beyond the test's patience: a `check` that waited behind a
    # run would be killed by invoke()'s timeout, not answer.
    machine.write_config(staging_wait_seconds=0, lock_timeout_seconds=3600)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    assert cli(m.root, "run").code == 0
    return m


def verdict(cli: Cli, m: simgpu.SimMachine) -> tuple[str, set[str]]:
    report = check_json(cli, m)
    text = cli(m.root, "check")
    assert text.stdout.splitlines()[-1] == f"verdict: {report['verdict']}"
    assert report["schema_version"] == 1
    assert "unit" not in report  # under --root systemd is never asked
    return str(report["verdict"]), codes(report)


@pytest.fixture
def run_in_progress(live: simgpu.SimMachine) -> Iterator[None]:
    """Another process holds the lock exclusively, as a run or clean does while it works.
    A separate process (flock locks belong to the open file, but a real run is another
    process, so the test is one too). After the good run of `live`."""
    lock = live.root / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    try:
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_healthy_is_ready(live: simgpu.SimMachine, cli: Cli) -> None:
    assert verdict(cli, live) == ("ready", set())
    assert check_json(cli, live)["setup_running"] is False


def test_no_gpu_is_no_gpu(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root", gpu=False)
    m.write_config()
    assert verdict(cli, m) == ("no-gpu", set())


def test_no_gpu_with_stale_state_is_broken(live: simgpu.SimMachine, cli: Cli) -> None:
    for dev in (live.root / "dev").glob("nvidia*"):
        dev.unlink()
    assert verdict(cli, live) == ("broken", {"stale-state"})


@pytest.mark.parametrize("tamper", ["library", "spec"])
def test_tampered_with_no_setup_running_is_broken(live: simgpu.SimMachine, cli: Cli,
                                                   tamper: str) -> None:
    if tamper == "library":
        (root_of(live) / "lib" / MA / f"libcuda.so.{live.version}").unlink()
    else:
        spec_of(live).unlink()
    got, found = verdict(cli, live)
    assert got == "broken", found
    assert ("spec-missing" in found) == (tamper == "spec")
    assert cli(live.root, "run").code == 0  # the repair the host agent triggers
    assert verdict(cli, live) == ("ready", set())


def test_missing_staging_is_not_ready_yet(live: simgpu.SimMachine, cli: Cli,
                                          tmp_path: Path) -> None:
    """The host has not (re)staged the driver: even a damaged root is "wait", because a
    run will rebuild it once staging is there."""
    shutil.move(live.root / "run/host-nvidia", tmp_path / "away")
    assert verdict(cli, live) == ("not-ready-yet", {"staging-missing"})
    (root_of(live) / "lib" / MA / f"libcuda.so.{live.version}").unlink()
    got, found = verdict(cli, live)
    assert got == "not-ready-yet" and "staging-missing" in found, found
    shutil.move(tmp_path / "away", live.root / "run/host-nvidia")
    assert cli(live.root, "run").code == 0
    assert verdict(cli, live) == ("ready", set())


def test_empty_staging_is_not_ready_yet(live: simgpu.SimMachine, cli: Cli) -> None:
    for d in (live.root / "run/host-nvidia").iterdir():
        shutil.rmtree(d)
        d.mkdir()
    assert verdict(cli, live) == ("not-ready-yet", {"staging-missing"})


@pytest.mark.usefixtures("run_in_progress")
def test_problems_while_a_run_holds_the_lock_are_not_ready_yet(
        live: simgpu.SimMachine, cli: Cli) -> None:
    """`check` does not wait behind the run (lock_timeout_seconds is an hour here) and
    says "not ready yet" for what it sees half done."""
    spec = spec_of(live).read_bytes()
    spec_of(live).unlink()
    report = check_json(cli, live)
    assert report["setup_running"] is True
    assert report["verdict"] == "not-ready-yet" and "spec-missing" in codes(report)
    spec_of(live).write_bytes(spec)


@pytest.mark.usefixtures("run_in_progress")
def test_a_whole_state_while_a_run_holds_the_lock_is_ready(
        live: simgpu.SimMachine, cli: Cli) -> None:
    report = check_json(cli, live)
    assert (report["setup_running"], report["verdict"]) == (True, "ready")


def test_check_creates_no_lock_file(m: simgpu.SimMachine, cli: Cli) -> None:
    """The probe opens the lock file read-only: a `check` before any run leaves none."""
    assert not os.path.lexists(m.root / LOCK)
    assert verdict(cli, m)[0] == "broken"
    assert not os.path.lexists(m.root / LOCK)


def test_a_shared_holder_is_not_a_run(live: simgpu.SimMachine, cli: Cli) -> None:
    """Another `check` (shared) does not make this one think a setup is running."""
    with open(live.root / LOCK) as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        assert check_json(cli, live)["setup_running"] is False
