"""GPU pods: a real container runtime starts a container from a CDI spec, as on a node.

Debian's podman applies CDI specs with the same library (tags.cncf.io/container-device-
interface) that containerd uses; runc runs the container and the spec's createContainer
hooks (nvidia-cdi-hook's create-symlinks and update-ldcache). The container's root is
tests/images.py's probe tree, made from this machine's own python3, glibc and ldconfig
(no debootstrap), mounted as an overlay per container (``--rootfs DIR:O``), so nothing a
container does reaches the cache.

Each pod runs in a private mount namespace (``unshare --mount --propagation private``)
where the spec directories given are bind-mounted over ``/etc/cdi`` and
``/var/run/cdi`` (podman reads both; an empty directory when none is given), and where
each ``hide`` path gets an empty tmpfs over it: that is how a pod's runtime sees a node
whose staging mounts (``/run/host-nvidia``) are not there. ``before`` commands run in that
namespace first (the device plugin generating its own spec with the staging hidden).

Every call is bounded in time (:data:`TIMEOUT`); a pod that cannot start fails with the
runtime's own message. :func:`probe` runs :data:`PROBE` in the container: what a CUDA
program would meet, as one JSON object.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import images

TIMEOUT = 60.0
TOOLS = ("podman", "runc", "unshare")
# Podman's defaults that fail here (FACTS.md): crun refuses hybrid cgroups, and the
# default ulimits cannot be set in this sandbox.
PODMAN_RUN = ("podman", "--runtime", "runc", "run", "--rm", "--network", "none",
              "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")

# Runs inside the container with its python3: the GPU userspace a CUDA program meets.
PROBE = r"""
import ctypes, glob, json, os, subprocess
r = {"devices": sorted(os.path.basename(p) for p in glob.glob("/dev/nvidia*"))}
driver = ("libcuda.so", "libnvidia-ml.so")
ldconfig_p = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
r["ldconfig_p"] = [x.strip() for x in ldconfig_p.splitlines() if x.strip().startswith(driver)]
cache = {}
for line in r["ldconfig_p"]:
    name, _, path = line.partition(" => ")
    cache.setdefault(name.split(" (")[0], path)
r["ldcache"] = {k: [v, os.path.realpath(v)] for k, v in cache.items()}
def call(lib, fn, *args):
    try:
        return getattr(ctypes.CDLL(lib), fn)(*args)
    except OSError as e:
        return str(e)
r["nvmlInit_v2"] = call("libnvidia-ml.so.1", "nvmlInit_v2")
r["cuInit"] = call("libcuda.so.1", "cuInit", 0)
try:
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
    r["nvidia_smi"] = [smi.returncode, (smi.stdout + smi.stderr).strip()]
except FileNotFoundError as e:
    r["nvidia_smi"] = [None, str(e)]
print(json.dumps(r))
"""


NVML_ERROR_DRIVER_NOT_LOADED = 9
CUDA_SUCCESS = 0
SMI_NO_DRIVER = "couldn't communicate with the NVIDIA driver"
SMI_NO_NVML = "couldn't find libnvidia-ml.so library in your system"


def missing(report: dict[str, Any], version: str) -> list[str]:
    """What a GPU pod of driver ``version`` should get and did not, by :data:`PROBE`'s
    ``report`` (empty: everything): without a GPU, NVML answers 9
    (NVML_ERROR_DRIVER_NOT_LOADED), cuInit a CUDA error code, and nvidia-smi that it
    could not reach the driver, which it says only once it has loaded NVML."""
    gaps = []
    if not {"nvidia0", "nvidiactl"} <= set(report["devices"]):
        gaps.append("/dev/nvidia0 and /dev/nvidiactl")
    for soname, stem in (("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia-ml.so")):
        if soname not in report["ldcache"]:
            gaps.append(f"{soname} in the linker cache")
        elif os.path.basename(report["ldcache"][soname][1]) != f"{stem}.{version}":
            gaps.append(f"{soname} resolving to {stem}.{version}")
    if report["nvmlInit_v2"] != NVML_ERROR_DRIVER_NOT_LOADED:
        gaps.append("nvmlInit_v2 answering 9")
    if not isinstance(report["cuInit"], int) or report["cuInit"] == CUDA_SUCCESS:
        gaps.append("cuInit answering a CUDA error code")
    if SMI_NO_DRIVER not in report["nvidia_smi"][1]:
        gaps.append("nvidia-smi loading NVML")
    return gaps


class PodUnavailable(RuntimeError):
    """A container runtime cannot run here (not root, podman or runc missing)."""


def unavailable() -> str | None:
    """Why pods cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root (podman as root, mount namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (tests/install-deps installs podman and runc)"
    return None


@dataclass
class Pod:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).strip()

    def report(self) -> dict[str, Any]:
        """The JSON object :data:`PROBE` printed (the last line of stdout)."""
        assert self.code == 0, f"pod failed ({self.code}): {self.output}"
        lines = self.stdout.strip().splitlines()
        assert lines, f"pod printed nothing: {self.output}"
        found: dict[str, Any] = json.loads(lines[-1])
        return found


def image() -> Path:
    """The container image: tests/images.py's probe tree (built on first use, about a
    second, from this machine's own files)."""
    return images.probe_root()


# Shell lines that set up a pod's mount namespace (run's ``setup``), one job each.
def bind(source: Path, target: Path) -> str:
    return f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}"


def tmpfs(target: Path) -> str:
    return f"mount -t tmpfs -o size=1g,mode=755 none {shlex.quote(str(target))}"


def copy(source: Path, target: Path) -> str:
    return f"cp -a {shlex.quote(str(source))} {shlex.quote(str(target))}"


def add_files(source: Path, target: Path) -> str:
    """The files of directory ``source`` appear in ``target`` too (a read-only overlay)."""
    return (f"mount -t overlay overlay -o lowerdir={shlex.quote(f'{source}:{target}')} "
            f"{shlex.quote(str(target))}")


def dev_with(nodes: Sequence[Path], scratch: Path) -> list[str]:
    """/dev as the host's plus the device nodes ``nodes`` (copied): a tmpfs over /dev
    holding links to the host's entries (kept reachable at ``scratch``, an empty
    directory) and the copies. The CDI library stats each spec device's host path."""
    q = shlex.quote
    lines = [f"mount --rbind /dev {q(str(scratch))}", tmpfs(Path("/dev")),
             f"for e in {q(str(scratch))}/*; do ln -s \"$e\" /dev/; done"]
    return lines + [copy(node, Path("/dev") / node.name) for node in nodes]


def run(device: str, argv: Sequence[str], *, etc_cdi: Path | None = None,
        run_cdi: Path | None = None, hide: Sequence[Path] = (), setup: Sequence[str] = (),
        before: Sequence[Sequence[str]] = (), timeout: float = TIMEOUT) -> Pod:
    """Start a container with ``--device DEVICE`` (e.g. ``nvidia.com/gpu=all``) running
    ``argv``, with the CDI specs of ``etc_cdi`` and ``run_cdi`` (an empty directory for
    None) and an empty tmpfs over each ``hide`` path; ``setup`` (shell lines made by
    the helpers above) runs first, ``before`` (commands) last. See the module doc."""
    why = unavailable()
    if why is not None:
        raise PodUnavailable(why)
    name = f"unb-pod-{uuid.uuid4().hex[:12]}"
    podman = [*PODMAN_RUN, "--name", name, "--device", device, "--rootfs",
              f"{image()}:O", *argv]
    lines = ["set -e", *setup]
    for specs, target in ((etc_cdi, Path("/etc/cdi")), (run_cdi, Path("/var/run/cdi"))):
        os.makedirs(target, exist_ok=True)
        lines.append(tmpfs(target) if specs is None else bind(specs, target))
    lines += [tmpfs(path) for path in hide]
    lines += [" ".join(shlex.quote(a) for a in cmd) for cmd in before]
    lines.append("exec " + " ".join(shlex.quote(a) for a in podman))
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["podman", "rm", "--force", "--time", "0", name],
                       capture_output=True, timeout=60, check=False)
        raise AssertionError(f"pod {name} did not finish within {timeout:.0f} s: "
                             f"{e.stdout!r} {e.stderr!r}") from None
    return Pod(proc.returncode, proc.stdout, proc.stderr)


def probe(device: str = "nvidia.com/gpu=all", **kwargs: Any) -> Pod:
    """:func:`run` of :data:`PROBE` with the container's python3."""
    return run(device, ["python3", "-c", PROBE], **kwargs)


def spec_without(spec: Path, out_dir: Path, *, hook: str | None = None,
                 mounts: tuple[str, ...] = ()) -> Path:
    """A copy of ``spec`` in ``out_dir`` (created; returned) less the hook named ``hook``
    and the mounts whose file names start with one of ``mounts``: the broken specs of
    the controls."""
    doc = yaml.safe_load(spec.read_text())
    edits = doc["containerEdits"]
    edits["hooks"] = [h for h in edits.get("hooks", []) if h["args"][1] != hook]
    edits["mounts"] = [m for m in edits.get("mounts", [])
                       if not os.path.basename(m["hostPath"]).startswith(mounts)]
    out_dir.mkdir()
    (out_dir / spec.name).write_text(yaml.safe_dump(doc))
    return out_dir
