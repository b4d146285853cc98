"""IMEX channels (GB200/GB300 NVL racks) in the spec's `all` device.

A multi-node NVLink job imports and exports GPU memory through
/dev/nvidia-caps-imex-channels/channel<N>. nvidia-ctk 1.20 puts those nodes in `all` in
management mode only; its NVML mode, the default on every GPU node, lists them nowhere
(tests/test_fake_nvidia_ctk.py holds it to that), so a pod on an NVL rack would get its
GPUs and no channel. The channel nodes are added to `all` here, the way management mode
writes them, with the major and minor of the node; their majors are checked against
/proc/devices with every other NVIDIA node (devices.py) and each node named by the spec
must be a character device (spec.py). A machine without the directory pays one stat in
cdi.py, which imports this module only when it exists, and its spec is nvidia-ctk's bytes
untouched.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from .config import IMEX_CHANNELS_DIR as DIR
from .config import Machine

_PREFIX = "channel"


def channels(machine: Machine) -> list[tuple[str, os.stat_result]]:
    """The machine's channel nodes (character devices named channel<N>), by N."""
    top = machine.at(DIR)
    found = []
    try:
        with os.scandir(top) as entries:
            for entry in entries:
                number = entry.name.removeprefix(_PREFIX)
                if entry.name.startswith(_PREFIX) and number.isdigit():
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode):
                        found.append((int(number), f"{DIR}/{entry.name}", st))
    except OSError:  # no IMEX channels on this machine (or unreadable: then none served)
        return []
    return [(path, st) for _, path, st in sorted(found)]


def node_edit(machine: Machine, path: str, st: os.stat_result) -> dict[str, Any]:
    """A deviceNodes entry as nvidia-ctk's management mode writes one."""
    edit: dict[str, Any] = {"path": path, "hostPath": str(machine.at(path)),
                            "major": os.major(st.st_rdev)}
    if os.minor(st.st_rdev):  # nvidia-ctk leaves a zero minor out (omitempty)
        edit["minor"] = os.minor(st.st_rdev)
    edit["fileMode"] = stat.S_IMODE(st.st_mode)
    edit["permissions"] = "rwm"
    return edit


def with_channels(machine: Machine, data: bytes) -> bytes:
    """`data` (a generated spec) with the machine's IMEX channels in `all`, when a
    channel is missing from it; else `data` unchanged."""
    found = channels(machine)
    if not found:
        return data
    import yaml

    from .config import load_yaml

    doc = load_yaml(data)
    devices = doc.get("devices") if isinstance(doc, dict) else None
    every = next((d for d in devices or [] if isinstance(d, dict) and d.get("name") == "all"),
                 None)
    if every is None:  # no `all` to extend: validation names what is wrong with the spec
        return data
    edits = every.setdefault("containerEdits", {})
    nodes = edits.setdefault("deviceNodes", [])
    named = {n.get("path") for n in nodes if isinstance(n, dict)}
    missing = [node_edit(machine, path, st) for path, st in found if path not in named]
    if not missing:
        return data
    nodes.extend(missing)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text: str = yaml.dump(doc, Dumper=dumper, sort_keys=False, default_flow_style=False)
    return text.encode()
