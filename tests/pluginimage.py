"""NVIDIA's device plugin image for the boot tests, made from local files (issue 32).

The image NVIDIA's DaemonSet runs, reduced to what it needs here:
``/usr/bin/nvidia-device-plugin`` and ``/usr/bin/nvidia-cdi-hook`` (where NVIDIA's image
has them), the libraries ``ldd`` names for them (libc and the loader; the plugin loads
NVML at run time from its driver root), glibc's runtime libraries, the host's static
``/sbin/ldconfig`` and an ``/etc/ld.so.conf`` (the update-ldcache hook of the CDI device
it is given runs in its root). Cached like tests/images.py's trees, as a one-layer OCI
archive for ``ctr images import``. A module of its own: tests/images.py's text is part of
its images' cache keys.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from images import (
    LDCONFIG,
    MULTIARCH,
    RUNTIME_LIBS,
    _cached,
    _copy_in,
    _skeleton,
    _stamp,
    oci_archive,
    shared_libraries,
)

VERSION = 1
def _build_plugin(root: Path, plugin: Path, hook: Path) -> None:
    """``/usr/bin/nvidia-device-plugin`` and ``/usr/bin/nvidia-cdi-hook`` (as NVIDIA's
    image has them), the libraries ``ldd`` names for them (libc and the loader), glibc's
    runtime libraries, the host's static ``/sbin/ldconfig`` and an ``/etc/ld.so.conf``
    (the update-ldcache hook of the CDI device it is given runs in its root)."""
    _skeleton(root)
    libs = {Path(f"/lib/{MULTIARCH}/{name}") for name in RUNTIME_LIBS}
    for lib in sorted(p for p in libs | shared_libraries([plugin, hook]) if p.exists()):
        _copy_in(root, lib)
    for src, name in ((plugin, "nvidia-device-plugin"), (hook, "nvidia-cdi-hook")):
        shutil.copy2(src, root / "usr/bin" / name)
        (root / "usr/bin" / name).chmod(0o755)
    _copy_in(root, LDCONFIG)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (root / f"etc/ld.so.conf.d/{MULTIARCH}.conf").write_text(
        f"/usr/local/lib/{MULTIARCH}\n/lib/{MULTIARCH}\n/usr/lib/{MULTIARCH}\n")


def plugin_archive(plugin: Path, hook: Path, ref: str) -> Path:
    """A cached OCI archive (``plugin.tar`` in its directory) of NVIDIA's plugin image
    made from local files (:func:`_build_plugin`), named ``ref``, its command the plugin."""
    key = _stamp(plugin, hook, LDCONFIG, Path(__file__)) + hashlib.sha256(
        f"{ref}/{VERSION}".encode()).hexdigest()[:8]

    def build(out: Path) -> None:
        tree = out / "tree"
        tree.mkdir()
        _build_plugin(tree, plugin, hook)
        oci_archive(tree, ref, out / "plugin.tar", cmd=["/usr/bin/nvidia-device-plugin"])
        shutil.rmtree(tree)

    return _cached("plugin-oci", key, build) / "plugin.tar"
