"""NVIDIA's real device plugin (k8s-device-plugin v0.20.0) as a plain process against a
simulated machine (issue 32; ../shared/FACTS.md, "NVIDIA's device plugin v0.20.0, run
here").

The plugin's paths are fixed: it serves on /var/lib/kubelet/device-plugins/nvidia-gpu.sock,
registers on .../kubelet.sock there, and writes its spec to /var/run/cdi. It runs in a
private mount namespace (``unshare --mount --propagation private``) where the test's
kubelet directory is bound over /var/lib/kubelet/device-plugins and the machine's
<root>/var/run/cdi over /var/run/cdi, so all of it lands in the test's directories; the
mounts go with the namespace when the plugin ends. It is given the product's driver root
<root>/run/nvidia/driver as both its host and its container driver root, and, as the
product's ``--root`` convention does, the machine's root as its dev root
(``NVIDIA_DEV_ROOT``), so the hostPaths of its spec are real paths on this system.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pod
import toolkit

DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
RUN_CDI = Path("/var/run/cdi")
SPEC = "k8s.device-plugin.nvidia.com-gpu.json"
KIND = "k8s.device-plugin.nvidia.com/gpu"
RESOURCE = "nvidia.com/gpu"
ENDPOINT = "nvidia-gpu.sock"
STOP_TIMEOUT = 10.0


def device_nodes(root: Path) -> list[Path]:
    """The machine's NVIDIA device nodes in its /dev (not in subdirectories)."""
    return sorted(p for p in (root / "dev").glob("nvidia*")
                  if p.is_char_device() and not p.is_symlink())


def edits(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A CDI spec's containerEdits: the common ones, then each device's."""
    return [doc.get("containerEdits", {}), *(d["containerEdits"] for d in doc["devices"])]


def host_paths(doc: dict[str, Any]) -> list[str]:
    """Every host path the spec makes a runtime open: mounts, device nodes, hooks."""
    paths = []
    for e in edits(doc):
        paths += [x["hostPath"] for x in e.get("mounts", [])]
        paths += [x.get("hostPath") or x["path"] for x in e.get("deviceNodes", [])]
        paths += [x["path"] for x in e.get("hooks", [])]
    return paths


def spec_path(root: Path) -> Path:
    """Where the plugin's spec lands for a machine at ``root``."""
    return root / RUN_CDI.relative_to("/") / SPEC


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        """Its exit status once it exited within ``timeout``, else None (still running)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after :data:`STOP_TIMEOUT`."""
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            self.wait(wait)
        with contextlib.suppress(ProcessLookupError):  # anything it left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)


@contextmanager
def running(binary: Path, root: Path, kubelet_dir: Path, *, log: Path,
            dev_root: Path | None = None, default_dev_root: bool = False,
            hide: tuple[Path, ...] = (), nodes: Sequence[Path] | None = None,
            extra: tuple[str, ...] = ()) -> Iterator[Running]:
    """NVIDIA's plugin ``binary`` against the machine at ``root`` (see the module doc),
    its stdout and stderr in ``log``; stopped, with its process group, on leaving.
    ``dev_root`` defaults to ``root``; ``default_dev_root``: no NVIDIA_DEV_ROOT at all,
    as NVIDIA's chart runs it without ``nvidiaDevRoot`` (it then takes the driver root).
    ``hide``: paths that get an empty tmpfs in its namespace (staging it cannot see).
    Its own /dev holds the machine's NVIDIA device nodes, as its container gets them on
    a node (it looks its GPUs' nodes up in its own /dev). ``nodes``: only these of them
    (a pod given a spec that leaves a GPU out; default all): the others are absent from
    its /dev and, in its namespace, from the machine's dev/ too, which is its dev root
    and where its NVML (loaded from the machine's driver root) looks for a GPU's node,
    as a container's NVML looks in the container's own /dev (tests/simnvml.c)."""
    driver_root = root / "run/nvidia/driver"
    run_cdi = root / RUN_CDI.relative_to("/")
    scratch = log.parent / f"{log.name}.host-dev"
    machine_dev = log.parent / f"{log.name}.machine-dev"
    for path in (kubelet_dir, run_cdi, DEVICE_PLUGINS, RUN_CDI, scratch, machine_dev):
        path.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "--device-list-strategy=cdi-cri",
            f"--nvidia-driver-root={driver_root}", f"--container-driver-root={driver_root}",
            f"--nvidia-cdi-hook-path={toolkit.NVIDIA_CDI_HOOK}", *extra]
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    if not default_dev_root:
        env["NVIDIA_DEV_ROOT"] = str(dev_root or root)
    q = shlex.quote
    script = "\n".join([
        "set -e",
        f"mount --bind {q(str(kubelet_dir))} {q(str(DEVICE_PLUGINS))}",
        f"mount --bind {q(str(run_cdi))} {q(str(RUN_CDI))}",
        *(() if nodes is None else only_nodes(root, nodes, machine_dev)),
        *pod.dev_with(device_nodes(root) if nodes is None else nodes, scratch),
        *(pod.tmpfs(path) for path in hide),
        "exec " + " ".join(q(a) for a in argv),
    ])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    plugin = Running(proc, log, argv, env)
    try:
        yield plugin
    finally:
        plugin.stop()


def only_nodes(root: Path, nodes: Sequence[Path], scratch: Path) -> list[str]:
    """Shell lines: the machine's dev/ with only ``nodes`` of its NVIDIA device nodes (a
    tmpfs over it holding copies of those and links to every other entry, the machine's
    dev/ kept reachable at ``scratch``, an empty directory)."""
    q = shlex.quote
    dev = root / "dev"
    unknown = [str(n) for n in nodes if n not in device_nodes(root)]
    if unknown:
        raise ValueError(f"{unknown}: not NVIDIA device nodes of the machine at {root}")
    left_out = {n.name for n in device_nodes(root)} - {n.name for n in nodes}
    return [f"mount --rbind {q(str(dev))} {q(str(scratch))}", pod.tmpfs(dev),
            *(f"ln -s {q(str(e))} {q(str(dev / e.name))}" for e in sorted(dev.iterdir())
              if e.name not in left_out and e not in nodes),
            *(pod.copy(scratch / n.name, dev / n.name) for n in nodes)]


def wait_for(path: Path, timeout: float) -> bool:
    """Whether ``path`` exists within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
