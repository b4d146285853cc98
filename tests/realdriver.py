"""Real NVIDIA driver userspace files for tests, from Debian non-free (535 in bookworm,
550 in trixie).

:func:`fetch_real_driver` downloads the driver's .debs (libcuda1, libnvidia-ml1,
nvidia-smi, ...) of a Debian suite (:data:`SUITES`) for ``amd64`` or ``arm64`` with a
PRIVATE apt configuration (its own sources.list, lists, cache and dpkg status; of the
machine's apt setup only the mirror URIs are read, by tests/mirrors.py, and nothing is
changed), unpacks them with ``dpkg-deb -x`` and caches the unpacked tree in
``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests/debian-nvidia/<suite>/<arch>/`` (default
``~/.cache/...``; bookworm's stays at ``debian-nvidia/<arch>/``, where older checkouts
share it). Later calls read only the cache: offline and fast. A lock file makes
concurrent callers (parallel pytest runs) wait for one download.

:func:`stage_real_driver` lays the files out like a host library directory (flat, with
the relative SONAME links the host's ldconfig makes), which is what the machine sees at
``/run/host-nvidia/<N>``. Debian itself installs them under
``usr/lib/<multiarch>/nvidia/current/`` behind /etc/alternatives links; that layout is
never what a staging dir looks like, so it is flattened.

tests/debian_ldconfig.py fetches Debian's own ldconfig of another CPU with the same
private apt configuration (:class:`PrivateApt`).

Command line: ``python3 tests/realdriver.py [--suite bookworm|trixie] [--arch amd64|arm64]
[--stage DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import mirrors

# Debian release -> its NVIDIA driver branch: bookworm 535, trixie 550.
SUITES = {"bookworm": "535", "trixie": "550"}
DEFAULT_SUITE = "bookworm"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
MULTIARCH = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}

# Without these three there is no driver to test with.
REQUIRED_PACKAGES: tuple[str, ...] = ("libcuda1", "libnvidia-ml1", "nvidia-smi")
# Compute, video, EGL (the library of the "libEGL_nvidia.so.<ver>: no such file" failure),
# vdpau (the vdpau/ subdir) and GSP firmware; about 90 MB to download, 270 MB unpacked
# (trixie's 550: 100 MB, 305 MB). Left out: libnvoptix1 (130 MB download), GL/GLX/Vulkan
# (pass packages=... for more). A package a suite lacks is skipped (not a required one).
DEFAULT_PACKAGES: tuple[str, ...] = (
    *REQUIRED_PACKAGES,
    "libnvidia-ptxjitcompiler1",
    "libnvidia-cfg1",
    "libnvidia-allocator1",
    "libnvidia-nvvm4",
    "libcudadebugger1",
    "libnvcuvid1",
    "libnvidia-encode1",
    "libnvidia-opticalflow1",
    "libnvidia-api1",
    "libegl-nvidia0",
    "libnvidia-eglcore",
    "libnvidia-gpucomp",  # 550 on: libnvidia-eglcore's DT_NEEDED; not in 535 (bookworm)
    "nvidia-vdpau-driver",
    "nvidia-cuda-mps",
    "firmware-nvidia-gsp",
)

HELPER_NAMES: tuple[str, ...] = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)

_MANIFEST_FORMAT = 1
_LIB_NAME = re.compile(r"^lib.+\.so(\.[0-9][0-9A-Za-z.]*)?$")


class RealDriverUnavailable(RuntimeError):
    """The real driver cannot be fetched here (no network, no apt, no such package)."""


@dataclasses.dataclass(frozen=True)
class RealDriver:
    suite: str  # Debian release: bookworm | trixie
    arch: str  # Debian architecture: amd64 | arm64
    multiarch: str  # x86_64-linux-gnu | aarch64-linux-gnu
    version: str  # driver version, e.g. 535.309.01
    package_version: str  # Debian version, e.g. 535.309.01-0+deb12u1
    tree: Path  # the unpacked packages (usr/lib/<multiarch>/nvidia/current/...)
    libraries: list[Path]  # regular-file shared objects in the tree
    sonames: dict[str, str | None]  # library file name -> DT_SONAME
    helpers: list[Path]  # helper executables in the tree (nvidia-smi, ...)
    firmware: list[Path]  # GSP firmware files in the tree
    packages: dict[str, str]  # package -> version unpacked

    @property
    def total_size(self) -> int:
        return sum(p.stat().st_size for p in [*self.libraries, *self.helpers, *self.firmware])

    def library(self, name: str) -> Path:
        for path in self.libraries:
            if path.name == name:
                return path
        raise KeyError(name)


def cache_dir(arch: str, kind: str = "debian-nvidia", suite: str = DEFAULT_SUITE) -> Path:
    """``<cache>/<kind>/<suite>/<arch>``; ``<kind>/<arch>`` for bookworm, the first suite
    (its path from before there were others, which older checkouts still use)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    top = base / "unbounded-nvidia-setup-tests" / kind
    return top / arch if suite == DEFAULT_SUITE else top / suite / arch


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class PrivateApt:
    """apt-get/apt-cache with a private configuration rooted at ``base``."""

    def __init__(self, base: Path, arch: str, suite: str,
                 components: str = "non-free non-free-firmware") -> None:
        self.base = base
        self.arch = arch
        for sub in (
            "lists/partial",
            "cache/archives/partial",
            "sources.list.d",
            "preferences.d",
            "debs",
        ):
            (base / sub).mkdir(parents=True, exist_ok=True)
        (base / "status").touch()
        try:
            archive, security = mirrors.debian_archive(), mirrors.debian_security()
        except mirrors.MirrorNotFound as exc:
            raise RealDriverUnavailable(str(exc)) from exc
        signed = f" [signed-by={KEYRING}]" if KEYRING.exists() else ""
        (base / "sources.list").write_text(
            f"deb{signed} {archive} {suite} {components}\n"
            f"deb{signed} {security} {suite}-security {components}\n"
        )

    def options(self) -> list[str]:
        b = self.base
        opts = {
            "Dir::Etc::sourcelist": b / "sources.list",
            "Dir::Etc::sourceparts": b / "sources.list.d",
            "Dir::Etc::preferences": b / "preferences",
            "Dir::Etc::preferencesparts": b / "preferences.d",
            "Dir::State::Lists": b / "lists",
            "Dir::State::status": b / "status",
            "Dir::Cache": b / "cache",
            "APT::Architecture": self.arch,
            "APT::Architectures": self.arch,
            # Downloads land in our own dirs; no need to drop to the _apt user.
            "APT::Sandbox::User": "root" if os.geteuid() == 0 else "",
            "Acquire::Languages": "none",
            "Acquire::Retries": "1",
        }
        out: list[str] = []
        for key, val in opts.items():
            if val != "":
                out += ["-o", f"{key}={val}"]
        return out

    def run(self, tool: str, *args: str, cwd: Path | None = None, timeout: float = 900) -> str:
        cmd = [tool, "-q", *self.options(), *args]
        env = {**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"}
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RealDriverUnavailable(f"{tool} {args[0]}: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RealDriverUnavailable(
                f"{tool} {' '.join(args[:1])} failed (exit {proc.returncode}): " + " | ".join(tail)
            )
        if (
            tool == "apt-get"
            and args[0] == "update"
            and re.search(r"^(W|E): .*(Failed to fetch|Some index files failed)", proc.stderr, re.M)
        ):
            raise RealDriverUnavailable(f"apt-get update: {proc.stderr.strip()[-500:]}")
        return proc.stdout


def _madison(apt: PrivateApt, packages: Sequence[str]) -> dict[str, list[str]]:
    """package -> versions available for the architecture (newest first as apt lists)."""
    out = apt.run("apt-cache", "madison", *packages)
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 3 and "Packages" in parts[2]:
            found.setdefault(parts[0], []).append(parts[1])
    return found


def _version_key(version: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", version)]


def read_soname(path: Path) -> str | None:
    """DT_SONAME of an ELF file: pyelftools when installed, else ``readelf -d``."""
    try:
        from elftools.elf.dynamic import DynamicSection
        from elftools.elf.elffile import ELFFile
    except ImportError:
        proc = subprocess.run(
            ["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True
        )
        m = re.search(r"\(SONAME\)\s+Library soname: \[(.*)\]", proc.stdout)
        return m.group(1) if m else None
    with open(path, "rb") as f:
        for section in ELFFile(f).iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_SONAME":
                        # .soname is set dynamically (not in pyelftools' type hints)
                        return str(getattr(tag, "soname", None))
    return None


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _scan(
    tree: Path, multiarch: str, version: str
) -> tuple[list[Path], dict[str, str | None], list[Path], list[Path]]:
    libs: list[Path] = []
    helpers: list[Path] = []
    firmware: list[Path] = []
    for dirpath, _dirs, files in os.walk(tree):
        for name in sorted(files):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            rel = path.relative_to(tree).as_posix()
            if (
                rel.startswith((f"usr/lib/{multiarch}/", f"lib/{multiarch}/"))
                and _LIB_NAME.match(name)
                and _is_elf(path)
            ):
                libs.append(path)
            elif name in HELPER_NAMES and os.access(path, os.X_OK) and _is_elf(path):
                helpers.append(path)
            elif re.search(rf"(^|/)firmware/nvidia/{re.escape(version)}/gsp[^/]*\.bin$", rel):
                firmware.append(path)
    libs.sort()
    sonames = {p.name: read_soname(p) for p in libs}
    return libs, sonames, sorted(helpers), sorted(firmware)


def _load_manifest(base: Path, arch: str, suite: str) -> RealDriver | None:
    try:
        data = json.loads((base / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    # Manifests from before the suites were written for bookworm only.
    if data.get("format") != _MANIFEST_FORMAT or data.get("suite", DEFAULT_SUITE) != suite:
        return None
    tree = base / data["tree"]
    drv = RealDriver(
        suite=suite,
        arch=arch,
        multiarch=MULTIARCH[arch],
        version=data["version"],
        package_version=data["package_version"],
        tree=tree,
        libraries=[tree / p for p in data["libraries"]],
        sonames=dict(data["sonames"]),
        helpers=[tree / p for p in data["helpers"]],
        firmware=[tree / p for p in data["firmware"]],
        packages=dict(data["packages"]),
    )
    if not all(p.is_file() for p in [*drv.libraries, *drv.helpers, *drv.firmware]):
        return None
    return drv


def _write_manifest(base: Path, drv: RealDriver, requested: Sequence[str]) -> None:
    def rel(paths: list[Path]) -> list[str]:
        return [p.relative_to(drv.tree).as_posix() for p in paths]

    data = {
        "format": _MANIFEST_FORMAT,
        "suite": drv.suite,
        "version": drv.version,
        "package_version": drv.package_version,
        "tree": drv.tree.name,
        "requested": sorted(requested),
        "packages": drv.packages,
        "libraries": rel(drv.libraries),
        "sonames": drv.sonames,
        "helpers": rel(drv.helpers),
        "firmware": rel(drv.firmware),
        "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = base / "manifest.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, base / "manifest.json")


def _requested_before(base: Path) -> set[str]:
    try:
        return set(json.loads((base / "manifest.json").read_text()).get("requested", []))
    except (OSError, ValueError):
        return set()


def fetch_real_driver(
    arch: str = "amd64",
    *,
    suite: str = DEFAULT_SUITE,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    refresh: bool = False,
) -> RealDriver:
    """The newest NVIDIA driver in Debian ``suite`` + ``suite``-security for ``arch``:
    535 in bookworm, 550 in trixie. ``packages`` not in the suite are left out, except
    :data:`REQUIRED_PACKAGES`.

    Served from the cache when it holds every requested package (no network at all);
    ``refresh=True`` asks the archive again (keeping the cache, with a warning, when
    that fails; when a newer driver is found the older tree is deleted, which breaks
    another process still using it: refresh only from a command line). Raises
    RealDriverUnavailable with the reason when the files cannot be had (no
    apt-get/dpkg-deb, archive unreachable, required package missing)."""
    if arch not in MULTIARCH:
        raise ValueError(f"unsupported arch {arch!r} (one of {', '.join(MULTIARCH)})")
    if suite not in SUITES:
        raise ValueError(f"unsupported suite {suite!r} (one of {', '.join(SUITES)})")
    base = cache_dir(arch, suite=suite)
    with locked(base / ".lock"):
        cached = _load_manifest(base, arch, suite)
        if cached is not None and not refresh and set(packages) <= _requested_before(base):
            return cached
        try:
            return _download(base, arch, suite, list(dict.fromkeys(packages)), cached)
        except RealDriverUnavailable as exc:
            if cached is None:
                raise
            warnings.warn(f"using the cached driver: {exc}", stacklevel=2)
            return cached


def _download(base: Path, arch: str, suite: str, packages: list[str],
              cached: RealDriver | None) -> RealDriver:
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RealDriverUnavailable(f"{tool} not found: cannot fetch Debian packages")
    apt = PrivateApt(base / "apt", arch, suite)
    apt.run("apt-get", "update")
    available = _madison(apt, [*REQUIRED_PACKAGES, *packages])
    if "libcuda1" not in available:
        raise RealDriverUnavailable(f"libcuda1 is not in Debian {suite} non-free for {arch}")
    pkg_version = max(available["libcuda1"], key=_version_key)
    version = pkg_version.split("-", 1)[0]
    wanted: dict[str, str] = {}
    for pkg in packages:
        if pkg_version in available.get(pkg, []):
            wanted[pkg] = pkg_version
        elif pkg in REQUIRED_PACKAGES:
            raise RealDriverUnavailable(f"{pkg} {pkg_version} is not available for {arch}")
    if (
        cached is not None
        and cached.package_version == pkg_version
        and set(wanted) <= set(cached.packages)
    ):
        _write_manifest(base, cached, sorted(set(packages) | _requested_before(base)))
        return cached  # the archive has nothing newer
    debs = base / "apt" / "debs"
    for old in debs.glob("*.deb"):
        old.unlink()
    apt.run("apt-get", "download", *(f"{p}={v}" for p, v in wanted.items()), cwd=debs)
    deb_files = sorted(debs.glob("*.deb"))
    if len(deb_files) != len(wanted):
        raise RealDriverUnavailable(
            f"apt-get download gave {len(deb_files)} files for {len(wanted)} packages"
        )
    tmp_tree = Path(tempfile.mkdtemp(prefix=".tree-", dir=base))
    try:
        for deb in deb_files:
            subprocess.run(
                ["dpkg-deb", "-x", str(deb), str(tmp_tree)], check=True, capture_output=True
            )
        tree = base / f"tree-{pkg_version}"
        if tree.exists():
            shutil.rmtree(tree)
        os.rename(tmp_tree, tree)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(tmp_tree, ignore_errors=True)
        raise RealDriverUnavailable(f"unpacking the driver packages failed: {exc}") from exc
    for deb in deb_files:  # the unpacked tree is the cache; the .debs are not needed
        deb.unlink()
    for old in base.glob("tree-*"):
        if old != tree:
            shutil.rmtree(old, ignore_errors=True)
    libs, sonames, helpers, firmware = _scan(tree, MULTIARCH[arch], version)
    names = {p.name for p in libs}
    for required in (f"libcuda.so.{version}", f"libnvidia-ml.so.{version}"):
        if required not in names:
            raise RealDriverUnavailable(f"{required} is not in the unpacked packages")
    drv = RealDriver(
        suite=suite,
        arch=arch,
        multiarch=MULTIARCH[arch],
        version=version,
        package_version=pkg_version,
        tree=tree,
        libraries=libs,
        sonames=sonames,
        helpers=helpers,
        firmware=firmware,
        packages=wanted,
    )
    _write_manifest(base, drv, packages)
    return drv


def _copy(src: Path, dest: Path, hardlink: bool, mode: int) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(dest):
        dest.unlink()
    if hardlink:
        os.link(src, dest)
    else:
        shutil.copyfile(src, dest)
        os.chmod(dest, mode)
        st = src.stat()
        os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))


def _staged_name(lib: Path) -> str:
    """Where a library goes in a host library dir: VDPAU drivers in vdpau/ (Debian keeps
    the file in nvidia/current/ and links it into vdpau/ through /etc/alternatives)."""
    return f"vdpau/{lib.name}" if lib.name.startswith("libvdpau_") else lib.name


def stage_real_driver(
    staging: Path,
    drv: RealDriver,
    *,
    bin_dir: Path | None = None,
    firmware_dir: Path | None = None,
    linker_names: bool = True,
    hardlink: bool = False,
) -> list[str]:
    """Lay ``drv`` out in ``staging`` like a host library dir: every library as a regular
    file directly in ``staging`` (VDPAU drivers in ``vdpau/``), a relative SONAME link for
    each library whose SONAME differs from its name (``libcuda.so.1 -> libcuda.so.<ver>``,
    as the host's ldconfig makes) and, with ``linker_names``, the packages' own linker
    names (``libcuda.so -> libcuda.so.1``, ``libnvidia-ml.so``, ``libnvcuvid.so``, ...).
    Helpers go to ``bin_dir`` and firmware to ``firmware_dir/nvidia/<ver>/`` when given.
    ``hardlink`` links instead of copying (faster; only for tests that never modify the
    staged files, which share the cache's inodes). Returns the names made in ``staging``.
    """
    created: list[str] = []
    staging.mkdir(parents=True, exist_ok=True)
    staged: dict[Path, str] = {}
    for lib in drv.libraries:
        name = _staged_name(lib)
        _copy(lib, staging / name, hardlink, 0o644)
        staged[lib.resolve()] = name
        created.append(name)

    def link(name: str, target_name: str) -> None:
        path = staging / name
        if os.path.lexists(path) or "/" in name.removeprefix("vdpau/"):
            return
        target = os.path.relpath(staging / target_name, path.parent)
        os.symlink(target, path)
        created.append(name)

    for lib in drv.libraries:
        soname = drv.sonames.get(lib.name)
        if soname and soname != lib.name:
            name = staged[lib.resolve()]
            link(f"{os.path.dirname(name)}/{soname}".lstrip("/"), name)
    if linker_names:
        # The packages' own relative links next to the libraries (libcuda.so ->
        # libcuda.so.1, ...), re-pointed at the flat copies.
        for lib_dir in {lib.parent for lib in drv.libraries}:
            for entry in sorted(lib_dir.iterdir()):
                if not (entry.is_symlink() and entry.name.startswith("lib")):
                    continue
                final = entry.resolve()
                if final in staged and not os.readlink(entry).startswith("/"):
                    sub = os.path.dirname(staged[final])
                    via = os.readlink(entry)
                    target_name = f"{sub}/{via}".lstrip("/") if "/" not in via else None
                    if target_name is not None and os.path.lexists(staging / target_name):
                        link(f"{sub}/{entry.name}".lstrip("/"), target_name)
                    else:
                        link(f"{sub}/{entry.name}".lstrip("/"), staged[final])
    if bin_dir is not None:
        for helper in drv.helpers:
            _copy(helper, bin_dir / helper.name, hardlink, 0o755)
    if firmware_dir is not None:
        for fw in drv.firmware:
            _copy(fw, firmware_dir / "nvidia" / drv.version / fw.name, hardlink, 0o644)
    return created


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch (and stage) a real NVIDIA driver.")
    parser.add_argument("--suite", default=DEFAULT_SUITE, choices=list(SUITES))
    parser.add_argument("--arch", default="amd64", choices=sorted(MULTIARCH))
    parser.add_argument("--refresh", action="store_true")
    parser.add_argument("--stage", type=Path, help="stage the libraries into this dir")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        drv = fetch_real_driver(args.arch, suite=args.suite, refresh=args.refresh)
    except RealDriverUnavailable as exc:
        print(f"realdriver: {exc}", file=sys.stderr)
        return 1
    print(
        f"{drv.suite} {drv.arch}: NVIDIA {drv.version} (Debian {drv.package_version}) "
        f"in {drv.tree} "
        f"[{time.monotonic() - start:.1f} s, {drv.total_size / 1e6:.0f} MB]"
    )
    for lib in drv.libraries:
        rel = lib.relative_to(drv.tree)
        print(f"  {rel}  {lib.stat().st_size:>10}  SONAME {drv.sonames[lib.name]}")
    for path in [*drv.helpers, *drv.firmware]:
        print(f"  {path.relative_to(drv.tree)}  {path.stat().st_size:>10}")
    if args.stage:
        created = stage_real_driver(args.stage, drv)
        print(f"staged {len(created)} entries in {args.stage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
