"""internal/discover/hooks.go: the spec's createContainer hooks and the program they run."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from typing import Any

from .logger import Logger
from .lookup import EXECUTABLE_SEARCH_DIRS, Locator, assert_executable

DEFAULT_HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
DEFAULT_CTK_PATH = "/usr/bin/nvidia-ctk"

HOOKS_ALWAYS = (
    "create-symlinks",
    "update-ldcache",
    "enable-cuda-compat",
    "disable-device-node-modification",
    "chmod",
)
HOOK_APPLICATION_PROFILE = "update-application-profile"


class HookCreator:
    """internal/discover/hooks.go cdiHookCreator."""

    def __init__(
        self, hook_path: str, ldconfig_path: str, disabled: Sequence[str], enabled: Sequence[str]
    ) -> None:
        self.hook_path = hook_path
        self.ldconfig_path = ldconfig_path
        states = {name: True for name in [*disabled, "chmod"]}
        self.all_disabled = bool(states.get("all")) and not enabled
        for name in enabled:
            states[name] = False
        self.states = states

    def _is_disabled(self, name: str, args: Sequence[str]) -> bool:
        if self.all_disabled:
            return True
        if name in self.states:
            return self.states[name]
        if self.states.get("all"):
            return True
        return name in ("create-symlinks", "chmod") and not args

    def create(self, name: str, args: Sequence[str] = ()) -> dict[str, Any] | None:
        if self._is_disabled(name, args):
            return None
        base = os.path.basename(self.hook_path)
        fixed = [base, "hook"] if base == "nvidia-ctk" else [base]
        extra: list[str] = []
        if name == "create-symlinks":
            for arg in args:
                extra += ["--link", arg]
        elif name == "chmod":
            extra = ["--mode", "755"]
            for arg in args:
                extra += ["--path", arg]
        elif name == "update-ldcache":
            if self.ldconfig_path:
                extra += ["--ldconfig-path", self.ldconfig_path]
            for arg in args:
                extra += ["--folder", arg]
        else:
            extra = list(args)
        return {
            "hookName": "createContainer",
            "path": self.hook_path,
            "args": [*fixed, name, *extra],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }


def resolve_hook_path(log: Logger, path: str) -> str:
    """config.ResolveNVIDIACDIHookPath: an absolute path is used as given; otherwise the
    executable locator looks for the name (nvidia-cdi-hook when none is given) in $PATH, then
    in the default PATH dirs that $PATH lacks, and the first executable non-directory found
    is used, as found (not resolved). A name with a '/' is only checked. Nothing found: a
    warning and /usr/bin/nvidia-cdi-hook (/usr/bin/nvidia-ctk for a path named nvidia-ctk)."""
    ctk = posixpath.basename(path) == "nvidia-ctk"
    label = "NVIDIA Container Toolkit CLI" if ctk else "NVIDIA CDI Hook CLI"
    default = DEFAULT_CTK_PATH if ctk else DEFAULT_HOOK_PATH
    if path.startswith("/"):
        log.debug(f"Using specified {label} path {path}")
        return path
    name = path or posixpath.basename(default)
    log.debug(f"Locating {label} as {name}")
    if "/" in name:
        reason = assert_executable(name)
        found = [] if reason else [name]
        error = f"absolute path {name} is not an executable file: {reason}"
    else:
        dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
        dirs += [d for d in EXECUTABLE_SEARCH_DIRS if d not in dirs]
        found = Locator(log, "", dirs, assert_executable, count=1, required=False).locate(name)
        error = f"{name}: not found"
    if not found:
        log.warning(f"Failed to locate {name}: {error}")
        return default
    log.debug(f"Found {name} candidates: {found}")
    return found[0]
