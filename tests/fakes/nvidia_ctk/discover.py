"""internal/discover: mounts, character devices, and the create-symlinks hook's links."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .edits import MOUNT_OPTIONS, Edits
from .elf import ElfError, read_dt_soname
from .filepath import go_ext, go_join, trim_prefix
from .logger import CtkError, Logger
from .lookup import Locator, assert_char_device
from .version import V1_19, Version


@dataclass
class Mount:
    host_path: str
    path: str

    def to_spec(self) -> dict[str, Any]:
        return {
            "hostPath": self.host_path,
            "containerPath": self.path,
            "options": list(MOUNT_OPTIONS),
        }


def locate_mounts(log: Logger, locator: Locator, root: str, patterns: Iterable[str]) -> list[Mount]:
    """internal/discover/mounts.go: located paths, container path = prefix-stripped path."""
    base = go_join("/", root)
    mounts: list[Mount] = []
    seen: set[str] = set()
    for pattern in patterns:
        try:
            located = locator.locate(pattern)
        except CtkError as exc:
            log.warning(f"Could not locate {pattern}: {exc}")
            continue
        if not located:
            log.warning(f"Missing {pattern}")
            continue
        for path in located:
            if path in seen:
                continue
            seen.add(path)
            relative = path if base == "/" else trim_prefix(path, base)
            relative = relative or path
            log.info(f"Selecting {path} as {relative}")
            mounts.append(Mount(path, relative))
    return mounts


def device_edits(
    log: Logger,
    dev_root: str,
    patterns: Iterable[str],
    ctk: Version,
    blocked: Sequence[str] = (),
) -> Edits:
    """internal/discover/char_devices.go + internal/edits/device.go."""
    locator = Locator(log, dev_root, ("/", "/dev"), assert_char_device)
    edits = Edits()
    for node in locate_mounts(log, locator, dev_root, patterns):
        if blocked and os.path.basename(node.host_path).startswith(tuple(blocked)):
            continue
        spec: dict[str, Any] = {"path": node.path}
        if node.host_path != node.path:
            spec["hostPath"] = node.host_path
        if ctk >= V1_19:
            st = os.stat(node.host_path)
            mode = st.st_mode & 0o7777
            for key, value in (
                ("major", os.major(st.st_rdev)),
                ("minor", os.minor(st.st_rdev)),
                ("fileMode", mode),
                ("permissions", "rwm"),
                ("gid", st.st_gid),
            ):
                if value:
                    spec[key] = value
            if st.st_gid and mode and not (mode & 0o4 and mode & 0o2):
                edits.additional_gids.append(st.st_gid)
        edits.device_nodes.append(spec)
    return edits


def is_driver_library(library: str, filename: str) -> bool:
    return fnmatch.fnmatchcase(filename, library + ".*.*")


def so_link(soname: str) -> str:
    """discover.getSoLink: libfoo.so.1.2 -> libfoo.so."""
    while True:
        ext = go_ext(soname)
        if not ext:
            return ""
        if ext == ".so":
            return soname
        soname = soname[: -len(ext)]


def is_symlink(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def symlink_links(log: Logger, mounts: Sequence[Mount]) -> list[str]:
    """internal/discover/symlinks.go additionalSymlinks: the create-symlinks --link args."""
    links: list[str] = []
    processed: set[str] = set()
    for mount in mounts:
        if mount.path in processed:
            continue
        processed.add(mount.path)
        directory, filename = posixpath.split(mount.path)
        wanted: list[str] = []
        if is_driver_library("libcuda.so", filename):
            wanted.append(f"libcuda.so.1::{go_join(directory, 'libcuda.so')}")
        elif is_driver_library("libGLX_nvidia.so", filename):
            wanted.append(f"{filename}::{go_join(directory, 'libGLX_indirect.so.0')}")
        elif is_driver_library("libnvidia-opticalflow.so", filename):
            target = go_join(directory, "libnvidia-opticalflow.so")
            wanted.append(f"libnvidia-opticalflow.so.1::{target}")
        if is_driver_library("*", filename):
            host_dir = os.path.dirname(mount.host_path)
            try:
                soname = read_dt_soname(mount.host_path)
            except (OSError, ElfError) as exc:
                log.warning(f"Failed to get soname symlinks for {mount}: {exc}")
            else:
                if soname != filename and is_symlink(os.path.join(host_dir, soname)):
                    wanted.append(f"{filename}::{go_join(directory, soname)}")
                link = so_link(soname)
                if link and link != soname and is_symlink(os.path.join(host_dir, link)):
                    wanted.append(f"{soname}::{go_join(directory, link)}")
        for link in wanted:
            if link not in links:
                links.append(link)
    return links


def is_lib_name(path: str) -> bool:
    base = os.path.basename(path)
    if not fnmatch.fnmatchcase(base, "lib?*.so*"):
        return False
    parts = base.split(".so")
    return len(parts) == 1 or parts[-1] == "" or parts[-1].startswith(".")
