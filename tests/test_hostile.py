"""The hostile staging corpus (issue 4, item 5): one test per hostile input.

Every test runs the real `run` under ``strace -f`` (invariants.traced) and asserts that

* nothing outside the driver files is copied, linked or opened for writing: every path
  the process tree created, wrote, renamed, linked, deleted or chmod'ed is in the set the
  tool may touch (invariants.write_violations), every symlink it made is relative;
* the hostile target itself (/etc/shadow, /proc/self/..., a FIFO, a device node, a
  decoy outside staging) is never opened, not even for reading (O_PATH does not count:
  it runs no driver code and reads nothing);
* the run ends with a correct root (exactly the expected driver files, `check` clean) or
  with one clear error line and the live state unchanged;

and, through the `secure_after` fixture, the security invariants of the machine.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import yaml

from check_schema import check_report
from invariants import (
    Traced,
    parse_calls,
    run_cli,
    secure_after,  # noqa: F401  (fixture)
    spec_host_paths,
    symlink_targets,
    traced,
    write_violations,
)
from unbounded_nvidia_setup.discover import Inspected, Staged
from unbounded_nvidia_setup.elf import ElfInfo, read_elf
from unbounded_nvidia_setup.plan import soname_problem

import drivertables
import elfbuild
import elfmutate
import realdriver
import simgpu
from conftest import Outcome, needs_root, needs_tool
from realmachine import real_machine
from test_realdriver import fetch
from test_run import snapshot

pytestmark = [
    needs_root,
    needs_tool("strace"),
    pytest.mark.usefixtures("secure_after"),
]
MA = simgpu.MULTIARCH
SECRETS = ("/etc/shadow", "/etc/gshadow", "/proc/self/environ", "/proc/self/mem")


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config(staging_wait_seconds=0, lock_timeout_seconds=5)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine) -> simgpu.SimMachine:
    """After one good run: the state a refused run must leave alone."""
    assert run_cli(m.root, "run").code == 0
    return m


def name(m: simgpu.SimMachine, stem: str) -> str:
    return f"libnvidia-{stem}.so.{m.version}"


def confined(tr: Traced, m: simgpu.SimMachine, tmp_path: Path,
             never_opened: tuple[Path | str, ...] = ()) -> None:
    """Nothing written outside the allowed set, no absolute link made, no secret and
    none of `never_opened` opened."""
    assert write_violations(tr, m.root, forbidden=tmp_path) == []
    for link, target in symlink_targets(tr.calls):
        assert not target.startswith("/"), (link, target)
    for path in (*SECRETS, *(m.root / s.lstrip("/") for s in SECRETS), *never_opened):
        assert not tr.opened(path), f"{path} was opened"


def correct_root(m: simgpu.SimMachine, *, extra: tuple[str, ...] = (),
                 missing: tuple[str, ...] = (), helpers: list[str] | None = None) -> None:
    """The root holds exactly the expected driver files, and `check` finds nothing."""
    lib = m.driver_lib_dir
    files = {str(p.relative_to(lib)) for p in lib.rglob("*") if p.is_file()
             and not p.is_symlink()}
    assert files == (set(m.expected_libs) - set(missing)) | set(extra)
    bins = {p.name for p in (m.driver_root / "usr/bin").iterdir()}
    assert bins == set(m.helpers if helpers is None else helpers)
    report = check_report(run_cli(m.root, "check", "--json"))
    assert report["ok"] is True, report["problems"]


def succeeded(tr: Traced, m: simgpu.SimMachine, tmp_path: Path, **kwargs: object) -> None:
    assert tr.outcome.code == 0, tr.outcome.stderr
    assert not tr.outcome.errors
    assert not list(m.driver_root.parent.glob(".driver.*"))
    correct_root(m, **kwargs)  # type: ignore[arg-type]


def refused(tr: Traced, m: simgpu.SimMachine, before: object, expect: str,
            code: int = 1) -> str:
    """One clear line, the right exit code, the live state exactly as before."""
    out = tr.outcome
    assert out.code == code, out.stderr
    assert len(out.errors) == 1, out.lines
    assert expect in out.errors[0] and "; " in out.errors[0], out.errors[0]
    assert snapshot(m) == before
    assert not list(m.driver_root.parent.glob(".driver.*"))
    assert not (m.root / "run/unbounded-nvidia-setup").exists()
    return out.errors[0]


def run_traced(m: simgpu.SimMachine, **kwargs: object) -> Traced:
    return traced(m.root, "run", **kwargs)  # type: ignore[arg-type]


def up_to_fs_root(directory: Path) -> str:
    """A relative path from `directory` to the real / (enough ../ to get there)."""
    return "../" * len(directory.resolve().parts)


# --------------------------------------------------------------------------------------
# Links


def test_symlink_loop_pair(m: simgpu.SimMachine, tmp_path: Path) -> None:
    lib = m.lib_dir
    os.symlink(name(m, "loopb"), lib / name(m, "loopa"))
    os.symlink(name(m, "loopa"), lib / name(m, "loopb"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_symlink_to_itself(m: simgpu.SimMachine, tmp_path: Path) -> None:
    os.symlink(name(m, "self"), m.lib_dir / name(m, "self"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_symlink_chain_longer_than_the_kernel_follows(m: simgpu.SimMachine,
                                                     tmp_path: Path) -> None:
    """45 hops to a real driver library: more than the 40 the kernel (and the tool) follow."""
    lib = m.lib_dir
    hops = [name(m, f"chain{i}") for i in range(45)]
    for here, there in zip(hops, [*hops[1:], f"libnvidia-cfg.so.{m.version}"], strict=True):
        os.symlink(there, lib / here)
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert not [p for p in m.driver_lib_dir.iterdir() if "chain" in p.name]


def test_absolute_link_to_etc_shadow(m: simgpu.SimMachine, tmp_path: Path) -> None:
    os.symlink("/etc/shadow", m.lib_dir / name(m, "shadow"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_relative_link_escaping_to_etc_shadow(m: simgpu.SimMachine, tmp_path: Path) -> None:
    os.symlink(up_to_fs_root(m.lib_dir) + "etc/shadow", m.lib_dir / name(m, "shadow"))
    # The same through the vdpau/ subdir, which is scanned too.
    os.symlink(up_to_fs_root(m.lib_dir / "vdpau") + "etc/shadow",
               m.lib_dir / "vdpau" / f"libvdpau_nvidia.so.{m.version}.1")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_relative_link_escaping_to_proc_self_environ(m: simgpu.SimMachine,
                                                     tmp_path: Path) -> None:
    os.symlink(up_to_fs_root(m.lib_dir) + "proc/self/environ", m.lib_dir / name(m, "environ"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_absolute_links_into_proc_self(m: simgpu.SimMachine, tmp_path: Path) -> None:
    os.symlink("/proc/self/mem", m.lib_dir / name(m, "mem"))
    os.symlink("/proc/self/fd/0", m.lib_dir / name(m, "stdin"))
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=("/proc/self/fd/0",))
    succeeded(tr, m, tmp_path)


def test_link_into_a_sibling_staging_dir(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """A link may not leave its own staging dir, not even for another staging dir."""
    assert m.bin_dir is not None
    os.symlink("../1/nvidia-smi", m.lib_dir / name(m, "sibling"))
    os.symlink("../0/nvidia-smi-copy", m.bin_dir / "nvidia-imex")  # a helper name
    shutil.copy(m.bin_dir / "nvidia-smi", m.lib_dir / "nvidia-smi-copy")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_absolute_link_inside_staging_pointing_back_into_staging(m: simgpu.SimMachine,
                                                                 tmp_path: Path) -> None:
    """A machine-absolute link back into its staging dir is followed (as the kernel would
    inside the machine) and becomes a relative link; a host-absolute one means nothing in
    the machine and is skipped. With no module version the links decide the version."""
    lib = m.lib_dir
    (m.root / "proc/driver/nvidia/version").unlink()
    (lib / "libnvidia-ml.so.1").unlink()
    os.symlink(f"/run/host-nvidia/0/libnvidia-ml.so.{m.version}", lib / "libnvidia-ml.so.1")
    os.symlink(str((lib / f"libnvidia-cfg.so.{m.version}").resolve()), lib / name(m, "absback"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert os.readlink(m.driver_lib_dir / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{m.version}"
    assert not (m.driver_lib_dir / name(m, "absback")).exists()


def test_vdpau_subdir_is_a_link_out_of_staging(m: simgpu.SimMachine, tmp_path: Path) -> None:
    decoy = tmp_path / "decoy-vdpau"
    shutil.move(m.lib_dir / "vdpau", decoy)
    os.symlink(os.path.relpath(decoy, m.lib_dir), m.lib_dir / "vdpau")
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=tuple(decoy.iterdir()))
    succeeded(tr, m, tmp_path, missing=tuple(n for n in m.expected_libs if "vdpau/" in n))


def test_firmware_dir_is_a_link_out_of_staging(m: simgpu.SimMachine, tmp_path: Path) -> None:
    assert m.firmware_dir is not None
    decoy = tmp_path / "decoy-firmware"
    shutil.move(m.firmware_dir / "nvidia" / m.version, decoy)
    os.symlink(str(decoy), m.firmware_dir / "nvidia" / m.version)
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=tuple(decoy.iterdir()))
    succeeded(tr, m, tmp_path)
    assert not (m.driver_root / "lib/firmware").exists()


def test_hard_link_to_a_secret_named_like_a_driver_library(m: simgpu.SimMachine,
                                                           tmp_path: Path) -> None:
    """A hard link is a regular file of the staging dir: it is read (4 bytes of ELF magic)
    and, not being ELF, never copied."""
    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash:19000:0:99999:7:::\n")
    os.link(secret, m.lib_dir / name(m, "secret"))
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    for path in m.driver_root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert b"$6$hash" not in path.read_bytes()


# --------------------------------------------------------------------------------------
# Entries that are not regular files


def test_fifo_named_like_a_driver_library(m: simgpu.SimMachine, tmp_path: Path) -> None:
    fifo = m.lib_dir / name(m, "fifo")
    os.mkfifo(fifo)
    tr = run_traced(m, timeout=60)
    confined(tr, m, tmp_path, never_opened=(fifo,))
    succeeded(tr, m, tmp_path)


def test_fifo_in_place_of_a_required_library(live: simgpu.SimMachine, tmp_path: Path) -> None:
    fifo = live.lib_dir / f"libnvidia-ml.so.{live.version}"
    fifo.unlink()
    os.mkfifo(fifo)
    before = snapshot(live)
    tr = run_traced(live, timeout=60)
    confined(tr, live, tmp_path, never_opened=(fifo,))
    refused(tr, live, before, f"incomplete driver state: libnvidia-ml.so.{live.version}")


def test_socket_named_like_a_driver_library(m: simgpu.SimMachine, tmp_path: Path) -> None:
    simgpu._make_socket(m.lib_dir, name(m, "socket"))
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=(m.lib_dir / name(m, "socket"),))
    succeeded(tr, m, tmp_path)


def test_character_device_named_like_a_driver_library(m: simgpu.SimMachine,
                                                      tmp_path: Path) -> None:
    """/dev/zero's numbers: a tool that reads it never stops; one that opens a device
    runs its driver's open (think watchdog)."""
    dev = m.lib_dir / name(m, "zero")
    os.mknod(dev, stat.S_IFCHR | 0o644, os.makedev(1, 5))
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=(dev,))
    succeeded(tr, m, tmp_path)


def test_block_device_named_like_a_driver_library(m: simgpu.SimMachine,
                                                  tmp_path: Path) -> None:
    dev = m.lib_dir / name(m, "loop")
    os.mknod(dev, stat.S_IFBLK | 0o644, os.makedev(7, 0))
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=(dev,))
    succeeded(tr, m, tmp_path)


def test_directory_named_like_a_driver_library(m: simgpu.SimMachine, tmp_path: Path) -> None:
    directory = m.lib_dir / name(m, "dir")
    directory.mkdir()
    elfbuild.compile_so(directory / name(m, "indir"), "libnvidia-indir.so.1")
    (m.lib_dir / "vdpau" / f"libvdpau_nvidia.so.{m.version}.d").mkdir()
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=(directory / name(m, "indir"),))
    succeeded(tr, m, tmp_path)


def test_directory_named_like_a_helper(m: simgpu.SimMachine, tmp_path: Path) -> None:
    assert m.bin_dir is not None
    helper = m.bin_dir / "nvidia-debugdump"
    helper.unlink()
    helper.mkdir()
    elfbuild.compile_exe(helper / "nvidia-debugdump")
    tr = run_traced(m)
    confined(tr, m, tmp_path, never_opened=(helper / "nvidia-debugdump",))
    succeeded(tr, m, tmp_path, helpers=[h for h in m.helpers if h != "nvidia-debugdump"])


# --------------------------------------------------------------------------------------
# Regular files that are not driver libraries


def test_truncated_elf_with_a_driver_name(live: simgpu.SimMachine, tmp_path: Path) -> None:
    elfbuild.truncated_elf(live.lib_dir / name(live, "truncated"))
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    refused(tr, live, before, "damaged ELF file")


def test_zero_length_file_with_a_driver_name(m: simgpu.SimMachine, tmp_path: Path) -> None:
    (m.lib_dir / name(m, "empty")).write_bytes(b"")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_zero_length_file_in_place_of_libcuda(live: simgpu.SimMachine, tmp_path: Path) -> None:
    os.truncate(live.lib_dir / f"libcuda.so.{live.version}", 0)
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    refused(tr, live, before, f"incomplete driver state: libcuda.so.{live.version}")


def test_non_elf_files_with_driver_names(m: simgpu.SimMachine, tmp_path: Path) -> None:
    (m.lib_dir / name(m, "ldscript")).write_text("/* GNU ld script */\nINPUT(libcuda.so.1)\n")
    (m.lib_dir / name(m, "random")).write_bytes(os.urandom(4096))
    (m.lib_dir / name(m, "magic")).write_bytes(b"\x7fEL")  # shorter than the magic
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_32bit_elf_with_a_driver_name(m: simgpu.SimMachine, tmp_path: Path) -> None:
    elfbuild.elf32_so(m.lib_dir / name(m, "elf32"), "libnvidia-elf32.so.1")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


def test_32bit_elf_in_place_of_libcuda(live: simgpu.SimMachine, tmp_path: Path) -> None:
    elfbuild.elf32_so(live.lib_dir / f"libcuda.so.{live.version}", "libcuda.so.1")
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    refused(tr, live, before, f"incomplete driver state: libcuda.so.{live.version}")


def test_foreign_architecture_elf_with_a_driver_name(m: simgpu.SimMachine,
                                                     tmp_path: Path) -> None:
    elfbuild.aarch64_so(m.lib_dir / name(m, "arm"), "libnvidia-arm.so.1")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)


# --------------------------------------------------------------------------------------
# Hostile ELF contents: DT_SONAME becomes a link name in the root


def test_soname_with_a_path_traversal(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """DT_SONAME `../../../../../etc/evil`: the SONAME link would be made outside the
    root (a symlink in <root>/etc). The library is left out with a warning."""
    elfbuild.compile_so(m.lib_dir / name(m, "evil"), "../../../../../etc/evil")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert not os.path.lexists(m.root / "etc/evil")
    assert any("DT_SONAME" in line for line in tr.outcome.lines)


def test_soname_naming_another_library(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """A library claiming to be libcuda.so.1 (or libc.so.6) shadows nothing and adds no
    foreign link to the root."""
    elfbuild.compile_so(m.lib_dir / name(m, "fakecuda"), "libcuda.so.1")
    elfbuild.compile_so(m.lib_dir / name(m, "fakelibc"), "libc.so.6")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert os.readlink(m.driver_lib_dir / "libcuda.so.1") == f"libcuda.so.{m.version}"
    assert not os.path.lexists(m.driver_lib_dir / "libc.so.6")


def test_soname_with_a_newline(m: simgpu.SimMachine, tmp_path: Path) -> None:
    elfbuild.compile_so(m.lib_dir / name(m, "nl"), "libnvidia-nl.so.1\nlibc.so.6")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert not [line for line in tr.outcome.lines if line.startswith("libc.so.6")]


def fake_lib(name: str, soname: str | None) -> Inspected:
    return Inspected(Staged(0, Path("/s") / name, ""), ElfInfo(64, "x86_64", "ET_DYN", soname),
                     size=1, mtime_ns=1, dev=1, ino=1)


@pytest.mark.parametrize("file,soname,problem", [
    ("libcuda.so.550.127.05", "libcuda.so.1", None),
    ("libnvidia-gpucomp.so.550.127.05", "libnvidia-gpucomp.so.550.127.05", None),
    ("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1", None),
    ("libnvidia-vulkan-producer.so.535.183.01", None, None),
    ("libnvidia-x.so.1", "../../etc/x", "is not a plain file name"),
    ("libnvidia-x.so.1", "..", "is not a plain file name"),
    ("libnvidia-x.so.1", "libnvidia-x.so.1\n", "is not a plain file name"),
    ("libnvidia-x.so.1", "libcuda.so.1", "is not a name of this library"),
    ("libnvidia-x.so.1", "libc.so.6", "is not a name of this library"),
    # issue 16: each of these once made a root that failed its own verification
    ("libnvidia-x.so.1", "libnvidia-x", "is not a library name (no .so in it)"),
    ("libnvidia-x.so.1", "libnvidia-x.so." + "1" * 250,
     "is longer than a file name can be (255 bytes)"),
    ("libcuda.so.550.127.05.bak", "libcuda.so",
     "is the linker name the driver root links to libcuda.so.1"),
])
def test_soname_rule(file: str, soname: str | None, problem: str | None) -> None:
    assert soname_problem(fake_lib(file, soname)) == problem


# --------------------------------------------------------------------------------------
# Modes, owners, names


def test_setuid_setgid_world_writable_and_foreign_owned_sources(m: simgpu.SimMachine,
                                                               tmp_path: Path) -> None:
    assert m.bin_dir is not None and m.firmware_dir is not None
    cuda = m.lib_dir / f"libcuda.so.{m.version}"
    os.chown(cuda, 1000, 1000)  # (chown clears set-id bits: chmod after it)
    cuda.chmod(0o6777)
    smi = m.bin_dir / "nvidia-smi"
    os.chown(smi, 1000, 1000)
    smi.chmod(0o6755)
    fw = next((m.firmware_dir / "nvidia" / m.version).iterdir())
    fw.chmod(0o4666)
    (m.lib_dir / "vdpau").chmod(0o777)
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert stat.S_IMODE((m.driver_lib_dir / cuda.name).stat().st_mode) == 0o644
    assert stat.S_IMODE((m.driver_root / "usr/bin/nvidia-smi").stat().st_mode) == 0o755
    # The sources are left as they were: the tool never changes staging.
    assert stat.S_IMODE(cuda.stat().st_mode) == 0o6777 and cuda.stat().st_uid == 1000


def test_names_with_spaces_and_newlines(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """Valid libraries, but such names would go into every GPU pod's mount list: they
    are skipped with one warning line each, the newline shown as \\n."""
    for stem in ("with space", "new\nline", "tab\there"):
        elfbuild.compile_so(m.lib_dir / name(m, stem), f"libnvidia-{stem}.so.1")
    elfbuild.compile_so(m.lib_dir / f"libcuda.so.{m.version}\nx", "libcuda.so.1")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    warnings = [line for line in tr.outcome.lines if "not a plain file name" in line]
    assert len(warnings) == 4, tr.outcome.lines
    assert not [line for line in tr.outcome.lines if line.startswith(("line.so", "x", "here"))]


def test_very_long_names(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """255 bytes, the longest name a Linux filesystem holds: a valid library under such a
    name is a driver library like any other, with its SONAME link."""
    pad = 255 - len(f"libnvidia-.so.{m.version}")
    long_name = f"libnvidia-{'x' * pad}.so.{m.version}"
    assert len(long_name) == 255
    soname = f"libnvidia-{'x' * pad}.so.1"
    elfbuild.compile_so(m.lib_dir / long_name, soname)
    junk = f"libnvidia-{'y' * pad}.so.{m.version}"
    (m.lib_dir / junk).write_text("not ELF")
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path, extra=(long_name,))
    assert os.readlink(m.driver_lib_dir / soname) == long_name
    doc = yaml.safe_load((m.root / "etc/cdi/nvidia.yaml").read_text())
    assert str(m.driver_lib_dir / long_name) in spec_host_paths(doc)[0]


# --------------------------------------------------------------------------------------
# Several drivers


NEWER = "560.35.03"


def add_driver_set(m: simgpu.SimMachine, version: str) -> None:
    """Every driver library of another version, as regular files without links."""
    for entry in drivertables.DRIVER_LIBS:
        fname = entry.name.format(ver=version)
        sub = f"{entry.subdir}/" if entry.subdir else ""
        if "{ver}" in entry.name:
            elfbuild.compile_so(m.lib_dir / sub / fname, simgpu._fmt(entry.soname, version))


def test_two_driver_versions_with_a_module_version(m: simgpu.SimMachine,
                                                   tmp_path: Path) -> None:
    """Userspace of a newer driver installed on the host, kernel module not reloaded yet:
    the module's version wins, every file of the other version stays out."""
    add_driver_set(m, NEWER)
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert not [p for p in m.driver_root.rglob(f"*{NEWER}*")]


def test_two_driver_versions_without_a_module_version(m: simgpu.SimMachine,
                                                      tmp_path: Path) -> None:
    """No /proc/driver/nvidia/version: the host's libcuda.so.1 link names the driver."""
    add_driver_set(m, NEWER)
    (m.root / "proc/driver/nvidia/version").unlink()
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert not [p for p in m.driver_root.rglob(f"*{NEWER}*")]


def test_two_driver_versions_without_module_version_or_links(live: simgpu.SimMachine,
                                                             tmp_path: Path) -> None:
    add_driver_set(live, NEWER)
    (live.root / "proc/driver/nvidia/version").unlink()
    for link in ("libcuda.so.1", "libnvidia-ml.so.1", "libcuda.so", "libnvidia-ml.so"):
        (live.lib_dir / link).unlink()
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    error = refused(tr, live, before, "cannot tell the driver version")
    assert live.version in error and NEWER in error


def test_module_version_without_its_driver_files(live: simgpu.SimMachine,
                                                 tmp_path: Path) -> None:
    version_file = live.root / "proc/driver/nvidia/version"
    version_file.write_text(version_file.read_text().replace(live.version, NEWER))
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    refused(tr, live, before, f"incomplete driver state: libcuda.so.{NEWER}")


# --------------------------------------------------------------------------------------
# The staging dir itself, and files changing under the run


def test_staging_dir_replaced_by_a_symlink(live: simgpu.SimMachine, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(live.lib_dir, elsewhere)
    os.symlink(elsewhere, live.lib_dir)
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path)
    refused(tr, live, before, "is a symlink, not a directory")
    assert not [x for x in tr.accesses if x.path.startswith(f"{elsewhere}/")]


def start_when_copying(m: simgpu.SimMachine, name: str, action: object) -> object:
    """A `during` callback: wait until the run has created the copy of `name` in its new
    generation (so the source is open and was checked, and the copy waits in strace's
    delay), then act."""

    def during() -> None:
        deadline = time.monotonic() + 60
        pattern = f".driver.*/lib/{MA}/{name}"
        while not list(m.driver_root.parent.glob(pattern)):
            assert time.monotonic() < deadline, "the run never started copying"
            time.sleep(0.01)
        action()  # type: ignore[operator]

    return during


# Every worker thread's first copy waits 1.5 s in the kernel-entry of copy_file_range,
# after the source was opened and checked: the window in which the tests change it.
DELAY_FIRST_COPY = "copy_file_range:delay_enter=1500000:when=1"


def test_staging_dir_swapped_for_a_symlink_during_the_copy(m: simgpu.SimMachine,
                                                           tmp_path: Path) -> None:
    """Files opened after the swap come from elsewhere: the identity check (device,
    inode, size, mtime recorded at inspection) catches it."""
    elfbuild.compile_so(m.lib_dir / f"libcuda.so.{m.version}", "libcuda.so.1", size=8 << 20)
    copy = tmp_path / "copy-of-0"
    shutil.copytree(m.lib_dir, copy, symlinks=True)

    def swap() -> None:
        os.rename(m.lib_dir, tmp_path / "original-0")
        os.symlink(copy, m.lib_dir)

    tr = run_traced(m, inject=DELAY_FIRST_COPY,
                    during=start_when_copying(m, f"libcuda.so.{m.version}", swap))
    os.unlink(m.lib_dir)
    os.rename(tmp_path / "original-0", m.lib_dir)
    confined(tr, m, tmp_path)
    assert tr.outcome.code == 1, tr.outcome.stderr
    assert len(tr.outcome.errors) == 1 and "changed" in tr.outcome.errors[0]
    assert not os.path.lexists(m.driver_root)
    assert not list(m.driver_root.parent.glob(".driver.*"))


@pytest.mark.parametrize("change", ["grow", "shrink", "replace"])
def test_library_changing_while_being_copied(m: simgpu.SimMachine, tmp_path: Path,
                                             change: str) -> None:
    """libcuda (the largest file, copied first) changes while its copy waits in the
    kernel: growing or shrinking fails the run ("changed"); a new file renamed over it
    leaves the copy reading the inode it opened: a correct root of what was inspected."""
    cuda = m.lib_dir / f"libcuda.so.{m.version}"
    elfbuild.compile_so(cuda, "libcuda.so.1", size=8 << 20)
    original = cuda.read_bytes()

    def act() -> None:
        if change == "grow":
            with open(cuda, "ab") as f:
                f.write(b"\0" * 4096)
        elif change == "shrink":
            os.truncate(cuda, len(original) // 2)
        else:
            elfbuild.compile_so(m.lib_dir / ".new", "libcuda.so.1", size=9 << 20)
            os.rename(m.lib_dir / ".new", cuda)

    tr = run_traced(m, inject=DELAY_FIRST_COPY, during=start_when_copying(m, cuda.name, act))
    confined(tr, m, tmp_path)
    if change == "replace":
        assert tr.outcome.code == 0, tr.outcome.stderr
        assert (m.driver_lib_dir / cuda.name).read_bytes() == original
        out = run_cli(m.root, "run")  # the next run picks the new file up
        assert out.code == 0 and (m.driver_lib_dir / cuda.name).stat().st_size == 9 << 20
        return
    assert tr.outcome.code == 1, tr.outcome.stderr
    assert len(tr.outcome.errors) == 1, tr.outcome.lines
    assert "changed while being copied" in tr.outcome.errors[0]
    assert not os.path.lexists(m.driver_root)
    assert not list(m.driver_root.parent.glob(".driver.*"))


def test_library_rewritten_in_place_keeping_its_mtime(m: simgpu.SimMachine,
                                                      tmp_path: Path) -> None:
    """libcuda's DT_SONAME rewritten in place while its copy waits in the kernel, and its
    mtime put back: inode, size and mtime are what the run inspected, so the copy's
    identity check passes, but the copy's ELF headers differ from the plan's. That is the
    host changing its driver, not a bug (issue 16; before, the run ended in "the new
    driver root failed verification (...); this is a bug")."""
    cuda = m.lib_dir / f"libcuda.so.{m.version}"
    elfbuild.compile_so(cuda, "libcuda.so.1", size=8 << 20)
    data = cuda.read_bytes()
    lay = elfmutate.layout(data)
    entry = lay.first(elfmutate.DT_SONAME)
    assert entry is not None and lay.strtab is not None
    at = lay.strtab + entry.value
    assert data[at:at + 13] == b"libcuda.so.1\0"
    before = cuda.stat()

    def rewrite() -> None:
        with open(cuda, "r+b") as f:
            f.seek(at)
            f.write(b"libcuda.so.2")
        os.utime(cuda, ns=(before.st_atime_ns, before.st_mtime_ns))

    tr = run_traced(m, inject=DELAY_FIRST_COPY, during=start_when_copying(m, cuda.name, rewrite))
    confined(tr, m, tmp_path)
    assert cuda.stat().st_mtime_ns == before.st_mtime_ns
    assert tr.outcome.code == 1, tr.outcome.stderr
    assert len(tr.outcome.errors) == 1, tr.outcome.lines
    error = tr.outcome.errors[0]
    assert f"staged file {os.path.realpath(cuda)} changed during setup" in error, error
    assert "this is a bug" not in error
    assert not os.path.lexists(m.driver_root)
    assert not list(m.driver_root.parent.glob(".driver.*"))


def test_background_writer_rewriting_a_large_library(m: simgpu.SimMachine,
                                                     tmp_path: Path) -> None:
    """A writer rewrites a 64 MB libcuda in place the whole time: step i writes i into
    a field near the end (A), then into one near the start (B), so at every moment A is
    B or B + 1. The run fails cleanly, or (if it ever saw a quiet moment) built a root
    whose copy is a true snapshot: the file as it was at one moment, A - B in {0, 1}, every
    other byte as written, and `check` says ready. (An append-only writer could not tell:
    every copy of a growing file is a prefix of it.)"""
    cuda = m.lib_dir / f"libcuda.so.{m.version}"
    elfbuild.compile_so(cuda, "libcuda.so.1", size=64 << 20)
    original = bytearray(cuda.read_bytes())
    field_b, field_a = 1 << 20, len(original) - 8  # both in elfbuild's padding
    stop = threading.Event()
    fd = os.open(cuda, os.O_WRONLY)

    def put(offset: int, value: int) -> None:
        os.pwrite(fd, value.to_bytes(8, "little"), offset)

    put(field_a, 0)
    put(field_b, 0)
    original[field_a:field_a + 8] = original[field_b:field_b + 8] = bytes(8)

    def writer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            put(field_a, step)
            put(field_b, step)
            time.sleep(0.001)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        tr = run_traced(m)
    finally:
        stop.set()
        thread.join()
        os.close(fd)
    confined(tr, m, tmp_path)
    if tr.outcome.code == 0:
        copy = (m.driver_lib_dir / cuda.name).read_bytes()
        a = int.from_bytes(copy[field_a:field_a + 8], "little")
        b = int.from_bytes(copy[field_b:field_b + 8], "little")
        assert a - b in (0, 1), f"a torn copy: A={a}, B={b}"
        want = bytearray(original)
        want[field_a:field_a + 8] = copy[field_a:field_a + 8]
        want[field_b:field_b + 8] = copy[field_b:field_b + 8]
        assert copy == want
        assert check_report(run_cli(m.root, "check", "--json"))["verdict"] == "ready"
        return
    assert tr.outcome.code == 1 and len(tr.outcome.errors) == 1, tr.outcome.lines
    assert "changed" in tr.outcome.errors[0]
    assert not os.path.lexists(m.driver_root)
    assert not list(m.driver_root.parent.glob(".driver.*"))
    report = check_report(run_cli(m.root, "check", "--json"))
    assert "root-missing" in {p["code"] for p in report["problems"]}, report


# --------------------------------------------------------------------------------------
# Where the root goes


def test_run_nvidia_is_a_symlink(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """The tool refuses to build the driver root through a link in its parents."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (m.root / "run/nvidia").parent.mkdir(parents=True, exist_ok=True)
    os.symlink(elsewhere, m.root / "run/nvidia")
    tr = run_traced(m)
    assert tr.outcome.code == 1 and len(tr.outcome.errors) == 1, tr.outcome.lines
    assert "run/nvidia is a symlink" in tr.outcome.errors[0]
    assert list(elsewhere.iterdir()) == []
    assert not [x for x in tr.writes() if x.path.startswith(f"{elsewhere}/")]
    assert not (m.root / "etc/cdi/nvidia.yaml").exists()
    os.unlink(m.root / "run/nvidia")  # (the invariants fixture would refuse it too)


def test_live_driver_root_is_a_symlink(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """An older agent's root: a link to a directory of absolute links. It is replaced by a
    real root; what it pointed at is left alone."""
    old = tmp_path / "old-root"
    (old / "lib" / MA).mkdir(parents=True)
    os.symlink(m.lib_dir / f"libcuda.so.{m.version}", old / "lib" / MA / "libcuda.so.1")
    (m.root / "run/nvidia").mkdir(parents=True)
    os.symlink(old, m.driver_root)
    tr = run_traced(m)
    confined(tr, m, tmp_path)
    succeeded(tr, m, tmp_path)
    assert [p.name for p in (old / "lib" / MA).iterdir()] == ["libcuda.so.1"]


def test_lock_file_is_a_symlink(live: simgpu.SimMachine, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    lock = live.root / "run/unbounded-nvidia-setup.lock"
    lock.unlink()
    os.symlink(victim, lock)
    before = snapshot(live)
    tr = run_traced(live)
    confined(tr, live, tmp_path, never_opened=(victim,))
    refused(tr, live, before, "cannot open the lock file")
    assert victim.read_text() == "keep me\n"


# --------------------------------------------------------------------------------------
# The real driver among everything hostile at once


def test_hostile_corpus_around_the_real_driver(tmp_path: Path) -> None:
    drv = fetch("amd64")
    m = real_machine(tmp_path, drv, keep_hostile=True)
    specials = [m.lib_dir / name(m, s) for s in ("fifo", "socket", "chardev")]
    tr = run_traced(m, timeout=180)
    confined(tr, m, tmp_path, never_opened=tuple(specials))
    # Real files are hard links into the cache here: the copies must not be.
    succeeded(tr, m, tmp_path)
    for hostile in m.hostile:
        assert not os.path.lexists(m.driver_lib_dir / hostile)


def test_real_arm64_driver_next_to_the_real_amd64_driver(tmp_path: Path,
                                                        aarch64_ldconfig: str) -> None:
    """Both real drivers staged side by side (same names, two staging dirs): an x86_64
    machine takes every amd64 file and skips every arm64 one as foreign; with arch forced
    to aarch64 it is the other way round, under lib/aarch64-linux-gnu, its linker cache
    made by the real arm64 ldconfig under qemu (traced too: it stays confined)."""
    amd, arm = fetch("amd64"), fetch("arm64")
    assert amd.version == arm.version
    m = simgpu.make_machine(tmp_path / "root", version=amd.version, stale_versions=(),
                            unrelated=8, helpers=False, firmware=False)
    shutil.rmtree(m.lib_dir)
    host = m.root / "run/host-nvidia"
    realdriver.stage_real_driver(host / "0", amd, bin_dir=host / "1",
                                 firmware_dir=host / "2", hardlink=True)
    realdriver.stage_real_driver(host / "3", arm, bin_dir=host / "4", hardlink=True)
    (m.root / "usr/lib/aarch64-linux-gnu").mkdir(parents=True)
    for arch, drv, config in (("x86_64", amd, {}),
                              ("aarch64", arm, {"arch": "aarch64",
                                               "ldconfig": aarch64_ldconfig,
                                               # the x86_64 stand-in cannot load the
                                               # arm64 NVML
                                               "nvidia_ctk_args": ["--mode=management"]})):
        m.write_config(**config)
        tr = run_traced(m, timeout=180)
        confined(tr, m, tmp_path)
        assert tr.outcome.code == 0, tr.outcome.stderr
        root = m.driver_root
        lib = root / "lib" / drv.multiarch
        assert {p.name for p in (root / "lib").iterdir()} == {drv.multiarch, "firmware"}
        names = {str(p.relative_to(lib)) for p in lib.rglob("*") if p.is_file()
                 and not p.is_symlink()}
        assert names == {realdriver._staged_name(p) for p in drv.libraries}
        for path in [*lib.rglob("*.so.*"), root / "usr/bin/nvidia-smi"]:
            if path.is_file() and not path.is_symlink():
                with open(path, "rb") as f:
                    info = read_elf(f)
                assert info is not None and info.machine == arch and info.bits == 64, path
        report = check_report(run_cli(m.root, "check", "--json"))
        assert report["ok"] is True, report["problems"]


# --------------------------------------------------------------------------------------
# The tracer itself: a write outside the allowed set must be seen


def test_the_tracer_sees_writes_outside_the_allowed_set(tmp_path: Path) -> None:
    """strace pads short pids, splits calls of concurrent threads, quotes odd names and
    shows fds as <path>; a chroot()ed ldconfig names paths inside its new root."""
    root = tmp_path / "root"
    text = "\n".join([
        f'812   openat(AT_FDCWD</>, "{root}/run/lock/x.lock", O_RDWR|O_CREAT, 0600) = 3',
        f'812   mkdir("{root}/run/nvidia/.driver.ab/lib/../../../../etc/cron.d", 0755'
        " <unfinished ...>",
        "813   chroot(\"" + str(root) + "\") = 0",
        f'813   openat(AT_FDCWD<{root}>, "/etc/ld.so.cache~", O_WRONLY|O_CREAT, 0600) = 4',
        "812   <... mkdir resumed>) = -1 EEXIST (File exists)",
        f'12345 symlinkat("libx.so.1", 7<{root}/run/nvidia/.driver.ab/lib>, "a\\nb") = 0',
        f'12345 unlinkat(5<{tmp_path}/decoy\\76dir>, "f", 0) = 0',
        f'12345 openat(AT_FDCWD, "{root}/run/host-nvidia/0/l", O_RDONLY|O_PATH) = 6',
        '12345 openat(AT_FDCWD, "/etc/shadow", O_RDONLY) = -1 ENOENT (No such file)',
        f'12345 linkat(AT_FDCWD, "{root}/run/host-nvidia/0/l", AT_FDCWD, '
        f'"{root}/run/nvidia/.driver.ab/l", 0) = 0',
    ])
    tr = Traced(Outcome(0, "", ""), parse_calls(text))
    bad = write_violations(tr, root, forbidden=tmp_path)
    assert bad == [  # /run/lock is no longer the tool's: the lock is /run/<name>.lock
        f"openat write '{root}/run/lock/x.lock' = 3",
        f"mkdir write '{root}/etc/cron.d' = -1 EEXIST (File exists)",
        f"unlinkat write '{tmp_path}/decoy>dir/f' = 0",
        f"linkat link-source '{root}/run/host-nvidia/0/l' = 0",
    ]
    assert [x.path for x in tr.accesses if x.syscall == "symlinkat"] == [
        f"{root}/run/nvidia/.driver.ab/lib/a\nb"]
    assert tr.opened("/etc/shadow") and not tr.opened(f"{root}/run/host-nvidia/0/l")


def test_the_tracer_sees_what_a_link_into_proc_self_opened(tmp_path: Path) -> None:
    """strace names what the kernel opened, never the /proc/self path that led there: a
    link to /proc/self/environ opens /proc/<tgid>/environ, to /proc/thread-self/...
    /proc/<tgid>/task/<tid>/..., and to /proc/self/fd/0 whatever fd 0 is (/dev/null)."""
    for link, target in (("env", "/proc/self/environ"), ("stdin", "/proc/self/fd/0"),
                         ("task", up_to_fs_root(tmp_path) + "proc/thread-self/environ")):
        os.symlink(target, tmp_path / link)
    text = "\n".join([
        f'812 openat(AT_FDCWD, "{tmp_path}/env", O_RDONLY|O_CLOEXEC) = 3</proc/812/environ>',
        f'813 openat(AT_FDCWD, "{tmp_path}/task", O_RDONLY) = 4</proc/812/task/813/environ>',
        f'812 openat(AT_FDCWD, "{tmp_path}/stdin", O_RDONLY|O_NONBLOCK) = 5</dev/null>',
        # O_NOFOLLOW does not follow the last link: nothing was opened through it.
        f'812 openat(AT_FDCWD, "{tmp_path}/env", O_RDONLY|O_NOFOLLOW) = -1 ELOOP (Too many)',
        # What the product does for a staged file: O_PATH, then reopen via /proc/self/fd.
        f'812 openat(AT_FDCWD, "{tmp_path}/lib.so", O_RDONLY|O_PATH|O_NOFOLLOW) = 6</x/lib.so>',
        '812 openat(AT_FDCWD, "/proc/self/fd/6", O_RDONLY|O_CLOEXEC) = 7</x/lib.so>',
        # Another process's environ (pid 99 is not traced) and a plain /dev/null.
        '812 openat(AT_FDCWD, "/proc/99/environ", O_RDONLY) = 8</proc/99/environ>',
        '812 openat(AT_FDCWD, "/dev/null", O_RDONLY) = 9</dev/null>',
    ])
    tr = Traced(Outcome(0, "", ""), parse_calls(text))

    def fds(path: str) -> list[str]:
        return sorted({x.result.split("<")[0] for x in tr.opened(path)})

    assert fds("/proc/self/environ") == ["3", "4"]
    assert fds("/proc/thread-self/environ") == ["4"]
    assert fds("/proc/self/fd/0") == ["5"]
    assert fds("/proc/self/fd/6") == ["7"]
    assert fds("/proc/99/environ") == ["8"]
    assert fds("/dev/null") == ["5", "9"]
    assert fds("/proc/self/mem") == [] and fds(f"{tmp_path}/lib.so") == []
