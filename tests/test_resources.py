"""Resource faults (issue 4, item 3), beyond the one-liners of test_failures.py: full
filesystems when a good root is live and the new driver does not fit, inodes running out,
a full /etc/cdi, a read-only /etc/cdi and a failing nvidia-ctk on a first boot, a stuck
run holding the lock, and an error (ENOSPC, EIO, EPERM) injected into every class of
mutating syscall the run makes.

Each fault must end in one clear line and the right exit code, leave the live root and
spec as they were (or, on a first boot, absent) with no temporary data anywhere, and the
next run must succeed. The security invariants are checked after every test."""

from __future__ import annotations

import fnmatch
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from check_schema import check_report
from invariants import (
    product_env,
    run_cli,
    secure_after,  # noqa: F401  (fixture)
)
from test_crash import (
    METRICS_DIR,
    NOT_MADE,
    Point,
    Swapper,
    assert_metrics_whole,
    assert_whole,
    kill_points,
    points_or_fail,
    recovered,
    run_injected,
    swapper,
    wait_for_orphans,
)
from unbounded_nvidia_setup.config import LAST_RUN, Config
from unbounded_nvidia_setup.tree import manifest

import elfbuild
import simgpu
from conftest import needs_root, needs_tool, stand_in_only
from test_failures import new_driver
from test_run import root_of, snapshot, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
NEW = "570.133.20"


def mount_tmpfs(mounts: list[Path], path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    mounts.append(path)


def used(path: Path) -> tuple[int, int]:
    """(blocks, inodes) in use on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_blocks - st.f_bfree, st.f_files - st.f_ffree


def fails_cleanly(m: simgpu.SimMachine, code: int, expect: str,
                  env: dict[str, str] | None = None, *, unchanged: bool = True) -> str:
    before = snapshot(m)
    out = run_cli(m.root, "run", env=env)
    assert out.code == code, out.stderr
    assert len(out.errors) == 1, out.lines
    assert expect in out.errors[0] and "; " in out.errors[0], out.errors[0]
    if unchanged:
        assert snapshot(m) == before
    assert_no_leftovers(m)
    return out.errors[0]


def assert_no_leftovers(m: simgpu.SimMachine) -> None:
    """A failed run cleaned up after itself: no generation beside the root, no work dir,
    no temp file of an atomic write."""
    assert not list(root_of(m).parent.glob(".driver.*"))
    assert not (m.root / "run/unbounded-nvidia-setup").exists()
    assert_no_temp_files(m)


def assert_no_temp_files(m: simgpu.SimMachine) -> None:
    """No temp file of an atomic write: spec, drop-in, metrics (when metrics are on), the
    last run's record."""
    for directory in (spec_of(m).parent, m.root / "etc/ld.so.conf.d",
                      m.root / METRICS_DIR.lstrip("/")):
        if directory.exists():
            assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    record = m.root / LAST_RUN.lstrip("/")
    assert not list(record.parent.glob(f".{record.name}.*.tmp"))


def bigger_new_driver(m: simgpu.SimMachine, tmp_path: Path, size: int) -> None:
    """Stage a newer driver whose files take `size` more bytes than the live one's."""
    new_driver(m, tmp_path, NEW)
    elfbuild.compile_so(m.staging[0] / f"libnvidia-gpucomp.so.{NEW}",
                      f"libnvidia-gpucomp.so.{NEW}", size=size)


# --------------------------------------------------------------------------------------
# Full filesystems


def test_new_driver_does_not_fit_next_to_the_live_root(tmp_path: Path,
                                                       mounts: list[Path]) -> None:
    """The old root fits, the new one does not fit beside it: one line, the old root and
    spec stay live, and the filesystem holds exactly what it held before."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    mount_tmpfs(mounts, m.root / "run/nvidia", "size=2m")
    assert run_cli(m.root, "run").code == 0
    before = used(m.root / "run/nvidia")
    bigger_new_driver(m, tmp_path, 3 << 20)
    error = fails_cleanly(m, 1, "no space left")
    assert str(m.root / "run/nvidia") in error
    assert os.listdir(m.root / "run/nvidia") == ["driver"]
    assert used(m.root / "run/nvidia") == before
    assert (root_of(m) / f"lib/x86_64-linux-gnu/libcuda.so.{m.version}").is_file()


def test_inodes_run_out_while_building(tmp_path: Path, mounts: list[Path]) -> None:
    """Space is plenty but inodes are not (tmpfs nr_inodes): creating a file, directory or
    link fails with ENOSPC somewhere in the build; same outcome."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    mount_tmpfs(mounts, m.root / "run/nvidia", "size=64m,nr_inodes=100")
    assert run_cli(m.root, "run").code == 0
    before = used(m.root / "run/nvidia")
    assert before[1] > 50  # the live root took more than half the inodes
    new_driver(m, tmp_path, NEW)
    fails_cleanly(m, 1, "no space left")
    assert os.listdir(m.root / "run/nvidia") == ["driver"]
    assert used(m.root / "run/nvidia") == before


def test_full_cdi_filesystem(tmp_path: Path, mounts: list[Path]) -> None:
    """/etc/cdi full when the new spec is written: the new root is swapped back out, the
    old root and spec stay live together, no temp file is left in /etc/cdi."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    cdi = m.root / "etc/cdi"
    mount_tmpfs(mounts, cdi, "size=256k")
    assert run_cli(m.root, "run").code == 0
    filler = cdi / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    new_driver(m, tmp_path, NEW)
    fails_cleanly(m, 1, "cannot install the CDI spec")
    assert sorted(os.listdir(cdi)) == ["filler.bin", "nvidia.yaml"]
    filler.unlink()
    assert run_cli(m.root, "run").code == 0


def test_read_only_cdi_dir_on_first_boot(tmp_path: Path, mounts: list[Path]) -> None:
    """Nothing was live: the new root is taken away again, the drop-in too."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    cdi = m.root / "etc/cdi"
    cdi.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(cdi), str(cdi)], check=True)
    mounts.append(cdi)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(cdi)], check=True)
    fails_cleanly(m, 1, "cannot install the CDI spec")
    assert not os.path.lexists(root_of(m))
    assert os.listdir(root_of(m).parent) == []
    assert not (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").exists()


# --------------------------------------------------------------------------------------
# nvidia-ctk failing on a first boot (test_failures covers a live machine)


def processes_under(root: Path) -> list[int]:
    needle = str(root).encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
    return found


@stand_in_only("hang, crash or corrupt its output on request")
@pytest.mark.parametrize("knob,value,expect", [
    ("FAKE_NVIDIA_CTK_SIGNAL", "KILL", "killed by SIGKILL"),
    ("FAKE_NVIDIA_CTK_SIGNAL", "SEGV", "killed by SIGSEGV"),
    ("FAKE_NVIDIA_CTK_HANG", "1", "did not finish within 2 s"),
])
def test_nvidia_ctk_failing_on_first_boot_leaves_nothing(tmp_path: Path, knob: str,
                                                         value: str, expect: str) -> None:
    """No root, spec, drop-in, work dir or temp file afterwards, and no nvidia-ctk left
    running (a hung one is killed with its whole process group)."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config(nvidia_ctk_timeout_seconds=2)
    start = time.monotonic()
    fails_cleanly(m, 1, expect, env={knob: value})
    # The 2 s set above ended a hung nvidia-ctk, not the shipped timeout.
    assert time.monotonic() - start < Config().nvidia_ctk_timeout_seconds
    assert not os.path.lexists(root_of(m))
    assert not spec_of(m).exists()
    assert not (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").exists()
    assert processes_under(m.root) == []
    assert run_cli(m.root, "run").code == 0


# --------------------------------------------------------------------------------------
# The lock


@stand_in_only("hang, crash or corrupt its output on request")
def test_lock_held_by_a_stuck_run(tmp_path: Path) -> None:
    """A run hangs in nvidia-ctk while holding the lock: other runs and cleans give up
    after the lock timeout with 75 and change nothing, a check answers at once "not ready
    yet"; once the stuck run is killed, the
    next run succeeds and clears what it left."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert run_cli(m.root, "run").code == 0
    new_driver(m, tmp_path, NEW)
    stuck_config = tmp_path / "stuck.yaml"
    stuck_config.write_text(m.config_path.read_text() + "nvidia_ctk_timeout_seconds: 600\n")
    m.write_config(lock_timeout_seconds=1)
    stuck = subprocess.Popen(
        [sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(m.root), "--config",
         str(stuck_config), "run"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=product_env({"FAKE_NVIDIA_CTK_HANG": "1"}))
    try:
        # Stuck: nvidia-ctk started and the state has stopped changing for a second.
        deadline = time.monotonic() + 60
        before, quiet = snapshot(m), time.monotonic()
        while (not (m.root / "run/unbounded-nvidia-setup").exists()
               or time.monotonic() - quiet < 1):
            assert stuck.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
            now = snapshot(m)
            if now != before:
                before, quiet = now, time.monotonic()
        for command in ("run", "clean"):
            start = time.monotonic()
            out = run_cli(m.root, command)
            assert out.code == 75, (command, out.stderr)
            assert len(out.errors) == 1 and "holds" in out.errors[0], out.lines
            # Its own lock wait (1 s), not the shipped one, and not the stuck run's end.
            assert 1 <= time.monotonic() - start < Config().lock_timeout_seconds
        # check does not wait behind a run (issue 11): what it sees is not ready yet.
        report = check_report(run_cli(m.root, "check", "--json"))
        assert report["setup_running"] is True and report["verdict"] == "not-ready-yet"
        assert snapshot(m) == before
    finally:
        # The stuck run and the nvidia-ctk it started (in a session of its own), by pid.
        for pid in processes_under(m.root):
            os.kill(pid, signal.SIGKILL)
        stuck.wait()
    wait_for_orphans(m.root)
    out = run_cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert (root_of(m) / f"lib/x86_64-linux-gnu/libcuda.so.{NEW}").is_file()
    assert os.listdir(root_of(m).parent) == ["driver"]
    assert not (m.root / "run/unbounded-nvidia-setup").exists()


# --------------------------------------------------------------------------------------
# An error injected into every class of mutating syscall

ERRNO = {
    "mkdir": "ENOSPC", "openat": "ENOSPC", "copy_file_range": "ENOSPC", "symlink": "ENOSPC",
    "write": "ENOSPC", "fsync": "EIO", "rename": "EIO", "renameat": "EIO", "renameat2": "EIO",
    "unlink": "EIO",
    "unlinkat": "EIO", "rmdir": "EIO", "fchown": "EPERM", "fchmod": "EPERM",
    "utimensat": "EPERM", "chmod": "EPERM",
}
# What the one line of a failed run says for each injected error: the error itself, not
# a later symptom of a run that went on after it.
SAYS = {"ENOSPC": "no space left", "EIO": "input/output error",
        "EPERM": "operation not permitted"}
ERROR_CASES = [(scenario, syscall) for scenario in ("first-boot", "new-driver")
               for syscall in ERRNO
               if (scenario, syscall) not in NOT_MADE
               and (scenario == "new-driver" or syscall in ("mkdir", "openat", "rename",
                                                            "renameat", "unlink", "unlinkat",
                                                            "rmdir", "fsync", "write"))]
# Where an injected error may end in exit 0, by (syscall, glob of the path the failed
# call acted on, as test_crash.where names it), and why the run is right to go on. An
# exit 0 after any other injected error fails the test: either the product swallowed an
# error it must not, or this table lacks a reason.
HARMLESS: dict[tuple[str, str], str] = {
    ("write", "pipe:*"): "a log line that cannot be written is dropped and the run goes on "
                         "(log.log); the outcome also reaches systemd as STATUS=",
    **dict.fromkeys(
        [("mkdir", "/run"), ("mkdir", "/etc/cdi"), ("mkdir", "/etc/ld.so.conf.d")],
        "the directory exists already: mkdir(exist_ok=True) takes a failure on an "
        "existing directory as done, and it is"),
    ("unlink", "/run/unbounded-nvidia-setup"):
        "clearing the work dir before nvidia-ctk runs, where there is none: the mkdir "
        "that follows would fail on anything left",
    **dict.fromkeys(
        [("unlinkat", "/run/unbounded-nvidia-setup/*"), ("rmdir", "/run/unbounded-nvidia-setup"),
         ("unlinkat", "/run/nvidia/.driver.*"), ("rmdir", "/run/nvidia/.driver.*")],
        "deleting the private work dir or the old generation after the swap: nothing "
        "reads them, the run warns, and the next run removes them (tree.remove_leftovers, "
        "cdi.Generator; recovered() checks)"),
    # The directory, its temp file and the file (fnmatch's * also matches "/").
    **dict.fromkeys(
        [(syscall, f"{METRICS_DIR}*") for syscall in
         ("openat", "fchmod", "write", "fsync", "renameat", "unlinkat")],
        "metrics never fail a run: one warning (metrics.write); node_exporter keeps "
        "serving the previous file, and the next run writes a new one"),
    ("mkdir", "/run"): "the directory exists already (write_atomically's mkdir of the "
                       "last run's record's directory, exist_ok=True)",
    **dict.fromkeys(
        [(syscall, f"{os.path.dirname(LAST_RUN)}/*{os.path.basename(LAST_RUN)}*") for syscall
         in ("openat", "write", "fsync", "rename", "renameat", "unlink", "unlinkat")],
        "the record of how the run ended never fails a run: one warning (outcome.write), "
        "and the older record is removed, so `check` names no last run rather than an "
        "older one"),
}
# Failed runs that do not leave the live state as it was before them, by (syscall, glob
# of the failed call's path). A product bug each, listed so the suite stays green while
# it is open: the test fails once a gap is closed, so the entry goes with the fix.
def listed(table: dict[tuple[str, str], str], syscall: str, path: str) -> str | None:
    return next((why for (name, glob), why in table.items()
                 if name == syscall and fnmatch.fnmatchcase(path, glob)), None)


def live_state(s: Swapper) -> tuple[object, bytes | None, bytes | None]:
    """The driver root's manifest and the spec's and drop-in's bytes (None: absent)."""
    def read(path: Path) -> bytes | None:
        return path.read_bytes() if path.exists() else None

    return (manifest(root_of(s.m)), read(spec_of(s.m)),
            read(s.m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"))


@pytest.fixture
def two_drivers(tmp_path: Path) -> Swapper:
    s = swapper(tmp_path)
    s.learn()
    return s


def spread(points: list[Point]) -> list[Point]:
    """First, middle and last kill point by index, and every point aimed at a purpose."""
    indexed = [p for p in points if not p.only]
    ends = {indexed[i] for i in (0, len(indexed) // 2, -1)} if indexed else set()
    return [p for p in points if p in ends or p.purpose]


@needs_tool("strace")
@pytest.mark.parametrize("scenario,syscall", ERROR_CASES)
def test_error_at_a_mutating_step_fails_cleanly(two_drivers: Swapper, scenario: str,
                                                syscall: str) -> None:
    """`strace -e inject=SYSCALL:error=ERRNO:when=N` at every kill point of test_crash on
    a first boot, at the first, a middle, the last and every aimed one when swapping to a
    new driver. The trace shows the injected call failed (and, for an aimed point, that
    it was the call aimed at). Then either exit 1 with one line naming that error, no
    leftovers, and the live root, spec and drop-in exactly as before the run
    or exit 0 where HARMLESS says why that error does not matter;
    never a traceback; the next run succeeds."""
    s = two_drivers
    errno = ERRNO[syscall]
    points = points_or_fail(scenario, syscall, kill_points(scenario, s)[syscall])
    if scenario == "new-driver":
        points = spread(points)
    outcomes = []
    for point in points:
        target = s.prepare(scenario)
        before = live_state(s)
        run = run_injected(s.m, point, f"error={errno}")
        hit = [w for _, w in run.hits]
        assert hit, f"N={point}: the injected {errno} never fired"
        assert all(f"= -1 {errno} " in f"= {c.result}" for c, _ in run.hits), run.hits
        assert run.landed(point), f"N={point}: aimed at {point.purpose}, hit {hit}"
        if run.code == 0:
            unexplained = [path for path in hit if not listed(HARMLESS, syscall, path)]
            assert not unexplained, (
                f"N={point}: exit 0 although {syscall} on {unexplained} failed with {errno}; "
                f"the product ignored it, or HARMLESS must say why that is right")
            if any(path.startswith(METRICS_DIR) for path in hit):
                warned = [line for line in run.stderr.splitlines()
                          if line.startswith("warning: metrics not written")]
                assert len(warned) == 1 and SAYS[errno] in warned[0].lower(), run.stderr
            if any(LAST_RUN.rsplit("/", 1)[1] in path for path in hit):
                warned = [line for line in run.stderr.splitlines()
                          if line.startswith("warning: cannot record how this run ended")]
                assert len(warned) == 1 and SAYS[errno] in warned[0].lower(), run.stderr
                record = s.m.root / LAST_RUN.lstrip("/")
                assert not record.exists() or "exit_code 0" in record.read_text(), \
                    f"N={point}: an older run's record is left"
            assert_no_temp_files(s.m)
        else:
            errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
            assert run.code == 1 and len(errors) == 1, f"N={point}: {run.stderr}"
            assert "; " in errors[0] and SAYS[errno] in errors[0].lower(), errors[0]
            assert_no_leftovers(s.m)
            assert live_state(s) == before, f"N={point}: failed without rolling back"
        outcomes.append(f"{point}:{run.code}")
        assert_whole(s, may_be_absent=scenario == "first-boot")
        assert_metrics_whole(s)
        recovered(s, target)
    print(f"ERRORS {scenario} {syscall} {errno} at N:exit {' '.join(outcomes)}: held")
