"""Talking to other programs, with their behaviour scripted (pytest-subprocess)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from pytest_subprocess import FakeProcess

from unbounded_nvidia_setup import cdi
from unbounded_nvidia_setup.budget import Limit
from unbounded_nvidia_setup.config import Config, Machine
from unbounded_nvidia_setup.log import Failure
from unbounded_nvidia_setup.run import run

CTK = "/opt/nvidia-ctk"


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    ctk = tmp_path / "nvidia-ctk"
    ctk.write_text("")
    ctk.chmod(0o755)
    return Machine.create(tmp_path, Config(nvidia_ctk=str(ctk),
                                           nvidia_ctk_args=("--mode=management",)))


def find_ctk(machine: Machine) -> cdi.Ctk:
    with cdi.Generator(machine) as generator:
        return generator.version()


@pytest.mark.parametrize("output,expect", [
    ("NVIDIA Container Toolkit CLI version 1.20.0\ncommit: abc\n", (1, 20, 0)),
    ("NVIDIA Container Toolkit CLI version 1.17.8\ncommit: abc\n", (1, 17, 8)),
    ("NVIDIA Container Toolkit CLI version v1.18.0-rc.1\n", (1, 18, 0)),
])
def test_ctk_version(machine: Machine, fp: FakeProcess, output: str,
                     expect: tuple[int, int, int]) -> None:
    fp.register([machine.config.nvidia_ctk, "--version"], stdout=output)
    assert find_ctk(machine).version == expect


@pytest.mark.parametrize("output,code", [("garbage\n", 0), ("", 1)])
def test_ctk_version_unusable(machine: Machine, fp: FakeProcess, output: str,
                              code: int) -> None:
    fp.register([machine.config.nvidia_ctk, "--version"], stdout=output, returncode=code)
    with pytest.raises(Failure, match="cannot tell the version"):
        find_ctk(machine)


def test_hook_flags_only_from_1_18(machine: Machine) -> None:
    out = Path("/w/nvidia.yaml")
    new = cdi.generate_argv(machine, cdi.Ctk(CTK, (1, 18, 0)), out)
    old = cdi.generate_argv(machine, cdi.Ctk(CTK, (1, 17, 8)), out)
    assert new == [CTK, "cdi", "generate", f"--driver-root={machine.driver_root}",
                   f"--dev-root={machine.root}", "--format=yaml", f"--output={out}",
                   "--disable-hook", "all", "--enable-hook", "create-symlinks",
                   "--enable-hook", "update-ldcache", "--mode=management"]
    assert old == [*new[:7], "--mode=management"]


def test_live_machine_passes_dev_root_slash() -> None:
    machine = Machine.create(Path("/"), Config())
    argv = cdi.generate_argv(machine, cdi.Ctk(CTK, (1, 20, 0)), Path("/w/nvidia.yaml"))
    assert "--driver-root=/run/nvidia/driver" in argv and "--dev-root=/" in argv


def test_run_reports_the_last_stderr_line(fp: FakeProcess) -> None:
    fp.register(["prog"], stderr="warming up\nfatal: broken\n", returncode=3)
    result = run(["prog"], limit=Limit(5))
    assert not result.ok and result.why() == "exit status 3: fatal: broken"


def test_run_reports_a_signal(fp: FakeProcess) -> None:
    fp.register(["prog"], returncode=-9)
    assert run(["prog"], limit=Limit(5)).why() == "killed by SIGKILL"


def test_run_of_a_missing_program_is_one_line() -> None:
    with pytest.raises(Failure, match="cannot run /nonexistent/prog"):
        run(["/nonexistent/prog"], limit=Limit(5))


def group_members(pgid: int) -> list[str]:
    """Live processes (zombies are dead) of process group `pgid`, as "pid comm"."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:]
        state, _, pgrp = fields.split()[:3]
        if int(pgrp) == pgid and state not in "ZX":
            alive.append(f"{pid} {comm}")
    return alive


def test_run_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    """A hung program with children of its own: a sleep that let go of the output pipes
    (a plain kill of the shell would leave it running) and a shell that holds them (it
    would hold up the wait for the output until it ends by itself). The shell records its
    pid, which is the group's, once both are started."""
    ready = tmp_path / "pgid"
    holds = 60  # how long the shell holding the pipes lives
    script = ("sleep 300 </dev/null >/dev/null 2>&1 & "
              f"sh -c 'sleep {holds}; :' & "
              f"echo $$ > {ready}.tmp && mv {ready}.tmp {ready}; wait")
    start = time.monotonic()
    try:
        with pytest.raises(Failure, match=r"sh did not finish within 3 s"):
            run(["sh", "-c", script], limit=Limit(3))
        took = time.monotonic() - start
        assert ready.exists(), "the shell never started its children: raise the timeout"
        # Honoured: not before the timeout, and not held up by the shell on the pipes.
        assert 3 <= took < holds, took
        pgid = int(ready.read_text())
        # SIGKILL is delivered asynchronously: the group is gone soon, not at once.
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_members(pgid) == []
    finally:
        if ready.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(ready.read_text()), signal.SIGKILL)
