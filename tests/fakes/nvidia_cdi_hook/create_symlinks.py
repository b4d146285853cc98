"""cmd/nvidia-cdi-hook/create-symlinks: each TARGET::LINK made inside the container root."""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import stat
import uuid
from collections.abc import Sequence

from .filepath import go_clean, go_join
from .logger import HookError, go_err, log
from .oci import in_root


def create_symlinks(links: Sequence[str], root: str) -> None:
    done: set[str] = set()
    for spec in links:
        if spec in done:
            log("debug", f"Link {spec} already processed")
            continue
        if len(parts := spec.split("::")) != 2:
            raise HookError(f"invalid symlink specification {spec}")
        target, link = parts
        try:
            if link_exists(target, link_path := go_join(root, link)):
                log("debug", f"Link {link_path} already exists")
            else:
                try:
                    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
                except OSError as exc:
                    raise HookError(f"failed to open container root: open {root}: "
                                    f"{go_err(exc)}") from exc
                action = functools.partial(symlink_in_root, target, link, root)
                code, message = in_root(root_fd, action)
                os.close(root_fd)
                if code:
                    raise HookError(message or f"child exit code {code}")
        except HookError as exc:
            raise HookError(f"failed to create link [{target} {link}]: {exc}") from exc
        done.add(spec)


def link_exists(target: str, link_path: str) -> bool:
    """symlinks.Resolve on the lexical host path: is it a symlink whose content is the target?"""
    try:
        if not stat.S_ISLNK(os.lstat(link_path).st_mode):
            return link_path == target
        return os.readlink(link_path) == target
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise HookError(f"failed to check if link exists: failed to resolve existing symlink "
                        f"{link_path}: failed to get file info: lstat {link_path}: "
                        f"{go_err(exc)}") from exc


def symlink_in_root(target: str, link: str, root: str) -> None:
    """createSymlinkInRoot, run chrooted into the container root."""
    link_dir = go_clean(link[: link.rfind("/") + 1])  # filepath.Dir
    base = link.rstrip("/").rsplit("/", 1)[-1] or ("/" if link else ".")  # filepath.Base
    host_root = os.path.realpath(root)  # the name the real hook reads from /proc/self/fd
    try:
        dir_fd = os.open(link_dir, os.O_PATH)
    except FileNotFoundError:
        try:
            dir_fd = mkdir_all(link_dir, host_root)
        except HookError as exc:
            raise HookError(f"failed to create parent dir of link in root: {exc}") from exc
    except OSError as exc:
        raise HookError(f"failed to open parent dir of link in root: securejoin.OpenInRoot "
                        f"{link_dir}: openat2 {link_dir}: {go_err(exc)}") from exc
    log("info", f"Symlinking {go_join(host_root, os.path.realpath(link_dir), base)} to {target}")
    temporary = f"{base}-{uuid.uuid4()}"
    try:
        os.symlink(target, temporary, dir_fd=dir_fd)
    except OSError as exc:
        raise HookError(f"failed to create temporary symlink: {go_err(exc)}") from exc
    try:
        os.rename(temporary, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        os.unlink(temporary, dir_fd=dir_fd)
        raise HookError(f"failed to create symlink: {go_err(exc)}") from exc


def mkdir_all(path: str, host_root: str) -> int:
    """pathrs.MkdirAllHandle: existing directories are followed (inside the root), missing
    ones made 0755 and entered without following symlinks. Returns the last one's descriptor."""
    current, done = os.open("/", os.O_PATH), "/"
    for part in [p for p in path.split("/") if p not in ("", ".")]:
        try:
            following = os.open(part, os.O_PATH | os.O_DIRECTORY, dir_fd=current)
        except FileNotFoundError:
            name, op = f"{go_join(host_root, os.path.realpath(done))}/{part}", "mkdirat"
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=current)
                op = "openat2"
                following = os.open(part, os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=current)
            except OSError as exc:
                raise HookError(f"{op} {name}: {go_err(exc)}") from exc
        os.close(current)
        current, done = following, posixpath.join(done, part)
    return current
