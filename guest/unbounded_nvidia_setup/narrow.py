"""A spec narrowed to the GPUs NVML can use: what is left of management mode's `all`.

When NVML's lookups by UUID fail for another GPU's sake (nvml.py), NVIDIA's nvidia-ctk
cannot write an NVML-mode spec for the usable GPUs at all. Its management mode can: it
never asks NVML for a device, and its `all` lists every NVIDIA node under /dev. That is
more than NVML mode's `all` gives a pod. It also lists the unusable GPUs' nodes, the
MIG config and monitor caps (MIG management rights) and every IMEX channel (an
isolation boundary, handed out one by one). So every device node that NVML mode would
not give is dropped here. What stays is the control nodes, the usable GPUs' nodes, and
the access caps of their MIG devices.
"""

from __future__ import annotations

from typing import Any

from .gpus import node_path_minor

# Every NVML-mode spec gives these to `all` (its common edits), whatever the GPUs.
CONTROL = frozenset({"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                     "/dev/nvidia-modeset"})
_CAP = "/dev/nvidia-caps/nvidia-cap"


def keeps(path: str, minors: set[int], caps: set[int]) -> bool:
    if path in CONTROL:
        return True
    minor = node_path_minor(path)
    if minor is not None:
        return minor in minors
    rest = path.removeprefix(_CAP)
    return rest != path and rest.isdigit() and int(rest) in caps


def narrowed(doc: dict[str, Any], minors: set[int], caps: set[int]) -> list[str]:
    """Drop, in place, every device node of `doc` that `keeps` does not; the paths
    dropped, in spec order."""
    edits = [doc.get("containerEdits")]
    edits += [d.get("containerEdits") for d in doc.get("devices") or [] if isinstance(d, dict)]
    dropped: list[str] = []
    for edit in edits:
        if not isinstance(edit, dict) or not isinstance(edit.get("deviceNodes"), list):
            continue
        kept = []
        for node in edit["deviceNodes"]:
            path = str(node.get("path", "")) if isinstance(node, dict) else ""
            if keeps(path, minors, caps):
                kept.append(node)
            else:
                dropped.append(path)
        edit["deviceNodes"] = kept
    return dropped
