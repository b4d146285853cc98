"""The GPU fault model: what a GPU's state can be and why, and every word said of it.

One home for the node's GPUs (docs/architecture.md, "The GPU fault model"):

- NVML's codes this tool names, with nvmlErrorString's text and what an operator does
  about each (`CODES`). A new NVML error is one entry there.
- `Gpu`, one GPU as the kernel module lists it and as NVML answered for it, and
  `NodeGpus`, the node's GPUs as a run found them (and as its record keeps them).
- The one reader of the kernel module's per-GPU information files, and the one walk of
  a CDI spec's container edits and device nodes.
- Every sentence `run`, `check`, `status`, STATUS= and the metrics say about GPUs.

The kernel's list: /proc/driver/nvidia/gpus/<PCI bus id>/information, one per GPU (its
"GPU UUID:", "Device Minor:" and "GPU Excluded:" lines). /proc/driver is not namespaced:
the machine reads the host kernel's. A GPU excluded on the host (NVreg_ExcludedGpus) is
listed with "GPU Excluded: Yes" and a placeholder UUID, and NVML does not enumerate it:
NVML's indices are the positions of the other GPUs in PCI bus order.

A GPU is unusable when any per-device call nvidia-ctk's NVML mode makes fails for it, or
does not answer within `nvml_gpu_timeout_seconds` (nvml.py asks, degrade.py serves the
others). Imported on every boot (the record, `served`): plain classes and str methods
only, no dataclass, no regular expression, no import beyond `os`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Machine
    from .problems import Problem

GPUS_DIR = "/proc/driver/nvidia/gpus"
RELOAD = "`systemctl reload unbounded-nvidia-setup`"
RESTART = "`systemctl restart unbounded-nvidia-setup`"

# NVML's return codes (nvml.h) this tool names.
SUCCESS = 0
NOT_SUPPORTED = 3
NO_PERMISSION = 4
INSUFFICIENT_POWER = 8
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
IRQ_ISSUE = 11
GPU_IS_LOST = 15
UNKNOWN = 999

# What an operator does, by what the code means.
_RESET = f"a GPU reset (`nvidia-smi -r`) or a reboot on the host brings it back, then {RELOAD}"
_ACCESS = ("in a container NVML answers this when the process may not open the GPU's "
           "device node: check the machine's device rules (DeviceAllow= of its "
           "systemd-nspawn unit) and the node's mode on the host, then re-bind the devices "
           f"or restart the machine, then {RELOAD}")
_HARDWARE = f"repair the host (power, PCIe), then {RESTART}"


class Code:
    """One NVML code: nvmlErrorString's text (Debian's 550 library), what it says of the
    GPU, what to do, and whether nvml.h ties it to the attached devices as a whole."""

    __slots__ = ("meaning", "node_wide", "text", "todo")

    def __init__(self, text: str, meaning: str, todo: str, node_wide: bool = False) -> None:
        self.text = text
        self.meaning = meaning
        self.todo = todo
        self.node_wide = node_wide


CODES = {
    NO_PERMISSION: Code("Insufficient Permissions", "may not be opened here", _ACCESS),
    INSUFFICIENT_POWER: Code("Insufficient External Power", "lacks external power",
                             _HARDWARE, node_wide=True),
    DRIVER_NOT_LOADED: Code("Driver Not Loaded", "has no loaded driver", _HARDWARE),
    # Not NVML's answer but this tool's, for a call that did not return within
    # nvml_gpu_timeout_seconds (Gpu.waited): NVML's own code for a time bound passed.
    TIMEOUT: Code("Timeout", "does not answer (GSP timeout, Xid 119/120)", _RESET),
    IRQ_ISSUE: Code("Interrupt Request Issue", "has an interrupt problem", _HARDWARE,
                    node_wide=True),
    GPU_IS_LOST: Code("GPU is lost", "is lost (Xid 79, fallen off the bus)", _RESET),
    UNKNOWN: Code("Unknown Error", "fails with an unknown error (Xid 119/120, GSP)", _RESET),
}
# Errors nvml.h ties to the attached devices as a whole, not to the GPU asked for.
NODE_WIDE = frozenset(c for c, v in CODES.items() if v.node_wide)
# How nvidia-ctk says that it failed on a GPU: its lookups' wrapping, and NVML's texts.
FAILURE_WORDS = ("device handle", *(c.text for n, c in CODES.items() if n != TIMEOUT))


def text(code: int, texts: dict[int, str] | None = None) -> str:
    """nvmlErrorString's text for `code`: the library's own when it was asked."""
    known = CODES.get(code)
    return (texts or {}).get(code) or (known.text if known else "an NVML error")


class Gpu:
    """One GPU. From the kernel's list: its bus id, UUID (None: the module's placeholder),
    minor and whether the host excluded it. From NVML: its index (None: not enumerated),
    MIG mode and the slots of its MIG devices, and, when it is unusable, the code and the
    call that answered it (`code`, `query`); a call that went unanswered has TIMEOUT and
    the seconds it was given (`waited`)."""

    __slots__ = ("bus_id", "code", "excluded", "index", "mig", "migs", "minor", "query",
                 "uuid", "waited")

    def __init__(self, index: int | None, bus_id: str | None = None, uuid: str | None = None,
                 minor: int | None = None, *, excluded: bool = False, mig: bool = False,
                 code: int | None = None, query: str | None = None,
                 waited: float | None = None) -> None:
        self.index = index
        self.bus_id = bus_id
        self.uuid = uuid
        self.minor = minor
        self.excluded = excluded
        self.mig = mig
        self.migs: list[int] = []  # slots with a MIG device (nvidia-ctk's `<index>:<slot>`)
        self.code = code
        self.query = query
        self.waited = waited

    @property
    def device(self) -> str | None:
        return None if self.minor is None else f"/dev/nvidia{self.minor}"

    @property
    def usable(self) -> bool:
        return self.code is None

    def _fault(self) -> Code:
        return CODES.get(self.code or UNKNOWN) or CODES[UNKNOWN]

    def name(self) -> str:
        known = [x for x in (self.uuid, self.device, self.bus_id) if x]
        what = "excluded GPU" if self.excluded else (
            "GPU" if self.index is None else f"GPU {self.index}")
        return f"{what} ({', '.join(known)})" if known else what

    def why(self, texts: dict[int, str] | None = None) -> str:
        """What NVML said of it: `NVML answers 15 (GPU is lost) to
        nvmlDeviceGetHandleByIndex`, or `NVML did not answer nvmlDeviceGetMigMode within
        10 s`."""
        call = f" {self.query}" if self.query else ""
        if self.waited is not None:
            return f"NVML did not answer{call} for it within {self.waited:g} s"
        return f"NVML answers {self.code} ({text(self.code or UNKNOWN, texts)}) to{call or ' it'}"

    def fault(self, texts: dict[int, str] | None = None) -> str:
        """`GPU 2 (GPU-…, /dev/nvidia2, 0000:37:00.0) is lost (Xid 79, fallen off the
        bus): NVML answers 15 (GPU is lost) to nvmlDeviceGetHandleByIndex`."""
        return f"{self.name()} {self._fault().meaning}: {self.why(texts)}"

    def todo(self) -> str:
        return self._fault().todo

    def record(self) -> str:
        """Its line in the run's record (outcome.py)."""
        return " ".join(["unusable", str(-1 if self.index is None else self.index),
                         "-" if self.code is None else str(self.code), self.device or "-",
                         self.uuid or "-", self.bus_id or "-", self.query or "-",
                         "-" if self.waited is None else f"{self.waited:g}"])

    @classmethod
    def from_record(cls, key: str, value: str) -> Gpu | None:
        """A record line's GPU (`unusable …`, or an older record's `lost <index> <device>
        <uuid> <bus>`); None when it does not read as one."""
        parts = value.split(" ")
        if key == "lost":
            parts = [parts[0], str(GPU_IS_LOST), *parts[1:]]
        parts += ["-"] * (7 - len(parts))
        if len(parts) != 7 or not parts[0].lstrip("-").isdigit():
            return None
        code, device, uuid, bus, query, waited = (None if p == "-" else p for p in parts[1:])
        minor = device.removeprefix("/dev/nvidia") if device else None
        try:
            return cls(int(parts[0]) if parts[0] != "-1" else None, bus, uuid,
                       int(minor) if minor and minor.isdigit() else None,
                       code=None if code is None else int(code), query=query,
                       waited=None if waited is None else float(waited))
        except ValueError:
            return None

    def __repr__(self) -> str:
        return (f"Gpu({self.index!r}, code={self.code!r}, device={self.device!r}, "
                f"query={self.query!r}, waited={self.waited!r})")


class NodeGpus:
    """The node's GPUs as a run found them. On a healthy node nothing was asked and it is
    empty. After a failed generate: every GPU NVML enumerates (`gpus`, usable or not,
    index order), an error of all attached devices (`node_error`: then none is usable),
    NVML's own texts, and the kernel's view then (`kernel`, `fingerprint`). Read back
    from the run's record it holds the unusable GPUs only, whether any GPU was served,
    and how many reloads since left the node as it is (`attempts`)."""

    __slots__ = ("attempts", "gpus", "kernel", "node_error", "serves", "texts")

    def __init__(self, gpus: list[Gpu] | None = None, node_error: int | None = None, *,
                 serves: bool = True, kernel: str | None = None, attempts: int = 0,
                 texts: dict[int, str] | None = None) -> None:
        self.gpus = gpus or []
        self.node_error = node_error
        self.serves = serves and node_error is None
        self.kernel = kernel
        self.attempts = attempts
        self.texts = texts or {}

    @property
    def unusable(self) -> list[Gpu]:
        return [g for g in self.gpus if not g.usable]

    @property
    def usable(self) -> list[Gpu]:
        return [g for g in self.gpus if g.usable]

    @property
    def degraded(self) -> bool:
        return bool(self.unusable) or not self.serves

    def serve_minors(self) -> set[int]:
        """The /dev/nvidia<N> a spec for the usable GPUs gives containers: a MIG-enabled
        GPU only through its MIG devices (none without them), as NVML mode's `all`."""
        if self.node_error is not None:
            return set()
        return {g.minor for g in self.usable if g.minor is not None and (g.migs or not g.mig)}

    def device_ids(self) -> list[str]:
        """nvidia-ctk's `--device-id` values for the usable GPUs, as its own `all` lists
        them: a GPU by UUID, a MIG-enabled one by its MIG devices (`<index>:<slot>`)."""
        ids: list[str] = []
        for gpu in self.usable:
            if gpu.mig:
                ids += [f"{gpu.index}:{slot}" for slot in gpu.migs]
            elif gpu.uuid is not None:
                ids.append(gpu.uuid)
        return ids

    def record(self) -> list[str]:
        """Its lines in the run's record (outcome.py)."""
        lines = [g.record() for g in self.unusable]
        if self.node_error is not None:
            lines.append(f"node_error {self.node_error}")
        if not self.serves:
            lines.append("serves_none 1")
        if self.kernel:
            lines.append(f"kernel {self.kernel}")
        if self.attempts:
            lines.append(f"attempts {self.attempts}")
        return lines

    def counted_after(self, previous: NodeGpus | None) -> NodeGpus:
        """This reload's GPUs, counting it towards the drift check's backoff (drift.py)
        when it leaves a degraded node degraded."""
        if self.degraded and previous is not None and previous.degraded:
            self.attempts = previous.attempts + 1
        return self


# ------------------------------------------------------------------- the kernel's list


def is_uuid(value: str) -> bool:
    """GPU-<hex and dashes>: not the module's placeholder for a GPU it has not set up."""
    rest = value.removeprefix("GPU-")
    return rest != value and len(rest) >= 32 and set(rest) <= _HEX


_HEX = frozenset("0123456789abcdefABCDEF-")
_FIELDS = ("GPU UUID", "Device Minor", "GPU Excluded")
_MAX_INFO = 1 << 14


def read_small(path: str | os.PathLike[str]) -> str:
    """A small file's first 16 KiB (a /proc file of the module's, the run's record);
    empty when it cannot be read. Never through a symlink, nor waiting on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            return os.read(fd, _MAX_INFO).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError:
        return ""


def _buses(machine: Machine) -> tuple[str, list[str]]:
    top = str(machine.at(GPUS_DIR))
    try:
        return top, sorted(os.listdir(top))
    except OSError:
        return top, []


def kernel_gpus(machine: Machine) -> list[Gpu]:
    """The GPUs the loaded module lists, in PCI bus order; empty when it lists none (or
    cannot be read). NVML's index is the position among those not excluded."""
    top, buses = _buses(machine)
    found = []
    index = 0
    for bus in buses:
        fields = {}
        for line in read_small(f"{top}/{bus}/information").splitlines():
            key, sep, value = line.partition(":")
            words = value.split()
            if sep and key in _FIELDS and len(words) == 1:
                fields[key] = words[0]
        uuid = fields.get("GPU UUID", "")
        minor = fields.get("Device Minor", "")
        excluded = fields.get("GPU Excluded", "").lower() == "yes"
        found.append(Gpu(None if excluded else index, bus, uuid if is_uuid(uuid) else None,
                         int(minor) if minor.isdigit() else None, excluded=excluded))
        index += not excluded
    return found


def fingerprint(machine: Machine) -> str:
    """What the kernel shows of the GPUs now (bus ids and information files), as a
    short digest: the drift check asks NVML again early only when it changed."""
    import zlib

    top, buses = _buses(machine)
    crc = 0
    for bus in buses:
        crc = zlib.crc32(f"{bus}\0{read_small(f'{top}/{bus}/information')}\0".encode(), crc)
    return f"{len(buses)}-{crc:08x}"


# ------------------------------------------------------------------------ a spec's walk


def edits(doc: Any) -> list[dict[str, Any]]:
    """Every containerEdits of a spec: the common edits, then each device's."""
    if not isinstance(doc, dict):
        return []
    found = [doc.get("containerEdits")]
    found += [d.get("containerEdits") for d in doc.get("devices") or [] if isinstance(d, dict)]
    return [e for e in found if isinstance(e, dict)]


def device_nodes(doc: Any) -> list[dict[str, Any]]:
    """Every deviceNodes entry of a spec, in any device or its common edits."""
    return [node for edit in edits(doc) for node in edit.get("deviceNodes") or []
            if isinstance(node, dict)]


def node_path_minor(path: str) -> int | None:
    """N of /dev/nvidia<N>; None for any other node."""
    rest = path.removeprefix("/dev/nvidia")
    return int(rest) if rest != path and rest.isdigit() else None


def served_minors(doc: Any) -> set[int]:
    """The /dev/nvidia<N> a spec gives containers (by each node's path in them)."""
    served = set()
    for node in device_nodes(doc):
        minor = node_path_minor(str(node.get("path", "")))
        if minor is not None:
            served.add(minor)
    return served


# ----------------------------------------------------------------------- what is said


def report(machine: Machine, doc: Any, found: NodeGpus,
           spec: str) -> tuple[dict[str, Any], list[Problem]]:
    """`check --json`'s `gpus` section and the GPUs' problems. The section: what the
    kernel lists, and what the installed spec (`doc`, None without one, at `spec`)
    serves of it, counted from the spec on every node. The problems: `gpu-lost` /
    `gpu-unusable` for each GPU the last run found NVML cannot use and the spec still
    leaves out, `no-usable-gpu` when it serves none (the verdict `degraded` or
    `no-usable-gpu` when nothing else is wrong). A GPU the spec leaves out for another
    reason (excluded, a MIG-enabled GPU without MIG devices, a GPU that arrived since) is
    no problem of this kind."""
    from .problems import Problem

    kernel = kernel_gpus(machine)
    listed = [g for g in kernel if not g.excluded]
    served = served_minors(doc) if doc is not None else set()
    out = [g for g in found.unusable if not found.serves or g.minor not in served]
    entries = [{"index": g.index, "uuid": g.uuid, "device": g.device, "bus_id": g.bus_id,
                "nvml_error": g.code, "nvml_error_text": text(g.code or UNKNOWN),
                "query": g.query, "timeout_seconds": g.waited} for g in out]
    count = len({g.minor for g in listed if g.minor in served})
    section = {"listed": len(listed), "served": count,
               "lost": [{k: e[k] for k in ("index", "uuid", "device", "bus_id")}
                        for e in entries if e["nvml_error"] == GPU_IS_LOST],
               "unusable": entries,
               "excluded": sorted(g.bus_id or "" for g in kernel if g.excluded),
               "node_error": found.node_error}
    problems = []
    for gpu in out:
        code = "gpu-lost" if gpu.code == GPU_IS_LOST else "gpu-unusable"
        problems.append(Problem(code, f"{gpu.fault()} when the spec was generated; it is not "
                                f"in {spec}, which serves {count} of {len(listed)} GPUs; "
                                f"{gpu.todo()}", str(machine.at(gpu.device or "/dev"))))
    if not found.serves:
        node = found.node_error
        if node is not None:
            why = (f"NVML answered {node} ({text(node)}), an error of the attached GPUs, "
                   f"no single GPU's; {(CODES[node] if node in CODES else CODES[UNKNOWN]).todo}")
        else:
            why = "NVML could use none of them"
        problems.append(Problem(
            "no-usable-gpu", f"this node serves none of its {len(listed)} GPUs: {why}; no "
            f"CDI spec is installed at {spec}, so a pod that asks for nvidia.com/gpu fails "
            "to start; keep GPU pods off this node", spec))
    return section, problems


def plugin_problems(found: NodeGpus, doc: Any, path: str, written: str) -> list[Problem]:
    """`plugin-spec-unusable-gpu`: the device plugin's spec (`doc`, written at `written`)
    lists a GPU the last run found NVML cannot use. The plugin wrote it before, and its
    health check reacts to Xids only: a pod it allocates that GPU to fails."""
    from .problems import Problem

    listed = served_minors(doc)
    return [Problem("plugin-spec-unusable-gpu",
                    f"{path} (written {written}) lists {g.name()}, which the last run found "
                    f"unusable ({g.why()}); a pod the device plugin allocates it to fails: "
                    "restart the device plugin's pod once the GPU is reset or excluded on "
                    "the host", path)
            for g in found.unusable if g.minor is not None and g.minor in listed]


def warnings(found: NodeGpus) -> list[str]:
    """What a run logs of the GPUs it found unusable, one line each."""
    if found.node_error is not None:
        code = found.node_error
        return [f"NVML answers {code} ({text(code, found.texts)}) for the node's GPUs, an "
                "error of the attached devices, no single GPU's: no GPU is served and no CDI "
                "spec is installed; keep GPU pods off this node and "
                + (CODES[code].todo if code in CODES else _HARDWARE)]
    usable = len(found.serve_minors())
    lines = []
    if not usable:
        lines.append(f"NVML can use none of the {len(found.gpus)} GPUs of this node: no GPU "
                     "is served and no CDI spec is installed; keep GPU pods off this node")
    for gpu in found.unusable:
        lines.append(gpu.fault(found.texts)
                     + (f"; the spec serves the {usable} GPUs NVML can use" if usable else "")
                     + f"; {gpu.todo()}")
    return lines


def status_word(found: NodeGpus, served: int, listed: int) -> str:
    """STATUS='s first words after a run or reload: `systemctl status` shows them."""
    bad = ", ".join(f"{g.name()} {'lost' if g.code == GPU_IS_LOST else 'unusable'}"
                    for g in found.unusable)
    if not found.serves:
        return (f"Up without GPUs: this node serves none of its {listed} GPUs"
                + (f" ({bad})" if bad else "") + "; no CDI spec is installed: keep GPU pods "
                "off this node")
    if found.degraded:
        return f"Ready (degraded): the spec serves {served} of {listed} GPUs, {bad}"
    return "Ready" if served >= listed else f"Ready: the spec serves {served} of {listed} GPUs"


def status_lines(gpus: dict[str, Any]) -> list[str]:
    """`status`'s GPU lines, from `check`'s `gpus` section."""
    if not gpus or not gpus["listed"]:
        return []
    bad = ", ".join(
        f"GPU {g['index']} ({g['uuid'] or g['device'] or '-'}, "
        + (f"NVML {g['nvml_error']}" if g["timeout_seconds"] is None
           else f"no answer within {g['timeout_seconds']:g} s") + ")"
        for g in gpus["unusable"])
    lines = [f"GPUs:           the spec serves {gpus['served']} of {gpus['listed']} GPUs"
             + (f" (unusable: {bad})" if bad else "")]
    if gpus["excluded"]:
        lines.append(f"                excluded on the host: {', '.join(gpus['excluded'])}")
    return lines


# The metrics of `check`'s `gpus` section (metrics.py writes them): name, help, value.
METRICS = (
    # Listed and served apart, both as the node shows them: `served < listed` is a node
    # serving fewer GPUs than it has, for a fault (gpu-lost, gpu-unusable) or by design
    # (a MIG-enabled GPU without MIG devices); the problem codes tell the two apart.
    ("gpus", "GPUs the kernel module lists (/proc/driver/nvidia/gpus) and NVML "
     "enumerates: those the host excluded are not counted.", lambda g: g.get("listed", 0)),
    ("gpus_served", "GPUs of those whose device node the installed CDI spec serves.",
     lambda g: g.get("served", 0)),
    ("gpus_excluded", "GPUs the host excluded (NVreg_ExcludedGpus): listed by the kernel "
     "module, never served.", lambda g: len(g.get("excluded", []))),
)
