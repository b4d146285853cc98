"""Validation of CDI specs: ours (/etc/cdi/nvidia.yaml) and the device plugin's."""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config import IMEX_CHANNELS_DIR, Machine, load_yaml
from .gpus import edits as _edits
from .problems import Problem

KIND = "nvidia.com/gpu"


# A spec is read whole; NVIDIA's run to tens of KiB (a GB300 node's, every MIG device
# and IMEX channel in it, well under 1 MiB). A larger file is no spec of theirs.
SPEC_MAX = 1 << 22


def load(path: Path) -> tuple[Any, str | None]:
    """(document, None) or (None, why it could not be read). Only a regular file, never
    through a symlink, never waiting on a FIFO, at most SPEC_MAX bytes (issue 37)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return None, "a symlink" if e.errno == errno.ELOOP else e.strerror
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        data = os.read(fd, SPEC_MAX + 1)
    except OSError as e:
        return None, e.strerror
    finally:
        os.close(fd)
    if len(data) > SPEC_MAX:
        return None, f"larger than {SPEC_MAX} bytes, more than any CDI spec"
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None, "not text"
    import yaml

    try:
        if path.suffix == ".json":  # the device plugin's spec: json stays off a run's imports
            import json

            return json.loads(text), None
        return load_yaml(text), None
    except (ValueError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, f"does not parse: {first}"


def host_path(machine: Machine, path: str) -> Path:
    """A hostPath as this process sees it. Under --root, specs that nvidia-ctk generated
    already name real paths (root-prefixed); paths written for the machine itself do not."""
    if machine.is_live or path == str(machine.root) or path.startswith(f"{machine.root}/"):
        return Path(path)
    return machine.at(path)


def _entries(edits: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [m for e in edits for m in (e.get(key) or []) if isinstance(m, dict)]


def mount_paths(doc: Any) -> list[str]:
    """The hostPath of every mount of a spec, common and per device."""
    return [str(m.get("hostPath", "")) for m in _entries(_edits(doc), "mounts")]


def mounted_names(doc: Any) -> set[str]:
    return {os.path.basename(path) for path in mount_paths(doc)}


def device_names(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return []
    return [str(d.get("name")) for d in doc.get("devices") or [] if isinstance(d, dict)]


# The problem codes of each spec, spelled out rather than built from a prefix: every code
# the tool emits is a literal in its source, which is how tests/test_contract.py finds
# them all. The device plugin's spec has no kind to match (kind=None) and no helpers to
# require, so it has no -wrong-kind or -missing-helper code.
SPEC_CODES = {
    "invalid": "spec-invalid",
    "wrong-kind": "spec-wrong-kind",
    "no-devices": "spec-no-devices",
    "staging-path": "spec-staging-path",
    "missing-host-path": "spec-missing-host-path",
    "bad-device-node": "spec-bad-device-node",
    "missing-library": "spec-missing-library",
    "missing-helper": "spec-missing-helper",
    "imex-channel": "spec-imex-channel",
    "unsafe-path": "spec-unsafe-path",
}
PLUGIN_SPEC_CODES = {
    "invalid": "plugin-spec-invalid",
    "no-devices": "plugin-spec-no-devices",
    "staging-path": "plugin-spec-staging-path",
    "missing-host-path": "plugin-spec-missing-host-path",
    "bad-device-node": "plugin-spec-bad-device-node",
    "missing-library": "plugin-spec-missing-library",
}


# What to change when NVIDIA's device plugin wrote its spec wrong: the setting that
# fixes each problem (docs/host-integration.md, "NVIDIA's device plugin"). Our own spec's
# problems are ours to fix and carry none.
PLUGIN_FIXES = {
    "plugin-spec-missing-library": "deploy the plugin with nvidiaDriverRoot=/run/nvidia/driver "
    "(NVIDIA_DRIVER_ROOT), then restart its pod: it reads the root as it was at its start",
    "plugin-spec-staging-path": "deploy the plugin with nvidiaDriverRoot=/run/nvidia/driver, "
    "never a staging mount",
    "plugin-spec-missing-host-path": "restart the device plugin's pod: its spec names files of "
    "a driver root replaced since it started (pod-on-old-root)",
    "plugin-spec-no-devices": "give the plugin's container the NVIDIA device nodes (a CDI "
    "device from /etc/cdi/nvidia.yaml, or NVIDIA's runtime) and NVIDIA_DEV_ROOT=/",
    "plugin-spec-invalid": "restart the device plugin's pod: it writes its spec again",
}
# The chart's default: the dev root is the driver root, /run/nvidia/driver/dev/..., which
# this root does not have (it holds driver files only).
DEV_ROOT_FIX = ("set the plugin's dev root to / (NVIDIA_DEV_ROOT=/, the Helm chart's "
                "nvidiaDevRoot: /): by default it is the driver root")


def imex_channel(machine: Machine, node: dict[str, Any]) -> bool:
    """Whether a deviceNodes entry gives containers an IMEX channel, by its path in them
    or its hostPath. Here, not in imex.py: every validation asks, and imex.py is
    imported only on machines with channels."""
    path, host = node.get("path"), node.get("hostPath")
    # Every node of every validation passes here: most are nothing like a channel.
    if "imex" not in (path if isinstance(path, str) else "") + (
            host if isinstance(host, str) else ""):
        return False
    if isinstance(path, str) and os.path.normpath(path).startswith(f"{IMEX_CHANNELS_DIR}/"):
        return True
    return isinstance(host, str) and bool(host) and os.path.normpath(
        host_path(machine, host)).startswith(f"{machine.at(IMEX_CHANNELS_DIR)}/")


# What nvidia-ctk writes for this root names files of the driver root, device nodes of
# the dev root and plain container paths. A control character (a newline) or a `::` in a
# path makes NVIDIA's create-symlinks hook (which splits --link at `::`) fail every GPU
# pod; a `..` names another place than the one it seems to; a mount from elsewhere hands
# every pod a file of the machine's.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Hook flags whose value is a path: create-symlinks' --link TARGET::LINK, update-ldcache's
# --folder and --ldconfig-path (`@` marks a host path), chmod's --path.
_PATH_FLAGS = ("--link", "--folder", "--ldconfig-path", "--path")


def path_problem(path: str) -> str | None:
    """Why `path` is not one plain absolute path, or None."""
    if _CONTROL.search(path):
        return "has a control character"
    if "::" in path:
        return "has a '::'"
    if not path.startswith("/"):
        return "is not absolute"
    if ".." in path.split("/"):
        return "has a '..'"
    return None


def _target_problem(target: str, link: str) -> str | None:
    """Why a create-symlinks TARGET is not sane for its LINK, or None. A relative target
    may climb (`../card1` from /dev/dri/by-path), never above the container's root."""
    if not target:
        return "has no target"
    depth = 0 if target.startswith("/") else len(
        [p for p in posixpath.dirname(link).split("/") if p not in ("", ".")])
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return "has a target that climbs above the container's root"
        elif part not in ("", "."):
            depth += 1
    return None


def _path_args(args: list[str]) -> Iterator[tuple[str, str]]:
    """(flag, value) of every path flag of a hook, given as `--flag value` or `--flag=value`."""
    for before, arg in zip(["", *args], args, strict=False):
        flag, equals, value = arg.partition("=")
        if before in _PATH_FLAGS:
            yield before, arg
        elif equals and flag in _PATH_FLAGS:
            yield flag, value


def hook_problem(args: list[Any]) -> tuple[str, str] | None:
    """(the argument, why) for the first argument of a hook that is not sane, or None."""
    for arg in args:
        if not isinstance(arg, str) or _CONTROL.search(arg):
            return str(arg), "has a control character" if isinstance(arg, str) else "is no string"
    for flag, value in _path_args(args):
        if flag == "--link":
            target, separator, link = value.partition("::")
            why = (path_problem(link) or _target_problem(target, link)) if separator else \
                "has no '::'"
        else:
            why = path_problem(value.removeprefix("@") if flag == "--ldconfig-path" else value)
        if why:
            return f"{flag} {value}", why
    return None


def _mount_problem(mount: dict[str, Any], path: str, root: str, dev: str) -> str | None:
    """Why a mount of our spec is not a plain path of the driver root (`root`, with its
    trailing slash) or a device node under `dev`, at a plain container path, or None.
    Strings, not Paths: this runs for every mount of every run's spec."""
    raw, inside = str(mount.get("hostPath", "")), mount.get("containerPath")
    if why := path_problem(raw):
        return f"{raw!r}, which {why}"
    if isinstance(inside, str) and (why := path_problem(inside)):
        return f"{raw} at {inside!r}, which {why}"
    if path.startswith(root) or path == root[:-1]:
        return None
    try:
        if path.startswith(dev) and stat.S_ISCHR(os.stat(path).st_mode):
            return None
    except OSError:
        pass
    return f"{raw}, which is outside {root.rstrip('/')}"


def _numbers(node: dict[str, Any]) -> tuple[int, int] | None:
    """The (major, minor) a deviceNodes entry gives, None when it gives no major (the
    runtime then takes the host node's); a missing minor is 0 (omitempty)."""
    major, minor = node.get("major"), node.get("minor", 0)
    if not isinstance(major, int) or not isinstance(minor, int):
        return None
    return major, minor


def spec_problems(doc: Any, machine: Machine, *, codes: dict[str, str], where: str,
                  kind: str | None, version: str | None,
                  helpers: tuple[str, ...] = ()) -> list[Problem]:
    """Everything DESIGN step 10 asks of a spec, as problems with `codes` (SPEC_CODES or
    PLUGIN_SPEC_CODES)."""
    if not isinstance(doc, dict):
        return [Problem(codes["invalid"], f"{where} is not a CDI spec (no mapping)", where)]
    problems = []
    if kind is not None and doc.get("kind") != kind:
        problems.append(Problem(codes["wrong-kind"],
                                f"{where} has kind {doc.get('kind')!r}, expected {kind!r}", where))
    if not device_names(doc):
        problems.append(Problem(codes["no-devices"], f"{where} lists no devices", where))
    edits = _edits(doc)
    driver_root = machine.driver_root
    staging = machine.at(machine.staging_parent)
    driver_files = set()
    root_prefix, dev_prefix = f"{driver_root}/", f"{machine.at('/dev')}/"
    for mount in _entries(edits, "mounts"):
        raw = str(mount.get("hostPath", ""))
        path = host_path(machine, raw)
        if path.is_relative_to(staging) or Path(raw).is_relative_to(machine.staging_parent):
            problems.append(Problem(codes["staging-path"],
                                    f"{where} mounts {raw} from the staging mounts, which GPU "
                                    "pods cannot rely on", raw))
        elif "unsafe-path" in codes and (why := _mount_problem(mount, str(path), root_prefix,
                                                                 dev_prefix)):
            problems.append(Problem(codes["unsafe-path"], f"{where} mounts {why}", raw))
        elif not os.path.exists(path):
            problems.append(Problem(codes["missing-host-path"],
                                    f"{where} mounts {raw}, which does not exist", raw))
        elif path.is_relative_to(driver_root):
            driver_files.add(path.name)
    for node in _entries(edits, "deviceNodes"):
        # Our spec only: a channel is an isolation boundary that NVIDIA hands out one by
        # one (imex.py), never with nvidia.com/gpu.
        raw = str(node.get("hostPath") or node.get("path") or "")
        if "imex-channel" in codes and imex_channel(machine, node):
            problems.append(Problem(codes["imex-channel"],
                                    f"{where} names IMEX channel {node.get('path') or raw!r}, "
                                    "which only its consumers hand out, one by one", raw))
        try:
            st = os.stat(host_path(machine, raw))
        except OSError:
            st = None
        if st is None or not stat.S_ISCHR(st.st_mode):
            fix = ""
            if codes is PLUGIN_SPEC_CODES:
                fix = "; " + (DEV_ROOT_FIX if host_path(machine, raw).is_relative_to(
                    driver_root / "dev") else "restart the device plugin's pod")
            problems.append(Problem(codes["bad-device-node"],
                                    f"{where} names device node {raw!r}, which is not a "
                                    f"character device{fix}", raw))
        elif _numbers(node) not in (None, (os.major(st.st_rdev), os.minor(st.st_rdev))):
            # The runtime makes the pod's node from the spec's numbers, not the host's
            # node: a caps or IMEX node re-created since (MIG reconfigured, a module
            # reloaded) would give pods a node of another device, or of none.
            major, minor = _numbers(node) or (0, 0)
            problems.append(Problem(codes["bad-device-node"],
                                    f"{where} gives device node {raw!r} the numbers "
                                    f"{major}:{minor}, but it is "
                                    f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", raw))
    # Our spec only: the device plugin's names its own driver root and hooks.
    for hook in _entries(edits, "hooks") if "unsafe-path" in codes else []:
        args = hook.get("args")
        if isinstance(args, list) and (bad := hook_problem(args)):
            problems.append(Problem(codes["unsafe-path"],
                                    f"{where} runs hook {hook.get('path')} with "
                                    f"{bad[0]!r}, which {bad[1]}", bad[0]))
    patterns = [("libcuda.so", "library"), ("libnvidia-ml.so", "library")]
    patterns += [(h, "helper") for h in helpers]
    for name, what in patterns:
        if what == "helper":
            found = name in driver_files
            wanted = name
        elif version:
            wanted = f"{name}.{version}"
            found = wanted in driver_files
        else:
            wanted = f"{name}.<version>"
            found = any(re.fullmatch(rf"{re.escape(name)}\.\d+\.\d+(\.\d+)?", n)
                        for n in driver_files)
        if not found:
            problems.append(Problem(codes[f"missing-{what}"],
                                    f"{where} does not mount {wanted} from {driver_root}", where))
    if codes is PLUGIN_SPEC_CODES:
        problems = [replace(p, message=f"{p.message}; {PLUGIN_FIXES[p.code]}")
                    if p.code in PLUGIN_FIXES else p for p in problems]
    return problems
