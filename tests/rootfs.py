"""A Debian trixie machine rootfs for boot tests, built once and cached.

:func:`fresh_rootfs` gives a bootable rootfs at ``dest``: debootstrap ``minbase`` of trixie
(systemd 257, python3 and the product's two runtime dependencies from Debian, and
nothing else Python: the installed package must do without click and pyelftools) plus what
every test boot needs (see :data:`CUSTOMIZATION`):

* stand-ins for ``containerd.service`` and ``kubelet.service``, installed and enabled like
  the real ones (unit files in ``/usr/lib/systemd/system``, ``WantedBy=multi-user.target``
  links in ``/etc``).  Their programs, ``/usr/local/bin/containerd`` and ``kubelet``, are
  Python scripts (so their process names are the real ones, which the product looks for
  before swapping a live root).  They append ``<name> start pid=<pid> mono_us=<t>`` to
  ``/var/log/fake-services.log`` when they start and ``<name> stop ...`` when SIGTERM
  arrives, then sleep forever.  ``<t>`` is CLOCK_MONOTONIC in microseconds, the host's
  clock inside systemd-nspawn (no time namespace), so it compares directly with
  systemd's ``*TimestampMonotonic`` properties;
* hostname ``gpu-node``, an empty root password, a fresh random ``/etc/machine-id`` per
  copy, no console getty and no apt/dpkg timers (nothing that waits for a human or adds
  noise to a 2-core machine).

The first call runs debootstrap (about a minute) and stores the result as an uncompressed
tarball ``trixie-<key>.tar`` in ``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests/rootfs/``
(default ``~/.cache/...``); ``<key>`` hashes the suite, the package list and the
customization, so changing any of them rebuilds.  Builders serialise on an flock, write to
a temporary name and rename, so concurrent pytest processes are safe.  Later calls extract
the tarball (about 2.5 s for the ~290 MB tree here), or with ``overlay=True`` mount an
overlayfs over a cached extracted tree (instant; the tree is extracted once per key).
Either way, :func:`remove_rootfs` undoes it.

Command line: ``python3 tests/rootfs.py DEST [--overlay]`` (root only).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import mirrors

SUITE = "trixie"
# The Debian archive comes from the machine's apt sources (tests/mirrors.py); this
# variable, or mirrors.ARCHIVE_ENV, overrides it.
MIRROR_ENV = "UNS_TEST_DEBIAN_MIRROR"
INCLUDE = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-yaml",
    "python3-sdnotify",
)
HOSTNAME = "gpu-node"
SERVICES_LOG = "/var/log/fake-services.log"
DEBOOTSTRAP_TIMEOUT = 900.0

_FAKE_SERVICE = f"""\
#!/usr/bin/python3
# Stand-in for a long-running node service (boot tests). Logs start and stop with
# CLOCK_MONOTONIC in microseconds, the clock of systemd's *TimestampMonotonic properties.
import os, signal, sys, time

NAME = os.path.basename(sys.argv[0])
LOG = "{SERVICES_LOG}"

def note(event: str) -> None:
    line = f"{{NAME}} {{event}} pid={{os.getpid()}} mono_us={{time.monotonic_ns() // 1000}}\\n"
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    print(line, end="", flush=True)

def on_term(signum: int, frame: object) -> None:
    note("stop")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
note("start")
while True:
    signal.pause()
"""

_CONTAINERD_UNIT = """\
# Boot-test stand-in for containerd.service (installed like Debian's / upstream's).
[Unit]
Description=containerd container runtime (test stand-in)
Documentation=https://containerd.io
After=network.target local-fs.target

[Service]
ExecStart=/usr/local/bin/containerd
Type=simple
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNOFILE=infinity

[Install]
WantedBy=multi-user.target
"""

_KUBELET_UNIT = """\
# Boot-test stand-in for kubelet.service (installed like the kubeadm packages' unit;
# like the real one it has no ordering against containerd of its own).
[Unit]
Description=kubelet: The Kubernetes Node Agent (test stand-in)
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/local/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""

# path in the rootfs -> (mode, content); "->target" makes a symlink instead.
CUSTOMIZATION: dict[str, tuple[int, str]] = {
    "usr/local/bin/containerd": (0o755, _FAKE_SERVICE),
    "usr/local/bin/kubelet": (0o755, _FAKE_SERVICE),
    "usr/lib/systemd/system/containerd.service": (0o644, _CONTAINERD_UNIT),
    "usr/lib/systemd/system/kubelet.service": (0o644, _KUBELET_UNIT),
    "etc/systemd/system/multi-user.target.wants/containerd.service": (
        0o777,
        "->/usr/lib/systemd/system/containerd.service",
    ),
    "etc/systemd/system/multi-user.target.wants/kubelet.service": (
        0o777,
        "->/usr/lib/systemd/system/kubelet.service",
    ),
    # No console login prompt (nothing reads the nspawn console) and no timers.
    "etc/systemd/system/console-getty.service": (0o777, "->/dev/null"),
    "etc/systemd/system/getty@.service": (0o777, "->/dev/null"),
    "etc/hostname": (0o644, HOSTNAME + "\n"),
    "etc/hosts": (0o644, f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n"),
    "etc/machine-id": (0o444, ""),
}
REMOVE = (
    "etc/systemd/system/timers.target.wants",
    "etc/systemd/system/getty.target.wants",
    "var/cache/apt/archives",
    "var/lib/apt/lists",
)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "unbounded-nvidia-setup-tests" / "rootfs"


def cache_key() -> str:
    blob = json.dumps(
        {"suite": SUITE, "include": INCLUDE, "custom": CUSTOMIZATION, "remove": REMOVE, "v": 1},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tarball_path() -> Path:
    return cache_dir() / f"{SUITE}-{cache_key()}.tar"


def tree_path() -> Path:
    return cache_dir() / f"{SUITE}-{cache_key()}.tree"


def _log(msg: str) -> None:
    print(f"rootfs: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cache_lock(name: str = ".lock") -> Iterator[None]:
    """An exclusive flock on ``name`` in the cache dir: one builder of a cached tree at a
    time, across test processes."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / name, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def customize(root: Path) -> None:
    """Apply :data:`CUSTOMIZATION` and :data:`REMOVE` to a debootstrapped tree."""
    for rel in REMOVE:
        target = root / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    for rel, (mode, content) in CUSTOMIZATION.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        if content.startswith("->"):
            target.symlink_to(content[2:])
        else:
            target.write_text(content)
            target.chmod(mode)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    # Empty root password: `root::` in /etc/shadow (debootstrap leaves `root:*:`).
    shadow = root / "etc/shadow"
    lines = shadow.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("root:"):
            fields = line.split(":")
            fields[1] = ""
            lines[i] = ":".join(fields)
    shadow.write_text("".join(lines))


def _build_tarball(final: Path) -> None:
    """debootstrap + customize + tar, into ``final`` via a temporary name."""
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        tree = work / "root"
        mirror = mirrors.debian_archive(MIRROR_ENV, mirrors.ARCHIVE_ENV)
        start = time.monotonic()
        _log(f"debootstrap {SUITE} from {mirror} into {tree} (first run only, about a minute)")
        cmd = [
            "debootstrap",
            "--variant=minbase",
            "--include=" + ",".join(INCLUDE),
            SUITE,
            str(tree),
            mirror,
        ]
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=DEBOOTSTRAP_TIMEOUT, check=False, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-25:])
            raise RuntimeError(f"debootstrap failed ({proc.returncode}):\n{tail}")
        customize(tree)
        tmp_tar = work / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(tree), "-cpf", str(tmp_tar), "."],
            check=True, timeout=600, stdin=subprocess.DEVNULL,
        )
        os.replace(tmp_tar, final)
        _log(f"cached {final} ({final.stat().st_size >> 20} MB, "
             f"{time.monotonic() - start:.0f} s)")
    finally:
        _rmtree(work)


def _mounts_below(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    top = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if point == top or point.startswith(top.rstrip("/") + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _rmtree(path: Path) -> None:
    """Delete ``path``; first unmount anything mounted below it (a debootstrap killed
    half-way leaves its proc/sys mounts, and deleting through a mount is never wanted)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    for point in _mounts_below(path):
        subprocess.run(["umount", "-l", point], check=False, timeout=60,
                       stdin=subprocess.DEVNULL, capture_output=True)
    left = _mounts_below(path)
    if left:
        raise RuntimeError(f"not deleting {path}: still mounted: {', '.join(left)}")
    shutil.rmtree(path)


def _remove_stale(keep: set[Path]) -> None:
    """Under the cache lock: drop other keys' tarballs and trees (a concurrent run of
    older test code using one as its overlay lower layer would lose it) and the
    leftovers of builds that were killed."""
    for pattern in (f"{SUITE}-*", ".build-*", ".tree-*"):
        for entry in cache_dir().glob(pattern):
            if entry not in keep:
                _rmtree(entry)


def ensure_tarball() -> Path:
    """The cached tarball, built on first use."""
    final = tarball_path()
    if final.is_file():
        return final
    with cache_lock():
        if not final.is_file():
            _remove_stale({final, tree_path()})
            _build_tarball(final)
    return final


def _extract(tar: Path, dest: Path) -> None:
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(dest), "-xpf", str(tar)],
        check=True, timeout=600, stdin=subprocess.DEVNULL,
    )


def ensure_tree() -> Path:
    """The cached extracted tree (lower layer for overlays), made on first use."""
    tree = tree_path()
    if tree.is_dir():
        return tree
    tar = ensure_tarball()
    with cache_lock():
        if not tree.is_dir():
            for leftover in tree.parent.glob(".tree-*"):
                _rmtree(leftover)
            tmp = Path(tempfile.mkdtemp(prefix=".tree-", dir=tree.parent))
            try:
                _extract(tar, tmp)
                os.rename(tmp, tree)
            except BaseException:
                _rmtree(tmp)
                raise
    return tree


def _overlay_dirs(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.overlay"


def _write_machine_id(dest: Path) -> None:
    mid = dest / "etc/machine-id"
    if mid.exists() or mid.is_symlink():
        mid.unlink()
    mid.write_text(os.urandom(16).hex() + "\n")
    mid.chmod(0o444)


def fresh_rootfs(dest: Path, *, overlay: bool = False, lower: Path | None = None) -> Path:
    """A fresh copy of the cached trixie rootfs at ``dest`` (created; must be empty).

    ``overlay=False``: the tarball is extracted into ``dest``.  ``overlay=True``: ``dest``
    becomes an overlayfs mount over the cached extracted tree, with its upper and work
    dirs in ``<dest.parent>/.<dest.name>.overlay``.  Call :func:`remove_rootfs` when done
    (it handles both). ``lower``: another cached tree as the overlay's lower layer (a
    variant of this one, e.g. tests/cri.py's with containerd)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    if overlay:
        lower = lower or ensure_tree()
        layers = _overlay_dirs(dest)
        (layers / "upper").mkdir(parents=True)
        (layers / "work").mkdir()
        opts = f"lowerdir={lower},upperdir={layers / 'upper'},workdir={layers / 'work'}"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(dest)],
            check=True, timeout=60, stdin=subprocess.DEVNULL,
        )
    else:
        _extract(ensure_tarball(), dest)
    _write_machine_id(dest)
    return dest


def remove_rootfs(dest: Path) -> None:
    """Undo :func:`fresh_rootfs`: unmount an overlay (lazily if busy) and delete."""
    dest = Path(dest)
    if dest.exists() and os.path.realpath(dest) in _mounts_below(dest):
        res = subprocess.run(["umount", str(dest)], check=False, timeout=60,
                             stdin=subprocess.DEVNULL, capture_output=True)
        if res.returncode != 0:
            subprocess.run(["umount", "-l", str(dest)], check=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    _rmtree(_overlay_dirs(dest))
    _rmtree(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make a fresh Debian trixie test rootfs.")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--overlay", action="store_true",
                        help="overlayfs over the cached tree instead of extracting")
    args = parser.parse_args(argv)
    start = time.monotonic()
    fresh_rootfs(args.dest, overlay=args.overlay)
    print(f"{args.dest}: ready in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
