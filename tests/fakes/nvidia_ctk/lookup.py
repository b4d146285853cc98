"""pkg/lookup and internal/lookup/root: locators below a root, and the driver root."""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .filepath import go_join, trim_prefix, unique
from .logger import CtkError, Logger

# pkg/lookup/library.go: default search paths below the root (ld.so.cache fallback omitted).
LIBRARY_SEARCH_DIRS = (
    "/",
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
)
# pkg/lookup/path.go defaultPATH; only searched below the root here (see the package docstring).
EXECUTABLE_SEARCH_DIRS = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
)

Filter = Callable[[str], "str | None"]


def assert_file(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"error getting info for {path}: {exc.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return f"specified path '{path}' is a directory"
    return None


def assert_executable(path: str) -> str | None:
    reason = assert_file(path)
    if reason is not None:
        return reason
    if os.stat(path).st_mode & 0o111 == 0:
        return f"specified file '{path}' is not executable"
    return None


def assert_char_device(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"error getting info for {path}: {exc.strerror}"
    if not stat.S_ISCHR(st.st_mode):
        return f"{path} is not a character device"
    return None


@dataclass
class Locator:
    """pkg/lookup file locator, optionally with evaluated symlinks (the 'symlink locator')."""

    log: Logger
    root: str
    search_paths: Sequence[str] = ()
    filter: Filter = assert_file
    count: int = 0
    resolve: bool = False
    required: bool = True

    def prefixes(self) -> list[str]:
        paths = unique(self.search_paths)
        if not paths:
            return [self.root]
        return [go_join(self.root, p) for p in paths]

    def locate(self, pattern: str) -> list[str]:
        found: list[str] = []
        prefixes = self.prefixes()
        self.log.debug(f'Locating "{pattern}" in {prefixes}')
        for prefix in prefixes:
            full = go_join(glob.escape(prefix), pattern)
            for candidate in sorted(glob.glob(full, include_hidden=True)):
                reason = self.filter(candidate)
                if reason is not None:
                    self.log.debug(f"Candidate '{candidate}' does not meet requirements: {reason}")
                    continue
                found.append(candidate)
                if self.count and len(found) == self.count:
                    break
            if self.count and len(found) == self.count:
                break
        if not found:
            if self.required:
                raise CtkError(f"pattern {pattern} not found")
            return []
        if not self.resolve:
            return found
        resolved: list[str] = []
        for candidate in found:
            try:
                resolved.append(os.path.realpath(candidate, strict=True))
            except OSError as exc:
                raise CtkError(f"failed to resolve link: {exc}") from exc
        return unique(resolved)


class Driver:
    """internal/lookup/root/root.go."""

    def __init__(self, log: Logger, root: str, dev_root: str, nvml_version: str) -> None:
        self.log = log
        self.root = root
        self.dev_root = dev_root
        self._version = nvml_version
        self._lib_dirs: list[str] = []

    def libraries(self) -> Locator:
        return Locator(self.log, self.root, LIBRARY_SEARCH_DIRS, resolve=True)

    def relative_to_root(self, path: str) -> str:
        if self.root == "/" or not path.startswith("/"):
            return path
        return trim_prefix(path, self.root)

    def _infer_version(self) -> str:
        suffix = self._version or "*.*"
        errors: list[str] = []
        for library in ("libcuda.so.", "libnvidia-ml.so."):
            try:
                paths = self.libraries().locate(library + suffix)
            except CtkError as exc:
                errors.append(f'failed to locate "{library}": {exc}')
                continue
            version = trim_prefix(os.path.basename(paths[0]), library)
            if not version:
                errors.append(f"failed to extract version from path {paths[0]}")
                continue
            return version
        raise CtkError("\n".join(errors))

    def _update(self) -> None:
        version = self._infer_version()
        if self._version and self._version != version:
            raise CtkError(f"unexpected version detected: {self._version} != {version}")
        try:
            paths = self.libraries().locate(f"lib*.so.{version}")
        except CtkError as exc:
            raise CtkError(f"failed to locate versioned driver libraries: {exc}") from exc
        self._version = version
        self._lib_dirs = unique(self.relative_to_root(os.path.dirname(p)) for p in paths)

    def version(self) -> str:
        if not self._lib_dirs:
            self._update()
        return self._version

    def lib_dirs(self) -> list[str]:
        if not self._lib_dirs:
            self._update()
        return self._lib_dirs

    def driver_library_locator(self, *extra: str) -> Locator:
        dirs = list(self.lib_dirs())
        for name in extra:
            dirs += [name] if name.startswith("/") else [go_join(d, name) for d in self.lib_dirs()]
        return Locator(self.log, self.root, dirs, resolve=True, required=False)
