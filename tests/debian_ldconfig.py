"""Debian's own ldconfig of another CPU architecture (libc-bin), fetched for tests.

A simulated machine of another CPU (arm64 here) needs that CPU's ldconfig, run under
qemu user emulation. It comes from Debian bookworm's ``libc-bin`` (component main),
fetched with tests/realdriver.py's private apt configuration and cached like the driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from realdriver import PrivateApt, RealDriverUnavailable, cache_dir, locked

# ELF e_machine of each Debian architecture's own programs.
_ELF_MACHINE = {"amd64": 62, "arm64": 183}


def _runs_on(path: Path, arch: str) -> bool:
    """`path` is an executable ELF file for the CPU of Debian architecture `arch`."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return (
        head[:4] == b"\x7fELF"
        and int.from_bytes(head[18:20], "little") == _ELF_MACHINE[arch]
        and os.access(path, os.X_OK)
    )


def fetch_ldconfig(arch: str = "arm64") -> Path:
    """Debian bookworm's own ldconfig for ``arch``, from ``libc-bin`` (component main).

    An ldconfig indexes only libraries of its own architecture (x86_64's says "is for
    unknown machine 183" to every aarch64 file and leaves it out of the cache), so a
    simulated aarch64 machine needs aarch64's. Debian's ldconfig is static-pie: no
    loader or libc of its architecture is needed, ``qemu-aarch64-static`` runs it as it
    is. Cached in ``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests/debian-libc-bin/<arch>/``
    like the driver (later calls are offline); raises RealDriverUnavailable when it
    cannot be had."""
    if arch not in _ELF_MACHINE:
        raise ValueError(f"unsupported arch {arch!r} (one of {', '.join(_ELF_MACHINE)})")
    base = cache_dir(arch, "debian-libc-bin")
    binary = base / "ldconfig"
    with locked(base / ".lock"):
        if not _runs_on(binary, arch):
            _download_ldconfig(base, arch, binary)
    return binary


def _download_ldconfig(base: Path, arch: str, binary: Path) -> None:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RealDriverUnavailable(f"{tool} not found: cannot fetch Debian packages")
    apt = PrivateApt(base / "apt", arch, "bookworm", components="main")
    apt.run("apt-get", "update")
    debs = base / "apt" / "debs"
    for old in debs.glob("*.deb"):
        old.unlink()
    apt.run("apt-get", "download", "libc-bin", cwd=debs)
    deb_files = sorted(debs.glob("libc-bin_*.deb"))
    if len(deb_files) != 1:
        raise RealDriverUnavailable(f"apt-get download libc-bin gave {len(deb_files)} files")
    tmp_tree = Path(tempfile.mkdtemp(prefix=".tree-", dir=base))
    try:
        subprocess.run(
            ["dpkg-deb", "-x", str(deb_files[0]), str(tmp_tree)], check=True, capture_output=True
        )
        # bookworm ships sbin/ldconfig; later releases moved it to usr/sbin.
        found = [p for p in (tmp_tree / "sbin/ldconfig", tmp_tree / "usr/sbin/ldconfig")
                 if _runs_on(p, arch)]
        if not found:
            raise RealDriverUnavailable(f"{deb_files[0].name} has no {arch} ldconfig")
        os.replace(found[0], binary)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RealDriverUnavailable(f"unpacking {deb_files[0].name} failed: {exc}") from exc
    finally:
        shutil.rmtree(tmp_tree, ignore_errors=True)
        deb_files[0].unlink()
