"""The device nodes CUDA needs, and whether each belongs to an NVIDIA module loaded now.

A GPU is present when /dev/nvidiactl or a /dev/nvidia<N> is a character device (DESIGN
step 2). CUDA then also opens /dev/nvidia-uvm, which hosts often load on demand, so a
machine started before it was loaded has none. Every node's major must be its driver's:
nvidiactl, nvidia<N> and nvidia-modeset use the fixed major 195, registered as
"nvidia-frontend" up to 535 and as "nvidia", "nvidiactl" and "nvidia-modeset" since 545
(so only the number is compared); nvidia-uvm, nvidia-caps and nvidia-caps-imex-channels get dynamic
majors that /proc/devices names, as do nvidia-nvswitch and nvidia-nvlink
(docs/staging-contract.md cites the sources). A node
bound into the machine before a module reload keeps the old major, and CUDA in pods then
fails with error 999 (NVIDIA/nvidia-container-toolkit#1934); a node whose driver has no
line in /proc/devices belongs to a module that is not loaded. /proc/devices is not
namespaced: the machine reads the host kernel's table.

Only those modules' nodes are checked, each name matched whole (nvidia-uvm-tools is
uvm's, nvidia-nvswitchctl nvswitch's, nvidia-fs0 no nvidia<N>). A host that binds
/dev/nvidia* into the machine brings other modules' nodes too: GPUDirect Storage's
/dev/nvidia-fs<N> (nvidia-fs, its own dynamic major), or any other. This tool serves
none of them and cannot tell what their modules want, so they never darken a node
(DESIGN, 2026-12-05): they are not even looked at.
"""

from __future__ import annotations

import os
import stat

from . import discover
from .config import Machine
from .problems import Problem

FIXED_MAJOR = 195  # NV_MAJOR_DEVICE_NUMBER
UVM = "nvidia-uvm"
PROC_DEVICES = "/proc/devices"
# Directories of nodes with dynamic majors, and the name their driver registers.
_DIRS = {"nvidia-caps": "nvidia-caps",
         "nvidia-caps-imex-channels": "nvidia-caps-imex-channels"}
# Nodes with dynamic majors directly under /dev, by the name their driver registers:
# /dev/nvidia-uvm and -uvm-tools, /dev/nvidia-nvswitch<N> and -nvswitchctl,
# /dev/nvidia-nvlink (_module matches each name whole).
_UVM_NAMES = (UVM, "nvidia-uvm-tools")
NVSWITCH = "nvidia-nvswitch"
NVLINK = "nvidia-nvlink"
FIXED = ""  # _module's answer for the nvidia module's own nodes: compared by number
_MAX_PROC_DEVICES = 1 << 16

LOAD_UVM = ("on the host, load nvidia-uvm (`nvidia-modprobe -u -c0`) and bind /dev/nvidia-uvm "
            "and /dev/nvidia-uvm-tools into the machine; systemd retries")
BIND = "on the host, bind the NVIDIA device nodes into the machine; systemd retries"
RESTART_MACHINE = ("restart the machine from the host (systemd-nspawn@<machine>), which binds "
                   "the nodes of the modules loaded now; systemd retries")
LOAD_UVM_AND_RESTART = ("on the host, load nvidia-uvm (`nvidia-modprobe -u -c0`), then "
                        + RESTART_MACHINE)
NOT_BOUND = ("on the host, check `nvidia-smi` and the kernel log, then bind /dev/nvidia* into "
             "the machine; nothing was changed; systemd retries")


class Node:
    """An NVIDIA character device node under /dev, as the machine sees it. A plain class:
    run imports this module on every boot, and @dataclass costs more to create than the
    whole device check takes."""

    __slots__ = ("driver", "major", "minor", "path")

    def __init__(self, path: str, major: int, minor: int, driver: str) -> None:
        self.path = path  # e.g. /dev/nvidia-uvm
        self.major = major
        self.minor = minor
        self.driver = driver  # its /proc/devices name, or FIXED (_module)


def _is_gpu(name: str) -> bool:
    """nvidia<N> or nvidiactl (names are matched with str methods, not regular
    expressions: compiling them on every boot cost more than matching)."""
    rest = name[6:] if name.startswith("nvidia") else ""
    return rest == "ctl" or rest.isdigit()


def _module(name: str) -> str | None:
    """The /proc/devices name of the driver of /dev/<name>: FIXED for nvidia<N>,
    nvidiactl and nvidia-modeset (major 195), None for a node of a module this tool
    does not check (nvidia-fs<N>, any other)."""
    if _is_gpu(name) or name == "nvidia-modeset":
        return FIXED
    if name in _UVM_NAMES:
        return UVM
    rest = name[len(NVSWITCH):] if name.startswith(NVSWITCH) else None
    if rest == "ctl" or (rest and rest.isdigit()):
        return NVSWITCH
    return NVLINK if name == NVLINK else None


def parse(text: str) -> dict[int, set[str]] | None:
    """The character-device section of /proc/devices as the kernel writes it
    (fs/proc/devices.c: "Character devices:", then "%3d %s" lines, a blank line, "Block
    devices:"): major -> names. None when it does not read that way."""
    lines = text.split("\n")
    if not lines or lines[0] != "Character devices:":
        return None
    majors: dict[int, set[str]] = {}
    for index, line in enumerate(lines[1:], 1):
        if not line:  # the block devices follow, or the text was cut short
            return majors if lines[index + 1:index + 2] == ["Block devices:"] else None
        major, _, name = line.lstrip(" ").partition(" ")
        if not (major.isascii() and major.isdigit()) or not name or name[0].isspace():
            return None
        majors.setdefault(int(major), set()).add(name)
    return None


def read_majors(machine: Machine) -> dict[int, set[str]] | str:
    """/proc/devices' character majors, or why they cannot be read."""
    path = machine.at(PROC_DEVICES)
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_PROC_DEVICES).decode(errors="replace")
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    majors = parse(text)
    return majors if majors is not None else f"{path} does not read as the kernel writes it"


def _char(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None


def find_nodes(machine: Machine) -> tuple[list[Node], list[str]]:
    """(the character nodes of the modules this tool checks, under /dev and its
    nvidia-caps* dirs; names of theirs under /dev that are not a character device)."""
    dev = str(machine.at("/dev"))
    nodes: list[Node] = []
    odd: list[str] = []
    try:
        names = sorted(os.listdir(dev))
    except OSError:
        return [], []
    for name in names:
        if not name.startswith("nvidia"):
            continue
        if name in _DIRS:
            try:
                inner = sorted(os.listdir(f"{dev}/{name}"))
            except OSError:
                continue
            for sub in inner:
                found = _char(f"{dev}/{name}/{sub}")
                if found:
                    nodes.append(Node(f"/dev/{name}/{sub}", *found, _DIRS[name]))
            continue
        driver = _module(name)
        if driver is None:  # another module's node: not this tool's to judge
            continue
        found = _char(f"{dev}/{name}")
        if found:
            nodes.append(Node(f"/dev/{name}", *found, driver))
        else:
            odd.append(f"/dev/{name}")
    return nodes, odd


def findings(machine: Machine) -> list[tuple[Problem, str]]:
    """On a machine with a GPU: the nodes CUDA needs that are missing, and every NVIDIA
    node whose major is not the one its driver has now; each with what to do on the host."""
    nodes, odd = find_nodes(machine)
    have = {n.path for n in nodes}
    found: list[tuple[Problem, str]] = []

    def missing(path: str, what: str, todo: str) -> None:
        found.append((Problem("device-missing", what, str(machine.at(path))), todo))

    for path in odd:
        missing(path, f"{path} is not a character device", BIND)
    if "/dev/nvidiactl" not in have:
        missing("/dev/nvidiactl", "/dev/nvidiactl is missing: every NVIDIA program opens it",
                BIND)
    if not any(_is_gpu(p[5:]) and p != "/dev/nvidiactl" for p in have):
        missing("/dev", "no /dev/nvidia<N> GPU node in the machine", BIND)
    if f"/dev/{UVM}" not in have:
        missing(f"/dev/{UVM}", f"/dev/{UVM} is missing: CUDA needs it (the host has not "
                "loaded nvidia-uvm, or did not bind its nodes)", LOAD_UVM)
    majors = read_majors(machine)
    for node in nodes:
        driver = node.driver
        todo = RESTART_MACHINE
        if isinstance(majors, str):
            why = f"{majors}: cannot tell whether its driver is loaded"
        elif driver == FIXED:
            if node.major == FIXED_MAJOR and FIXED_MAJOR in majors:
                continue
            why = (f"the nvidia module's major is {FIXED_MAJOR}" if node.major != FIXED_MAJOR
                   else f"{PROC_DEVICES} lists no major {FIXED_MAJOR}: the nvidia module is "
                        "not loaded")
        else:
            current = sorted(major for major, names in majors.items() if driver in names)
            if node.major in current:
                continue
            if current:
                why = (f"{PROC_DEVICES} gives {driver} major {current[0]}: the node was "
                       "bound before the module was reloaded")
            else:
                why = f"{PROC_DEVICES} lists no {driver}: its module is not loaded"
                if driver == UVM:
                    todo = LOAD_UVM_AND_RESTART
        found.append((Problem("device-stale", f"{node.path} is character device "
                              f"{node.major}:{node.minor}, but {why}",
                              str(machine.at(node.path))), todo))
    return found


def problems(machine: Machine) -> list[Problem]:
    return [problem for problem, _ in findings(machine)]


def staged_without_nodes(machine: Machine) -> Problem | None:
    """On a machine without a GPU node: populated staging. The host agent mounts the
    staging only after discovering GPU, devices and driver together, so this is a GPU node
    whose devices did not arrive (a kernel update broke the module), not a CPU node."""
    staged = discover.populated_staging(machine)
    if not staged:
        return None
    return Problem("devices-not-bound", f"driver staging is mounted ({staged[0]}) but no "
                   "NVIDIA device node is (/dev/nvidiactl, /dev/nvidia<N>): the host's nvidia "
                   "module did not load or its devices were not bound into the machine",
                   str(machine.at("/dev")))
