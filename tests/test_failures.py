"""Bad input and broken tools: one clear line, the right exit code, nothing live changed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from invariants import product_argv, product_env, secure_after  # noqa: F401  (fixture)
from unbounded_nvidia_setup import run

import elfbuild
import simgpu
import simnvml
from conftest import Cli, Outcome, needs_root, needs_tool, stand_in_only
from test_run import check_json, root_of, snapshot, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config(staging_wait_seconds=0, nvidia_ctk_timeout_seconds=5,
                         lock_timeout_seconds=1)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    """A machine after one good run: the state that failures must leave alone."""
    assert cli(m.root, "run").code == 0
    return m


def fails_cleanly(cli: Cli, m: simgpu.SimMachine, code: int, expect: str,
                  env: dict[str, str] | None = None) -> str:
    before = snapshot(m)
    out = cli(m.root, "run", env=env)
    assert out.code == code, out.stderr
    assert len(out.errors) == 1, out.lines
    assert expect in out.errors[0], out.errors[0]
    assert "; " in out.errors[0]  # what is wrong; what to do
    assert snapshot(m) == before
    assert not list(root_of(m).parent.glob(".driver.*"))
    if spec_of(m).parent.exists():
        assert [p.name for p in spec_of(m).parent.iterdir()] in ([], ["nvidia.yaml"])
    return out.errors[0]


def new_driver(m: simgpu.SimMachine, tmp_path: Path, version: str = "570.133.20") -> None:
    """Replace the staging with a newer driver, so a run has to swap."""
    new = simgpu.make_machine(tmp_path / "newdrv", version=version, stale_versions=())
    shutil.rmtree(m.root / "run/host-nvidia")
    shutil.copytree(new.root / "run/host-nvidia", m.root / "run/host-nvidia", symlinks=True)
    shutil.copy(new.root / "proc/driver/nvidia/version", m.root / "proc/driver/nvidia/version")


def test_staging_absent_waits_then_exits_75(m: simgpu.SimMachine, cli: Cli) -> None:
    shutil.rmtree(m.root / "run/host-nvidia")
    m.write_config(staging_wait_seconds=1.5)
    start = time.monotonic()
    fails_cleanly(cli, m, 75, "driver staging is not ready after 1.5 s")
    assert time.monotonic() - start >= 1.5


def test_empty_staging_dir_waits_then_exits_75(m: simgpu.SimMachine, cli: Cli) -> None:
    (m.root / "run/host-nvidia/9").mkdir()
    error = fails_cleanly(cli, m, 75, "empty")
    assert "host-nvidia/9" in error


def test_staging_that_appears_while_waiting_is_used(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """The staging appears only once the run says it is waiting for it (no fixed sleep:
    a run slow to start would otherwise find it already there and never wait)."""
    staging = m.root / "run/host-nvidia"
    aside = tmp_path / "aside"
    shutil.move(staging, aside)
    m.write_config(staging_wait_seconds=30)
    with subprocess.Popen(product_argv(m.root, "run"), stderr=subprocess.PIPE, text=True,
                          env=product_env(), stdin=subprocess.DEVNULL) as proc:
        assert proc.stderr is not None
        before = []
        for line in proc.stderr:
            before.append(line)
            if line.startswith("Waiting for driver staging"):
                break
        else:
            proc.wait()
            pytest.fail(f"the run never waited for the staging: {''.join(before)}")
        shutil.move(aside, staging)
        after = proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == 0, after
    assert "nothing at" in before[-1], before[-1]
    assert "now holds driver" in after
    assert (root_of(m) / f"lib/x86_64-linux-gnu/libcuda.so.{m.version}").is_file()


def test_staging_path_that_is_a_file(live: simgpu.SimMachine, cli: Cli) -> None:
    (live.root / "run/host-nvidia/5").write_text("oops")
    fails_cleanly(cli, live, 1, "run/host-nvidia/5 is not a directory")


def test_staging_path_that_is_a_symlink(live: simgpu.SimMachine, cli: Cli) -> None:
    os.symlink("/usr/lib", live.root / "run/host-nvidia/5")
    fails_cleanly(cli, live, 1, "is a symlink, not a directory")


@needs_tool("setpriv", " (util-linux)")
def test_unreadable_staging_dir(live: simgpu.SimMachine, cli: Cli) -> None:
    """Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH meets permissions like anyone."""
    live.staging[1].chmod(0)
    before = snapshot(live)
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                           sys.executable, "-m", "unbounded_nvidia_setup", "--root",
                           str(live.root), "run"], capture_output=True, text=True)
    live.staging[1].chmod(0o755)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert "cannot read staging dir" in errors[0] and "Permission denied" in errors[0]
    assert "Traceback" not in proc.stderr
    assert snapshot(live) == before


def test_corrupt_elf_named_like_a_driver_library(live: simgpu.SimMachine, cli: Cli,
                                                 tmp_path: Path) -> None:
    elfbuild.truncated_elf(live.staging[0] / f"libnvidia-glcore.so.{live.version}")
    fails_cleanly(cli, live, 1, "damaged ELF file")


def test_missing_nvml_is_incomplete_driver_state(live: simgpu.SimMachine, cli: Cli) -> None:
    for p in live.staging[0].glob("libnvidia-ml.so*"):
        p.unlink()
    fails_cleanly(cli, live, 1, f"incomplete driver state: libnvidia-ml.so.{live.version}")


def test_only_foreign_architecture_libraries(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    for lib in m.staging[0].glob("lib*.so.*"):
        if not lib.is_symlink():
            soname = lib.name
            elfbuild.aarch64_so(lib, soname)
    fails_cleanly(cli, m, 1, "incomplete driver state")


def test_two_versions_and_no_module_version(live: simgpu.SimMachine, cli: Cli) -> None:
    (live.root / "proc/driver/nvidia/version").unlink()
    (live.staging[0] / "libcuda.so.1").unlink()
    (live.staging[0] / "libnvidia-ml.so.1").unlink()
    error = fails_cleanly(cli, live, 1, "cannot tell the driver version")
    assert live.version in error and live.stale_versions[0] in error


def test_version_from_libcuda_link_when_module_unreadable(live: simgpu.SimMachine,
                                                          cli: Cli) -> None:
    (live.root / "proc/driver/nvidia/version").unlink()
    out = cli(live.root, "run")
    assert out.code == 0 and "not rebuilt" in out.stderr


@pytest.mark.parametrize("setting,expect", [
    ({"nvidia_ctk": "/nonexistent/nvidia-ctk"}, "/nonexistent/nvidia-ctk not found"),
    ({"nvidia_ctk": "no-such-nvidia-ctk"}, "no-such-nvidia-ctk not found on PATH"),
    ({"ldconfig": "/nonexistent/ldconfig"}, "/nonexistent/ldconfig not found"),
])
def test_missing_programs_are_found_missing_before_anything_changes(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path, setting: dict[str, str],
        expect: str) -> None:
    new_driver(live, tmp_path)
    live.write_config(**setting)
    fails_cleanly(cli, live, 1, expect)


@stand_in_only("hang, crash or corrupt its output on request")
@pytest.mark.parametrize("knob,value,expect", [
    ("FAKE_NVIDIA_CTK_SIGNAL", "KILL", "killed by SIGKILL"),
    ("FAKE_NVIDIA_CTK_SIGNAL", "SEGV", "killed by SIGSEGV"),
    ("FAKE_NVIDIA_CTK_HANG", "1", "did not finish within 5 s"),
    ("FAKE_NVIDIA_CTK_CORRUPT", "garbage", "not valid YAML"),
    ("FAKE_NVIDIA_CTK_CORRUPT", "nokind", "expected 'nvidia.com/gpu'"),
    ("FAKE_NVIDIA_CTK_CORRUPT", "nodevices", "lists no devices"),
    ("FAKE_NVIDIA_CTK_CORRUPT", "staging", "from the staging mounts"),
])
def test_broken_nvidia_ctk_keeps_the_previous_root_and_spec(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path, knob: str, value: str,
        expect: str) -> None:
    new_driver(live, tmp_path)
    fails_cleanly(cli, live, 1, expect, env={knob: value})
    # The old generation is live again, consistent with the old spec.
    assert (root_of(live) / f"lib/x86_64-linux-gnu/libcuda.so.{live.version}").is_file()
    assert cli(live.root, "run").code == 0


def test_libnvidia_ml_without_nvml_keeps_the_previous_root_and_spec(
        live: simgpu.SimMachine, cli: Cli) -> None:
    """A libnvidia-ml without NVML's entry points (a stub, like the CUDA toolkit's): the
    real nvidia-ctk 1.20 loads it from the new root, calls nvmlInit and dies with exit
    127 (FACTS.md). The run names that, and the previous root and spec stay live."""
    elfbuild.compile_so(live.staging[0] / f"libnvidia-ml.so.{live.version}",
                      elfbuild.NVML_SONAME, nvml=False)
    error = fails_cleanly(cli, live, 1, "nvidia-ctk cdi generate failed (exit status 127")
    assert "symbol lookup error" in error and "undefined symbol: nvmlInit" in error


def test_failing_nvidia_ctk_on_first_boot_leaves_nothing(m: simgpu.SimMachine,
                                                         cli: Cli) -> None:
    m.write_config(nvidia_ctk_args=["--mode=bogus"])
    fails_cleanly(cli, m, 1, "nvidia-ctk cdi generate failed")
    assert not os.path.lexists(root_of(m))


def test_lock_held_by_a_stuck_process_gives_75(live: simgpu.SimMachine, cli: Cli) -> None:
    lock = live.root / "run/unbounded-nvidia-setup.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        start = time.monotonic()
        fails_cleanly(cli, live, 75, "holds")
        assert time.monotonic() - start >= 1
        # `check` does not wait for the lock: it answers at once that a setup is running
        # (tests/test_contract.py), so it never reaches the timeout and never exits 75.
        report = check_json(cli, live)
        assert (report["setup_running"], report["verdict"]) == (True, "ready")


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def test_full_driver_root_filesystem(m: simgpu.SimMachine, cli: Cli,
                                     mounts: list[Path]) -> None:
    elfbuild.compile_so(m.staging[0] / f"libnvidia-gpucomp.so.{m.version}",
                      "libnvidia-gpucomp.so", size=3 << 20)
    mount_tmpfs(m.root / "run/nvidia", "size=1m")
    mounts.append(m.root / "run/nvidia")
    error = fails_cleanly(cli, m, 1, "no space left")
    assert str(m.root / "run/nvidia") in error
    assert os.listdir(m.root / "run/nvidia") == []


def test_read_only_driver_root_filesystem(m: simgpu.SimMachine, cli: Cli,
                                          mounts: list[Path]) -> None:
    mount_tmpfs(m.root / "run/nvidia", "ro,size=1m")
    mounts.append(m.root / "run/nvidia")
    fails_cleanly(cli, m, 1, "is read-only")


def test_read_only_cdi_dir_keeps_the_previous_state(live: simgpu.SimMachine, cli: Cli,
                                                   tmp_path: Path, mounts: list[Path]) -> None:
    new_driver(live, tmp_path)
    cdi = live.root / "etc/cdi"
    subprocess.run(["mount", "--bind", str(cdi), str(cdi)], check=True)
    mounts.append(cdi)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(cdi)], check=True)
    fails_cleanly(cli, live, 1, "cannot install the CDI spec")


# --------------------------------------------------------------------------------------
# nvidia-ctk's own words in the journal (issue 21, point 1). Without -v: what reaches the
# journal at the unit's default verbosity. Its lines keep their logrus form, less the
# time= stamp (journald has its own).


def ctk_lines(lines: list[str], label: str = "warning: ") -> list[str]:
    """nvidia-ctk's lines the run logged with `label` (tty labels: "warning: ", "" for
    notice and info)."""
    prefix = f"{label}nvidia-ctk: "
    return [line[len(prefix):] for line in lines if line.startswith(prefix)]


class Recorded:
    """A Cli remembering its last outcome (fails_cleanly returns only the error line)."""

    def __init__(self, cli: Cli) -> None:
        self.cli = cli
        self.out: Outcome | None = None

    def __call__(self, *args: object, **kwargs: object) -> Outcome:
        self.out = self.cli(*args, **kwargs)
        return self.out


def logrus_ctk(directory: Path, stderr: list[str], status: int = 1) -> Path:
    """A stand-in nvidia-ctk (config key `nvidia_ctk`) that writes `stderr` (logrus lines
    given as (level, msg) pairs already formatted) and exits with `status`; `--version`
    answers 1.20.0, so the product does not retry without the hook flags."""
    directory.mkdir(exist_ok=True)
    text = directory / "stderr"
    text.write_text("".join(f"{line}\n" for line in stderr))
    script = directory / "nvidia-ctk"
    script.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then
    printf 'NVIDIA Container Toolkit CLI version 1.20.0\\ncommit: 0\\n'; exit 0
fi
cat {text} >&2
exit {status}
""")
    script.chmod(0o755)
    return script


def logrus(level: str, msg: str) -> str:
    """A line as logrus's TextFormatter writes it (msg quoted like Go's %q, as JSON does
    for these texts)."""
    return f'time="2026-12-02T04:35:42Z" level={level} msg={json.dumps(msg)}'


def test_nvml_failure_reaches_the_journal_with_its_cause(live: simgpu.SimMachine,
                                                         cli: Cli) -> None:
    """nvidia-ctk in its default mode (auto: NVML) on a machine whose NVML cannot
    initialise, as without a GPU: its error and its warning that NVML failed are in the
    journal at warning level, and the run's one error line quotes its error's message,
    not its raw logrus line."""
    simnvml.silence_nvml(live)
    live.write_config(staging_wait_seconds=0, nvidia_ctk_timeout_seconds=5,
                      lock_timeout_seconds=1, nvidia_ctk_args=None)
    recorded = Recorded(cli)
    error = fails_cleanly(recorded, live, 1, "nvidia-ctk cdi generate failed (exit status 1: "
                          "failed to generate CDI spec: ")
    assert "failed to initialize NVML: " in error and "level=" not in error, error
    assert recorded.out is not None
    said = ctk_lines(recorded.out.lines)
    assert any(line.startswith('level=error msg="failed to generate CDI spec: ')
               and "failed to initialize NVML" in line for line in said), said
    assert any(line.startswith('level=warning msg="Could not determine driver version')
               for line in said), said
    assert not any("level=info" in line for line in recorded.out.lines), recorded.out.lines
    assert not any(line.startswith("time=") for line in said), said


def test_the_first_error_line_is_the_cause(live: simgpu.SimMachine, cli: Cli,
                                           tmp_path: Path) -> None:
    """An nvidia-ctk that logs the cause first and a generic line last (the shape issue
    21 reports; 1.20 wraps the cause into its one error line instead): the run quotes
    the first, and both are in the journal; a warning said twice (1.20 repeats several)
    is relayed once."""
    cause = "failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND"
    again = logrus("warning", "Missing libnvidia-nvvm70.so.*")
    live.write_config(nvidia_ctk=str(logrus_ctk(tmp_path / "bin", [
        logrus("info", "Using /run/nvidia/driver/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        again, again,
        logrus("error", cause),
        logrus("error", "failed to generate CDI spec")])))
    recorded = Recorded(cli)
    error = fails_cleanly(recorded, live, 1, f"(exit status 1: {cause});")
    assert recorded.out is not None
    assert ctk_lines(recorded.out.lines) == [
        'level=warning msg="Missing libnvidia-nvvm70.so.*" (2 times)',
        f"level=error msg={json.dumps(cause)}",
        'level=error msg="failed to generate CDI spec"'], recorded.out.lines
    assert "Using /run" not in recorded.out.stderr, error


def test_a_flood_from_nvidia_ctk_reaches_the_journal_bounded(live: simgpu.SimMachine,
                                                             cli: Cli,
                                                             tmp_path: Path) -> None:
    """300 long warnings, then a long error: the journal gets at most run.RELAY_LINES of
    them, each cut to run.RELAY_LINE_CHARS, the error among them, and a note of how many
    were left out; the run's one line quotes the error, cut too."""
    warnings = [logrus("warning", f"Could not locate thing {n}: " + "x" * 2000)
                for n in range(300)]
    cause = "failed to create device CDI specs: " + "y" * 5000
    live.write_config(nvidia_ctk=str(logrus_ctk(tmp_path / "bin",
                                                [*warnings, logrus("error", cause)])))
    recorded = Recorded(cli)
    error = fails_cleanly(recorded, live, 1, "(exit status 1: failed to create device CDI "
                          "specs: yyy")
    assert len(error) < run.CAUSE_CHARS + 400, len(error)
    assert recorded.out is not None
    said = ctk_lines(recorded.out.lines)
    assert said[-1] == f"({301 - run.RELAY_LINES} more lines; -v logs all of them)", said[-1]
    assert len(said) == run.RELAY_LINES + 1, len(said)
    assert all(len(line) < run.RELAY_LINE_CHARS + 40 for line in said), \
        max(len(line) for line in said)
    assert said[-2].startswith('level=error msg="failed to create device CDI specs: yyy')
    assert len(recorded.out.stderr.encode()) < 3 * run.RELAY_LINES * run.RELAY_LINE_CHARS


def test_a_good_run_logs_nvidia_ctks_warnings_at_notice_level(m: simgpu.SimMachine,
                                                              cli: Cli) -> None:
    """nvidia-ctk warns on every healthy generate (no MIG caps, no nvidia-imex, ...): its
    warnings reach the journal at notice level, not as warnings of the run, and its
    info lines stay at debug level."""
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    said = ctk_lines(out.lines, label="")
    # NVIDIA's nvidia-ctk warns more in NVML mode than the journal takes: the relay's note
    # of how many it left out closes them
    if said and re.fullmatch(r"\(\d+ more lines; -v logs all of them\)", said[-1]):
        said = said[:-1]
    assert said and all(line.startswith("level=warning msg=") for line in said), out.lines
    assert not [line for line in out.lines if line.startswith("warning: ")], out.lines
    assert "level=info" not in out.stderr, out.stderr
