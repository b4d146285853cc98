"""What a real Debian GPU node machine has beside the driver, for tests/simgpu.py and
everything else that builds a machine: Debian's own linker conf files, /proc/devices as
the kernel writes it, device nodes, and the older agent's leftovers made as it made
them."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import drivertables

if TYPE_CHECKING:
    import simgpu


def mknod_char(path: Path, major: int, minor: int, mode: int = 0o666) -> None:
    """A character device node at ``path``, mode ``mode`` whatever the umask."""
    try:
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(path, mode)  # mknod's mode is filtered by the umask
    except PermissionError as exc:
        raise PermissionError(
            f"cannot mknod {path} (character devices need root / CAP_MKNOD)"
        ) from exc


# Debian's own linker configuration, byte for byte (libc-bin's libc.conf, libc6's
# <multiarch>.conf; bookworm and trixie alike). glibc reads the includes in byte order:
# aarch64-linux-gnu.conf sorts before unbounded-nvidia-setup.conf, x86_64-linux-gnu.conf
# after it.
LD_SO_CONF = "include /etc/ld.so.conf.d/*.conf\n\n"
LIBC_CONF = "# libc default configuration\n/usr/local/lib\n"
MULTIARCH_CONF = "# Multiarch support\n/usr/local/lib/{ma}\n/lib/{ma}\n/usr/lib/{ma}\n"


def debian_linker_files(root: Path, multiarch: str = "x86_64-linux-gnu") -> None:
    """/etc/ld.so.conf and Debian's conf files for ``multiarch``, merged /usr (``/lib`` a
    link to ``usr/lib``, as on every bookworm and trixie machine) and the multiarch
    library dirs. Another architecture's conf file, if there, is removed: a machine has
    its own."""
    conf_d = root / "etc" / "ld.so.conf.d"
    conf_d.mkdir(parents=True, exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text(LD_SO_CONF)
    (conf_d / "libc.conf").write_text(LIBC_CONF)
    for other in conf_d.glob("*-linux-gnu.conf"):
        other.unlink()
    (conf_d / f"{multiarch}.conf").write_text(MULTIARCH_CONF.format(ma=multiarch))
    (root / "usr" / "lib" / multiarch).mkdir(parents=True, exist_ok=True)
    (root / "usr" / "local" / "lib").mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(root / "lib"):
        os.symlink("usr/lib", root / "lib")


# /proc/devices as a GPU host's kernel writes it (fs/proc/devices.c: "%3d %s"): the
# drivers of a 550 open-module host, whose nvidia module registers 195 three times
# (nvidia, nvidiactl, and nvidia-modeset's own), beside the usual ones.
PROC_DEVICES_CHAR = (
    (1, "mem"), (4, "/dev/vc/0"), (4, "tty"), (4, "ttyS"), (5, "/dev/tty"),
    (5, "/dev/console"), (5, "/dev/ptmx"), (7, "vcs"), (10, "misc"), (13, "input"),
    (128, "ptm"), (136, "pts"), (180, "usb"),
)
PROC_DEVICES_BLOCK = ((7, "loop"), (8, "sd"), (9, "md"), (253, "device-mapper"),
                      (259, "blkext"))
NVIDIA_MAJORS = {"nvidia": 195, "nvidiactl": 195, "nvidia-modeset": 195}


def proc_devices_text(drivers: dict[str, int]) -> str:
    chars = sorted([*PROC_DEVICES_CHAR, *((major, name) for name, major in drivers.items())])
    lines = ["Character devices:", *(f"{major:3d} {name}" for major, name in chars), "",
             "Block devices:", *(f"{major:3d} {name}" for major, name in PROC_DEVICES_BLOCK)]
    return "\n".join(lines) + "\n"


def write_proc_devices(root: Path, drivers: dict[str, int] | None = None, *,
                       devices_present: bool = True) -> Path:
    """``proc/devices`` under ``root``. ``drivers``: NVIDIA driver name -> major (default:
    the majors of drivertables.DEVICES: 195, and nvidia-uvm's); none on a CPU machine."""
    if drivers is None:
        drivers = {}
        if devices_present:
            drivers = dict(NVIDIA_MAJORS)
            drivers["nvidia-uvm"] = dict((n, ma) for n, ma, _ in drivertables.DEVICES)[
                "nvidia-uvm"]
    path = root / "proc" / "devices"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(proc_devices_text(drivers))
    return path


def proc_devices_major(root: Path, name: str, default: int) -> int:
    """The major of driver ``name`` in ``root``'s proc/devices; added (``default``) when
    the file lacks it, as the kernel lists every registered driver."""
    path = root / "proc" / "devices"
    text = path.read_text() if path.exists() else "Character devices:\n\nBlock devices:\n"
    head, sep, block = text.partition("\n\n")
    lines = head.splitlines()
    for line in lines[1:]:
        major, _, driver = line.strip().partition(" ")
        if driver == name and major.isdigit():
            return int(major)
    chars = [(int(ln.split()[0]), ln.strip().partition(" ")[2]) for ln in lines[1:] if ln.strip()]
    chars.append((default, name))
    head = "\n".join([lines[0] if lines else "Character devices:",
                      *(f"{ma:3d} {drv}" for ma, drv in sorted(chars))])
    path.write_text(head + (sep or "\n\n") + block)
    return default


# Nodes of modules beside nvidia's that a host binding /dev/nvidia* into the machine
# brings too (FACTS.md, GPUDirect Storage): an H100 GDS host's nvidia-fs module makes
# /dev/nvidia-fs<N> under its own dynamic major (16 of them here; the tool must not care
# how many). OTHER_MODULE stands for any module the tool knows nothing of: named after
# NVIDIA's vGPU host module, but which nodes that module really makes is not checked
# here, and the tool must not care. Dynamic majors are handed out downwards from 511;
# these two are ones no other simulated driver takes (uvm 511, caps 510, IMEX 509, and
# 508 is the tests' "uvm reloaded").
GDS_MODULE, GDS_MAJOR, GDS_NODES = "nvidia-fs", 507, 16
OTHER_MODULE, OTHER_MAJOR = "nvidia-vgpu-vfio", 506


def add_other_module_nodes(root: Path, gds_nodes: int = GDS_NODES) -> list[str]:
    """/dev/nvidia-fs0..<gds_nodes - 1> and /dev/nvidia-vgpu-vfio under ``root``, each
    with its module's major in proc/devices (added when missing). Returns their names
    under dev/."""
    names = []
    major = proc_devices_major(root, GDS_MODULE, GDS_MAJOR)
    for n in range(gds_nodes):
        mknod_char(root / "dev" / f"{GDS_MODULE}{n}", major, n)
        names.append(f"{GDS_MODULE}{n}")
    mknod_char(root / "dev" / OTHER_MODULE, proc_devices_major(root, OTHER_MODULE, OTHER_MAJOR), 0)
    return [*names, OTHER_MODULE]


def leave_old_agent_links(m: simgpu.SimMachine, ldconfig: str = "ldconfig",
                          multiarch: str | None = None) -> list[str]:
    """What the older agent's SetupNVIDIA left on a machine: absolute links in
    /usr/lib/<multiarch> to every current driver library of the staging, then a plain
    ``ldconfig`` (no -X, its aux cache trusted), which made the SONAME links beside them
    (``libcuda.so.1 -> libcuda.so.<ver>``). ``ldconfig``: the machine's own (Debian's arm64
    one under qemu for an aarch64 machine). Returns the names of /usr/lib/<multiarch>
    that were not there before: the links into the staging and the SONAME links alike."""
    import subprocess

    ma = multiarch or m.multiarch
    usr = m.root / "usr" / "lib" / ma
    usr.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(usr))
    suffix = f".so.{m.version}"
    for path in sorted(m.lib_dir.iterdir()):
        if (path.name.endswith(suffix) and path.is_file() and not path.is_symlink()
                and path.name.startswith(drivertables.PREFIXES)):
            os.symlink("/" + str(path.relative_to(m.root)), usr / path.name)
    subprocess.run([ldconfig, "-r", str(m.root)], check=True, capture_output=True,
                   timeout=120)
    return sorted(set(os.listdir(usr)) - before)


