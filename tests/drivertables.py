"""The tables simulated machines are made from: a real driver's files, firmware and devices.

Names, SONAMEs and realistic sizes of a recent NVIDIA datacenter driver as its installer
or Ubuntu's packages lay it out, what a stale driver leaves behind, and the unrelated
host libraries and programs around it (some of them near misses for a naive prefix
rule). Pure data: tests/simgpu.py turns it into files.
"""

from __future__ import annotations

from typing import NamedTuple

_M = 1024 * 1024
_K = 1024


class DriverLib(NamedTuple):
    """One driver library: file name and SONAME templates (``{ver}`` = driver version)."""

    name: str
    soname: str | None  # None: no DT_SONAME
    subdir: str  # '' (the library dir itself) or 'vdpau'
    size: int  # realistic size in bytes (files are int(size * scale) bytes)


# Real file names and SONAMEs of a recent (535/550/570) datacenter driver as installed by
# NVIDIA's installer or Ubuntu's packages (flat in /usr/lib/x86_64-linux-gnu). Internal
# libraries (eglcore, glcore, glsi, tls, rtcore, gpucomp, glvkspirv, pkcs11) have
# SONAME == file name, so ldconfig makes no link for them. libnvidia-api.so.1 is shipped
# under its SONAME, and egl-wayland/egl-gbm carry their own (non-driver) versions.
# Sizes: the big ones as given for 550/570; the others close to Debian's 535.309.01 files.
DRIVER_LIBS: tuple[DriverLib, ...] = (
    DriverLib("libcuda.so.{ver}", "libcuda.so.1", "", 95 * _M),
    DriverLib("libcudadebugger.so.{ver}", "libcudadebugger.so.1", "", 10 * _M),
    DriverLib("libnvidia-ml.so.{ver}", "libnvidia-ml.so.1", "", 2 * _M),
    DriverLib("libnvidia-ptxjitcompiler.so.{ver}", "libnvidia-ptxjitcompiler.so.1", "", 28 * _M),
    DriverLib("libnvidia-nvvm.so.{ver}", "libnvidia-nvvm.so.4", "", 86 * _M),
    DriverLib("libnvidia-cfg.so.{ver}", "libnvidia-cfg.so.1", "", 450 * _K),
    DriverLib("libnvidia-opencl.so.{ver}", "libnvidia-opencl.so.1", "", 24 * _M),
    DriverLib("libnvidia-allocator.so.{ver}", "libnvidia-allocator.so.1", "", 340 * _K),
    DriverLib("libnvidia-gpucomp.so.{ver}", "libnvidia-gpucomp.so.{ver}", "", 72 * _M),
    DriverLib("libnvidia-rtcore.so.{ver}", "libnvidia-rtcore.so.{ver}", "", 88 * _M),
    DriverLib("libnvoptix.so.{ver}", "libnvoptix.so.1", "", 68 * _M),
    DriverLib("libnvcuvid.so.{ver}", "libnvcuvid.so.1", "", 10 * _M),
    DriverLib("libnvidia-encode.so.{ver}", "libnvidia-encode.so.1", "", 410 * _K),
    DriverLib("libnvidia-opticalflow.so.{ver}", "libnvidia-opticalflow.so.1", "", 260 * _K),
    DriverLib("libnvidia-fbc.so.{ver}", "libnvidia-fbc.so.1", "", 320 * _K),
    DriverLib("libnvidia-eglcore.so.{ver}", "libnvidia-eglcore.so.{ver}", "", 36 * _M),
    DriverLib("libnvidia-glcore.so.{ver}", "libnvidia-glcore.so.{ver}", "", 36 * _M),
    DriverLib("libnvidia-glsi.so.{ver}", "libnvidia-glsi.so.{ver}", "", 700 * _K),
    DriverLib("libnvidia-tls.so.{ver}", "libnvidia-tls.so.{ver}", "", 20 * _K),
    DriverLib("libnvidia-glvkspirv.so.{ver}", "libnvidia-glvkspirv.so.{ver}", "", 24 * _M),
    DriverLib("libEGL_nvidia.so.{ver}", "libEGL_nvidia.so.0", "", 1400 * _K),
    DriverLib("libGLX_nvidia.so.{ver}", "libGLX_nvidia.so.0", "", 1500 * _K),
    DriverLib("libGLESv2_nvidia.so.{ver}", "libGLESv2_nvidia.so.2", "", 320 * _K),
    DriverLib("libGLESv1_CM_nvidia.so.{ver}", "libGLESv1_CM_nvidia.so.1", "", 260 * _K),
    DriverLib("libnvidia-pkcs11.so.{ver}", "libnvidia-pkcs11.so.{ver}", "", 50 * _K),
    DriverLib(
        "libnvidia-pkcs11-openssl3.so.{ver}", "libnvidia-pkcs11-openssl3.so.{ver}", "", 50 * _K
    ),
    DriverLib("libnvidia-ngx.so.{ver}", "libnvidia-ngx.so.1", "", 4 * _M),
    DriverLib("libnvidia-api.so.1", "libnvidia-api.so.1", "", 760 * _K),
    DriverLib("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1", "", 100 * _K),
    DriverLib("libnvidia-egl-gbm.so.1.1.1", "libnvidia-egl-gbm.so.1", "", 30 * _K),
    DriverLib("libvdpau_nvidia.so.{ver}", "libvdpau_nvidia.so.1", "vdpau", 980 * _K),
)

# Linker names the NVIDIA installer adds next to the SONAME links (name -> SONAME).
HOST_LINKER_NAMES: dict[str, str] = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libnvcuvid.so": "libnvcuvid.so.1",
    "libnvidia-encode.so": "libnvidia-encode.so.1",
    "libnvidia-cfg.so": "libnvidia-cfg.so.1",
    "libnvidia-ptxjitcompiler.so": "libnvidia-ptxjitcompiler.so.1",
}

# Linker names the built driver root must carry (DESIGN.md, run step 6).
ROOT_LINKER_NAMES: dict[str, str] = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
}

# What a stale driver version leaves behind. libnvidia-vulkan-producer exists in 535 (with
# NO DT_SONAME, as in Debian's 535.309.01) and not in 550: a stale file without a current
# counterpart.
STALE_LIBS: tuple[DriverLib, ...] = (
    DriverLib("libcuda.so.{ver}", "libcuda.so.1", "", 29 * _M),
    DriverLib("libnvidia-ml.so.{ver}", "libnvidia-ml.so.1", "", 2 * _M),
    DriverLib("libnvidia-ptxjitcompiler.so.{ver}", "libnvidia-ptxjitcompiler.so.1", "", 21 * _M),
    DriverLib("libnvidia-vulkan-producer.so.{ver}", None, "", 23 * _K),
    DriverLib("libvdpau_nvidia.so.{ver}", "libvdpau_nvidia.so.1", "vdpau", 950 * _K),
)

HELPERS: tuple[str, ...] = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
HELPER_SIZES: dict[str, int] = {
    "nvidia-smi": 900 * _K,
    "nvidia-debugdump": 300 * _K,
    "nvidia-persistenced": 220 * _K,
    "nvidia-cuda-mps-control": 60 * _K,
    "nvidia-cuda-mps-server": 20 * _K,
}
# NVIDIA programs that are not helpers in DESIGN.md, plus ordinary host programs.
UNRELATED_EXES: tuple[str, ...] = ("nvidia-settings", "nvidia-xconfig", "ls", "kmod")

FIRMWARE: tuple[tuple[str, int], ...] = (("gsp_ga10x.bin", 38 * _M), ("gsp_tu10x.bin", 24 * _M))

# (character device name, major, minor) as the nvidia/nvidia-uvm modules create them.
DEVICES: tuple[tuple[str, int, int], ...] = (
    ("nvidia0", 195, 0),
    ("nvidia1", 195, 1),
    ("nvidiactl", 195, 255),
    ("nvidia-uvm", 511, 0),
    ("nvidia-uvm-tools", 511, 1),
    ("nvidia-modeset", 195, 254),
)

# Unrelated host libraries: (file name, SONAME). Some are near misses a prefix match
# must not take: libEGL/libGLX/libGLdispatch (GLVND), libOpenCL (ICD loader), libvdpau.
UNRELATED_LIBS: tuple[tuple[str, str], ...] = (
    ("libz.so.1.2.13", "libz.so.1"),
    ("libzstd.so.1.5.4", "libzstd.so.1"),
    ("liblzma.so.5.4.1", "liblzma.so.5"),
    ("libbz2.so.1.0.4", "libbz2.so.1.0"),
    ("libssl.so.3", "libssl.so.3"),
    ("libcrypto.so.3", "libcrypto.so.3"),
    ("libstdc++.so.6.0.30", "libstdc++.so.6"),
    ("libffi.so.8.1.2", "libffi.so.8"),
    ("libsystemd.so.0.35.0", "libsystemd.so.0"),
    ("libudev.so.1.7.5", "libudev.so.1"),
    ("libexpat.so.1.8.10", "libexpat.so.1"),
    ("libgmp.so.10.4.1", "libgmp.so.10"),
    ("libpcre2-8.so.0.11.2", "libpcre2-8.so.0"),
    ("libselinux.so.1", "libselinux.so.1"),
    ("libcap.so.2.66", "libcap.so.2"),
    ("libseccomp.so.2.5.4", "libseccomp.so.2"),
    ("libdrm.so.2.4.0", "libdrm.so.2"),
    ("libX11.so.6.4.0", "libX11.so.6"),
    ("libxcb.so.1.1.0", "libxcb.so.1"),
    ("libEGL.so.1.1.0", "libEGL.so.1"),
    ("libGLX.so.0.0.0", "libGLX.so.0"),
    ("libGLdispatch.so.0.0.0", "libGLdispatch.so.0"),
    ("libOpenCL.so.1.0.0", "libOpenCL.so.1"),
    ("libvdpau.so.1.0.0", "libvdpau.so.1"),
    ("libgcrypt.so.20.4.1", "libgcrypt.so.20"),
    ("libgpg-error.so.0.33.1", "libgpg-error.so.0"),
    ("liblz4.so.1.9.4", "liblz4.so.1"),
    ("libacl.so.1.1.2301", "libacl.so.1"),
    ("libattr.so.1.1.2501", "libattr.so.1"),
    ("libblkid.so.1.1.0", "libblkid.so.1"),
    ("libmount.so.1.1.0", "libmount.so.1"),
    ("libuuid.so.1.3.0", "libuuid.so.1"),
    ("libkmod.so.2.4.0", "libkmod.so.2"),
    ("libpam.so.0.85.1", "libpam.so.0"),
    ("libtinfo.so.6.4", "libtinfo.so.6"),
    ("libncursesw.so.6.4", "libncursesw.so.6"),
    ("libreadline.so.8.2", "libreadline.so.8"),
    ("libsqlite3.so.0.8.6", "libsqlite3.so.0"),
    ("libxml2.so.2.9.14", "libxml2.so.2"),
    ("libyaml-0.so.2.0.9", "libyaml-0.so.2"),
)

# Libraries a host with the CUDA toolkit / NVIDIA Container Toolkit installed has in its
# library dir (only with make_machine(toolkit_libs=True)). Not driver files, but
# libcudart/libcudart's "libcuda" prefix and libnvidia-container's "libnvidia-" prefix
# match a naive prefix rule.
TOOLKIT_LIBS: tuple[tuple[str, str], ...] = (
    ("libcudart.so.12.2.140", "libcudart.so.12"),
    ("libcublas.so.12.2.5.6", "libcublas.so.12"),
    ("libnvidia-container.so.1.17.8", "libnvidia-container.so.1"),
    ("libnvidia-container-go.so.1.17.8", "libnvidia-container-go.so.1"),
)

# The names the older agent's SetupNVIDIA linked into /usr/lib/<multiarch> (every driver
# library of the staging, by prefix).
PREFIXES = ("libcuda", "libnvidia-", "libnvcuvid", "libnvoptix", "libEGL_nvidia",
            "libGLX_nvidia", "libGLESv1_CM_nvidia", "libGLESv2_nvidia", "libvdpau_nvidia")
