"""A generate that failed or hung on a GPU: the node degrades, it never darkens.

Imported only when nvidia-ctk's generate failed on a GPU or did not finish
(cdi.Generator.spec): a healthy boot never pays for it (a module costs every boot about
5M instructions to import, docs/performance.md). It asks NVML which GPUs it can use
(nvml.py), has nvidia-ctk generate a spec for those, and returns what it found: the
caller (cdi.py) keeps it, and this module knows nothing of the caller. What it does is
docs/architecture.md's "A GPU NVML cannot use".

Management mode's `all` lists every NVIDIA node under /dev: more than NVML mode's `all`
gives a pod. It also lists the unusable GPUs' nodes, the MIG config and monitor caps
(MIG management rights) and every IMEX channel. So, when the spec comes from it, every
device node NVML mode would not give is dropped (`narrowed`): what stays is the control
nodes, the usable GPUs' nodes, and the access caps of their MIG devices.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from . import log
from .config import Machine, load_yaml
from .gpus import NodeGpus, edits, node_path_minor, read_small, served_minors, warnings
from .log import die
from .run import Result

# nvidia-ctk for some GPUs (`--device-id`) or a mode, within its own limit (None: the
# configured one), cut to what is left of the run's budget.
Generate = Callable[[list[str] | None, str | None, float | None], Result]
# The device nodes a management-mode spec is cut down to: GPU minors and MIG cap minors.
Narrowing = tuple[set[int], set[int]]

# Every NVML-mode spec gives these to `all` (its common edits), whatever the GPUs.
CONTROL = frozenset({"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                     "/dev/nvidia-modeset"})
_CAP = "/dev/nvidia-caps/nvidia-cap"
CAPABILITIES_DIR = "/proc/driver/nvidia/capabilities"


def degrade(machine: Machine, failed: Result, generate: Generate,
            written: Callable[[], bytes]) -> tuple[Result | None, NodeGpus | None,
                                                   Narrowing | None]:
    """(the generate that serves the usable GPUs, what NVML said of the node's GPUs, the
    narrowing its spec needs). A GPU that NVML cannot use degrades the node, it never
    darkens it (DESIGN, 2026-12-04, -05 and -07). NVML is asked by index which GPUs it
    can use (nvml.py), never trusting a lookup by UUID. nvidia-ctk is then asked for
    those GPUs by `--device-id`, which keeps its per-GPU devices. Where NVML's lookups by
    UUID fail or block for another GPU's sake, that fails too, and management mode's
    `all`, cut down to the usable GPUs, serves them. `failed` stands, with no GPUs, when
    NVML answers for every GPU or cannot be asked; no result when no GPU is usable.
    `written`: the spec the last generate wrote."""
    from .nvml import ask, assess

    answer = ask(machine)
    found = assess(machine, answer) if answer is not None else None
    if found is None:
        return failed, None, None
    for line in warnings(found):
        log.warn(line)
    if not found.serves:
        return None, found, None
    minors = found.serve_minors()
    ids = found.device_ids()
    if ids:
        # After a GPU that did not answer, a lookup by UUID may block on it too: this
        # try gets at most half of what is left, so that management mode still has the
        # rest (docs/architecture.md, "The time budget").
        own = None
        if any(g.waited is not None for g in found.gpus):
            left = machine.limit(None).seconds or 0.0
            configured = machine.config.nvidia_ctk_timeout_seconds or left
            own = round(min(configured, left / 2), 1)
        # `--mode=nvml`, the mode `auto` picks where NVML loads: `auto` asks every GPU
        # by index first (go-nvlib's HasAnIntegratedGPU), which blocks on a GPU that
        # does not answer; the `--device-id`s alone ask only the usable GPUs.
        result = generate(ids, "nvml", own)
        if result.ok and _serves(written, minors):
            return result, found, None
        log.info("nvidia-ctk cannot generate the usable GPUs' devices by UUID "
                 f"({result.why() if not result.ok else 'it served other GPUs'}): "
                 "serving them through management mode's `all`, without per-GPU devices")
    caps: set[int] = set()
    for gpu in found.usable:
        if gpu.mig and gpu.migs and gpu.minor is not None:
            caps |= mig_cap_minors(machine, gpu.minor)
    return generate(None, "management", None), found, (minors, caps)


def _serves(written: Callable[[], bytes], minors: set[int]) -> bool:
    try:
        doc = load_yaml(written())
    except Exception:  # any unreadable spec is "not what was asked"
        return False
    return served_minors(doc) == minors


def mig_cap_minors(machine: Machine, minor: int) -> set[int]:
    """The minors of the GPU's MIG access caps (/dev/nvidia-caps/nvidia-cap<M>) that
    exist now: each GPU and compute instance's `access` file says its DeviceFileMinor."""
    mig = machine.at(f"{CAPABILITIES_DIR}/gpu{minor}/mig")
    found: set[int] = set()
    try:
        with os.scandir(mig) as entries:
            gis = [e.path for e in entries
                   if e.name.startswith("gi") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return found
    for gi in gis:
        files = [f"{gi}/access"]
        try:
            with os.scandir(gi) as inner:
                files += [f"{e.path}/access" for e in inner
                          if e.name.startswith("ci") and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for path in files:
            for line in read_small(path).splitlines():
                key, _, value = line.partition(":")
                if key == "DeviceFileMinor" and value.strip().isdigit():
                    found.add(int(value))
    return found


def keeps(path: str, minors: set[int], caps: set[int]) -> bool:
    if path in CONTROL:
        return True
    minor = node_path_minor(path)
    if minor is not None:
        return minor in minors
    rest = path.removeprefix(_CAP)
    return rest != path and rest.isdigit() and int(rest) in caps


def narrow(doc: dict[str, Any], minors: set[int], caps: set[int]) -> list[str]:
    """Drop, in place, every device node of `doc` that `keeps` does not; the paths
    dropped, in spec order."""
    dropped: list[str] = []
    for edit in edits(doc):
        if not isinstance(edit.get("deviceNodes"), list):
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


def narrowed(data: bytes, minors: set[int], caps: set[int]) -> bytes:
    import yaml

    try:
        doc = load_yaml(data)
    except yaml.YAMLError:
        return data  # validation names it
    if not isinstance(doc, dict):
        return data
    dropped = narrow(doc, minors, caps)
    if dropped:
        log.info(f"left out of management mode's spec: {', '.join(dropped)}")
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text: str = yaml.dump(doc, Dumper=dumper, sort_keys=False, default_flow_style=False)
    return text.encode()


def check_served(found: NodeGpus, data: bytes, kept: str) -> None:
    """A degraded spec serves exactly the usable GPUs: never an unusable one."""
    served = served_minors(load_yaml(data))
    want = found.serve_minors()
    if served != want:
        names = ", ".join(f"/dev/nvidia{n}" for n in sorted(served ^ want))
        die(f"the spec nvidia-ctk wrote for the usable GPUs serves other GPUs than them "
            f"({names}); it was not installed",
            hint=f"{kept}; check the NVIDIA Container Toolkit version")
