"""Debian's real containerd in the boot suite's machine, and a CRI client playing kubelet.

**The machine.** :func:`ensure_tree` is tests/rootfs.py's cached trixie tree plus
``apt-get install --no-install-recommends containerd runc python3-grpcio
python3-protobuf`` (from the Debian archive the
host's apt configuration names, tests/mirrors.py; about 37 MB), with the stand-in
``/usr/local/bin/containerd`` removed (Debian's unit runs ``/usr/bin/containerd``) and
:data:`CONFIG_TOML` as ``/etc/containerd/config.toml``: the settings FACTS.md found this
host needs (``disable_cgroup``, ``restrict_oom_score_adj``, runc v2 with
``NoNewKeyring``), CDI on for ``/etc/cdi`` and ``/var/run/cdi``, and the locally imported
pause image as the sandbox image. kubelet stays the stand-in. It is cached like the base
tree (``containerd-<key>.tree`` beside it), and used as the lower layer of each node's
overlay. Booting needs :data:`NSPAWN_ARGS` (runc loads a BPF device filter), a host
directory bound at ``/var/lib/containerd`` (overlayfs cannot be the upper layer of
containerd's own overlay snapshots) and the OCI archives of tests/images.py bound at
:data:`GUEST_IMAGES`; :func:`import_images` loads them with ``ctr -n k8s.io images
import`` once containerd runs.

**The client.** PyPI's ``container-runtime-interface-api`` (2.0.1, the CRI v1 protos as
generated Python with type stubs) over grpcio, on
``unix:///proc/<guest PID 1>/root/run/containerd/containerd.sock``: the host reaches the
guest's socket through its root, no tool in the guest. Generating stubs from a
hand-written proto would put the field numbers in our hands; the package's are protoc's
output of the upstream api.proto. Every call has a deadline (:data:`CALL_TIMEOUT`); an
RPC error becomes :class:`CriError` with containerd's own message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rootfs

import images
import mirrors

# python3-grpcio and python3-protobuf: the machine's own kubelet.service in the device
# plugin's boot tests is a small Python kubelet (tests/boot/guestkubelet.py, issue 32).
PACKAGES = ("containerd", "runc", "python3-grpcio", "python3-protobuf")
VERSION = 1
PAUSE_REF = "localhost/unb-pause:1"
PROBE_REF = "localhost/unb-probe:1"
GUEST_IMAGES = "/var/lib/unbounded-nvidia-setup-tests/images"
NSPAWN_ARGS = ("--system-call-filter=bpf",)
CALL_TIMEOUT = 30.0
INSTALL_TIMEOUT = 900.0
SOCKET = "/run/containerd/containerd.sock"
NAMESPACE = "k8s.io"

CONFIG_TOML = f"""\
# written by tests/cri.py: what this host needs (FACTS.md, "Debian's real containerd")
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  sandbox_image = "{PAUSE_REF}"
  restrict_oom_score_adj = true
  disable_cgroup = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      NoNewKeyring = true
"""


class CriUnavailable(RuntimeError):
    """The CRI client or the containerd machine cannot be had here (the reason)."""


def client_missing() -> str | None:
    """Why the CRI client cannot be imported, or None."""
    try:
        import grpc  # noqa: F401
        from cri_api.v1 import api_pb2  # noqa: F401
    except ImportError as e:
        return f"no CRI client ({e}; `make venv` installs container-runtime-interface-api)"
    return None


# -- the machine's tree ---------------------------------------------------------------------


def cache_key() -> str:
    blob = json.dumps({"base": rootfs.cache_key(), "packages": PACKAGES,
                       "config": CONFIG_TOML, "v": VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tree_path() -> Path:
    return rootfs.cache_dir() / f"containerd-{cache_key()}.tree"


def _install(root: Path) -> None:
    mirror = mirrors.debian_archive(rootfs.MIRROR_ENV, mirrors.ARCHIVE_ENV)
    (root / "etc/apt/sources.list").write_text(f"deb {mirror} {rootfs.SUITE} main\n")
    script = ("set -e; apt-get -qq update; apt-get -qq install -y --no-install-recommends "
              f"{' '.join(PACKAGES)} >/dev/null; apt-get clean; rm -rf /var/lib/apt/lists/*;"
              " mkdir -p /var/lib/apt/lists/partial")
    proc = subprocess.run(
        ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--directory",
         str(root), "--resolv-conf=copy-host", "--timezone=off", "--pipe",
         "--setenv=DEBIAN_FRONTEND=noninteractive", "/bin/sh", "-c", script],
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT, stdin=subprocess.DEVNULL,
        check=False, env={**os.environ, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if proc.returncode != 0:
        raise CriUnavailable(f"apt-get install {' '.join(PACKAGES)} in the trixie tree "
                             f"failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    (root / "usr/local/bin/containerd").unlink()
    unit = (root / "usr/lib/systemd/system/containerd.service").read_text()
    if "ExecStart=/usr/bin/containerd" not in unit or "KillMode=process" not in unit:
        raise CriUnavailable(f"containerd.service is not Debian's:\n{unit}")
    for tool in ("usr/bin/containerd", "usr/bin/ctr", "usr/sbin/runc"):
        if not (root / tool).is_file():
            raise CriUnavailable(f"no /{tool} after installing {' '.join(PACKAGES)}")
    conf = root / "etc/containerd/config.toml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(CONFIG_TOML)
    (root / GUEST_IMAGES.lstrip("/")).mkdir(parents=True, exist_ok=True)


def ensure_tree() -> Path:
    """The cached tree (built on first use: the base tarball extracted, then apt)."""
    tree = tree_path()
    if tree.is_dir():
        return tree
    tar = rootfs.ensure_tarball()
    with rootfs.cache_lock(".containerd.lock"):
        if tree.is_dir():
            return tree
        for old in [*rootfs.cache_dir().glob("containerd-*.tree"),
                    *rootfs.cache_dir().glob(".containerd-build-*")]:
            rootfs._rmtree(old)
        start = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".containerd-build-", dir=rootfs.cache_dir()))
        try:
            root = work / "root"
            root.mkdir()
            rootfs._extract(tar, root)
            _install(root)
            os.rename(root, tree)
        finally:
            rootfs._rmtree(work)
        print(f"cri: cached {tree} ({time.monotonic() - start:.0f} s)", flush=True)
    return tree


def image_archives() -> Path:
    """A cached directory with the pause and probe images as OCI archives."""
    probe, pause = images.probe_root(), images.pause_root()
    key = hashlib.sha256(f"{probe.name}/{pause.name}/{VERSION}".encode()).hexdigest()[:16]
    out = images.cache_dir() / f"oci-{key}"
    if out.is_dir():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".oci-", dir=images.cache_dir()))
    try:
        images.oci_archive(pause, PAUSE_REF, tmp / "pause.tar", cmd=["/pause"])
        images.oci_archive(probe, PROBE_REF, tmp / "probe.tar", cmd=["/usr/bin/python3"])
        try:
            os.rename(tmp, out)
        except OSError:  # a concurrent builder won
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- the client -----------------------------------------------------------------------------


class CriError(RuntimeError):
    """A CRI call failed; the message is containerd's."""

    def __init__(self, call: str, code: str, details: str) -> None:
        super().__init__(f"{call}: {code}: {details}")
        self.call, self.code, self.details = call, code, details


@dataclass
class Container:
    id: str
    sandbox: str
    log: Path  # the log file as the host reaches it


@dataclass
class Exit:
    code: int
    reason: str
    message: str
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).strip()


def parse_log(text: str) -> tuple[str, str]:
    """(stdout, stderr) of a CRI container log (``<time> <stream> <P|F> <text>`` lines)."""
    out = {"stdout": "", "stderr": ""}
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[1] not in out:
            continue
        out[parts[1]] += (parts[3] if len(parts) > 3 else "") + ("" if parts[2] == "P" else "\n")
    return out["stdout"], out["stderr"]


class Cri:
    """kubelet's side of CRI v1 against the containerd of the machine whose guest PID 1
    is ``leader`` (a host PID)."""

    def __init__(self, leader: int, timeout: float = CALL_TIMEOUT) -> None:
        import grpc
        from cri_api.v1 import api_pb2, api_pb2_grpc

        self.leader = leader
        self.timeout = timeout
        self.pb: Any = api_pb2
        self.socket = Path(f"/proc/{leader}/root{SOCKET}")
        self._grpc: Any = grpc
        self._channel: Any = grpc.insecure_channel(f"unix://{self.socket}")
        self._rt: Any = api_pb2_grpc.RuntimeServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self.sandboxes: list[str] = []

    def close(self) -> None:
        self._channel.close()

    def call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._rt, name)(request, timeout=timeout or self.timeout)
        except self._grpc.RpcError as e:
            raise CriError(name, e.code().name, e.details()) from None

    def version(self) -> str:
        res = self.call("Version", self.pb.VersionRequest())
        return f"{res.runtime_name} {res.runtime_version} (CRI {res.runtime_api_version})"

    def run_pod(self, name: str) -> tuple[str, Any]:
        """RunPodSandbox with the node's network (no CNI), as kubelet does for a
        hostNetwork pod: (sandbox id, its config)."""
        pb = self.pb
        uid = uuid.uuid4().hex
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
            log_directory=f"/var/log/pods/default_{name}_{uid}",
            linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE))))
        res = self.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config))
        self.sandboxes.append(res.pod_sandbox_id)
        return str(res.pod_sandbox_id), config

    def create(self, sandbox: tuple[str, Any], name: str, argv: Sequence[str], *,
               cdi: Sequence[str] = (), mounts: Sequence[tuple[str, str]] = (),
               image: str = PROBE_REF) -> Container:
        """CreateContainer: ``argv`` in ``image`` with the CDI devices ``cdi`` (kubelet
        passes a device plugin's CDI names in this field) and bind ``mounts``
        (container path, host path), read-only, private propagation (a hostPath volume)."""
        pb = self.pb
        sid, sconfig = sandbox
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=image),
            command=list(argv), log_path=f"{name}.log",
            CDI_devices=[pb.CDIDevice(name=d) for d in cdi],
            mounts=[pb.Mount(container_path=c, host_path=h, readonly=True)
                    for c, h in mounts])
        res = self.call("CreateContainer", pb.CreateContainerRequest(
            pod_sandbox_id=sid, config=config, sandbox_config=sconfig))
        log = Path(f"/proc/{self.leader}/root{sconfig.log_directory}/{name}.log")
        return Container(str(res.container_id), sid, log)

    def start(self, c: Container) -> None:
        self.call("StartContainer", self.pb.StartContainerRequest(container_id=c.id))

    def status(self, c: Container) -> Any:
        return self.call("ContainerStatus",
                         self.pb.ContainerStatusRequest(container_id=c.id)).status

    def wait_exit(self, c: Container, timeout: float) -> Exit:
        """Bounded wait for the container to exit; its status and log."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(c)
            if st.state == self.pb.CONTAINER_EXITED:
                text = c.log.read_text(errors="replace") if c.log.exists() else ""
                out, err = parse_log(text)
                return Exit(int(st.exit_code), st.reason, st.message, out, err)
            if time.monotonic() >= deadline:
                raise AssertionError(f"container {c.id} still {st.state} after {timeout} s")
            time.sleep(0.1)

    def running(self, c: Container) -> bool:
        return bool(self.status(c).state == self.pb.CONTAINER_RUNNING)

    def exec_sync(self, c: Container, argv: Sequence[str], timeout: int = 20) -> Exit:
        res = self.call("ExecSync", self.pb.ExecSyncRequest(
            container_id=c.id, cmd=list(argv), timeout=timeout), timeout=timeout + 10)
        return Exit(int(res.exit_code), "", "", res.stdout.decode(errors="replace"),
                    res.stderr.decode(errors="replace"))

    def run(self, name: str, argv: Sequence[str], *, cdi: Sequence[str] = (),
            mounts: Sequence[tuple[str, str]] = (), timeout: float = 60.0) -> Exit:
        """A one-shot pod: sandbox, container, start, wait, log; the sandbox removed.
        A start that fails raises :class:`CriError` with containerd's message."""
        sandbox = self.run_pod(name)
        try:
            c = self.create(sandbox, name, argv, cdi=cdi, mounts=mounts)
            self.start(c)
            return self.wait_exit(c, timeout)
        finally:
            self.remove_pod(sandbox[0])

    def remove_pod(self, sid: str) -> None:
        self.call("StopPodSandbox", self.pb.StopPodSandboxRequest(pod_sandbox_id=sid),
                  timeout=60)
        self.call("RemovePodSandbox", self.pb.RemovePodSandboxRequest(pod_sandbox_id=sid),
                  timeout=60)
        if sid in self.sandboxes:
            self.sandboxes.remove(sid)

    def remove_all(self) -> None:
        """Stop and remove every sandbox this client made (before a poweroff: a
        container ignoring SIGTERM would hold it 40 s)."""
        for sid in list(self.sandboxes):
            self.remove_pod(sid)
