"""Discovery over real files: link resolution inside staging, ELF reading, hostile
staging entries."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from invariants import (
    assert_secure_root,
    secure_after,  # noqa: F401  (fixture)
    traced,
)
from unbounded_nvidia_setup.discover import resolve_inside_staging
from unbounded_nvidia_setup.elf import CorruptElf, read_elf

import elfbuild
import simgpu
from conftest import Cli, needs_root, needs_tool
from test_run import check_json, root_of

# The security invariants on every machine a test here ran the product on.
pytestmark = pytest.mark.usefixtures("secure_after")
MA = "x86_64-linux-gnu"


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    s = tmp_path / "run/host-nvidia/0"
    (s / "sub").mkdir(parents=True)
    (s / "libcuda.so.1.0").write_text("x")
    (s / "sub/libnvidia-x.so.1").write_text("x")
    (tmp_path / "outside").write_text("secret")
    return s


@pytest.mark.parametrize("link,target,expect", [
    ("libcuda.so.1", "libcuda.so.1.0", "libcuda.so.1.0"),
    ("l-sub", "sub/libnvidia-x.so.1", "sub/libnvidia-x.so.1"),
    ("l-dotdot-back", "sub/../libcuda.so.1.0", "libcuda.so.1.0"),
    ("l-abs-back", "/run/host-nvidia/0/libcuda.so.1.0", "libcuda.so.1.0"),
    ("l-escape", "../../../outside", None),
    ("l-abs-escape", "/outside", None),
    ("l-etc", "/etc/shadow", None),
    ("l-proc", "../../../../../../proc/self/environ", None),
    ("l-dangling", "nope", None),
    ("l-self", "l-self", None),
    ("l-dir", "sub", "sub"),
    ("l-base", ".", None),
])
def test_resolve_inside_staging(tmp_path: Path, staging: Path, link: str, target: str,
                        expect: str | None) -> None:
    os.symlink(target, staging / link)
    got = resolve_inside_staging(tmp_path, staging, link)
    assert got == (staging / expect if expect else None)


def test_resolve_inside_staging_loop_pair(tmp_path: Path, staging: Path) -> None:
    os.symlink("b", staging / "a")
    os.symlink("a", staging / "b")
    assert resolve_inside_staging(tmp_path, staging, "a") is None


def test_resolve_inside_staging_through_a_file(tmp_path: Path, staging: Path) -> None:
    assert resolve_inside_staging(tmp_path, staging, "libcuda.so.1.0/x") is None


def test_read_elf_of_real_objects(tmp_path: Path) -> None:
    elfbuild.compile_so(tmp_path / "a.so", "libcuda.so.1")
    elfbuild.compile_so(tmp_path / "nosoname.so", None)
    elfbuild.compile_exe(tmp_path / "exe")
    elfbuild.aarch64_so(tmp_path / "arm.so", "libcuda.so.1")
    elfbuild.elf32_so(tmp_path / "32.so", "libcuda.so.1")
    elfbuild.truncated_elf(tmp_path / "trunc.so")
    (tmp_path / "text").write_text("INPUT(libfoo.so.1)\n")
    (tmp_path / "empty").write_bytes(b"")

    def read(name: str) -> object:
        with open(tmp_path / name, "rb") as f:
            return read_elf(f)

    a = read("a.so")
    assert (a.bits, a.machine, a.kind, a.soname) == (64, "x86_64", "ET_DYN", "libcuda.so.1")  # type: ignore[attr-defined]
    assert read("nosoname.so").soname is None  # type: ignore[attr-defined]
    assert read("exe").kind in ("ET_EXEC", "ET_DYN")  # type: ignore[attr-defined]
    assert read("arm.so").machine == "aarch64"  # type: ignore[attr-defined]
    assert read("32.so").bits == 32  # type: ignore[attr-defined]
    assert read("text") is None and read("empty") is None
    with pytest.raises(CorruptElf):
        read("trunc.so")


@needs_root
def test_hostile_staging_gives_a_correct_root(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root", hostile=True)
    m.write_config()
    out = cli(m.root, "-v", "run")
    assert out.code == 0, out.stderr
    root = root_of(m)
    assert_secure_root(root)
    lib = root / "lib" / MA
    present = {str(p.relative_to(lib)) for p in lib.rglob("*")}
    for name in m.expected_libs:
        assert name in present
    for name in m.hostile:
        assert name not in present, name
    for name in m.optional_libs:  # spaces and newlines are never driver names
        assert name not in present, name
    setuid = lib / f"libnvidia-setuid.so.{m.version}"
    if setuid.exists():
        assert oct(setuid.stat().st_mode & 0o7777) == oct(0o644)
    # Nothing outside staging was read into the root: no file holds the text of
    # /etc/shadow, which a staged link names.
    secret = Path("/etc/shadow").read_bytes().strip()
    assert secret, "/etc/shadow is empty here: nothing to look for"
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            leaked = secret in path.read_bytes()  # not in the assertion: no secret in logs
            assert not leaked, f"{path} holds the text of /etc/shadow"
    assert check_json(cli, m)["ok"] is True
    # The log names what it skipped, each on one line.
    assert all("\n" not in line for line in out.lines)
    assert "ignoring" in out.stderr


@needs_root
@needs_tool("strace")
def test_special_files_named_like_libraries_are_never_opened_for_reading(
        tmp_path: Path) -> None:
    """A FIFO, a socket and device nodes named like libraries: the run may look at them
    with O_PATH and fstat, which runs no driver code and wakes no writer, but never opens
    them otherwise. Seen in the trace: a FIFO opened O_RDONLY|O_NONBLOCK does not block,
    and /dev/zero's or a loop device's numbers read like empty files, so the outcome alone
    would not show it."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    lib = m.staging[0]
    fifo = lib / f"libnvidia-fifo.so.{m.version}"
    os.mkfifo(fifo)
    chardev = lib / f"libnvidia-zero.so.{m.version}"
    os.mknod(chardev, stat.S_IFCHR | 0o644, os.makedev(1, 5))
    blockdev = lib / f"libnvidia-loop.so.{m.version}"
    os.mknod(blockdev, stat.S_IFBLK | 0o644, os.makedev(7, 0))
    sock = lib / f"libnvidia-sock.so.{m.version}"
    s = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(lib)  # socket paths are limited to 108 bytes
    try:
        s.bind(sock.name)
    finally:
        os.chdir(cwd)
    tr = traced(m.root, "run", timeout=60)
    s.close()
    assert tr.outcome.code == 0, tr.outcome.stderr
    for special in (fifo, chardev, blockdev, sock):
        assert tr.opened(special) == [], f"{special.name} was opened"
        assert not (root_of(m) / "lib" / MA / special.name).exists()
    # They were looked at (O_PATH), just not opened: the check above is not vacuous.
    looked_at = {c.args[1] for c in tr.calls if c.name == "openat" and len(c.args) > 2
                 and "O_PATH" in c.args[2]}
    assert {f'"{p}"' for p in (fifo, chardev, blockdev, sock)} <= looked_at


@needs_root
def test_aarch64_machine_builds_an_aarch64_root(tmp_path: Path, cli: Cli,
                                                aarch64_ldconfig: str) -> None:
    """With arch forced to aarch64, aarch64 libraries make lib/aarch64-linux-gnu and the
    real arm64 ldconfig (under qemu) puts every SONAME in the cache as (libc6,AArch64)."""
    m = simgpu.make_machine(tmp_path / "root")
    for lib in m.staging[0].glob("lib*.so.*"):
        if not lib.is_symlink():
            with open(lib, "rb") as f:
                info = read_elf(f)
            if info is not None and info.machine == "x86_64":
                elfbuild.aarch64_so(lib.parent / lib.name, info.soname or lib.name)
    simgpu.debian_linker_files(m.root, "aarch64-linux-gnu")  # Debian's arm64 conf files
    # Management mode: the x86_64 stand-in cannot load an aarch64 NVML.
    m.write_config(arch="aarch64", ldconfig=aarch64_ldconfig,
                   nvidia_ctk_args=["--mode=management"])
    out = cli(m.root, "run")
    # Helpers stay x86_64 here, so they are left out; libraries are aarch64.
    assert out.code == 0, out.stderr
    lib = root_of(m) / "lib/aarch64-linux-gnu"
    assert (lib / f"libcuda.so.{m.version}").is_file()
    assert not (root_of(m) / "lib" / MA).exists()
    assert "aarch64-linux-gnu" in (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
                                   ).read_text()
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    # What the machine's loader reads, independent of `check`'s own parsing.
    cache = subprocess.run([aarch64_ldconfig, "-p", "-C", str(m.root / "etc/ld.so.cache")],
                           capture_output=True, text=True, check=True).stdout
    assert ("\tlibcuda.so.1 (libc6,AArch64) => /run/nvidia/driver/lib/aarch64-linux-gnu/"
            "libcuda.so.1") in cache.splitlines()


# Each kernel module's /proc/driver/nvidia/version, as simgpu writes it (the real
# formats: the proprietary nvidia.ko's banner, and the open modules' "Open Kernel Module
# for <arch> ... Release Build (builder) <date>", what GB300 hosts run), and lines seen
# from real hosts beside them.
MODULE_LINES = [
    *((simgpu.module_version_text("550.127.05", flavor, arch), "550.127.05")
      for flavor in simgpu.MODULE_FLAVORS for arch in ("x86_64", "aarch64")),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  Release Build  "
     "(dvs-builder@U22-I3-B17-02-5)  Tue Sep 23 09:55:41 UTC 2025\n"
     "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04) \n", "580.95.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  610.43.02\n", "610.43.02"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.309.01  Thu Jul 10 2025\n",
     "535.309.01"),
    # No number where the version goes (a development build): nothing to trust.
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  TempVersion  Release Build  "
     "(bugfix_main)  (buildbrain@x)  Tue Dec 30 15:54:35 PST 2025\n", None),
]


@pytest.mark.parametrize(("text", "version"), MODULE_LINES)
def test_module_version_from_either_kernel_module(tmp_path: Path, text: str,
                                                  version: str | None) -> None:
    from unbounded_nvidia_setup.config import Config, Machine
    from unbounded_nvidia_setup.discover import module_version

    proc = tmp_path / "proc/driver/nvidia/version"
    proc.parent.mkdir(parents=True)
    proc.write_text(text)
    assert module_version(Machine(root=tmp_path, config=Config(), arch="x86_64")) == version


def test_simulated_machines_carry_both_kernel_modules(tmp_path: Path) -> None:
    """The default machine runs the open module, a 535 one the proprietary one, so both
    lines go through every scenario that reads the module version."""
    for version, banner in (("550.127.05", "Open Kernel Module for x86_64  550.127.05  "),
                            ("535.183.01", "NVIDIA UNIX x86_64 Kernel Module  535.183.01  ")):
        m = simgpu.make_machine(tmp_path / version, version, stale_versions=(), unrelated=0,
                                helpers=False, firmware=False, toolkit_libs=False)
        text = (m.root / "proc/driver/nvidia/version").read_text()
        assert text.startswith(f"NVRM version: NVIDIA UNIX {banner}"[:13]) and banner in text
