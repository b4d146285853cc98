"""What every reliability test (issue 4) ends with, and how those tests watch the real
process from outside.

* :func:`assert_secure_state` -- the security invariants of a machine's live state:
  every file in the driver root root-owned, 0644 or 0755, no set-id bit, one link
  (a copy, not a hard link); every symlink relative and resolving inside the root; the
  root's parents real directories; the spec 0644, root-owned, parsable, and naming no
  hostPath outside the driver root except device nodes under ``<root>/dev`` and the IPC
  sockets nvidia-ctk lists; no other ``*.yaml``/``*.json`` in ``/etc/cdi``.
* :func:`secure_after` -- a fixture asserting them on every simulated machine below
  ``tmp_path`` once the test is over (``pytest.mark.usefixtures("secure_after")``).
* :func:`traced` -- run the real CLI under ``strace -f -y`` and get back every path it
  (or a program it ran) created, wrote, linked, renamed, deleted, chmod'ed or opened;
  :func:`write_violations` checks the writes against the set of paths the tool may touch;
  ``Traced.opened`` finds opens by what the kernel reached (through links, and through
  /proc/self of whichever traced process opened it), not only by the name asked for.
* :func:`product_env` -- an environment in which ``#!/usr/bin/env python3`` (the
  nvidia-ctk stand-in) is this interpreter rather than a pyenv shim: runs are faster and
  the syscall counts the crash tests rely on do not depend on the shell setup.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from unbounded_nvidia_setup.config import LAST_RUN, LOCK_FILE

import toolkit
from conftest import Outcome

DRIVER_ROOT = "run/nvidia/driver"
CDI_SPEC = "etc/cdi/nvidia.yaml"
# Sockets and pipe dirs nvidia-ctk mounts into GPU pods besides driver files
# (internal/discover/ipc.go): persistenced, fabric manager, the MPS pipe dir.
IPC_SUFFIXES = ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket", "/nvidia-mps")


def product_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for running the product: the test interpreter first on PATH (the
    nvidia-ctk stand-in is ``#!/usr/bin/env python3``), no systemd notify/journal."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    env.pop("NOTIFY_SOCKET", None)
    env.pop("JOURNAL_STREAM", None)
    env.update(extra or {})
    return env


def product_argv(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(root), *args]


def run_cli(root: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> Outcome:
    """The real CLI as a subprocess (like conftest's `cli`), with :func:`product_env`."""
    proc = subprocess.run(product_argv(root, *args), capture_output=True, text=True,
                          env=product_env(env), timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stderr, proc.stderr
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


# --------------------------------------------------------------------------------------
# Security invariants


def assert_secure_root(live: Path) -> None:
    """Every entry root-owned, 0644/0755 (directories 0755), no set-id bits, no hard
    links; every link relative, inside the root and not dangling."""
    real = os.path.realpath(live)
    for directory, dirs, files in os.walk(live):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            assert (st.st_uid, st.st_gid) == (0, 0), f"{path} owned by {st.st_uid}:{st.st_gid}"
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                assert not target.startswith("/"), f"{path} -> {target} is absolute"
                resolved = os.path.realpath(path)
                assert resolved.startswith(real + "/"), f"{path} -> {target} leaves the root"
                assert os.path.exists(path), f"{path} -> {target} dangles"
                continue
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                assert mode == 0o755, f"{path}: directory mode {mode:04o}"
                continue
            assert stat.S_ISREG(st.st_mode), f"{path}: neither file, directory nor link"
            assert mode in (0o644, 0o755), f"{path}: mode {mode:04o}"
            assert st.st_nlink == 1, f"{path}: {st.st_nlink} hard links (not a private copy)"


def spec_host_paths(doc: object) -> tuple[list[str], list[str]]:
    """(mount hostPaths, device node hostPaths) of every containerEdits in a CDI spec."""
    assert isinstance(doc, dict)
    edits = [doc.get("containerEdits")]
    edits += [d.get("containerEdits") for d in doc.get("devices") or [] if isinstance(d, dict)]
    mounts: list[str] = []
    nodes: list[str] = []
    for edit in edits:
        if not isinstance(edit, dict):
            continue
        mounts += [str(m.get("hostPath")) for m in edit.get("mounts") or []]
        nodes += [str(n.get("hostPath") or n.get("path")) for n in edit.get("deviceNodes") or []]
    return mounts, nodes


def assert_secure_spec(root: Path) -> None:
    import yaml

    spec = root / CDI_SPEC
    if not spec.parent.is_dir():
        return
    others = [p.name for p in spec.parent.iterdir()
              if p.name.endswith((".yaml", ".json")) and p.name != spec.name]
    assert not others, f"{spec.parent} holds other specs: {others}"
    if not os.path.lexists(spec):
        return
    st = os.lstat(spec)
    assert stat.S_ISREG(st.st_mode), f"{spec} is not a regular file"
    assert stat.S_IMODE(st.st_mode) == 0o644, f"{spec}: mode {stat.S_IMODE(st.st_mode):04o}"
    assert (st.st_uid, st.st_gid) == (0, 0)
    doc = yaml.safe_load(spec.read_bytes())
    assert isinstance(doc, dict) and doc.get("kind") == "nvidia.com/gpu" and doc.get("devices")
    live = str(root / DRIVER_ROOT) + "/"
    mounts, nodes = spec_host_paths(doc)
    for host_path in mounts:
        path = os.path.normpath(host_path)
        if path.endswith(IPC_SUFFIXES):
            continue
        assert (path + "/").startswith(live), f"spec mounts {host_path} from outside the root"
    for host_path in nodes:
        path = os.path.normpath(host_path)
        assert path.startswith(f"{root}/dev/"), f"spec device node {host_path} not in /dev"
        if os.path.lexists(path):
            assert stat.S_ISCHR(os.lstat(path).st_mode), f"{path} is not a character device"


def assert_secure_state(root: Path) -> None:
    """The security invariants (issue 4, item 6) of the machine under `root`."""
    for parent in (root / "run", root / "run/nvidia"):
        assert not os.path.islink(parent), f"{parent} is a symlink"
    live = root / DRIVER_ROOT
    if os.path.lexists(live):
        assert stat.S_ISDIR(os.lstat(live).st_mode), f"{live} is not a real directory"
        assert_secure_root(live)
    assert_secure_spec(root)


def machine_roots(base: Path) -> list[Path]:
    """Every simulated machine below `base` that the product was pointed at."""
    return sorted(p.parents[2] for p in base.glob("*/etc/unbounded/nvidia-setup.yaml"))


@pytest.fixture
def secure_after(tmp_path: Path) -> Iterator[None]:
    """After the test: the security invariants hold on every machine it used."""
    yield
    for root in machine_roots(tmp_path):
        assert_secure_state(root)


# --------------------------------------------------------------------------------------
# strace: every path a process tree touches

TRACE_SET = ("open,openat,openat2,creat,rename,renameat,renameat2,link,linkat,symlink,"
             "symlinkat,unlink,unlinkat,rmdir,mkdir,mkdirat,mknod,mknodat,chmod,fchmod,"
             "fchmodat,chown,fchown,lchown,fchownat,utimensat,truncate,chroot")
_LINE = re.compile(r"^(\d+) +(?:<\.\.\. (\w+) resumed>(.*)|(\w+)\((.*))$")
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")
_ESCAPES = {"n": 10, "t": 9, "r": 13, "v": 11, "f": 12, "a": 7, "b": 8, "e": 27}


def unquote(token: str) -> str:
    """strace's quoted C string (or `<...>` fd path) back to text."""
    body = token[1:-1] if token[:1] in "\"<" else token
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in "01234567":
            j = i + 1
            while j < min(i + 4, len(body)) and body[j] in "01234567":
                j += 1
            out.append(int(body[i + 1:j], 8))
            i = j
        elif nxt == "x":
            out.append(int(body[i + 2:i + 4], 16))
            i += 4
        else:
            out.append(_ESCAPES.get(nxt, ord(nxt)))
            i += 2
    return out.decode(errors="surrogateescape")


def split_args(text: str) -> list[str]:
    """Top-level arguments of a syscall as strace prints it (quotes, fd paths, structs)."""
    args: list[str] = []
    depth = 0
    current = ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == '"' or (ch == "<" and current and (current[-1].isdigit()
                                                      or current.endswith("AT_FDCWD"))):
            close = '"' if ch == '"' else ">"
            j = i + 1
            while j < len(text) and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            current += text[i:j + 1]
            i = j + 1
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += ch
        i += 1
    if current.strip():
        args.append(current.strip())
    return args


@dataclass(frozen=True)
class Call:
    """One syscall as strace saw it: entry order, thread, arguments, result."""

    pid: int
    name: str
    args: tuple[str, ...]
    result: str


def parse_calls(text: str) -> list[Call]:
    """Calls in the order they were entered (which is when strace injects faults)."""
    calls: list[Call | None] = []
    pending: dict[int, tuple[int, str, str]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid = int(m.group(1))
        if m.group(2):  # "<... name resumed>rest"
            if pid in pending:
                index, name, head = pending.pop(pid)
                calls[index] = _finish(pid, name, head + m.group(3))
            continue
        name, rest = m.group(4), m.group(5)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = (len(calls), name, rest[: -len("<unfinished ...>")].rstrip())
            calls.append(Call(pid, name, (), ""))
        else:
            calls.append(_finish(pid, name, rest))
    return [c for c in calls if c is not None]


def _finish(pid: int, name: str, rest: str) -> Call:
    # rest = "args) = result" ; find the closing parenthesis of the argument list
    depth, i, quote = 0, 0, ""
    while i < len(rest):
        ch = rest[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch == '"':
            quote = '"'
        elif ch == "<" and i and (rest[i - 1].isdigit() or rest[:i].endswith("AT_FDCWD")):
            quote = ">"
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        i += 1
    args, result = rest[:i], rest[i + 1:].strip()
    return Call(pid, name, tuple(split_args(args)), result.removeprefix("= ").strip())


@dataclass(frozen=True)
class Access:
    """A path a traced process touched. kind: "write" (created, written, linked, renamed,
    deleted or changed metadata), "open" (opened for reading; O_PATH does not count) or
    "link-source" (the existing file of a hard link)."""

    pid: int
    syscall: str
    kind: str
    path: str
    result: str
    flags: str = ""  # of an open


def fd_path(arg: str) -> str | None:
    m = re.match(r"^(?:-?\d+|AT_FDCWD)(<.*>)$", arg)
    return unquote(m.group(1)) if m else None


def _string(arg: str) -> str | None:
    return unquote(arg) if arg.startswith('"') else None


# syscall -> [(dirfd index or None, path index, kind)]; flags are handled for opens.
_PATHS: dict[str, list[tuple[int | None, int, str]]] = {
    "creat": [(None, 0, "write")],
    "rename": [(None, 0, "write"), (None, 1, "write")],
    "renameat": [(0, 1, "write"), (2, 3, "write")],
    "renameat2": [(0, 1, "write"), (2, 3, "write")],
    "link": [(None, 0, "link-source"), (None, 1, "write")],
    "linkat": [(0, 1, "link-source"), (2, 3, "write")],
    "symlink": [(None, 1, "write")],
    "symlinkat": [(1, 2, "write")],
    "unlink": [(None, 0, "write")],
    "unlinkat": [(0, 1, "write")],
    "rmdir": [(None, 0, "write")],
    "mkdir": [(None, 0, "write")],
    "mkdirat": [(0, 1, "write")],
    "mknod": [(None, 0, "write")],
    "mknodat": [(0, 1, "write")],
    "chmod": [(None, 0, "write")],
    "fchmodat": [(0, 1, "write")],
    "chown": [(None, 0, "write")],
    "lchown": [(None, 0, "write")],
    "fchownat": [(0, 1, "write")],
    "truncate": [(None, 0, "write")],
}


def accesses(calls: Iterable[Call]) -> list[Access]:
    """Every path the calls touched, absolute and normalized, as the tracer sees it
    (absolute paths of a process that chroot()ed are put under its new root)."""
    chroot: dict[int, str] = {}
    found: list[Access] = []

    def resolve(pid: int, dirfd: str | None, raw: str) -> str:
        if raw.startswith("/"):
            return os.path.normpath(chroot.get(pid, "") + raw)
        base = (fd_path(dirfd) if dirfd else None) or os.getcwd()
        return os.path.normpath(os.path.join(base, raw))

    for call in calls:
        a = call.args
        if call.name == "chroot" and call.result == "0" and a:
            chroot[call.pid] = resolve(call.pid, None, _string(a[0]) or "/")
            continue
        if call.name in ("open", "openat", "openat2"):
            off = 0 if call.name == "open" else 1
            if len(a) <= off + 1:
                continue
            raw = _string(a[off])
            if raw is None:
                continue
            flags = a[off + 1]
            if "O_PATH" in flags:
                continue
            kind = "write" if any(f in flags for f in _WRITE_FLAGS) else "open"
            dirfd = a[0] if off else None
            found.append(Access(call.pid, call.name, kind, resolve(call.pid, dirfd, raw),
                                call.result, flags))
            opened = fd_path(call.result.split(" ")[0]) if call.result else None
            if opened:
                found.append(Access(call.pid, call.name, kind, os.path.normpath(opened),
                                    call.result, flags))
            continue
        if call.name in ("fchmod", "fchown") and a:
            path = fd_path(a[0])
            if path:
                found.append(Access(call.pid, call.name, "write", path, call.result))
            continue
        if call.name == "utimensat" and len(a) >= 2:
            raw = _string(a[1])
            path = resolve(call.pid, a[0], raw) if raw else fd_path(a[0])
            if path:
                found.append(Access(call.pid, call.name, "write", path, call.result))
            continue
        for dir_index, path_index, kind in _PATHS.get(call.name, []):
            if path_index < len(a) and (raw := _string(a[path_index])) is not None:
                dirfd = a[dir_index] if dir_index is not None else None
                found.append(Access(call.pid, call.name, kind,
                                    resolve(call.pid, dirfd, raw), call.result))
    return found


def call_path(call: Call) -> str | None:
    """The path a call acts on: its first path argument (resolved against its dirfd) or,
    for a call on a descriptor (write, fsync), that descriptor's path as ``strace -y``
    shows it (``pipe:[…]`` for a pipe)."""
    found = accesses([call])
    if found:
        return found[0].path
    return fd_path(call.args[0]) if call.args else None


def symlink_targets(calls: Iterable[Call]) -> list[tuple[str, str]]:
    """(link path as given, target) of every symlink the calls made."""
    out = []
    for call in calls:
        if call.name in ("symlink", "symlinkat") and len(call.args) >= 2:
            target = _string(call.args[0]) or ""
            out.append((_string(call.args[-1]) or "", target))
    return out


# /proc/self and /proc/thread-self mean the process that resolves them: strace names what
# the kernel opened through them /proc/<tgid>/... and /proc/<tgid>/task/<tid>/...
_PROC_SELF = re.compile(r"/proc/(self|thread-self)(/.*)?")
_PROC_PID = re.compile(r"/proc/(?:self|thread-self|\d+)(?:/.*)?")
_MAX_LINKS = 40


def through_links(path: str, *, follow_last: bool = True) -> str:
    """Where `path` leads now, following every symlink on the way as the kernel would (the
    last one only with `follow_last`: O_NOFOLLOW), but keeping /proc/self,
    /proc/thread-self and /proc/<pid> by name: what they lead to depends on who opens them
    (the traced process, not this test), and links below them (fd/N, cwd, exe) name that
    process's own files."""
    parts = [p for p in path.split("/") if p][::-1]
    current = "/"
    hops = 0
    while parts:
        part = parts.pop()
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if _PROC_PID.fullmatch(candidate):
            return os.path.normpath("/".join([candidate, *reversed(parts)]))
        try:
            is_link = stat.S_ISLNK(os.lstat(candidate).st_mode)
        except OSError:
            return os.path.normpath("/".join([candidate, *reversed(parts)]))
        if is_link and hops < _MAX_LINKS and (parts or follow_last):
            hops += 1
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            parts += [p for p in target.split("/") if p][::-1]
            continue
        current = candidate
    return current


@dataclass
class Traced:
    outcome: Outcome
    calls: list[Call]

    @cached_property
    def accesses(self) -> list[Access]:
        return accesses(self.calls)

    @cached_property
    def pids(self) -> frozenset[int]:
        """Every process and thread the trace shows."""
        return frozenset(c.pid for c in self.calls)

    def writes(self) -> list[Access]:
        return [x for x in self.accesses if x.kind in ("write", "link-source")]

    def opened(self, path: Path | str) -> list[Access]:
        """Opens (any mode, O_PATH aside) that reached `path`: by its name, through links
        that lead to it (followed now: staging does not change under these tests), or,
        for a /proc/self or /proc/thread-self path, the same file of a traced process,
        which is how strace names it."""
        wanted = os.path.normpath(str(path))
        leads: dict[tuple[str, bool], str] = {}
        found = []
        for x in self.accesses:
            if x.kind not in ("open", "write") or not x.syscall.startswith(("open", "creat")):
                continue
            key = (x.path, "O_NOFOLLOW" not in x.flags)
            if key not in leads:
                leads[key] = through_links(x.path, follow_last=key[1])
            if self._same_file(x.path, wanted) or self._same_file(leads[key], wanted):
                found.append(x)
        return found

    def _same_file(self, seen: str, wanted: str) -> bool:
        if seen == wanted:
            return True
        m = _PROC_SELF.fullmatch(wanted)
        if m is None:
            return False
        task = r"/task/(\d+)" if m.group(1) == "thread-self" else r"(?:/task/(\d+))?"
        got = re.fullmatch(r"/proc/(\d+)" + task + re.escape(m.group(2) or ""), seen)
        return got is not None and all(int(g) in self.pids for g in got.groups() if g)


def traced(root: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120, inject: str | None = None,
           during: Callable[[], None] | None = None) -> Traced:
    """Run the real CLI under strace, following every thread and child process.
    `inject` is an strace tampering spec (`SYSCALL:delay_enter=…:when=…`); `during` is
    called while the run goes on (to change the staging under it)."""
    trace = TRACE_SET
    tamper: list[str] = []
    if inject is not None:
        trace += "," + inject.split(":", 1)[0]  # only traced calls can be tampered with
        tamper = ["-e", f"inject={inject}"]
    with tempfile.TemporaryDirectory(prefix="unb-trace-") as tmp:
        out = Path(tmp) / "trace"
        argv = ["strace", "-f", "-qq", "-y", "-o", str(out), "-e", f"trace={trace}",
                *tamper, *product_argv(root, *args)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=product_env(env), stdin=subprocess.DEVNULL) as proc:
            try:
                if during is not None:
                    during()
                stdout, stderr = proc.communicate(timeout=timeout)
            except BaseException:
                proc.kill()
                proc.communicate()
                raise
        text = out.read_text(errors="surrogateescape")
    assert "Traceback" not in stderr, stderr
    calls = parse_calls(text)
    assert any(c.name.startswith("open") for c in calls), f"nothing parsed: {text[:300]!r}"
    return Traced(Outcome(proc.returncode, stdout, stderr), calls)


def _under(path: str, *bases: Path | str) -> bool:
    return any(path == str(b) or path.startswith(f"{b}/") for b in bases)


# What the real nvidia-ctk 1.20 does in the caller's own /dev (docs/reliability.md,
# "Real-tool mode"): in management mode it re-creates /dev/char/<major>:<minor> links for
# the device nodes it selects, as udev makes them; the real NVML it loads opens
# /dev/nvidiactl read-write and, as root, mknods it when it is missing. The stand-ins do
# neither, so this is allowed only in real-tool mode.
_REAL_TOOL_DEV = re.compile(r"/dev/(char/\d+:\d+|nvidiactl)")
# atomic.write_atomically's temporary file beside the last run's record.
_LAST_RUN_TMP = re.compile(re.escape(f"{os.path.dirname(LAST_RUN)}/.{os.path.basename(LAST_RUN)}.")
                           + r"[0-9a-f]{12}\.tmp")


def write_violations(run: Traced, root: Path, *, forbidden: Path,
                     multiarch: str = "x86_64-linux-gnu") -> list[str]:
    """Writes outside what the tool may touch: under `root`, only the driver root's dir,
    its work dir, the lock file, /etc/cdi, /etc/ld.so.conf.d, ldconfig's cache files, the
    last run's record (/run/unbounded-nvidia-setup.last-run, and its temporary file beside
    it) and (deleting legacy links only) /usr/lib/<multiarch>; outside `root`, /dev/null, Python's
    bytecode caches and /tmp -- except anything in `forbidden` (the test's own area) --
    and, in real-tool mode, what the real nvidia-ctk does in /dev (see _REAL_TOOL_DEV)."""
    allowed = [root / "run/nvidia", root / "run/unbounded-nvidia-setup", root / LOCK_FILE[1:],
               root / "etc/cdi", root / "etc/ld.so.conf.d", root / "var/cache/ldconfig"]
    ancestors = {str(p) for p in (root, root / "run", root / "etc", root / "var",
                                  root / "var/cache")}
    legacy = str(root / "usr/lib" / multiarch)
    bad = []
    for x in run.writes():
        path = x.path
        if _under(path, root):
            if _under(path, *allowed) or path.startswith(f"{root}/etc/ld.so.cache"):
                continue
            if path == str(root / LAST_RUN.lstrip("/")) or _LAST_RUN_TMP.fullmatch(
                    path.removeprefix(str(root))):
                continue
            if x.syscall in ("mkdir", "mkdirat") and path in ancestors:
                continue
            if x.syscall in ("unlink", "unlinkat") and os.path.dirname(path) == legacy:
                continue
        elif (path == "/dev/null" or "/__pycache__/" in path
              or (_under(path, "/tmp") and not _under(path, forbidden))
              or (toolkit.REAL and _REAL_TOOL_DEV.fullmatch(path))):
            continue
        bad.append(f"{x.syscall} {x.kind} {path!r} = {x.result}")
    return bad
