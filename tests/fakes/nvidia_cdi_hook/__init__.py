"""Test stand-in for NVIDIA's ``nvidia-cdi-hook`` 1.20 (``create-symlinks``, ``update-ldcache``),
run through the launcher tests/fakes/nvidia-cdi-hook. Specs from the nvidia-ctk stand-in name
it in their createContainer hooks, so a container runtime can really run it. It follows the
NVIDIA Container Toolkit v1.20.0 sources (cmd/nvidia-cdi-hook/{commands,create-symlinks,
update-ldcache}, internal/oci/state.go, internal/ldconfig) and is compared with the real binary
by tests/test_fake_nvidia_cdi_hook.py. Mirrored:

* Command line (urfave/cli v3): ``--debug/-d``, ``--quiet`` (or NVIDIA_CTK_DEBUG/_QUIET,
  NVIDIA_CDI_DEBUG/_QUIET; a value that is no Go bool fails), ``--version``, ``--help``. No
  hook, an unknown hook or an unknown *global* flag: a warning, exit 0 (a spec naming a newer
  hook must not fail the container). A bad flag of a known hook: ``Incorrect Usage: ...`` on
  stderr, help on stdout, an error line, exit 1. Flags may follow positional arguments;
  ``--link``/``--folder`` values split at commas.
* Container state: the first JSON value on stdin (or ``--container-spec`` FILE, '-' = stdin),
  keys matched case-insensitively, ``bundle`` -> ``<bundle>/config.json`` -> ``root.path``: as
  given when absolute (not cleaned), else joined to the bundle (no root: the bundle itself);
  only update-ldcache refuses a root of '' or '/'. Go's messages for a missing file, EOF,
  unexpected EOF, a non-JSON start and wrongly typed fields.
* create-symlinks: each ``TARGET::LINK`` once, in order; not exactly one ``::`` fails there.
  If the *lexical* host path ``<root>/<LINK>`` (outside the root when LINK climbs with ``..``)
  is a symlink to TARGET, nothing is done. Else the link's directory is resolved inside the
  root (``..`` stops at the root, absolute symlinks are root-relative), missing directories
  are made 0755 (not through symlinks), TARGET is symlinked verbatim at a temporary name and
  renamed over LINK: a file or link there is replaced, a directory fails (``is a directory``).
* update-ldcache: ``--ldconfig-path`` (default /sbin/ldconfig; ``<path>.real`` when that
  exists) is the *host's* ldconfig. In the root it makes ``/proc`` and leaves an empty
  ``/run/nvidia-ctk-hook/<uuid4>`` (where the real hook mounts proc and a tmpfs holding
  ldconfig, in its own mount namespace); the root must be a mount point (pivot_root: EBUSY on
  the root mount, else EINVAL). Inside the root: ``/etc/ld.so.conf`` is made (``include
  /etc/ld.so.conf.d/*.conf``) when missing; folders already configured (system dirs, lines of
  ld.so.conf and of the files its ``include`` globs match, relative globs taken from ``/``) are
  dropped, the rest go to a new ``/etc/ld.so.conf.d/00-nvcr-<random>.conf`` (none if nothing
  is left), the system dirs (Debian-like when ``/etc/debian_version`` exists) to a new
  ``zz-nvcr-<random>.conf`` on every run, both 0644; Alpine (``/etc/alpine-release``) also gets
  ``/etc/ld-musl-<arch>.path``. Then a memfd copy of the host ldconfig runs there as
  ``ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache``, empty environment: the root's cache and
  SONAME links are rebuilt. Failures print Go's log.Fatalf line (``YYYY/MM/DD HH:MM:SS Error
  updating ldcache: ...``), then ``exit status N`` (ldconfig's own status too), exit N.

Simplified (deliberate):

* update-ldcache runs in a forked child that chroots into the root (we are root) and
  fexecve()s the copy; the real hook re-executes itself in new mount/PID/net/IPC/UTS
  namespaces and pivot_roots. Files and ldconfig's result are the same; no mount is made, so
  the mount-point rule is read from /proc/self/mountinfo.
* create-symlinks resolves each link in a chrooted child, as RESOLVE_IN_ROOT does for
  ordinary paths; error texts match the real ones for the common cases only.
* A container root that is the host's ``/`` is refused before anything changes (the real
  create-symlinks would change the host; update-ldcache fails there with EBUSY after making
  ``/run/nvidia-ctk-hook/<uuid>`` on the host).
* Other JSON syntax errors carry Python's message; only the state's ociVersion, id, status,
  pid, bundle, annotations and the spec's root, root.path/readonly are type-checked (not the
  annotations' values); Go's Glob is approximated by Python's glob.
* enable-cuda-compat does what the real one does when the container has no CUDA compat
  library (nothing); with one, deciding from its ELF header is not simulated (exit 1).
* chmod, disable-device-node-modification and update-application-profile fail with
  "not simulated" (exit 1); ``noop`` does nothing.

Test knob: FAKE_NVIDIA_CDI_HOOK_LOG=<file> appends ``json.dumps(argv[1:])`` per call.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import os
import posixpath
import re
import signal
import stat
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

VERSION, COMMIT = "1.20.0", "5505e2f94d9aaa08561490db974ba3cd676af209"
APP = "NVIDIA CDI Hook"
NOT_SIMULATED = ("chmod", "disable-device-node-modification", "update-application-profile")
CUDA_COMPAT_DIR = "/usr/local/cuda/compat"
LDSOCONF, LDSOCONFD = "/etc/ld.so.conf", "/etc/ld.so.conf.d"
LDCONFIG_ARGV = ["ldconfig", "-f", LDSOCONF, "-C", "/etc/ld.so.cache"]
ARCH = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(os.uname().machine, "")
DEBIAN_DIRS = (*((f"/lib/{ARCH}-linux-gnu", f"/usr/lib/{ARCH}-linux-gnu") if ARCH else ()),
               "/lib", "/usr/lib")
NON_DEBIAN_DIRS = ("/lib", "/usr/lib", *(("/lib64", "/usr/lib64") if ARCH else ()),
                   *(("/libx32", "/usr/libx32") if ARCH == "x86_64" else ()))
GO_BOOLS = {**dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
            **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False)}
COMMANDS = {  # their flags
    "create-symlinks": {"link": "slice", "container-spec": "string"},
    "update-ldcache": {"folder": "slice", "ldconfig-path": "string", "container-spec": "string"},
    "enable-cuda-compat": {"host-driver-version": "string", "host-cuda-version": "string",
                           "cuda-compat-container-root": "string", "container-spec": "string"},
}
PERSISTENT_FLAGS = {"debug": "bool", "d": "bool", "quiet": "bool", "help": "bool", "h": "bool"}
GLOBAL_FLAGS = {**PERSISTENT_FLAGS, "version": "bool", "v": "bool"}
ALIASES = {"d": "debug", "h": "help", "v": "version"}
ENV_FLAGS = {"debug": ("NVIDIA_CTK_DEBUG", "NVIDIA_CDI_DEBUG"),
             "quiet": ("NVIDIA_CTK_QUIET", "NVIDIA_CDI_QUIET")}
MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


class HookError(Exception):
    """An error a hook returns (``level=error msg=...``, exit 1), or its child's failure."""


class UsageError(HookError):
    """A flag error (urfave/cli's usage-error path)."""


LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3}
THRESHOLD = {"level": 1}  # set from --debug / --quiet


def log(level: str, msg: str) -> None:
    """A logrus TextFormatter line on stderr."""
    if LEVELS[level] >= THRESHOLD["level"]:
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        zone = "Z" if now.endswith("+0000") else f"{now[-5:-2]}:{now[-2:]}"
        sys.stderr.write(f'time="{now[:-5]}{zone}" level={level} msg={json.dumps(msg)}\n')
        sys.stderr.flush()


def go_clean(path: str) -> str:
    """filepath.Clean (posixpath.normpath keeps a leading '//', Go does not)."""
    cleaned = posixpath.normpath(path) if path else "."
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


def go_join(*parts: str) -> str:
    nonempty = [p for p in parts if p]
    return go_clean("/".join(nonempty)) if nonempty else ""


def go_err(error: OSError | str) -> str:
    """Go spells errno and signal texts in lower case ('no such file or directory')."""
    text = error if isinstance(error, str) else error.strerror or os.strerror(error.errno or 0)
    return text[:1].lower() + text[1:]


def is_file(path: str) -> bool:
    """os.Stat succeeds and it is no directory (isDebianLike, isMusl)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


# --------------------------------------------------------------------------- container state


class Obj(list[tuple[str, Any]]):
    """A JSON object: encoding/json matches keys case-insensitively, the last match wins."""

    def get(self, name: str) -> Any:
        return next((v for k, v in reversed(self) if k.lower() == name.lower()), None)


def json_type(value: Any) -> str:
    if isinstance(value, bool | str | Obj):
        return {bool: "bool", str: "string", Obj: "object"}[type(value)]
    return "number" if isinstance(value, int | float) else "array"


STATE_FIELDS = {"ociVersion": (str, "string"), "id": (str, "string"), "status": (str, "string"),
                "pid": (int, "int"), "bundle": (str, "string"),
                "annotations": (Obj, "map[string]string")}
SPEC_FIELDS = {"root": (Obj, "specs.Root"), "root.path": (str, "string"),
               "root.readonly": (bool, "bool")}


def decode(text: str, go_type: str, fields: dict[str, tuple[type, str]]) -> Obj:
    """json.Decoder.Decode of the first value (null: the zero value), typed fields checked."""
    body = text.lstrip(" \t\r\n")
    try:
        value = json.JSONDecoder(object_pairs_hook=Obj).raw_decode(body)[0] if body else None
    except json.JSONDecodeError as exc:
        if exc.pos >= len(body.rstrip()) or exc.msg.startswith("Unterminated string"):
            raise ValueError("unexpected EOF") from exc
        if exc.msg == "Expecting value":
            raise ValueError(f"invalid character {body[exc.pos]!r} looking for beginning of "
                             "value") from exc
        raise ValueError(exc.msg) from exc
    if not body:
        raise ValueError("EOF")
    value = Obj() if value is None else value
    if not isinstance(value, Obj):
        raise ValueError(f"json: cannot unmarshal {json_type(value)} into Go value of type "
                         f"{go_type}")
    for path, (kind, kind_name) in fields.items():
        parent, _, name = path.rpartition(".")
        item = (value.get(parent) or Obj()).get(name) if parent else value.get(name)
        where = f"Root.{path}" if parent else f"{go_type.split('.')[1]}.{path}"
        if item is not None and (not isinstance(item, kind)
                                 or isinstance(item, bool) != (kind is bool)):
            raise ValueError(f"json: cannot unmarshal {json_type(item)} into Go struct field "
                             f"{where} of type {kind_name}")
    return value


def find_root(spec_file: str, ldcache: bool) -> str:
    """oci.LoadContainerState + State.GetContainerRoot (+ update-ldcache's own check)."""
    try:
        if spec_file in ("", "-"):
            text = sys.stdin.read()
        else:
            with open(spec_file, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        bundle: str = decode(text, "oci.State", STATE_FIELDS).get("bundle") or ""
    except OSError as exc:
        raise HookError(f"failed to load container state: failed to open file: open "
                        f"{spec_file}: {go_err(exc)}") from exc
    except ValueError as exc:
        raise HookError(f"failed to load container state: failed to decode container state: "
                        f"{exc}") from exc
    config = go_join(bundle, "config.json")
    try:
        with open(config, encoding="utf-8", errors="surrogateescape") as f:
            spec = decode(f.read(), "oci.minimalSpec", SPEC_FIELDS)
    except OSError as exc:
        raise HookError(f"failed to determined container root: failed to open OCI spec file: "
                        f"open {config}: {go_err(exc)}") from exc
    except ValueError as exc:
        raise HookError(f"failed to determined container root: failed to load minimal OCI "
                        f"spec: {exc}") from exc
    path: str = (spec.get("root") or Obj()).get("path") or ""
    root = path if path.startswith("/") else go_join(bundle, path)
    if ldcache and root in ("", "/"):
        raise HookError("failed to determined container root: <nil>")
    if not ldcache and root and os.path.realpath(root) == "/":
        raise HookError(f"container root {root} is the host's /: refused by this "
                        "nvidia-cdi-hook test stand-in (the real hook would change the host)")
    return root


def in_root(root_fd: int, action: Callable[[], None]) -> tuple[int, str]:
    """Runs the action in a child chrooted into the root (it may end in an exec). Returns the
    child's exit code (negative: the signal that killed it) and the HookError it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.fchdir(root_fd)
            os.chroot(".")
            os.chdir("/")
            action()
            code = 0
        except HookError as exc:
            os.write(write_end, str(exc).encode(errors="surrogateescape"))
        except BaseException as exc:
            os.write(write_end, f"stand-in failure: {exc!r}".encode())
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="surrogateescape")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), message


# --------------------------------------------------------------------------- create-symlinks


def create_symlinks(links: Sequence[str], root: str) -> None:
    done: set[str] = set()
    for spec in links:
        if spec in done:
            log("debug", f"Link {spec} already processed")
            continue
        if len(parts := spec.split("::")) != 2:
            raise HookError(f"invalid symlink specification {spec}")
        target, link = parts
        try:
            if link_exists(target, link_path := go_join(root, link)):
                log("debug", f"Link {link_path} already exists")
            else:
                try:
                    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
                except OSError as exc:
                    raise HookError(f"failed to open container root: open {root}: "
                                    f"{go_err(exc)}") from exc
                action = functools.partial(symlink_in_root, target, link, root)
                code, message = in_root(root_fd, action)
                os.close(root_fd)
                if code:
                    raise HookError(message or f"child exit code {code}")
        except HookError as exc:
            raise HookError(f"failed to create link [{target} {link}]: {exc}") from exc
        done.add(spec)


def link_exists(target: str, link_path: str) -> bool:
    """symlinks.Resolve on the lexical host path: is it a symlink whose content is the target?"""
    try:
        if not stat.S_ISLNK(os.lstat(link_path).st_mode):
            return link_path == target
        return os.readlink(link_path) == target
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise HookError(f"failed to check if link exists: failed to resolve existing symlink "
                        f"{link_path}: failed to get file info: lstat {link_path}: "
                        f"{go_err(exc)}") from exc


def symlink_in_root(target: str, link: str, root: str) -> None:
    """createSymlinkInRoot, run chrooted into the container root."""
    link_dir = go_clean(link[: link.rfind("/") + 1])  # filepath.Dir
    base = link.rstrip("/").rsplit("/", 1)[-1] or ("/" if link else ".")  # filepath.Base
    host_root = os.path.realpath(root)  # the name the real hook reads from /proc/self/fd
    try:
        dir_fd = os.open(link_dir, os.O_PATH)
    except FileNotFoundError:
        try:
            dir_fd = mkdir_all(link_dir, host_root)
        except HookError as exc:
            raise HookError(f"failed to create parent dir of link in root: {exc}") from exc
    except OSError as exc:
        raise HookError(f"failed to open parent dir of link in root: securejoin.OpenInRoot "
                        f"{link_dir}: openat2 {link_dir}: {go_err(exc)}") from exc
    log("info", f"Symlinking {go_join(host_root, os.path.realpath(link_dir), base)} to {target}")
    temporary = f"{base}-{uuid.uuid4()}"
    try:
        os.symlink(target, temporary, dir_fd=dir_fd)
    except OSError as exc:
        raise HookError(f"failed to create temporary symlink: {go_err(exc)}") from exc
    try:
        os.rename(temporary, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        os.unlink(temporary, dir_fd=dir_fd)
        raise HookError(f"failed to create symlink: {go_err(exc)}") from exc


def mkdir_all(path: str, host_root: str) -> int:
    """pathrs.MkdirAllHandle: existing directories are followed (inside the root), missing
    ones made 0755 and entered without following symlinks. Returns the last one's descriptor."""
    current, done = os.open("/", os.O_PATH), "/"
    for part in [p for p in path.split("/") if p not in ("", ".")]:
        try:
            following = os.open(part, os.O_PATH | os.O_DIRECTORY, dir_fd=current)
        except FileNotFoundError:
            name, op = f"{go_join(host_root, os.path.realpath(done))}/{part}", "mkdirat"
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=current)
                op = "openat2"
                following = os.open(part, os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=current)
            except OSError as exc:
                raise HookError(f"{op} {name}: {go_err(exc)}") from exc
        os.close(current)
        current, done = following, posixpath.join(done, part)
    return current


# --------------------------------------------------------------------------- update-ldcache


def prepare_root(root: str, ldconfig: str) -> tuple[int, int]:
    """Ldconfig.prepareRoot up to pivot_root: the root's /proc, the host ldconfig, the
    scratch dir, the mount-point rule. Returns descriptors of the root and the ldconfig copy."""
    real = os.path.realpath(root)
    if real == "/":  # the real hook fails so, after writing to the host
        raise HookError("error running pivot_root: pivot_root .: device or resource busy")
    what = f"failed to open root: open {root}"
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        what = "error mounting /proc: mkdirat proc"
        with contextlib.suppress(FileExistsError):
            os.mkdir("proc", 0o755, dir_fd=fd)
        what = f"error mounting host ldconfig: error reading host ldconfig: stat {ldconfig}"
        os.stat(ldconfig)
        what = "error mounting host ldconfig: error creating hook scratch folder"
        for part in ("run", "run/nvidia-ctk-hook", f"run/nvidia-ctk-hook/{uuid.uuid4()}"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
    except OSError as exc:
        raise HookError(f"{what}: {go_err(exc)}") from exc
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = {MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m[1], 8)), line.split()[4])
                  for line in f}
    if real not in points:  # pivot_root(".", "."): EBUSY on the root mount, else EINVAL
        below = max((p for p in points if real.startswith(p.rstrip("/") + "/")), key=len)
        text = os.strerror(errno.EBUSY if below == "/" else errno.EINVAL)
        raise HookError(f"error running pivot_root: pivot_root .: {go_err(text)}")
    try:  # SafeExec: a memfd copy (runc's exeseal), so the file's own mode does not matter
        with open(ldconfig, "rb") as f:
            ldconfig_fd = os.memfd_create("ldconfig", os.MFD_CLOEXEC)
            os.write(ldconfig_fd, f.read())
    except OSError:
        ldconfig_fd = os.open(ldconfig, os.O_PATH)
    return fd, ldconfig_fd


def configured_dirs(system: Sequence[str]) -> set[str]:
    """getLdsoconfDirectories: system dirs + ld.so.conf lines, following 'include ' globs."""
    dirs, seen, queue = set(system), set(), [LDSOCONF]
    while queue:
        if (name := queue.pop(0)) in seen or not name:
            continue
        seen.add(name)
        try:
            with open(name, "rb") as f:
                text = f.read().decode(errors="surrogateescape")
        except (FileNotFoundError, IsADirectoryError):
            continue
        for line in (raw.strip() for raw in text.split("\n")):
            if not line.startswith("include "):
                dirs.update([line] if line and not line.startswith("#") else [])
            elif glob.has_magic(pattern := line[len("include "):]):
                queue += sorted(glob.glob(pattern, include_hidden=True))
            elif os.path.lexists(pattern):
                queue.append(pattern)
    return dirs


def write_dirs(fd: int, dirs: Sequence[str]) -> None:
    """outputListToFile: a line per dir, first occurrence only; closes the file."""
    os.write(fd, "".join(f"{d}\n" for d in dict.fromkeys(dirs)).encode(errors="surrogateescape"))
    os.close(fd)


def create_dropin(pattern: str, dirs: Sequence[str]) -> None:
    """createLdsoconfdFile: os.CreateTemp(/etc/ld.so.conf.d, pattern), then chmod 0644."""
    if not dirs:
        return
    try:
        os.makedirs(LDSOCONFD, 0o755, exist_ok=True)
    except OSError as exc:
        reason = "not a directory" if isinstance(exc, FileExistsError) else go_err(exc)
        raise HookError(f"failed to write {pattern} drop-in: failed to create ld.so.conf.d: "
                        f"mkdir {LDSOCONFD}: {reason}") from exc
    prefix, _, suffix = pattern.partition("*")
    while True:
        name = f"{LDSOCONFD}/{prefix}{int.from_bytes(os.urandom(4), 'little')}{suffix}"
        with contextlib.suppress(FileExistsError):
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            break
    os.fchmod(fd, 0o644)
    write_dirs(fd, dirs)


def update_in_root(folders: Sequence[str], ldconfig_fd: int) -> None:
    """Ldconfig.UpdateLDCache after the pivot (chrooted here); ends by executing ldconfig."""
    system = DEBIAN_DIRS if is_file("/etc/debian_version") else NON_DEBIAN_DIRS
    try:
        with open(os.open(LDSOCONF, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
            f.write(f"include {LDSOCONFD}/*.conf\n")
    except FileExistsError:
        pass
    except OSError as exc:
        raise HookError(f"failed to ensure ld.so.conf file: failed to create top-level "
                        f"ld.so.conf file: open {LDSOCONF}: {go_err(exc)}") from exc
    known = configured_dirs(system)
    filtered = [d for d in dict.fromkeys(folders) if d not in known]
    create_dropin("00-nvcr-*.conf", filtered)
    create_dropin("zz-nvcr-*.conf", system)
    if is_file("/etc/alpine-release"):
        path = f"/etc/ld-musl-{ARCH}.path"
        write_dirs(os.open(path, os.O_CREAT | os.O_APPEND | os.O_RDWR, 0o644), [*filtered, *system])
    try:
        os.execve(ldconfig_fd, LDCONFIG_ARGV, {})
    except OSError as exc:
        raise HookError(go_err(exc)) from exc


def update_ldcache(folders: Sequence[str], ldconfig_path: str, root: str) -> int:
    """reexec.Command of the child above; urfave/cli prints a failed child's 'exit status N'
    and exits N (255 when it was killed)."""
    trimmed = ldconfig_path.removesuffix(".real")  # config.NormalizeLDConfigPath
    ldconfig = trimmed + ".real" if os.path.exists(trimmed + ".real") else trimmed
    try:
        root_fd, ldconfig_fd = prepare_root(root, ldconfig)
    except HookError as exc:
        code, message = 1, str(exc)
    else:
        code, message = in_root(root_fd, lambda: update_in_root(folders, ldconfig_fd))
        os.close(root_fd)
        os.close(ldconfig_fd)
    if message:
        sys.stderr.write(f"{time.strftime('%Y/%m/%d %H:%M:%S')} Error updating ldcache: "
                         f"{message}\n")
    if code < 0:
        sys.stderr.write(f"signal: {go_err(signal.strsignal(-code) or str(-code))}\n")
    elif code:
        sys.stderr.write(f"exit status {code}\n")
    return 255 if code < 0 else code


# --------------------------------------------------------------------------- command line


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


def parse_flags(args: Sequence[str], flags: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """urfave/cli v3 on Go's flag syntax: -x/--x, =value or the next argument, positional
    arguments anywhere, '--' ends the flags, slice values split at commas."""
    values: dict[str, Any] = {}
    positional: list[str] = []
    index = 0
    while index < len(args):
        arg, index = args[index], index + 1
        if arg == "--":
            return values, positional + list(args[index:])
        if not arg.startswith("-") or arg == "-":
            positional.append(arg)
            continue
        dashes = "--" if arg.startswith("--") else "-"
        name, has_value, value = arg[len(dashes):].partition("=")
        kind, key = flags.get(name), ALIASES.get(name, name)
        if kind is None:
            raise UsageError(f"flag provided but not defined: -{name}")
        if kind == "bool" and has_value and value not in GO_BOOLS:
            raise UsageError(f'invalid value "{value}" for flag -{name}: parse error')
        if kind == "bool":
            values[key] = GO_BOOLS[value] if has_value else True
            continue
        if not has_value:
            if index >= len(args):
                raise UsageError(f"flag needs an argument: {dashes}{name}")
            value, index = args[index], index + 1
        if kind == "slice":
            values.setdefault(key, []).extend(value.split(","))
        else:
            values[key] = value
    return values, positional


def env_flags(values: dict[str, Any]) -> None:
    """The boolean flags from the environment where the command line did not set them."""
    for flag, names in ENV_FLAGS.items():
        for name in names:
            if flag in values or not (text := os.environ.get(name, "")):
                continue
            if text not in GO_BOOLS:
                raise HookError(f'could not parse "{text}" as bool value from environment '
                                f'variable "{name}" for flag {flag}: parse error')
            values[flag] = GO_BOOLS[text]


def help_text(command: str = "") -> str:
    """urfave/cli's help, shortened: name, usage and the flags or commands."""
    items = [f"--{f}" for f in COMMANDS[command]] if command else [*COMMANDS, *NOT_SIMULATED]
    return (f"NAME:\n   {APP} {command}\n\nUSAGE:\n   {APP} {command or '[global options]'} "
            f"[options]\n\n{'OPTIONS' if command else 'COMMANDS'}:\n   {' '.join(items)}\n")


def run_command(command: str, args: Sequence[str], values: dict[str, Any]) -> int:
    try:
        try:
            options, _ = parse_flags(args, {**PERSISTENT_FLAGS, **COMMANDS[command]})
        except UsageError as exc:
            sys.stderr.write(f"Incorrect Usage: {exc}\n\n")
            sys.stdout.write(help_text(command))
            raise
        values = {**values, **options}
        env_flags(values)
        THRESHOLD["level"] = 3 if values.get("quiet") else 0 if values.get("debug") else 1
        if values.get("help"):
            sys.stdout.write(help_text(command))
            return 0
        spec_file = options.get("container-spec", "")
        if command == "create-symlinks":
            create_symlinks(options.get("link", []), find_root(spec_file, ldcache=False))
            return 0
        if command == "enable-cuda-compat":
            enable_cuda_compat(options, spec_file)
            return 0
        if not (ldconfig := options.get("ldconfig-path", "/sbin/ldconfig")):
            raise HookError("ldconfig-path must be specified")
        return update_ldcache(options.get("folder", []), ldconfig, find_root(spec_file, True))
    except HookError as exc:
        log("error", str(exc))
        return 1


def main(argv: Sequence[str]) -> int:
    if log_path := os.environ.get("FAKE_NVIDIA_CDI_HOOK_LOG"):
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(list(argv)) + "\n")
    index = 0  # global flags come before the hook's name
    while index < len(argv) and argv[index].startswith("-") and argv[index] not in ("-", "--"):
        index += 1
    rest = list(argv[index + (argv[index:index + 1] == ["--"]):])
    try:
        values, _ = parse_flags(argv[:index], GLOBAL_FLAGS)
    except UsageError as exc:
        if not str(exc).startswith("flag provided but not defined: -"):
            log("error", str(exc))
            return 1
        values, rest = {}, []  # the real hook's handler then sees no arguments at all
    command = rest[0] if rest else ""
    if command in COMMANDS:
        return run_command(command, rest[1:], values)
    try:
        env_flags(values)
    except HookError as exc:
        log("error", str(exc))
        return 1
    if values.get("version"):
        sys.stdout.write(f"{APP} version {VERSION}\ncommit: {COMMIT}\n")
    elif values.get("help") or command in ("help", "h"):
        topic = rest[1] if command in ("help", "h") and len(rest) > 1 else ""
        sys.stdout.write(help_text(topic if topic in COMMANDS else ""))
    elif command in NOT_SIMULATED:
        log("error", f"the {command} hook is not simulated by this nvidia-cdi-hook test stand-in")
        return 1
    elif command != "noop":
        log("warning", f"Unsupported CDI hook: {command}" if command else "No CDI hook specified")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
