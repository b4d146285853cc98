"""Processes whose mounts come from a driver root generation that is no longer live.

A pod that bind-mounted /run/nvidia/driver (the device plugin mounts it at /driver-root)
keeps the directory it saw when it started. containerd's unit has KillMode=process, so
such pods survive `systemctl restart unbounded-nvidia-setup`; after the swap their mount
is the replaced generation, first renamed (`/run/nvidia/.driver.<random>`), then deleted:
a device plugin regenerating its spec there writes one with no libraries, the incident's
first symptom. The tool never kills or restarts pods; `check` names them.

The kernel shows a bind mount's source in /proc/<pid>/mountinfo (proc(5)): field 3 is the
filesystem's major:minor, field 4 the path of the mounted directory within it, which
follows renames and ends in `//deleted` once the directory is gone. A mount of the driver
root's parent (/run/nvidia) follows every swap and is never stale. Processes that share a
mount namespace share the answer, so each namespace's table is read once where the
namespace can be told; the drift check's unit, without capabilities, cannot tell a pod's
namespace and reads each process's table, which anyone may.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .config import Machine
from .tree import GENERATION_PREFIX

_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_MAX_MOUNTINFO = 1 << 20
_OWN_MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str
    mount_point: str  # where the process sees the replaced generation
    source: str  # the generation's path within its filesystem, as the kernel names it now
    container: str | None  # the container id its cgroup names, when it names one


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, str, str]]:
    """(major:minor, root within the filesystem, mount point) of each line."""
    mounts = []
    for line in text.split("\n"):
        fields = line.split(" ")
        if len(fields) >= 5:
            mounts.append((fields[2], _unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_MOUNTINFO).decode(errors="surrogateescape")
    except OSError:
        return None


def generation_prefix(machine: Machine) -> tuple[str, str] | None:
    """(major:minor, path prefix within that filesystem) that every generation next to the
    live root has, read from this process's own mount table (where the driver root
    really is, also under --root); None when it cannot be told."""
    parent = os.path.realpath(machine.driver_root.parent)
    try:
        st = os.stat(parent)
    except OSError:
        return None
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    text = _read(_OWN_MOUNTINFO)
    if text is None:
        return None
    best: tuple[str, str] | None = None
    for dev, root, point in parse_mountinfo(text):
        inside = parent == point or parent.startswith(point.rstrip("/") + "/")
        if dev == device and inside and (best is None or len(point) >= len(best[1])):
            best = (root, point)
    if best is None:
        return None
    root, point = best
    within = os.path.normpath(os.path.join(root, os.path.relpath(parent, point)))
    return device, within.rstrip("/") + "/" + GENERATION_PREFIX


def container_of(cgroup_text: str) -> str | None:
    """The container id a process's /proc/<pid>/cgroup names (containerd's
    `cri-containerd-<id>.scope` or `.../<id>`), when it names one."""
    found = _CONTAINER_ID.findall(cgroup_text)
    return found[-1] if found else None


def stale_holders(machine: Machine) -> list[Holder]:
    """Every process of the machine that sees a replaced driver root generation."""
    where = generation_prefix(machine)
    if where is None:
        return []
    device, prefix = where
    proc = str(machine.at("/proc"))
    try:
        pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
    except OSError:
        return []
    stale_in: dict[str, list[tuple[str, str]]] = {}
    found: list[Holder] = []
    for pid in pids:
        base = f"{proc}/{pid}"
        try:
            namespace = os.readlink(f"{base}/ns/mnt")
            text = None
        except PermissionError:
            # The namespace link needs ptrace access, which the drift check's unit (no
            # capabilities) lacks for every pod; mountinfo is world-readable (issue 37).
            # Processes that show the same table share the answer as one namespace would.
            text = _read(f"{base}/mountinfo")
            if text is None:
                continue
            namespace = text
        except OSError:
            continue  # gone
        if namespace not in stale_in:
            if text is None:
                text = _read(f"{base}/mountinfo") or ""
            # Most namespaces mount no generation at all: one substring search says so,
            # and only the rest are parsed (a node's table has hundreds of lines).
            stale_in[namespace] = [] if f" {prefix}" not in text else [
                (point, root) for dev, root, point in parse_mountinfo(text)
                if dev == device and root.startswith(prefix)]
        mounts = stale_in[namespace]
        if not mounts:
            continue
        comm = (_read(f"{base}/comm") or "?").strip()
        container = container_of(_read(f"{base}/cgroup") or "")
        found += [Holder(pid, comm, point, root, container) for point, root in mounts]
    return found
