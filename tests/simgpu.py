"""Simulated GPU machines for tests: a directory used as ``--root DIR`` by the product.

Its ELF objects are real ones built by gcc (tests/elfbuild.py), with the names, SONAMEs
and sizes of a real driver (the tables DRIVER_LIBS, HELPERS, ... of tests/drivertables.py).

Layout made by :func:`make_machine` under ``root`` (``<ver>`` = driver version)::

    run/host-nvidia/0/            host library dir (like the host's /usr/lib/x86_64-linux-gnu)
        libcuda.so.<ver>          driver libraries (DRIVER_LIBS), real x86_64 .so files
        libcuda.so.1 -> libcuda.so.<ver>          SONAME links, as the host's ldconfig makes
        libcuda.so -> libcuda.so.1                a few linker names, as the installer makes
        vdpau/libvdpau_nvidia.so.<ver>            (+ its SONAME link)
        libcuda.so.<stale> ...    stale driver sets, no links pointing at them
        libz.so.1.2.13, libz.so.1 -> ... unrelated real libraries, plus non-library files
    run/host-nvidia/1/            host bin dir: HELPERS (real executables) + unrelated programs
    run/host-nvidia/2/            host firmware dir: nvidia/<ver>/gsp_*.bin (+ a stale version)
    dev/nvidia0 nvidia1 nvidiactl nvidia-uvm nvidia-uvm-tools nvidia-modeset   (char devices)
    dev/nvidia-fs0..15 nvidia-vgpu-vfio   other modules' nodes, with ``gds=True`` only
    proc/driver/nvidia/version    kernel module version, real format (open or proprietary)
    proc/driver/nvidia/gpus/<bus>/information   one per GPU (uuid, device minor), what the
                                  kernel module writes: the GPUs the simulated NVML lists
    proc/devices                  as the kernel writes it, with the nodes' majors
    etc/ld.so.conf, etc/ld.so.conf.d/{libc,x86_64-linux-gnu}.conf   Debian's own, verbatim
    lib -> usr/lib, usr/lib/x86_64-linux-gnu/, usr/local/lib/, run/lock/   (merged /usr)

The staging's libnvidia-ml is the simulated NVML (tests/simnvml.c, built by elfbuild):
loaded from anywhere under the machine (its staging ``<root>/run/host-nvidia/0``, the
product's driver root ``<root>/run/nvidia/driver``), it finds the machine by its own
real path, the part before ``/run/host-nvidia/`` or ``/run/nvidia/`` (``""``, the
machine's own /, in a booted test machine), and answers from the machine's files: the
product under ``--root <root>``, the nvidia-ctk stand-in and NVIDIA's real nvidia-ctk
all read the same simulated machine, with no environment variable. Its GPUs answer
while ``dev/nvidiactl`` is a character device and the kernel module lists them; a GPU
is made to fall off the bus (``simnvml.lose_gpu``), to fail otherwise
(``simnvml.fail_gpu``) or to run MIG (``simnvml.enable_mig``) in a file beside its
information file that only the simulation writes, and the machine's NVML reads the
header's rules on which lookups such a GPU fails as ``simnvml.set_reading`` says
(tests/simnvml.py changes what a made machine's GPUs say; the table is in simnvml.c)::

    proc/driver/nvidia/gpus/<bus>/simulated-nvml   "error <code>" (or "lost" = "error 15"),
                                  "mig", "mig-device <slot> <gi> <ci> <gi profile>
                                  <ci profile> <MIG-uuid>" lines
    proc/driver/nvidia/simulated-nvml-reading      "target" (also when absent), "walk"
                                  or "any"

``simnvml.exclude_gpu`` marks a GPU excluded by the host (NVML skips it) and
``simnvml.move_gpu_bus`` puts a GPU on another bus id (NVML index = bus order, not minor).

MIG also writes what the kernel module has then: ``proc/driver/nvidia-caps/mig-minors``
(read by nvidia-ctk from the HOST's absolute /proc: run it with the machine's
``proc/driver`` bound over /proc/driver, tests/procdriver.py),
``proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access`` and the
``dev/nvidia-caps/nvidia-cap<M>`` nodes (major: ``nvidia-caps`` in ``proc/devices``).
``simnvml.add_imex_channels`` makes IMEX channel nodes.

A machine made with ``gpu=False`` is a CPU node: no device nodes and no staging. One made
with ``nvml=False`` has GPUs no NVML answers (no information files): its config then asks
for ``--mode=management``; so does a machine whose staging holds another libnvidia-ml
(the real Debian one of tests/realmachine.py answers 9 here, as without a GPU).
:func:`debian_linker_files` gives a machine another architecture's conf files (arm64:
``aarch64-linux-gnu.conf``, which sorts before the drop-in), and
:func:`leave_old_agent_links` the older agent's leftovers, made as it made them.

Command line (used by ``make demo``)::

    python3 tests/simgpu.py DIR [--version V] [--hostile] [--scale S] [--no-gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

import drivertables
import elfbuild
import toolkit
from nodefiles import GDS_MAJOR as GDS_MAJOR
from nodefiles import NVIDIA_MAJORS as NVIDIA_MAJORS
from nodefiles import OTHER_MODULE as OTHER_MODULE
from nodefiles import add_other_module_nodes as add_other_module_nodes
from nodefiles import debian_linker_files as debian_linker_files
from nodefiles import leave_old_agent_links as leave_old_agent_links
from nodefiles import mknod_char as mknod_char
from nodefiles import proc_devices_major as proc_devices_major
from nodefiles import write_proc_devices as write_proc_devices
from simnvml import add_gpu_information

MULTIARCH = "x86_64-linux-gnu"
DEFAULT_VERSION = "550.127.05"
DEFAULT_STALE = ("535.183.01",)
SAME_AS_VERSION = "<version>"  # make_machine(module_version=...) default

_M = 1024 * 1024
_K = 1024


# --------------------------------------------------------------------------------------
# The machine


@dataclasses.dataclass
class SimMachine:
    """A simulated machine under ``root``. ``expected_*`` describe what a correct ``run``
    builds, assuming the driver version resolves to ``version`` (true unless a test sets
    ``module_version`` to something else)."""

    root: Path
    version: str
    module_version: str | None
    gpu: bool
    staging: list[Path]
    lib_dir: Path
    bin_dir: Path | None
    firmware_dir: Path | None
    # file name in <driver root>/lib/x86_64-linux-gnu/ ("vdpau/..." below it) -> SONAME
    expected_libs: dict[str, str | None]
    # symlink name (same dir convention) -> file name it must resolve to
    expected_links: dict[str, str]
    # files (and their links) a correct tool MAY include: hostile but valid names
    optional_libs: dict[str, str | None]
    optional_links: dict[str, str]
    helpers: list[str]  # names expected in <driver root>/usr/bin/
    firmware: list[str]  # paths expected under <driver root>/lib/firmware/
    stale_versions: tuple[str, ...]
    stale_files: list[str]  # names in lib_dir (or vdpau/...) belonging to stale drivers
    hostile: list[str]  # names in lib_dir a correct tool must skip
    unrelated: list[str]  # unrelated names in lib_dir (libraries, links and other files)
    devices: list[str]  # names under dev/
    # uuids of the GPUs NVML enumerates, in NVML index order (bus id order; excluded GPUs
    # left out); a failing GPU (simnvml.fail_gpu, lose_gpu) keeps its place
    nvml_gpus: list[str]

    multiarch: str = MULTIARCH

    @property
    def driver_root(self) -> Path:
        return self.root / "run" / "nvidia" / "driver"

    @property
    def driver_lib_dir(self) -> Path:
        return self.driver_root / "lib" / self.multiarch

    @property
    def cdi_spec(self) -> Path:
        return self.root / "etc" / "cdi" / "nvidia.yaml"

    @property
    def config_path(self) -> Path:
        return self.root / "etc" / "unbounded" / "nvidia-setup.yaml"

    @property
    def nvml_answers(self) -> bool:
        """Whether nvidia-ctk (the stand-in or the real one alike) finds GPUs through NVML
        here: the kernel module lists GPUs and the staging's libnvidia-ml is the
        simulated one (a real Debian one answers 9 on this GPU-less host)."""
        if not self.nvml_gpus:
            return False
        try:
            data = (self.lib_dir / f"libnvidia-ml.so.{self.version}").read_bytes()
        except OSError:
            return False
        return elfbuild.NVML_MARKER in data

    def nvidia_ctk_args(self) -> list[str]:
        """The product's default (no --mode: nvidia-ctk's auto, NVML mode on a GPU node)
        where NVML answers; ``--mode=management`` where it cannot."""
        return [] if self.nvml_answers else ["--mode=management"]

    def write_config(self, **overrides: object) -> Path:
        """Write ``<root>/etc/unbounded/nvidia-setup.yaml``. Defaults: ``nvidia_ctk`` =
        the tests' nvidia-ctk (tests/toolkit.py), ``nvidia_ctk_args`` =
        :meth:`nvidia_ctk_args` (none, the shipped default, unless no NVML answers).
        A key overridden with None is left out. Values are written as JSON flow
        scalars/lists, which YAML reads unchanged."""
        values: dict[str, object] = {
            "nvidia_ctk": str(toolkit.NVIDIA_CTK),
            "nvidia_ctk_args": self.nvidia_ctk_args(),
        }
        values.update(overrides)
        lines = ["# written by tests/simgpu.py"]
        lines += [f"{key}: {json.dumps(val)}" for key, val in values.items() if val is not None]
        path = self.config_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return path


class _Plan:
    """Regular ELF files to write: (path, kind, soname/tag, size, mode)."""

    def __init__(self) -> None:
        self.sos: list[tuple[Path, str | None, int, int]] = []
        self.exes: list[tuple[Path, str, int]] = []

    def so(self, path: Path, soname: str | None, size: int, mode: int = 0o644) -> None:
        self.sos.append((path, soname, size, mode))

    def exe(self, path: Path, tag: str, size: int) -> None:
        self.exes.append((path, tag, size))

    def run(self) -> None:
        elfbuild.prewarm((s for _, s, _, _ in self.sos), (t for _, t, _ in self.exes))
        for path, soname, size, mode in self.sos:
            elfbuild.compile_so(path, soname, size, mode=mode)
        for path, tag, size in self.exes:
            elfbuild.compile_exe(path, size, tag=tag)


def _fmt(template: str | None, version: str) -> str | None:
    return None if template is None else template.format(ver=version)


def _scaled(size: int, scale: float) -> int:
    return int(size * scale)


def _rel_link(directory: Path, name: str, target: str) -> None:
    link = directory / name
    if os.path.lexists(link):
        link.unlink()
    os.symlink(target, link)


def _make_socket(directory: Path, name: str) -> None:
    """A unix socket file; bound through /proc/self/fd/<dirfd>/ so long paths work."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(f"/proc/self/fd/{dfd}/{name}")
    finally:
        os.close(dfd)


def _add_hostile(
    lib: Path, ver: str, plan: _Plan
) -> tuple[list[str], dict[str, str | None], dict[str, str | None]]:
    """Entries in the library staging dir, all named like current driver libraries.

    Returns (names to skip, valid libs a tool must include, valid libs it may include).
    None of them may be opened for writing, followed out of the staging dir, or copied
    as anything but a plain regular file."""
    skip: list[str] = []
    expected: dict[str, str | None] = {}
    optional: dict[str, str | None] = {}

    def name(stem: str) -> str:
        return f"libnvidia-{stem}.so.{ver}"

    # Absolute symlink out of the staging dir, at a secret.
    os.symlink("/etc/shadow", lib / name("shadow"))
    skip.append(name("shadow"))
    # Relative symlink escaping via ../../.. up to the real / and into /proc.
    levels = len(lib.resolve().parts)
    os.symlink("../" * levels + "proc/self/environ", lib / name("escape"))
    skip.append(name("escape"))
    # Symlink loop.
    os.symlink(name("loopb"), lib / name("loopa"))
    os.symlink(name("loopa"), lib / name("loopb"))
    skip += [name("loopa"), name("loopb")]
    # FIFO: opening it for reading blocks forever.
    os.mkfifo(lib / name("fifo"))
    skip.append(name("fifo"))
    # Unix socket.
    _make_socket(lib, name("socket"))
    skip.append(name("socket"))
    # Character device (1,3 = /dev/null: a tool that reads it copies an empty file).
    mknod_char(lib / name("chardev"), 1, 3)
    skip.append(name("chardev"))
    # Directory with a library name, holding a real library (a tool must not recurse).
    (lib / name("dir")).mkdir()
    plan.so(lib / name("dir") / name("indir"), "libnvidia-indir.so.1", 0)
    skip.append(name("dir"))
    # Empty file, and a text file (a GNU ld script, as hosts have for libc.so).
    (lib / name("empty")).write_bytes(b"")
    (lib / name("text")).write_text("/* GNU ld script */\nINPUT(libnvidia-ml.so.1)\n")
    skip += [name("empty"), name("text")]
    # Valid ELF objects of the wrong class / machine.
    elfbuild.elf32_so(lib / name("elf32"), "libnvidia-elf32.so.1")
    elfbuild.aarch64_so(lib / name("aarch64"), "libnvidia-aarch64.so.1")
    skip += [name("elf32"), name("aarch64")]
    # Awkward but valid names: genuine x86_64 libraries with their own SONAMEs. A tool
    # may legitimately include them (or refuse such names); tests must accept both.
    for stem in ("with space", "new\nline"):
        soname = f"libnvidia-{stem}.so.1"
        plan.so(lib / name(stem), soname, 0)
        optional[name(stem)] = soname
    # setuid + world-writable copy of a real library: valid, must be copied as 0644.
    plan.so(lib / name("setuid"), "libnvidia-setuid.so.1", 0, mode=0o4777)
    expected[name("setuid")] = "libnvidia-setuid.so.1"
    # Absolute symlink back into the staging dir (real path of an existing driver lib).
    # Absolute targets in a host directory name host paths, which mean nothing inside the
    # machine; the tool skips it (and must not end up with two files for one SONAME).
    os.symlink(str((lib / f"libnvidia-cfg.so.{ver}").resolve()), lib / name("absback"))
    skip.append(name("absback"))
    return skip, expected, optional


def make_machine(
    root: Path,
    version: str = DEFAULT_VERSION,
    *,
    gpu: bool = True,
    module_version: str | None = SAME_AS_VERSION,
    stale_versions: tuple[str, ...] = DEFAULT_STALE,
    unrelated: int = 40,
    hostile: bool = False,
    helpers: bool = True,
    firmware: bool = True,
    scale: float = 0.0,
    libcuda_link: bool = True,
    toolkit_libs: bool = True,
    nvml: bool = True,
    module_flavor: str | None = None,
    gds: bool = False,
) -> SimMachine:
    """Build a simulated GPU machine under ``root`` (see the module docstring).

    ``module_version`` defaults to ``version``; None means no
    ``proc/driver/nvidia/version``. ``scale`` multiplies the realistic sizes (0: tiny
    files, 1.0: a full-size ~0.8 GB driver). ``libcuda_link=False`` leaves out
    ``libcuda.so.1`` and ``libcuda.so``. ``toolkit_libs`` adds CUDA toolkit / container
    toolkit libraries (TOOLKIT_LIBS) that are not driver files. ``nvml``: the GPUs
    answer NVML (``simnvml.add_gpu_information``); False: no GPU does. ``module_flavor``:
    the kernel module's version line, "open" or "proprietary" (:func:`module_version_text`;
    default :func:`default_module_flavor`, so the suite meets both). ``gds``: an H100
    GPUDirect Storage host's machine, with the other modules' /dev/nvidia* nodes its
    host binds too (:func:`add_other_module_nodes`)."""
    if module_version == SAME_AS_VERSION:
        module_version = version
    root = Path(root)
    if (root / "run" / "host-nvidia").exists():
        raise FileExistsError(f"{root} already holds a simulated machine")
    plan = _Plan()
    host = root / "run" / "host-nvidia"
    lib = host / "0"
    (lib / "vdpau").mkdir(parents=True)
    staging = [lib]

    expected: dict[str, str | None] = {}
    links: dict[str, str] = {}
    for entry in drivertables.DRIVER_LIBS:
        fname = entry.name.format(ver=version)
        soname = _fmt(entry.soname, version)
        sub = f"{entry.subdir}/" if entry.subdir else ""
        plan.so(lib / sub / fname, soname, _scaled(entry.size, scale))
        expected[sub + fname] = soname
        if soname is not None and soname != fname:
            if libcuda_link or soname != "libcuda.so.1":
                _rel_link(lib / sub, soname, fname)
            links[sub + soname] = sub + fname
    for linker, soname in drivertables.HOST_LINKER_NAMES.items():
        if libcuda_link or soname != "libcuda.so.1":
            _rel_link(lib, linker, soname)
    for linker, soname in drivertables.ROOT_LINKER_NAMES.items():
        links[linker] = links[soname]

    stale_files: list[str] = []
    for stale in stale_versions:
        for entry in drivertables.STALE_LIBS:
            sub = f"{entry.subdir}/" if entry.subdir else ""
            fname = entry.name.format(ver=stale)
            plan.so(lib / sub / fname, _fmt(entry.soname, stale), _scaled(entry.size, scale))
            stale_files.append(sub + fname)

    unrelated_names: list[str] = []
    pool = list(drivertables.UNRELATED_LIBS)
    pool += [
        (f"libsimextra{i}.so.0.0.{i}", f"libsimextra{i}.so.0")
        for i in range(max(0, unrelated - len(pool)))
    ]
    extra = list(drivertables.TOOLKIT_LIBS) if toolkit_libs else []
    for fname, soname in pool[:unrelated] + extra:
        plan.so(lib / fname, soname, _scaled(200 * _K, scale))
        unrelated_names.append(fname)
        if soname != fname:
            _rel_link(lib, soname, fname)
            unrelated_names.append(soname)
    if unrelated:
        plan.so(lib / "vdpau" / "libvdpau_va_gl.so.1", "libvdpau_va_gl.so.1", 0)
        unrelated_names.append("vdpau/libvdpau_va_gl.so.1")
        (lib / "libz.a").write_bytes(b"!<arch>\n")
        (lib / "libc.so").write_text(
            "/* GNU ld script */\nGROUP ( /lib/x86_64-linux-gnu/libc.so.6 )\n"
        )
        (lib / "pkgconfig").mkdir()
        (lib / "pkgconfig" / "zlib.pc").write_text("Name: zlib\nVersion: 1.2.13\n")
        (lib / "gconv").mkdir()
        (lib / "gconv" / "gconv-modules").write_text("# simulated\n")
        unrelated_names += ["libz.a", "libc.so", "pkgconfig", "gconv"]

    hostile_names: list[str] = []
    optional: dict[str, str | None] = {}
    optional_links: dict[str, str] = {}
    if hostile:
        hostile_names, must, may = _add_hostile(lib, version, plan)
        expected.update(must)
        optional.update(may)
        # The host's ldconfig makes SONAME links for these valid libraries too.
        for fname, maybe_soname in must.items():
            if maybe_soname is not None and maybe_soname != fname:
                _rel_link(lib, maybe_soname, fname)
                links[maybe_soname] = fname
        for fname, maybe_soname in may.items():
            if maybe_soname is not None and maybe_soname != fname:
                _rel_link(lib, maybe_soname, fname)
                optional_links[maybe_soname] = fname

    bin_dir: Path | None = None
    helper_names: list[str] = []
    if helpers:
        bin_dir = host / "1"
        bin_dir.mkdir(parents=True)
        staging.append(bin_dir)
        for helper in drivertables.HELPERS:
            plan.exe(
                bin_dir / helper,
                f"{helper} (simulated {version})",
                _scaled(drivertables.HELPER_SIZES[helper], scale),
            )
            helper_names.append(helper)
        for prog in drivertables.UNRELATED_EXES:
            plan.exe(bin_dir / prog, f"{prog} (simulated)", 0)
        script = bin_dir / "nvidia-bug-report.sh"
        script.write_text("#!/bin/sh\necho simulated\n")
        script.chmod(0o755)

    fw_dir: Path | None = None
    fw_names: list[str] = []
    if firmware:
        fw_dir = host / "2"
        staging.append(fw_dir)
        for ver in (version, *stale_versions[:1]):
            for fw, size in drivertables.FIRMWARE:
                elfbuild.write_file(
                    fw_dir / "nvidia" / ver / fw,
                    f"simulated GSP firmware {ver} {fw}\n".encode(),
                    _scaled(size, scale),
                )
                if ver == version:
                    fw_names.append(f"nvidia/{ver}/{fw}")
        elfbuild.write_file(fw_dir / "regulatory.db", b"simulated\n")
        elfbuild.write_file(fw_dir / "intel" / "ibt-20-1-3.sfi", b"simulated\n")

    plan.run()
    if not gpu:  # a CPU machine: the host mounts no staging either
        shutil.rmtree(host)
        staging = []

    devices: list[str] = []
    dev = root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    nvml_gpus: list[str] = []
    if gpu:
        for dname, major, minor in drivertables.DEVICES:
            mknod_char(dev / dname, major, minor)
            devices.append(dname)
            if nvml and dname[len("nvidia"):].isdigit():
                nvml_gpus.append(add_gpu_information(root, minor, version))

    if module_version is not None:
        proc = root / "proc" / "driver" / "nvidia"
        proc.mkdir(parents=True, exist_ok=True)
        flavor = module_flavor or default_module_flavor(module_version)
        (proc / "version").write_text(module_version_text(module_version, flavor))

    debian_linker_files(root, MULTIARCH)
    write_proc_devices(root, devices_present=gpu)
    if gpu and gds:
        devices += add_other_module_nodes(root)
    (root / "run" / "lock").mkdir(parents=True, exist_ok=True)

    return SimMachine(
        root=root,
        version=version,
        module_version=module_version,
        gpu=gpu,
        staging=staging,
        lib_dir=lib,
        bin_dir=bin_dir,
        firmware_dir=fw_dir,
        expected_libs=expected,
        expected_links=links,
        optional_libs=optional,
        optional_links=optional_links,
        helpers=helper_names,
        firmware=fw_names,
        stale_versions=tuple(stale_versions),
        stale_files=stale_files,
        hostile=hostile_names,
        unrelated=unrelated_names,
        devices=devices,
        nvml_gpus=nvml_gpus,
    )


# --------------------------------------------------------------------------------------
# What the kernel module says


MODULE_FLAVORS = ("open", "proprietary")


def default_module_flavor(version: str) -> str:
    """The open kernel module from 550 on (the simulated default, 550.127.05, and the real
    550 set), the proprietary one before (535, the stale drivers): the suite meets both.
    (NVIDIA's installer defaults to the open modules from 560; GB300 hosts need them.)"""
    major = version.split(".", 1)[0]
    return "open" if major.isdigit() and int(major) >= 550 else "proprietary"


def module_version_text(version: str, flavor: str = "proprietary",
                        arch: str = "x86_64") -> str:
    """``/proc/driver/nvidia/version`` as each module writes it (kernel-open/nvidia and
    the proprietary nvidia.ko: "NVRM version: " + its banner, two spaces around the
    version; the open one adds "Release Build" and its builder), then the GCC line.
    ``arch``: the kernel's, x86_64 or aarch64."""
    if flavor == "open":
        banner = (f"NVIDIA UNIX Open Kernel Module for {arch}  {version}  Release Build  "
                  "(dvs-builder@U16-I3-D08-2-2)  Tue Oct  8 02:55:37 UTC 2024")
    elif flavor == "proprietary":
        banner = f"NVIDIA UNIX {arch} Kernel Module  {version}  Tue Oct  8 03:13:40 UTC 2024"
    else:
        raise ValueError(f"module flavor {flavor!r}: expected one of {MODULE_FLAVORS}")
    return (f"NVRM version: {banner}\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) \n")


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            st = os.lstat(os.path.join(dirpath, fname))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a simulated GPU machine under DIR.")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--version", default=DEFAULT_VERSION)
    parser.add_argument("--hostile", action="store_true")
    parser.add_argument(
        "--scale",
        type=float,
        default=0.0,
        help="file size factor: 0 tiny (default), 1.0 realistic (~0.8 GB)",
    )
    parser.add_argument("--no-gpu", action="store_true", help="no /dev/nvidia* nodes")
    parser.add_argument(
        "--no-config", action="store_true", help="do not write etc/unbounded/nvidia-setup.yaml"
    )
    args = parser.parse_args(argv)
    target: Path = args.dir
    if target.exists() and any(target.iterdir()):
        print(f"simgpu: {target} is not empty; remove it first", file=sys.stderr)
        return 2
    start = time.monotonic()
    machine = make_machine(
        target, args.version, gpu=not args.no_gpu, hostile=args.hostile, scale=args.scale
    )
    if not args.no_config:
        machine.write_config()
    elapsed = time.monotonic() - start
    print(
        f"simulated machine in {machine.root} ({elapsed:.2f} s, "
        f"{_tree_size(machine.root) / _M:.1f} MiB)"
    )
    print(f"  driver {machine.version}, stale {', '.join(machine.stale_versions) or '-'}")
    print(f"  staging: {', '.join(str(p) for p in machine.staging)}")
    print(f"  devices: {', '.join(machine.devices) or '-'}")
    print(
        f"  expected libraries: {len(machine.expected_libs)}, helpers: "
        f"{len(machine.helpers)}, firmware: {len(machine.firmware)}"
    )
    if machine.hostile:
        print(f"  hostile entries: {len(machine.hostile)}")
    print(f"  try: unbounded-nvidia-setup --root {machine.root} run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
