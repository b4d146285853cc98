"""A test kubelet for device plugins, as kubelet's device manager plays it (issue 32).

It serves ``Registration.Register`` on ``<dir>/kubelet.sock`` (a gRPC server on a unix
socket) and records each registration; then, as kubelet does once a plugin registered,
it dials the plugin's endpoint ``<dir>/<endpoint>`` and calls GetDevicePluginOptions,
ListAndWatch (a stream, read on a thread for as long as the plugin serves it, so a test
can wait for a device's health to change), GetPreferredAllocation and Allocate.

The API is tests/deviceplugin/api.proto, the part of Kubernetes' device plugin API
v1beta1 used here; its Python side is generated at test time with grpcio-tools into a
directory the caller gives (:func:`api`), never committed. Every wait is bounded in time,
and :meth:`Kubelet.close` ends the server, the channels and the stream's thread.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

PROTO = Path(__file__).resolve().parent / "deviceplugin" / "api.proto"
VERSION = "v1beta1"  # the API version a plugin registers with, as kubelet accepts it
SOCKET = "kubelet.sock"
TIMEOUT = 30.0
# A unix socket's path is at most 107 bytes (sun_path): kubelet's own directory is short.
SUN_PATH_MAX = 107
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"

# The generated modules' names: unique, so they never meet another "api_pb2" (the CRI's).
_MODULE = "unb_deviceplugin_v1beta1"


@dataclass(frozen=True)
class Api:
    pb2: ModuleType
    grpc: ModuleType


_loaded: Api | None = None


def api(cache: Path) -> Api:
    """The generated Python side of :data:`PROTO` (protoc from grpcio-tools, into
    ``cache``/<hash of the proto>), imported once per process."""
    global _loaded
    if _loaded is not None:
        return _loaded
    from grpc_tools import protoc

    text = PROTO.read_bytes()
    out = cache / hashlib.sha256(text).hexdigest()[:16]
    if not (out / f"{_MODULE}_pb2_grpc.py").exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(PROTO, out / f"{_MODULE}.proto")
        include = Path(protoc.__file__).parent / "_proto"
        code = protoc.main(["grpc_tools.protoc", f"-I{out}", f"-I{include}",
                            f"--python_out={out}", f"--grpc_python_out={out}",
                            str(out / f"{_MODULE}.proto")])
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {PROTO}")
    sys.path.insert(0, str(out))
    try:
        _loaded = Api(importlib.import_module(f"{_MODULE}_pb2"),
                      importlib.import_module(f"{_MODULE}_pb2_grpc"))
    finally:
        sys.path.remove(str(out))
    return _loaded


@dataclass(frozen=True)
class Registration:
    version: str
    endpoint: str
    resource_name: str
    options: dict[str, bool]
    at: float  # time.monotonic() when it came


@dataclass(frozen=True)
class Allocation:
    """One container's part of Allocate's answer."""
    cdi_devices: list[str]
    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (container path, host path, read only)
    devices: list[tuple[str, str, str]]  # (container path, host path, permissions)
    annotations: dict[str, str]


def _options(msg: Any) -> dict[str, bool]:
    return {"pre_start_required": bool(msg.pre_start_required),
            "get_preferred_allocation_available": bool(msg.get_preferred_allocation_available)}


class Kubelet:
    """kubelet's registration server on ``directory``/kubelet.sock; :meth:`close` ends
    it and every plugin connection made through it."""

    def __init__(self, directory: Path, generated: Api) -> None:
        import grpc

        self.dir = directory
        self.socket = directory / SOCKET
        if len(str(self.socket)) > SUN_PATH_MAX or len(str(directory / "nvidia-gpu.sock")) > \
                SUN_PATH_MAX:
            raise ValueError(f"{directory}: too long for a unix socket's path")
        self.api = generated
        self.registrations: list[Registration] = []
        self._cond = threading.Condition()
        self._plugins: list[Plugin] = []
        kubelet = self

        class Servicer(generated.grpc.RegistrationServicer):  # type: ignore[name-defined,misc]
            def Register(self, request: Any, context: Any) -> Any:
                with kubelet._cond:
                    kubelet.registrations.append(Registration(
                        request.version, request.endpoint, request.resource_name,
                        _options(request.options), time.monotonic()))
                    kubelet._cond.notify_all()
                return generated.pb2.Empty()

        directory.mkdir(parents=True, exist_ok=True)
        self._server: Any = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generated.grpc.add_RegistrationServicer_to_server(Servicer(), self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()

    def wait_registration(self, timeout: float = TIMEOUT, count: int = 1) -> Registration:
        """The ``count``-th registration, once it came (AssertionError after ``timeout``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.registrations) >= count, timeout):
                raise AssertionError(f"no registration {count} on {self.socket} within "
                                     f"{timeout:.0f} s ({len(self.registrations)} came)")
            return self.registrations[count - 1]

    def connect(self, registration: Registration, timeout: float = TIMEOUT) -> Plugin:
        """Dial the plugin's endpoint, as kubelet does after its Register."""
        plugin = Plugin(self, self.dir / registration.endpoint, timeout)
        self._plugins.append(plugin)
        return plugin

    def close(self) -> None:
        for plugin in self._plugins:
            plugin.close()
        self._server.stop(grace=None).wait(10)
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> Kubelet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Watch:
    lists: list[dict[str, str]] = field(default_factory=list)  # each answer: id -> health
    ended: str | None = None  # why the stream ended


class Plugin:
    """kubelet's connection to one plugin endpoint."""

    def __init__(self, kubelet: Kubelet, endpoint: Path, timeout: float) -> None:
        import grpc

        self.api = kubelet.api
        self.endpoint = endpoint
        self.timeout = timeout
        self._channel: Any = grpc.insecure_channel(f"unix://{endpoint}")
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        self._stub: Any = self.api.grpc.DevicePluginStub(self._channel)
        self._cond = threading.Condition()
        self._watch = _Watch()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    def options(self) -> dict[str, bool]:
        return _options(self._stub.GetDevicePluginOptions(self.api.pb2.Empty(),
                                                          timeout=self.timeout))

    def watch(self) -> None:
        """ListAndWatch, read on a thread until the stream ends or :meth:`close`."""
        self._stream = self._stub.ListAndWatch(self.api.pb2.Empty())
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name=f"ListAndWatch {self.endpoint.name}")
        self._thread.start()

    def _read(self) -> None:
        why = "the plugin ended the stream"
        try:
            for answer in self._stream:
                with self._cond:
                    self._watch.lists.append({d.ID: d.health for d in answer.devices})
                    self._cond.notify_all()
        except Exception as e:  # grpc.RpcError: the plugin went, or close() cancelled
            why = f"{type(e).__name__}: {e}"
        with self._cond:
            self._watch.ended = why
            self._cond.notify_all()

    def devices(self, until: Callable[[dict[str, str]], bool] = bool,
                timeout: float | None = None) -> dict[str, str]:
        """The latest device list (id -> health) once ``until`` holds for it (default:
        the first, non-empty list); AssertionError, with every list seen, after
        ``timeout`` or when the stream ends first."""
        def done() -> bool:
            w = self._watch
            return bool(w.lists and until(w.lists[-1])) or w.ended is not None

        with self._cond:
            self._cond.wait_for(done, self.timeout if timeout is None else timeout)
            w = self._watch
            if w.lists and until(w.lists[-1]):
                return dict(w.lists[-1])
            raise AssertionError(f"ListAndWatch of {self.endpoint}: not as awaited "
                                 f"(lists seen {w.lists}, ended: {w.ended})")

    @property
    def lists(self) -> list[dict[str, str]]:
        with self._cond:
            return [dict(x) for x in self._watch.lists]

    def preferred(self, available: list[str], size: int,
                  must_include: tuple[str, ...] = ()) -> list[str]:
        pb2 = self.api.pb2
        request = pb2.PreferredAllocationRequest(container_requests=[
            pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                    must_include_deviceIDs=list(must_include),
                                                    allocation_size=size)])
        answer = self._stub.GetPreferredAllocation(request, timeout=self.timeout)
        return list(answer.container_responses[0].deviceIDs)

    def allocate(self, ids: list[str]) -> Allocation:
        pb2 = self.api.pb2
        request = pb2.AllocateRequest(container_requests=[
            pb2.ContainerAllocateRequest(devices_ids=ids)])
        answer = self._stub.Allocate(request, timeout=self.timeout)
        c = answer.container_responses[0]
        return Allocation(
            cdi_devices=[d.name for d in c.cdi_devices], envs=dict(c.envs),
            mounts=[(m.container_path, m.host_path, m.read_only) for m in c.mounts],
            devices=[(d.container_path, d.host_path, d.permissions) for d in c.devices],
            annotations=dict(c.annotations))

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._thread is not None:
            self._thread.join(10)
        self._channel.close()
