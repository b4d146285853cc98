"""pkg/nvcdi: the device nodes, driver files and hooks the nvml and management modes find."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence

from .discover import is_lib_name, locate_mounts, symlink_links
from .edits import Edits
from .filepath import go_join, trim_prefix, unique
from .hooks import HookCreator
from .logger import CtkError, Logger
from .lookup import EXECUTABLE_SEARCH_DIRS, Driver, Locator, assert_executable
from .version import V1_18, Version

DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
MANAGEMENT_DEVICE_PATTERNS = (
    "/dev/nvidia*",
    "/dev/nvidia-caps/nvidia-cap*",
    "/dev/nvidia-modeset",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-uvm",
    "/dev/nvidiactl",
    "/dev/nvidia-caps-imex-channels/channel*",
)
MANAGEMENT_BLOCKED_PREFIXES = ("nvidia-fs", "nvidia-nvswitch", "nvidia-nvlink")
CONTROL_DEVICE_PATTERNS = (
    "/dev/nvidia-modeset",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-uvm",
    "/dev/nvidiactl",
)


def firmware_search_paths(log: Logger) -> list[str]:
    paths: list[str] = []
    try:
        with open("/sys/module/firmware_class/parameters/path", encoding="utf-8") as f:
            custom = f.read().strip()
    except OSError as exc:
        log.warning(f"failed to get custom firmware class path: {exc}")
        custom = ""
    if custom:
        paths.append(custom)
    release = os.uname().release
    return [
        *paths,
        go_join("/lib/firmware/updates/", release),
        "/lib/firmware/updates/",
        go_join("/lib/firmware/", release),
        "/lib/firmware/",
    ]


def driver_edits(log: Logger, driver: Driver, hooks: HookCreator, ctk: Version) -> Edits:
    """pkg/nvcdi/driver-nvml.go newDriverVersionDiscoverer."""
    try:
        version = driver.version()
    except CtkError as exc:
        raise CtkError(f'failed to determine driver version (""): {exc}') from exc
    log.info(f"Using driver version {version}")
    root = driver.root

    libs = driver.driver_library_locator("vdpau").locate(f"*.so.{version}")
    if root != "/":
        libs = [trim_prefix(lib, root) for lib in libs]
    library_mounts = locate_mounts(log, Locator(log, root), root, libs)
    library_mounts += locate_mounts(
        log, driver.driver_library_locator(), root, ["libnvidia-nvvm70.so.*"]
    )

    edits = Edits()
    edits.mounts += [m.to_spec() for m in library_mounts]
    folders = unique(posixpath.dirname(m.path) for m in library_mounts if is_lib_name(m.path))
    hook_list = [
        hooks.create("create-symlinks", symlink_links(log, library_mounts)),
        hooks.create("enable-cuda-compat", [f"--host-driver-version={version}"]),
        hooks.create("update-ldcache", folders) if folders else None,
    ]
    if ctk >= V1_18:
        hook_list.append(hooks.create("disable-device-node-modification"))
        edits.env.append("NVIDIA_CTK_LIBCUDA_DIR=" + ":".join(driver.lib_dirs()))
    edits.hooks += [h for h in hook_list if h is not None]

    ipc = Locator(log, root, ("/run", "/var/run"), count=1)
    firmware = Locator(log, root, firmware_search_paths(log))
    binaries = Locator(log, root, EXECUTABLE_SEARCH_DIRS, filter=assert_executable, count=1)
    for locator, patterns in (
        (ipc, ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket")),
        (firmware, (go_join("nvidia", version, "gsp*.bin"),)),
        (binaries, DRIVER_BINARIES),
    ):
        edits.mounts += [m.to_spec() for m in locate_mounts(log, locator, root, patterns)]
    return edits


def device_names(strategies: Sequence[str], index: int, uuid: str) -> list[str]:
    names = {"index": str(index), "uuid": uuid, "type-index": f"gpu{index}"}
    return [names[s] for s in strategies]
