"""A process that sees a simulated machine's /proc/driver as the host's.

NVIDIA's nvidia-ctk reads MIG caps minors only from the host's absolute
/proc/driver/nvidia-caps/mig-minors (internal/nvcaps), not under --driver-root or
--dev-root, and the nvidia-ctk stand-in follows it. A test whose machine has MIG devices
(simnvml.enable_mig) therefore runs nvidia-ctk, or the product that runs it, in a private
mount namespace where ``<root>/proc/driver`` is bound over /proc/driver (which exists,
empty, on this GPU-less host). Nothing outside that process and its children sees it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_SCRIPT = 'mount --bind "$0" /proc/driver && exec "$@"'


def available() -> str | None:
    """Why a private /proc/driver cannot be had here, or None."""
    import os

    if os.geteuid() != 0:
        return "not root (a private mount namespace and a bind mount)"
    if shutil.which("unshare") is None:
        return "unshare not installed (util-linux)"
    if not os.path.isdir("/proc/driver"):
        return "this kernel has no /proc/driver to bind over"
    return None


def in_private_proc_driver(root: Path, argv: list[str]) -> list[str]:
    """``argv`` wrapped to run in a private mount namespace (``unshare -m --propagation
    private``) with ``<root>/proc/driver`` bind-mounted over /proc/driver."""
    source = Path(root) / "proc" / "driver"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", _SCRIPT, str(source),
            *argv]
