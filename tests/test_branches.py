"""Documented branches that had no test of their own (issue 12, point 6), each with real
parts: the real ldconfig failing and hanging after the swap, the sendfile fallback of the
copy (staging and driver root on different filesystems, as on a node), the
extra_library_prefixes key through discover, verify and check, the
/sys/module/nvidia/version fallback, a new root that fails its verification, and `status`
while a real flock(1) process or a hung run holds the lock."""

from __future__ import annotations

import errno
import filecmp
import os
import re
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from check_schema import check_report
from invariants import (
    Call,
    Traced,
    parse_calls,
    product_argv,
    product_env,
    run_cli,
    secure_after,  # noqa: F401  (fixture)
    traced,
    unquote,
)
from test_crash import wait_for_orphans
from test_resources import processes_under

import elfbuild
import simgpu
from conftest import Cli, Outcome, needs_root, stand_in_only
from test_failures import mount_tmpfs, new_driver
from test_run import check_json, codes, load_spec, root_of, snapshot, spec_of
from test_run import mounts as spec_mounts

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
FAST = {"staging_wait_seconds": 0, "nvidia_ctk_timeout_seconds": 5, "lock_timeout_seconds": 1}


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config(**FAST)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    assert cli(m.root, "run").code == 0
    return m


# --------------------------------------------------------------------------------------
# ldconfig failing or hanging after the swap


def root_moves(tr: Traced, m: simgpu.SimMachine) -> list[int]:
    """Indexes of the calls that renamed something to or from the live driver root."""
    live = f'"{root_of(m)}"'
    return [i for i, c in enumerate(tr.calls)
            if c.name in ("rename", "renameat", "renameat2") and live in c.args]


def ldconfig_starts(tr: Traced, m: simgpu.SimMachine) -> list[int]:
    """Indexes of `ldconfig -r <root>` entering the machine (its chroot)."""
    return [i for i, c in enumerate(tr.calls)
            if c.name == "chroot" and c.args[:1] == (f'"{m.root}"',) and c.result == "0"]


def rolled_back_around_ldconfig(tr: Traced, m: simgpu.SimMachine, before: object,
                                expect: str) -> str:
    """One error line, the live state exactly as before, nothing left over; and from the
    trace: the new root went live, ldconfig ran on it, the root was put back, and
    ldconfig ran once more for the old one."""
    out = tr.outcome
    assert out.code == 1, out.stderr
    assert len(out.errors) == 1, out.lines
    assert expect in out.errors[0] and "; " in out.errors[0], out.errors[0]
    assert snapshot(m) == before
    assert not list(root_of(m).parent.glob(".driver.*"))
    assert not (m.root / "run/unbounded-nvidia-setup").exists()
    swap, unswap = root_moves(tr, m)
    first, again = ldconfig_starts(tr, m)
    assert swap < first < unswap < again, (swap, first, unswap, again)
    return out.errors[0]


def old_generation_whole(cli: Cli, m: simgpu.SimMachine) -> None:
    """The previous generation is live again with its links, linker cache and spec: check
    finds it out of date for the newer driver (and its kernel module), nothing else."""
    report = check_json(cli, m)
    assert "root-out-of-date" in codes(report)
    assert not codes(report) & {"root-missing-link", "root-wrong-link", "root-dangling-link",
                                "ldcache-stale", "spec-missing-host-path"}, report["problems"]


@pytest.mark.parametrize("first_boot", [True, False], ids=["first-boot", "swap"])
def test_ldconfig_failing_after_the_swap_puts_the_previous_state_back(
        m: simgpu.SimMachine, cli: Cli, tmp_path: Path, first_boot: bool) -> None:
    """The real ldconfig fails for real: the name of its temporary cache file is taken by
    a directory ("Can't create temporary cache file /etc/ld.so.cache~: Is a directory")."""
    if not first_boot:
        assert cli(m.root, "run").code == 0
        new_driver(m, tmp_path)
    before = snapshot(m)
    cache = m.root / "etc/ld.so.cache"
    cache_before = cache.read_bytes() if cache.exists() else None
    blocker = m.root / "etc/ld.so.cache~"
    blocker.mkdir()
    tr = traced(m.root, "run")
    error = rolled_back_around_ldconfig(tr, m, before, "ldconfig failed")
    assert "ld.so.cache~" in error
    assert any("after rolling back: ldconfig failed" in line for line in tr.outcome.lines)
    assert (cache.read_bytes() if cache.exists() else None) == cache_before
    if first_boot:
        assert not os.path.lexists(root_of(m)) and not spec_of(m).exists()
        assert not (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").exists()
    else:
        old_generation_whole(cli, m)
    blocker.rmdir()
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True


def test_ldconfig_hanging_after_the_swap_is_killed_and_the_previous_state_back(
        live: simgpu.SimMachine, cli: Cli, tmp_path: Path) -> None:
    """The real ldconfig hangs for real: a *.conf in /etc/ld.so.conf.d is a FIFO, which it
    blocks opening, as it would on a directory of a hung network filesystem. The run
    kills it after ldconfig_timeout_seconds, and the rollback's own ldconfig too."""
    new_driver(live, tmp_path)
    live.write_config(**FAST, ldconfig_timeout_seconds=1)
    before = snapshot(live)
    fifo = live.root / "etc/ld.so.conf.d/zz-on-a-hung-nfs.conf"
    os.mkfifo(fifo)
    tr = traced(live.root, "run")
    error = rolled_back_around_ldconfig(tr, live, before, "did not finish within 1 s")
    assert "ldconfig" in error
    assert any("after rolling back:" in line and "did not finish within 1 s" in line
               for line in tr.outcome.lines)
    # No ldconfig is left blocked on the FIFO: opening it for writing finds no reader.
    with pytest.raises(OSError) as e:
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert e.value.errno == errno.ENXIO
    fifo.unlink()
    old_generation_whole(cli, live)
    assert cli(live.root, "run").code == 0
    assert check_json(cli, live)["ok"] is True


# --------------------------------------------------------------------------------------
# The copy across filesystems: copy_file_range fails with EXDEV, sendfile copies


def strace_run(root: Path, syscalls: str) -> tuple[Outcome, list[Call]]:
    """`run` under strace -f -y, tracing only `syscalls` (threads and children too)."""
    with tempfile.TemporaryDirectory(prefix="unb-trace-") as tmp:
        out = Path(tmp) / "trace"
        argv = ["strace", "-f", "-qq", "-y", "-o", str(out), "-e", f"trace={syscalls}",
                *product_argv(root, "run")]
        proc = subprocess.run(argv, capture_output=True, text=True, env=product_env(),
                              stdin=subprocess.DEVNULL, timeout=120)
        calls = parse_calls(out.read_text(errors="surrogateescape"))
    assert "Traceback" not in proc.stderr, proc.stderr
    return Outcome(proc.returncode, proc.stdout, proc.stderr), calls


def fd_path(arg: str) -> str:
    m = re.fullmatch(r"\d+(<.*>)", arg)
    assert m, arg
    return unquote(m.group(1))


_GENERATION = re.compile(r"^.*/run/nvidia/\.driver\.[0-9a-f]+/")


def regular_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()}


def sendfile_copies(calls: list[Call]) -> dict[str, tuple[set[str], int]]:
    """Per file of the new generation (relative path): its sources and bytes sendfile'd."""
    copies: dict[str, tuple[set[str], int]] = {}
    for c in calls:
        if c.name == "sendfile":
            dest = _GENERATION.sub("", fd_path(c.args[0]))
            sources, total = copies.get(dest, (set(), 0))
            assert re.fullmatch(r"\d+", c.result), c
            copies[dest] = (sources | {fd_path(c.args[1])}, total + int(c.result))
    return copies


def test_copy_across_filesystems_falls_back_to_sendfile(m: simgpu.SimMachine,
                                                       mounts: list[Path],
                                                       tmp_path: Path) -> None:
    """The production layout: staging is the host's filesystem bind-mounted into the
    machine and /run a tmpfs, so copy_file_range fails with EXDEV (Linux does not copy
    across filesystems with it) and every file is copied with sendfile, in the kernel,
    byte for byte."""
    assert os.stat(m.staging[0]).st_dev == os.stat(m.root).st_dev
    mount_tmpfs(m.root / "run/nvidia", "size=256m")
    mounts.append(m.root / "run/nvidia")
    assert os.stat(m.root / "run/nvidia").st_dev != os.stat(m.staging[0]).st_dev
    out, calls = strace_run(m.root, "copy_file_range,sendfile")
    assert out.code == 0, out.stderr
    files = regular_files(root_of(m))
    attempts = [c for c in calls if c.name == "copy_file_range"]
    assert len(attempts) == len(files)  # one try per file, then sendfile for the rest
    assert all(c.result.startswith("-1 EXDEV") for c in attempts), attempts[:3]
    copies = sendfile_copies(calls)
    assert set(copies) == set(files)
    for rel, size in files.items():
        (source,), total = copies[rel]
        assert total == size, rel
        assert filecmp.cmp(root_of(m) / rel, source, shallow=False), rel
        assert Path(source).is_relative_to(m.root / "run/host-nvidia"), source
    assert check_json_ok(m)

    # The same machine with the root on the staging's filesystem: copy_file_range does
    # every copy and sendfile is never called (the trace tells the two paths apart).
    same = simgpu.make_machine(tmp_path / "same")
    same.write_config(**FAST)
    out, calls = strace_run(same.root, "copy_file_range,sendfile")
    assert out.code == 0, out.stderr
    assert not [c for c in calls if c.name == "sendfile"]
    assert all(re.fullmatch(r"\d+", c.result) for c in calls), calls[:3]


def check_json_ok(m: simgpu.SimMachine) -> bool:
    return bool(check_report(run_cli(m.root, "check", "--json"))["ok"])


# --------------------------------------------------------------------------------------
# extra_library_prefixes


def test_extra_library_prefixes_are_driver_files_for_discover_verify_and_check(
        m: simgpu.SimMachine, cli: Cli) -> None:
    """Tegra-style driver libraries (libnvrm_gpu.so, unversioned, SONAME = name; a
    versioned one with its SONAME link) carry no default driver prefix: only with
    extra_library_prefixes does discover take them, does the new root pass verification
    and does check accept them."""
    staging = m.staging[0]
    extra = {"libnvrm_gpu.so": "libnvrm_gpu.so",
             f"libnvrm_mem.so.{m.version}": "libnvrm_mem.so.1"}
    for name, soname in extra.items():
        elfbuild.compile_so(staging / name, soname, size=64 << 10)
    os.symlink(f"libnvrm_mem.so.{m.version}", staging / "libnvrm_mem.so.1")
    lib = root_of(m) / "lib" / MA

    assert cli(m.root, "run").code == 0
    assert not list(lib.glob("libnvrm*"))

    m.write_config(**FAST, extra_library_prefixes=["libnvrm_"])
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    for name in extra:
        copy = lib / name
        assert copy.is_file() and not copy.is_symlink(), name
        assert stat.S_IMODE(copy.stat().st_mode) == 0o644
        assert filecmp.cmp(copy, staging / name, shallow=False)
    assert os.readlink(lib / "libnvrm_mem.so.1") == f"libnvrm_mem.so.{m.version}"
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    section = report["driver_root"]
    assert isinstance(section, dict) and set(extra) <= set(section["libraries"])
    assert str(lib / f"libnvrm_mem.so.{m.version}") in spec_mounts(load_spec(m))

    # check judges the root by the key, not by what is there: without it these are
    # foreign files, and the next run takes them out.
    m.write_config(**FAST)
    report = check_json(cli, m)
    problems = report["problems"]
    assert isinstance(problems, list)
    foreign = {p["path"] for p in problems if p["code"] == "root-foreign-file"}
    assert foreign == {str(lib / n) for n in (*extra, "libnvrm_mem.so.1")}, problems
    assert cli(m.root, "run").code == 0
    assert not list(lib.glob("libnvrm*"))
    assert check_json(cli, m)["ok"] is True


# --------------------------------------------------------------------------------------
# The kernel module version from /sys/module/nvidia/version


def test_module_version_from_sys_module_when_proc_is_not_readable(m: simgpu.SimMachine,
                                                                  cli: Cli) -> None:
    """Without /proc/driver/nvidia/version the module version comes from
    /sys/module/nvidia/version, and it decides: staging holds the current 550 driver
    (which its libcuda.so.1 link names) and a complete stale 535; the module says 535."""
    stale = m.stale_versions[0]
    proc_version = m.root / "proc/driver/nvidia/version"
    proc_text = proc_version.read_text()
    proc_version.unlink()
    sys_version = m.root / "sys/module/nvidia/version"
    sys_version.parent.mkdir(parents=True)
    sys_version.write_text(f"{stale}\n")
    lib = root_of(m) / "lib" / MA

    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert f"kernel module version: {stale}" in out.stderr
    assert (lib / f"libcuda.so.{stale}").is_file()
    assert not list(lib.glob(f"*.{m.version}"))
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    assert (report["module_version"], report["driver_version"]) == (stale, stale)
    assert f"Kernel module:  {stale}" in cli(m.root, "status").stdout

    # /proc, when readable, comes first.
    proc_version.write_text(proc_text)
    assert cli(m.root, "run").code == 0
    assert (lib / f"libcuda.so.{m.version}").is_file()
    assert not list(lib.glob(f"*.{stale}"))
    # A /sys file that does not hold a version is no version: libcuda.so.1 decides.
    proc_version.unlink()
    sys_version.write_text("loaded\n")
    out = cli(m.root, "run")
    assert out.code == 0 and "kernel module version: not readable" in out.stderr
    assert "not rebuilt" in out.stderr
    assert check_json(cli, m)["module_version"] is None


# --------------------------------------------------------------------------------------
# "the new driver root failed verification": no staged input reaches it since issue 16.
# The two that did here (a DT_SONAME without ".so", a libcuda.so.<ver> without DT_SONAME)
# and every other the staging fuzz found are planning's now (tests/test_staging_errors.py,
# tests/test_staging_fuzz.py); a generation that still fails verification because a
# staged file was rewritten under the run is reported as that change
# (test_hostile.py::test_library_rewritten_in_place_keeping_its_mtime).


# --------------------------------------------------------------------------------------
# `status` while another process holds the lock


Holder = Callable[[simgpu.SimMachine, str], subprocess.Popen[str]]


@pytest.fixture
def holder() -> Iterator[Holder]:
    """Start a real flock(1) process holding the machine's lock (`exclusive` or
    `shared`) until its stdin is closed; returns once it holds it."""
    started: list[subprocess.Popen[str]] = []

    def hold(m: simgpu.SimMachine, mode: str) -> subprocess.Popen[str]:
        lock = m.root / "run/unbounded-nvidia-setup.lock"
        proc = subprocess.Popen(["flock", f"--{mode}", str(lock), "sh", "-c", "echo held; read x"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        return proc

    yield hold
    for proc in started:
        release(proc)


def release(proc: subprocess.Popen[str]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()
    proc.wait(timeout=30)


# The lock wait of the status tests: a status that waited for the lock would take all of it.
LOCK_WAIT = 60


def test_status_while_a_process_holds_the_lock_answers_at_once(
        live: simgpu.SimMachine, cli: Cli, holder: Holder) -> None:
    """`status` never waits for the lock (issue 16, point 3): with a lock wait of a minute,
    it answers within seconds, exit 0, saying a setup is in progress, and still shows the
    state it read."""
    live.write_config(**{**FAST, "lock_timeout_seconds": LOCK_WAIT})
    holder(live, "exclusive")
    start = time.monotonic()
    out = cli(live.root, "status", timeout=LOCK_WAIT)
    # Less than the lock wait it would sit out if it waited (no guess at this machine's
    # speed: a status that waits is seen by the wait's whole length).
    assert time.monotonic() - start < LOCK_WAIT
    assert out.code == 0 and out.errors == [], out.stderr
    assert "Waiting" not in out.stderr
    assert out.stdout.startswith("Setup:          in progress"), out.stdout
    assert f"Driver version: {live.version}" in out.stdout


@stand_in_only("hang on request")
def test_status_during_a_hung_run_answers_at_once(live: simgpu.SimMachine, cli: Cli,
                                                  tmp_path: Path) -> None:
    """A run stuck in nvidia-ctk holds the lock; `status` says so at once."""
    new_driver(live, tmp_path)
    live.write_config(**{**FAST, "lock_timeout_seconds": LOCK_WAIT, "nvidia_ctk_timeout_seconds": 0,
                         "run_timeout_seconds": 600})
    with subprocess.Popen(product_argv(live.root, "run"), stderr=subprocess.PIPE, text=True,
                          env=product_env({"FAKE_NVIDIA_CTK_HANG": "1"}),
                          stdin=subprocess.DEVNULL) as stuck:
        try:
            assert stuck.stderr is not None
            for line in stuck.stderr:
                if line.startswith("Generating the CDI spec"):
                    break
            else:
                pytest.fail("the run never reached nvidia-ctk")
            start = time.monotonic()
            out = cli(live.root, "status", timeout=LOCK_WAIT)
            assert time.monotonic() - start < LOCK_WAIT  # it did not wait for the lock
            assert stuck.poll() is None  # still holding the lock
        finally:
            for pid in processes_under(live.root):
                os.kill(pid, signal.SIGKILL)
    assert out.code == 0 and out.errors == [], out.stderr
    assert out.stdout.startswith("Setup:          in progress"), out.stdout
    wait_for_orphans(live.root)


def test_status_beside_a_shared_holder_does_not_wait(live: simgpu.SimMachine, cli: Cli,
                                                    holder: Holder) -> None:
    """A `check` holds the lock shared: no run is in progress."""
    holder(live, "shared")
    out = cli(live.root, "status")
    assert out.code == 0, out.stderr
    assert "Waiting" not in out.stderr
    assert out.stdout.startswith("Setup:          not running"), out.stdout
    assert f"Driver version: {live.version}" in out.stdout
    assert "Problems:       none" in out.stdout
