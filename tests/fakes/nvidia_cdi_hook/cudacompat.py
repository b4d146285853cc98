"""cmd/nvidia-cdi-hook/cudacompat: enable-cuda-compat, up to where it reads an ELF header."""

from __future__ import annotations

import glob
import os
from typing import Any

from .filepath import go_join
from .logger import HookError, go_err, log
from .oci import find_root, in_root

CUDA_COMPAT_DIR = "/usr/local/cuda/compat"


def enable_cuda_compat(options: dict[str, Any], spec_file: str) -> None:
    """cudacompat.go: nothing to do without host versions, or without exactly one
    ``libcuda.so.*.*`` in the container's compat dir; deciding from that library's ELF
    header whether to use it is not simulated."""
    if not (options.get("host-driver-version") or options.get("host-cuda-version")):
        return
    root = find_root(spec_file, ldcache=False)
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise HookError(f"failed to open container root: open {root}: {go_err(exc)}") from exc
    compat = options.get("cuda-compat-container-root") or CUDA_COMPAT_DIR

    def count() -> None:  # in the root: 0, 1 or "more" compat libraries
        os._exit(min(len(glob.glob(go_join(compat, "libcuda.so.*.*"))), 2))

    try:
        code, _ = in_root(root_fd, count)
    finally:
        os.close(root_fd)
    if code == 1:
        raise HookError("enable-cuda-compat with CUDA compat libraries in the container is "
                        "not simulated by this nvidia-cdi-hook test stand-in")
    if code > 1:
        log("warning", "Unexpected number of CUDA compat libraries in container")
