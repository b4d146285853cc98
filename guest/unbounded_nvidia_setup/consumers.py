"""The CDI specs NVIDIA's other consumers of the driver root write on this node.

Ours (/etc/cdi/nvidia.yaml) is rebuilt by every run and the device plugin's has checks
of its own (state.py). Beside them, the GPU Operator's toolkit operand writes a
management spec when its pod starts, and NVIDIA's DRA driver a spec per claim and one
base spec when its kubelet plugin starts (docs/nvidia-stack.md). Each names the files
of the root as they were then: after a swap to another driver they name files the root
no longer has, and every pod created through them fails as the incident's pods did,
while the node looks right. `check` and `status` read them (never `run`: a healthy boot
pays nothing); they are never ours to rewrite or remove, so the step is their owner's
pod restart.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Machine
from .problems import Problem
from .spec import host_path, mount_paths
from .spec import load as load_spec

SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")
# A directory holding more is no CDI directory of a node's: the walk stops there.
_MAX_SPECS = 4096
# The driver version a spec names, from the libraries it mounts.
_VERSIONED = re.compile(r"lib(?:cuda|nvidia-ml)\.so\.(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class Consumer:
    """Who writes a spec, told by its kind or, failing that, its file name (FACTS.md)."""

    name: str  # for people: "the GPU Operator's toolkit"
    short: str  # for JSON and status: "gpu-operator-toolkit"
    kinds: tuple[str, ...]
    files: tuple[str, ...]  # fnmatch patterns of the file name
    step: str  # what rewrites the spec


# Ours by its path alone (who()), and checked by state.py, not here.
OURS = Consumer("unbounded-nvidia-setup", "unbounded-nvidia-setup", (), (),
                "`systemctl reload unbounded-nvidia-setup`")
DEVICE_PLUGIN = Consumer(
    "NVIDIA's device plugin", "device-plugin", (), ("k8s.device-plugin.nvidia.com-*",),
    "restart the device plugin's pod on this node")
CONSUMERS = (
    Consumer("the GPU Operator's toolkit", "gpu-operator-toolkit",
             ("management.nvidia.com/gpu",), ("management.nvidia.com-*",),
             "restart the GPU Operator's nvidia-container-toolkit pod on this node (it writes "
             "this spec when it starts)"),
    Consumer("NVIDIA's DRA driver (a claim)", "dra-driver-claim",
             ("k8s.gpu.nvidia.com/claim",), ("k8s.gpu.nvidia.com-claim_*",),
             "restart the DRA driver's kubelet plugin pod on this node (its containers keep "
             "the driver root they started with), then the pods of that claim"),
    Consumer("NVIDIA's DRA driver (compute domains)", "dra-driver-compute-domain",
             ("k8s.compute-domain.nvidia.com/*",), ("k8s.compute-domain.nvidia.com-*",),
             "restart the DRA driver's kubelet plugin pod on this node (it writes this "
             "spec when it starts)"),
)
OTHER = Consumer("another NVIDIA consumer", "other", ("*nvidia.com/*",), (),
                 "restart the pod that wrote it")


@dataclass
class NvidiaSpec:
    path: Path
    consumer: Consumer
    kind: str | None = None
    versions: list[str] = field(default_factory=list)  # the driver versions it names
    missing: list[str] = field(default_factory=list)  # root files it mounts, now gone
    error: str | None = None

    def matches(self, live: str | None) -> bool:
        return not self.missing and not self.error and self.versions in ([], [live])

    def to_json(self, live: str | None) -> dict[str, Any]:
        found: dict[str, Any] = {
            "path": str(self.path), "consumer": self.consumer.short, "kind": self.kind,
            "driver_versions": self.versions, "missing": len(self.missing),
            "matches_live_root": self.matches(live)}
        if self.error:
            found["error"] = self.error
        return found


def who(path: Path, kind: str | None, machine: Machine) -> Consumer | None:
    """The consumer a spec belongs to; None for a spec that is not NVIDIA's. Ours is ours
    by its path alone: a /var/run/cdi/nvidia.yaml of the same kind is nvidia-cdi-refresh's
    (`spec-shadowed`)."""
    name = path.name
    if path == machine.cdi_spec:
        return OURS
    if fnmatch.fnmatch(name, DEVICE_PLUGIN.files[0]):
        return DEVICE_PLUGIN
    for consumer in CONSUMERS:
        if kind is not None and any(fnmatch.fnmatch(kind, k) for k in consumer.kinds):
            return consumer
    for consumer in CONSUMERS:
        if any(fnmatch.fnmatch(name, f) for f in consumer.files):
            return consumer
    if kind is not None and fnmatch.fnmatch(kind, OTHER.kinds[0]):
        return OTHER
    return None


def _spec_files(machine: Machine) -> list[Path]:
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for directory in SPEC_DIRS:
        path = machine.at(directory)
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in seen:  # /var/run is /run, and may be /etc/cdi's
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries if e.name.endswith(_SPEC_SUFFIXES))
        except OSError:
            continue
        found += [path / n for n in names[:_MAX_SPECS]]
    return found


def read(machine: Machine, loaded: dict[Path, tuple[Any, str | None]]) -> list[NvidiaSpec]:
    """Every NVIDIA spec in /etc/cdi and /var/run/cdi, with the driver versions it names
    and the files of the driver root it mounts that the root no longer has. `loaded`:
    specs `check` has read already (ours, the device plugin's), not read again."""
    root = f"{machine.driver_root}/"
    specs: list[NvidiaSpec] = []
    for path in _spec_files(machine):
        doc, why = loaded[path] if path in loaded else load_spec(path)
        kind = doc.get("kind") if isinstance(doc, dict) else None
        kind = kind if isinstance(kind, str) else None
        consumer = who(path, kind, machine)
        if consumer is None:
            continue
        spec = NvidiaSpec(path, consumer, kind, error=why)
        if isinstance(doc, dict):
            mounts = [m for m in mount_paths(doc) if m]
            spec.versions = sorted({v for m in mounts for v in _VERSIONED.findall(
                os.path.basename(m))})
            seen = [(m, str(host_path(machine, m))) for m in mounts]
            spec.missing = [m for m, host in seen
                            if host.startswith(root) and not os.path.lexists(host)]
        specs.append(spec)
    return specs


def problems(specs: list[NvidiaSpec]) -> list[Problem]:
    """A consumer's spec naming files the live root no longer has. Ours and the device
    plugin's are left to their own checks (spec-*, plugin-spec-*)."""
    found = []
    for spec in specs:
        if spec.consumer in (OURS, DEVICE_PLUGIN) or not spec.missing:
            continue
        drivers = f" (driver {', '.join(spec.versions)})" if spec.versions else ""
        more = f" and {len(spec.missing) - 1} more" if len(spec.missing) > 1 else ""
        found.append(Problem(
            "consumer-spec-stale", f"{spec.path}, written by {spec.consumer.name}{drivers}, "
            f"mounts {spec.missing[0]}{more}, which the live driver root no longer has: pods "
            f"created through it fail; {spec.consumer.step}", str(spec.path)))
    return found


def status_lines(section: list[dict[str, Any]]) -> list[str]:
    """`status`: one line per NVIDIA spec, from check's `nvidia_specs` section."""
    lines: list[str] = []
    for spec in section:
        names = ", ".join(spec["driver_versions"]) or "no driver version"
        if spec.get("error"):
            verdict = f"unreadable ({spec['error']})"
        elif spec["missing"]:
            verdict = f"stale: {spec['missing']} file(s) gone from the live root"
        elif spec["matches_live_root"]:
            verdict = "matches the live root"
        else:
            verdict = "names another driver than the live root's"
        label = "NVIDIA specs:" if not lines else ""
        lines.append(f"{label:<16}{spec['consumer']} {spec['path']}: {names}; {verdict}")
    return lines
