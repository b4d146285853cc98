"""IMEX channels (GB200/GB300 NVL racks) kept out of the spec.

A multi-node NVLink job imports and exports GPU memory through
/dev/nvidia-caps-imex-channels/channel<N>. A channel is an isolation boundary between
jobs: memory one job exports is reachable by any process holding the same channel. So
NVIDIA hands channels out one by one, to the job that needs one: `nvidia-ctk cdi
generate --mode=imex --class=imex-channel`, the device plugin's own imex-channel spec
(--imex-channel-ids), the DRA driver per ComputeDomain. nvidia-ctk 1.20's NVML mode, the
default, lists channels nowhere on purpose; its management mode (or a config's
nvidia_ctk_args) puts every channel in `all`, and a pod asking for nvidia.com/gpu=all
would get them all. They are taken out here, from every device and from the common
edits, whatever nvidia-ctk wrote; check reports a spec that still carries one
(spec-imex-channel, spec.py). Their majors are still checked with every other NVIDIA node
(devices.py). A machine without the channel directory pays one stat in cdi.py, which
imports this module only when it exists.
"""

from __future__ import annotations

from typing import Any

from .config import Machine, load_yaml
from .gpus import edits
from .spec import imex_channel


def _strip(machine: Machine, edits: Any) -> bool:
    """Take the channel nodes out of one containerEdits; whether any was there. An empty
    deviceNodes goes too, as nvidia-ctk leaves it out (omitempty)."""
    nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
    if not isinstance(nodes, list):
        return False
    kept = [n for n in nodes if not (isinstance(n, dict) and imex_channel(machine, n))]
    if len(kept) == len(nodes):
        return False
    if kept:
        edits["deviceNodes"] = kept
    else:
        del edits["deviceNodes"]
    return True


def without_channels(machine: Machine, data: bytes) -> bytes:
    """`data` (a generated spec) with no IMEX channel node in any device or in the common
    edits; `data` itself, the same bytes, when it names none. A device left with no edits
    at all (one channel's own device, `--mode=imex` in the config) goes: CDI refuses a
    spec with an empty device, and validation then names what is left."""
    doc = load_yaml(data)
    if not isinstance(doc, dict):  # validation names what is wrong with the spec
        return data
    changed = False
    for edit in edits(doc):
        changed = _strip(machine, edit) or changed
    devices = doc.get("devices")
    if not changed:
        return data
    if isinstance(devices, list):
        doc["devices"] = [d for d in devices
                          if not (isinstance(d, dict) and d.get("containerEdits") == {})]
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text: str = yaml.dump(doc, Dumper=dumper, sort_keys=False, default_flow_style=False)
    return text.encode()
