"""Container images made from files this machine already has: no debootstrap, no registry.

* :func:`probe_root`: a directory tree holding the host's own python3 (its binary, the
  shared libraries ``ldd`` names for it and its extension modules, and the standard
  library less its tests, build config and tool packages), the host's static
  ``/sbin/ldconfig``, ``/bin/sh``, glibc's runtime libraries and libgcc_s (what the
  driver's libraries link against: :data:`RUNTIME_LIBS`) and an ``/etc/ld.so.conf``
  for the multiarch dirs.
  That is what tests/pod.py's PROBE needs (python3 with ctypes, json and subprocess;
  ``ldconfig -p``) and what NVIDIA's update-ldcache hook needs in a container root
  (``/etc/ld.so.conf``). nvidia-smi and the driver libraries come from the CDI spec.
  podman runs it as ``--rootfs DIR:O`` (tests/pod.py, ``make demo``); containerd gets it
  as an OCI archive (:func:`oci_archive`).
* :func:`pause_root`: ``/pause``, a static C program (the host's gcc and libc.a) that
  waits for SIGTERM or SIGINT and exits 0: the sandbox (pause) image of the CRI pods.

Both are built once per key (the host files' sizes and mtimes, this module's
:data:`VERSION`) under ``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests/images/`` with a
lock, a temporary name and a rename, like tests/rootfs.py's trees; building the probe
root takes about a second (copies of about 30 MB).
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

VERSION = 1
PYTHON = Path("/usr/bin/python3")
LDCONFIG = Path("/sbin/ldconfig")
SHELL = Path("/bin/sh")
MULTIARCH = "x86_64-linux-gnu"
# What NVIDIA's libraries need from a distribution beyond python3's own: glibc's runtime
# libraries (libpthread, libdl, librt, libutil...; their NEEDED entries) and libgcc_s.
RUNTIME_LIBS = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                "libutil.so.1", "libresolv.so.2", "libanl.so.1", "libmvec.so.1",
                "libnss_files.so.2", "libnss_dns.so.2", "libgcc_s.so.1",
                "ld-linux-x86-64.so.2")
# Parts of the standard library a probe never imports (about 30 MB of the 54).
STDLIB_SKIP = ("test", "config-3.11-x86_64-linux-gnu", "lib2to3", "idlelib", "tkinter",
               "ensurepip", "pydoc_data", "dist-packages", "site-packages", "__pycache__",
               "turtledemo", "venv", "distutils")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGTERM, done);
    signal(SIGINT, done);
    for (;;) pause();
}
"""


class ImageError(RuntimeError):
    """An image cannot be made from this machine's files (the reason says which)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "unbounded-nvidia-setup-tests" / "images"


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _stamp(*paths: Path) -> str:
    parts: list[object] = [VERSION, Path(__file__).read_text()]
    for p in paths:
        st = p.stat()
        parts += [str(p), os.path.realpath(p), st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _cached(name: str, key: str, build: Callable[[Path], None]) -> Path:
    final = cache_dir() / f"{name}-{key}"
    if final.is_dir():
        return final
    with _lock():
        if final.is_dir():
            return final
        for old in cache_dir().glob(f"{name}-*"):
            shutil.rmtree(old)
        for old in cache_dir().glob(f".{name}-build-*"):
            shutil.rmtree(old)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=cache_dir()))
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _skeleton(root: Path) -> None:
    """Merged-/usr layout (as Debian's), the mount points a runtime needs, a root user."""
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", f"usr/lib/{MULTIARCH}",
              "etc/ld.so.conf.d", "dev", "proc", "sys", "tmp", "run", "var/run", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    (root / "tmp").chmod(0o1777)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")


def _copy_in(root: Path, path: Path) -> None:
    """The file at ``path`` (symlinks followed) as a regular file at the same path in
    ``root`` (whose /lib, /bin... are the merged-/usr links)."""
    dest = root / str(path).lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        shutil.copy2(path, dest)


LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


def shared_libraries(files: Sequence[Path]) -> set[Path]:
    """Every library ``ldd`` resolves for ``files`` (the loader included)."""
    found: set[Path] = set()
    for f in files:
        proc = subprocess.run(["ldd", str(f)], capture_output=True, text=True, timeout=30,
                              check=False, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:  # static ("not a dynamic executable")
            continue
        found |= {Path(m[1]) for m in map(LDD_LINE.search, proc.stdout.splitlines()) if m}
    return found


def _python_version() -> str:
    name = os.path.basename(os.path.realpath(PYTHON))  # python3.11
    if not re.fullmatch(r"python3\.\d+", name):
        raise ImageError(f"{PYTHON} is {name}, not a python3.N binary")
    return name


def _build_probe(root: Path) -> None:
    for tool in (PYTHON, LDCONFIG, SHELL):
        if not tool.exists():
            raise ImageError(f"no {tool} on this machine (the probe image copies it)")
    version = _python_version()
    stdlib = Path("/usr/lib") / version
    _skeleton(root)
    shutil.copytree(stdlib, root / str(stdlib).lstrip("/"), symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP])
    dynload = sorted((stdlib / "lib-dynload").glob("*.so"))
    binaries = [Path(os.path.realpath(PYTHON)), Path(os.path.realpath(SHELL))]
    libs = {Path(f"/lib/{MULTIARCH}/{name}") for name in RUNTIME_LIBS}
    missing = sorted(str(p) for p in libs if not p.exists())
    if missing:
        raise ImageError(f"this machine lacks {', '.join(missing)}")
    for lib in sorted(libs | shared_libraries([*binaries, *dynload])):
        _copy_in(root, lib)
    for b in binaries:
        _copy_in(root, b)
    (root / "usr/bin/python3").symlink_to(version)
    if not (root / "usr/bin/sh").exists():
        (root / "usr/bin/sh").symlink_to(os.path.basename(binaries[1]))
    _copy_in(root, LDCONFIG)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (root / f"etc/ld.so.conf.d/{MULTIARCH}.conf").write_text(
        f"/usr/local/lib/{MULTIARCH}\n/lib/{MULTIARCH}\n/usr/lib/{MULTIARCH}\n")
    subprocess.run([str(LDCONFIG), "-r", str(root)], check=True, timeout=60,
                   capture_output=True, stdin=subprocess.DEVNULL)


def probe_root() -> Path:
    """The probe image's tree (built on first use; see the module doc)."""
    if not PYTHON.exists():
        raise ImageError(f"no {PYTHON} on this machine (the probe image copies it)")
    return _cached("probe", _stamp(PYTHON, Path(os.path.realpath(PYTHON)), LDCONFIG),
                   _build_probe)


def _build_pause(root: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageError("no gcc (tests/install-deps installs gcc and libc6-dev)")
    src = root.parent / f"{root.name}.c"
    src.write_text(PAUSE_C)
    try:
        proc = subprocess.run([gcc, "-static", "-Os", "-s", "-o", str(root / "pause"),
                               str(src)], capture_output=True, text=True, timeout=120,
                              check=False, stdin=subprocess.DEVNULL)
    finally:
        src.unlink()
    if proc.returncode != 0:
        raise ImageError(f"gcc -static pause.c failed: {proc.stderr.strip()}")


def pause_root() -> Path:
    """The pause image's tree: ``/pause`` only."""
    return _cached("pause", _stamp(), _build_pause)


# -- OCI archives for `ctr images import` ---------------------------------------------------


def _layer(tree: Path) -> bytes:
    """An uncompressed tar of ``tree`` (numeric root ownership, mtimes kept)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            return info
        for path in sorted(tree.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(tree)), recursive=False, filter=owner)
    return buf.getvalue()


def oci_archive(tree: Path, ref: str, out: Path, *, cmd: Sequence[str] = ()) -> Path:
    """``out``: a one-layer OCI image archive of ``tree`` named ``ref`` (the
    ``io.containerd.image.name`` annotation `ctr images import` reads), with ``cmd`` as
    its default command and a PATH; gzip-compressed layer."""
    raw = _layer(tree)
    layer = gzip.compress(raw, compresslevel=1, mtime=0)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [PATH_ENV], **({"Cmd": list(cmd)} if cmd else {})},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw).hexdigest()]},
    }).encode()
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(config, "application/vnd.oci.image.config.v1+json"),
        "layers": [blob(layer, "application/vnd.oci.image.layer.v1.tar+gzip")],
    }).encode()
    desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
    desc["annotations"] = {"io.containerd.image.name": ref,
                           "org.opencontainers.image.ref.name": ref.rpartition(":")[2]}
    index = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
    files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index,
             **{f"blobs/sha256/{d}": data for d, data in blobs.items()}}
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out)
    return out
