"""What the spec serves of the node's GPUs, as `check` reports it: the GPUs the last
run found NVML could not use (outcome.py), the ones the host excluded, and how many of
the others the spec serves. Only a run asks NVML (nvml.py); check reads the run's
record beside the files.
"""

from __future__ import annotations

from typing import Any

from . import outcome
from .config import Machine
from .problems import Problem

# Measured with NVIDIA's device plugin v0.20.0 (tests/test_device_plugin.py): its device
# map asks NVML for every GPU by index at its start, and a GPU NVML cannot use ends the
# process ("error building GPU device map: error getting device handle for index 'N':
# GPU is lost"). It registers nothing and writes no spec: while a GPU is unusable, no pod
# gets a GPU through it, whatever our spec serves. Nothing in our root or spec can
# change that.
PLUGIN_WORD = ("NVIDIA's device plugin (v0.20) exits at its start while NVML cannot use "
               "one of the GPUs, so nothing is allocated through it on this node")


def check_gpus(machine: Machine, sections: dict[str, dict[str, Any]], doc: Any,
               found: outcome.Gpus) -> list[Problem]:
    """On a node whose last run left GPUs out (state.py counts a healthy node's itself,
    without importing this module). Each GPU the last run found NVML could not use
    (outcome.py) and left out of the spec is `gpu-lost` (NVML's GPU_IS_LOST) or `gpu-
    unusable` (another error) while the spec still does not serve it: the verdict is
    `degraded` when nothing else is wrong. No GPU usable at all is `no-usable-gpu`. Only
    a run asks NVML; check reads the run's record, which names the GPUs of the live spec
    (a run proving its end state passes its own). A GPU the spec leaves out for another
    reason (excluded on the host, a MIG-enabled GPU without MIG devices, a GPU that
    arrived since) is not reported."""
    from . import gpus, nvml

    kernel = gpus.kernel_gpus(machine)
    listed = [g for g in kernel if not g.excluded]
    served = gpus.served_minors(doc) if doc is not None else set()
    count = len({g.minor for g in listed if g.minor in served})
    left_out = [u for u in found.unusable
                if found.serves_none or u.device is None
                or gpus.node_path_minor(u.device) not in served]
    entries = [{"index": u.index, "uuid": u.uuid, "device": u.device, "bus_id": u.bus_id,
                "nvml_error": u.code, "nvml_error_text": nvml.TEXTS.get(u.code)}
               for u in left_out]
    sections["gpus"] = {
        "listed": len(listed), "served": count,
        "lost": [{k: e[k] for k in ("index", "uuid", "device", "bus_id")}
                 for e in entries if e["nvml_error"] == nvml.GPU_IS_LOST],
        "unusable": entries, "excluded": sorted(g.bus_id for g in kernel if g.excluded),
        "node_error": found.node_error}
    spec = machine.cdi_spec
    problems = []
    for u in left_out:
        what = ", ".join(x for x in (u.uuid, u.device, u.bus_id) if x)
        name = f"GPU {u.index}" + (f" ({what})" if what else "")
        text = nvml.TEXTS.get(u.code, "an NVML error")
        code = "gpu-lost" if u.code == nvml.GPU_IS_LOST else "gpu-unusable"
        why = ("lost (GPU_IS_LOST, Xid 79: fallen off the bus)" if u.code == nvml.GPU_IS_LOST
               else f"unusable ({u.code}, {text})")
        problems.append(Problem(
            code, f"{name} is not in {spec}: NVML reported it {why} when the spec was "
            f"generated; the spec serves {count} of {len(listed)} GPUs; {PLUGIN_WORD}",
            str(machine.at(u.device or "/dev"))))
    if found.serves_none:
        why = (f"NVML answered {found.node_error} "
               f"({nvml.TEXTS.get(found.node_error, 'an NVML error')}), an error of the "
               "attached GPUs, no single GPU's" if found.node_error is not None
               else "NVML could use none of them")
        problems.append(Problem(
            "no-usable-gpu", f"this node serves none of its {len(listed)} GPUs: {why}; no "
            f"CDI spec is installed at {spec}, so a pod that asks for nvidia.com/gpu fails "
            "to start; keep GPU pods off this node and repair the host",
            str(spec)))
    return problems
