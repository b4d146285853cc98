"""A generate that failed on a GPU's NVML handle: the node degrades, it never darkens.

Imported only when nvidia-ctk's generate failed on a device handle (cdi.Generator.spec):
a healthy boot never pays for it (a module costs every boot about 5M instructions to
import, docs/performance.md). What it does is docs/architecture.md's "A GPU NVML cannot
use".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import log
from .config import load_yaml
from .log import die
from .run import Result

if TYPE_CHECKING:
    from .cdi import Generator
    from .gpus import Assessment


def degrade(generator: Generator, failed: Result) -> Result | None:
    """A GPU that NVML cannot use degrades the node, it never darkens it (DESIGN,
    2026-12-04 and 2026-12-05). NVML is asked by index which GPUs it can use
    (nvml.py), never trusting a lookup by UUID. nvidia-ctk is then asked for those
    GPUs by `--device-id`, which keeps its per-GPU devices. Where NVML's lookups by
    UUID fail for another GPU's sake, that fails too, and management mode's `all`,
    cut down to the usable GPUs (narrow.py), serves them. `failed` stands when NVML
    answers for every GPU or cannot be asked; None when no GPU is usable."""
    from . import nvml
    from .gpus import assess, mig_cap_minors

    answer = nvml.ask(generator.machine)
    assessment = assess(generator.machine, answer) if answer is not None else None
    if assessment is None:
        return failed
    generator.assessment = assessment
    _warn(assessment)
    if assessment.serves_none:
        return None
    minors = assessment.serve_minors()
    ids = assessment.device_ids()
    if ids:
        result = generator.generate(ids).wait()
        if result.ok and _serves(generator, minors):
            return result
        log.info("nvidia-ctk cannot generate the usable GPUs' devices by UUID "
                 f"({result.why() if not result.ok else 'it served other GPUs'}): "
                 "serving them through management mode's `all`, without per-GPU devices")
    caps: set[int] = set()
    for gpu in assessment.usable:
        if gpu.mig and gpu.migs and gpu.minor is not None:
            caps |= mig_cap_minors(generator.machine, gpu.minor)
    generator.narrow_to = minors, caps
    return generator.generate(mode="management").wait()


def _serves(generator: Generator, minors: set[int]) -> bool:
    from .gpus import served_minors

    try:
        doc = load_yaml(generator.output())
    except Exception:  # any unreadable spec is "not what was asked"
        return False
    return served_minors(doc) == minors


def narrowed(data: bytes, minors: set[int], caps: set[int]) -> bytes:
    import yaml

    from .narrow import narrowed as cut

    try:
        doc = load_yaml(data)
    except yaml.YAMLError:
        return data  # validation names it
    if not isinstance(doc, dict):
        return data
    dropped = cut(doc, minors, caps)
    if dropped:
        log.info(f"left out of management mode's spec: {', '.join(dropped)}")
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text: str = yaml.dump(doc, Dumper=dumper, sort_keys=False, default_flow_style=False)
    return text.encode()


def check_served(assessment: Assessment, data: bytes) -> None:
    """A degraded spec serves exactly the usable GPUs: never an unusable one."""
    from .gpus import served_minors

    served = served_minors(load_yaml(data))
    want = assessment.serve_minors()
    if served != want:
        names = ", ".join(f"/dev/nvidia{n}" for n in sorted(served ^ want))
        die(f"the spec nvidia-ctk wrote for the usable GPUs serves other GPUs than them "
            f"({names}); it was not installed",
            hint="the previous driver root and spec were kept; check the NVIDIA "
                 "Container Toolkit version")


def _warn(assessment: Assessment) -> None:
    from . import nvml

    if assessment.node_error is not None:
        code = assessment.node_error
        log.warn(f"NVML answers {code} ({assessment_text(assessment, code)}) for the node's "
                 "GPUs, an error of the attached devices, no single GPU's: no GPU is served "
                 "and no CDI spec is installed; keep GPU pods off this node and repair the "
                 "host (power, PCIe), then `systemctl restart unbounded-nvidia-setup`")
        return
    usable = len(assessment.serve_minors())
    if not usable:
        log.warn(f"NVML can use none of the {assessment.count} GPUs of this node: no GPU "
                 "is served and no CDI spec is installed; keep GPU "
                 "pods off this node and repair the host (a GPU reset or a reboot), then "
                 "`systemctl reload unbounded-nvidia-setup`")
    for gpu, code in assessment.unusable:
        what = "is lost (Xid 79, fallen off the bus)" if code == nvml.GPU_IS_LOST else \
            "cannot be used"
        log.warn(f"{gpu.describe()} {what}: NVML answers {code} "
                 f"({assessment_text(assessment, code)}) for it"
                 + (f"; the spec serves the {usable} GPUs NVML can use" if usable else "")
                 + "; a GPU reset or reboot on the host brings it back, then "
                 "`systemctl reload unbounded-nvidia-setup`")


def assessment_text(assessment: Assessment, code: int) -> str:
    from . import nvml

    return assessment.texts.get(code) or nvml.TEXTS.get(code) or "an NVML error"
