#!/usr/bin/python3
"""A test kubelet that runs as the booted machine's own kubelet.service (issue 32).

Installed by tests/boot/test_device_plugin_boot.py as ``/usr/local/bin/kubelet`` in the
machine (the unit's program, so its process name is kubelet's, as the product expects),
run by Debian trixie's python3 with python3-grpcio (1.51) and python3-protobuf (4.21).
No generated code: the messages are built at start from a FileDescriptorSet of
tests/deviceplugin/api.proto, which the host's protoc (grpcio-tools) writes beside it
(:data:`DESCRIPTORS`), and the gRPC methods are generic handlers and channel calls, so no
version check of generated code meets the guest's older runtime.

As kubelet's device manager does, at every start it removes and creates again
``/var/lib/kubelet/device-plugins/kubelet.sock`` (a plugin watching that directory then
registers again and regenerates its spec) and serves ``Registration.Register`` there; on
each registration it dials the plugin's endpoint, calls GetDevicePluginOptions and reads
ListAndWatch on a thread. Everything it sees goes to :data:`STATE` (JSON, replaced
atomically). The test asks it for GetPreferredAllocation and Allocate by writing
``<REQUESTS>/<name>.json`` (``{"op": "allocate", "ids": [...]}`` or ``{"op":
"preferred", "available": [...], "size": N}``); the answer lands in
``<ANSWERS>/<name>.json``. It logs start and stop in the stand-in services' log, as
tests/rootfs.py's stand-in does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

NAME = "kubelet"
SERVICES_LOG = "/var/log/fake-services.log"
DIR = "/var/lib/kubelet/device-plugins"
SOCKET = f"{DIR}/kubelet.sock"
HOME = "/run/test-kubelet"
STATE = f"{HOME}/state.json"
REQUESTS = f"{HOME}/requests"
ANSWERS = f"{HOME}/answers"
DESCRIPTORS = "/usr/local/lib/unb-test-kubelet/api.desc"
PACKAGE = "v1beta1"
CALL_TIMEOUT = 20.0
KEEP_LISTS = 20


def mono_us() -> int:
    return time.monotonic_ns() // 1000


def note(event: str) -> None:
    line = f"{NAME} {event} pid={os.getpid()} mono_us={mono_us()}\n"
    fd = os.open(SERVICES_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    print(line, end="", flush=True)


def messages() -> dict[str, Any]:
    with open(DESCRIPTORS, "rb") as fh:
        fds = descriptor_pb2.FileDescriptorSet.FromString(fh.read())
    pool = descriptor_pool.DescriptorPool()
    for fdp in fds.file:
        pool.Add(fdp)
    get = getattr(message_factory, "GetMessageClass", None)
    factory = message_factory.MessageFactory(pool)
    out = {}
    for fdp in fds.file:
        for msg in fdp.message_type:
            desc = pool.FindMessageTypeByName(f"{fdp.package}.{msg.name}")
            out[msg.name] = get(desc) if get else factory.GetPrototype(desc)
    return out


M = messages()
LOCK = threading.Lock()
STATE_DOC: dict[str, Any] = {"pid": os.getpid(), "started_mono_us": mono_us(),
                             "socket_mono_us": None, "registrations": [], "watches": [],
                             "errors": []}


def describe(e: BaseException) -> str:
    details = e.details() if hasattr(e, "details") else e
    return f"{type(e).__name__}: {details}"


def save() -> None:
    """Under LOCK: STATE_DOC to STATE, atomically."""
    tmp = f"{STATE}.tmp"
    with open(tmp, "w") as fh:
        json.dump(STATE_DOC, fh)
    os.replace(tmp, STATE)


def error(text: str) -> None:
    with LOCK:
        STATE_DOC["errors"].append({"mono_us": mono_us(), "error": text})
        save()


def call(channel: grpc.Channel, method: str, request: Any, reply: str, *,
         stream: bool = False, timeout: float | None = CALL_TIMEOUT) -> Any:
    make = channel.unary_stream if stream else channel.unary_unary
    fn = make(f"/{PACKAGE}.DevicePlugin/{method}",
              request_serializer=type(request).SerializeToString,
              response_deserializer=M[reply].FromString)
    return fn(request, timeout=timeout)


class Plugin:
    """kubelet's connection to one registered plugin."""

    def __init__(self, registration: dict[str, Any]) -> None:
        self.endpoint = f"{DIR}/{registration['endpoint']}"
        self.channel = grpc.insecure_channel(f"unix://{self.endpoint}")
        grpc.channel_ready_future(self.channel).result(timeout=CALL_TIMEOUT)
        opts = call(self.channel, "GetDevicePluginOptions", M["Empty"](), "DevicePluginOptions")
        registration["dialed_options"] = {
            "pre_start_required": bool(opts.pre_start_required),
            "get_preferred_allocation_available": bool(opts.get_preferred_allocation_available)}
        with LOCK:
            self.watch = {"endpoint": registration["endpoint"], "mono_us": mono_us(),
                          "lists": [], "ended": None}
            STATE_DOC["watches"].append(self.watch)
            save()
        self.stream = call(self.channel, "ListAndWatch", M["Empty"](), "ListAndWatchResponse",
                           stream=True, timeout=None)
        threading.Thread(target=self.read, daemon=True).start()

    def read(self) -> None:
        why = "the plugin ended the stream"
        try:
            for answer in self.stream:
                with LOCK:
                    lists = self.watch["lists"]
                    lists.append({"mono_us": mono_us(),
                                  "devices": {d.ID: d.health for d in answer.devices}})
                    del lists[:-KEEP_LISTS]
                    save()
        except Exception as e:  # grpc.RpcError: the plugin went, or it was cancelled
            why = describe(e)
        with LOCK:
            self.watch["ended"] = why
            self.watch["ended_mono_us"] = mono_us()
            save()

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


CURRENT: list[Plugin] = []


def register(request: Any, context: Any) -> Any:
    reg = {"version": request.version, "endpoint": request.endpoint,
           "resource_name": request.resource_name, "mono_us": mono_us(),
           "options": {"pre_start_required": bool(request.options.pre_start_required),
                       "get_preferred_allocation_available":
                           bool(request.options.get_preferred_allocation_available)}}
    with LOCK:
        STATE_DOC["registrations"].append(reg)
        save()
    # kubelet answers Register at once and dials the plugin afterwards.
    threading.Thread(target=connect, args=(reg,), daemon=True).start()
    return M["Empty"]()


def connect(reg: dict[str, Any]) -> None:
    try:
        plugin = Plugin(reg)
    except Exception as e:
        error(f"dialing {reg['endpoint']}: {type(e).__name__}: {e}")
        return
    for old in CURRENT:
        old.close()
    CURRENT[:] = [plugin]
    with LOCK:
        save()


def answer(request: dict[str, Any]) -> dict[str, Any]:
    if not CURRENT:
        return {"error": "no plugin registered"}
    channel = CURRENT[-1].channel
    if request["op"] == "allocate":
        msg = M["AllocateRequest"](container_requests=[
            M["ContainerAllocateRequest"](devices_ids=request["ids"])])
        c = call(channel, "Allocate", msg, "AllocateResponse").container_responses[0]
        return {"cdi_devices": [d.name for d in c.cdi_devices], "envs": dict(c.envs),
                "mounts": [[m.container_path, m.host_path, m.read_only] for m in c.mounts],
                "devices": [[d.container_path, d.host_path, d.permissions] for d in c.devices],
                "annotations": dict(c.annotations)}
    if request["op"] == "preferred":
        msg = M["PreferredAllocationRequest"](container_requests=[
            M["ContainerPreferredAllocationRequest"](
                available_deviceIDs=request["available"], allocation_size=request["size"])])
        c = call(channel, "GetPreferredAllocation", msg, "PreferredAllocationResponse")
        return {"ids": list(c.container_responses[0].deviceIDs)}
    return {"error": f"unknown op {request['op']!r}"}


def serve_requests() -> None:
    while True:
        for name in sorted(os.listdir(REQUESTS)):
            if not name.endswith(".json"):
                continue
            path = f"{REQUESTS}/{name}"
            try:
                with open(path) as fh:
                    request = json.load(fh)
                result = answer(request)
            except Exception as e:  # grpc.RpcError included: the test reads why
                result = {"error": describe(e)}
            os.unlink(path)
            tmp = f"{ANSWERS}/.{name}"
            with open(tmp, "w") as fh:
                json.dump(result, fh)
            os.replace(tmp, f"{ANSWERS}/{name}")
        time.sleep(0.05)


def main() -> int:
    def on_term(signum: int, frame: object) -> None:
        note("stop")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    note("start")
    for d in (DIR, REQUESTS, ANSWERS):
        os.makedirs(d, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(f"{PACKAGE}.Registration", {
        "Register": grpc.unary_unary_rpc_method_handler(
            register, request_deserializer=M["RegisterRequest"].FromString,
            response_serializer=M["Empty"].SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{SOCKET}")
    server.start()
    with LOCK:
        STATE_DOC["socket_mono_us"] = mono_us()
        save()
    serve_requests()
    return 0


if __name__ == "__main__":
    sys.exit(main())
