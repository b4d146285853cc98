"""A Debian trixie tree to build the package in, made once and cached.

The machines the package installs into run Debian trixie, whose debhelper (13.24) differs
from the bookworm host's (13.11): it installs units into ``usr/lib/systemd/system`` itself.
:func:`fresh_tree` gives the cached test rootfs (tests/rootfs.py) plus the package's
Build-Depends (and build-essential, which dpkg-checkbuilddeps requires implicitly), from
the Debian archive this machine's apt configuration names (tests/mirrors.py).

The first call extracts the rootfs tarball, installs :data:`BUILD_DEPS` with apt in a
chroot (a private mount namespace with its own /proc) and stores the result as
``buildroot-trixie-<key>.tar`` next to the rootfs tarball; ``<key>`` hashes the rootfs key
and the package list. Later calls extract that tarball (a few seconds). Builders
serialise on their own flock and rename a finished tarball into place.
:func:`build_deb` runs ``packaging/build-deb`` (what ``make deb`` runs) inside a tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rootfs

import mirrors

BUILD_DEPS = (
    "build-essential",
    "debhelper",
    "dh-python",
    "go-md2man",
    "pybuild-plugin-pyproject",
    "python3-all",
    "python3-setuptools",
)
# What packaging/build-deb copies from the source tree (plus the script itself).
SOURCES = ("pyproject.toml", "README.md", "Makefile", "guest", "units", "packaging", "docs")
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
             "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
APT_TIMEOUT = 900.0
BUILD_TIMEOUT = 600.0


class BuildRootUnavailable(RuntimeError):
    """The tree could not be made here (no archive, no network, apt failed)."""


def cache_key() -> str:
    blob = json.dumps({"rootfs": rootfs.cache_key(), "deps": BUILD_DEPS, "v": 1},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tarball_path() -> Path:
    return rootfs.cache_dir() / f"buildroot-{rootfs.SUITE}-{cache_key()}.tar"


def _log(msg: str) -> None:
    print(f"buildroot: {msg}", file=sys.stderr, flush=True)


def in_chroot(tree: Path, script: str, *, timeout: float,
              check: bool = True) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` chrooted into ``tree`` with its own /proc, in a private mount
    namespace (nothing stays mounted), with a clean environment."""
    wrapper = 'mount -t proc proc "$1/proc" && exec chroot "$1" /bin/sh -c "$2"'
    proc = subprocess.run(
        ["unshare", "--mount", "--fork", "sh", "-c", wrapper, "sh", str(tree), script],
        capture_output=True, text=True, timeout=timeout, env=CLEAN_ENV,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"in {tree}: `{script}` exited {proc.returncode}:\n{tail}")
    return proc


def _extract(tar: Path, dest: Path) -> None:
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(dest), "-xpf", str(tar)],
                   check=True, timeout=600, stdin=subprocess.DEVNULL)


def _build_tarball(final: Path) -> None:
    mirror = mirrors.debian_archive(rootfs.MIRROR_ENV, mirrors.ARCHIVE_ENV)
    work = Path(tempfile.mkdtemp(prefix=".buildroot-", dir=final.parent))
    try:
        tree = work / "root"
        tree.mkdir()
        start = time.monotonic()
        _extract(rootfs.ensure_tarball(), tree)
        (tree / "etc/apt/sources.list").write_text(f"deb {mirror} {rootfs.SUITE} main\n")
        resolv = tree / "etc/resolv.conf"
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        with contextlib.suppress(OSError):
            shutil.copyfile("/etc/resolv.conf", resolv)
        _log(f"installing {', '.join(BUILD_DEPS)} from {mirror} (first run only)")
        try:
            in_chroot(tree, "apt-get -q update && apt-get -q -y --no-install-recommends "
                      f"install {' '.join(BUILD_DEPS)} && apt-get clean && "
                      "rm -rf /var/lib/apt/lists/*", timeout=APT_TIMEOUT)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            raise BuildRootUnavailable(f"apt in the trixie tree failed: {e}") from e
        tmp_tar = work / "buildroot.tar"
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(tree), "-cpf",
                        str(tmp_tar), "."], check=True, timeout=600, stdin=subprocess.DEVNULL)
        os.replace(tmp_tar, final)
        _log(f"cached {final} ({final.stat().st_size >> 20} MB, "
             f"{time.monotonic() - start:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_tarball() -> Path:
    final = tarball_path()
    if final.is_file():
        return final
    with rootfs.cache_lock(".buildroot.lock"):
        if not final.is_file():
            for stale in rootfs.cache_dir().glob(f"buildroot-{rootfs.SUITE}-*.tar"):
                stale.unlink()
            for leftover in rootfs.cache_dir().glob(".buildroot-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            _build_tarball(final)
    return final


def fresh_tree(dest: Path) -> Path:
    """A fresh copy of the cached build tree at ``dest`` (created; must be empty)."""
    tar = ensure_tarball()
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    _extract(tar, dest)
    return dest


def build_deb(tree: Path, repo: Path, version: str) -> tuple[Path, str]:
    """Copy the sources of ``repo`` into ``tree`` and run ``packaging/build-deb VERSION``
    there; the .deb (still inside ``tree``) and the build's output."""
    src = tree / "build/src"
    src.mkdir(parents=True)
    for name in SOURCES:
        path = repo / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    proc = in_chroot(tree, f"cd /build/src && sh packaging/build-deb '{version}' /build/dist",
                     timeout=BUILD_TIMEOUT, check=False)
    output = proc.stdout + proc.stderr
    deb = tree / "build/dist" / f"unbounded-nvidia-setup_{version}_all.deb"
    if proc.returncode != 0 or not deb.is_file():
        tail = "\n".join(output.splitlines()[-40:])
        raise AssertionError(f"packaging/build-deb in the trixie tree failed "
                             f"({proc.returncode}), no {deb.name}:\n{tail}")
    return deb, output
