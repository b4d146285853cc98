"""The nvidia-cdi-hook 1.20 test stand-in: its entry point and the dispatch to the hooks.

Run through the launcher tests/fakes/nvidia-cdi-hook. Specs from the nvidia-ctk stand-in
name it in their createContainer hooks, so a container runtime can really run it. It follows
the NVIDIA Container Toolkit v1.20.0 sources (cmd/nvidia-cdi-hook/{commands,create-symlinks,
update-ldcache,cudacompat}, internal/oci/state.go, internal/ldconfig) and is compared with
the real binary by tests/test_fake_nvidia_cdi_hook.py.

Its modules import only those before them in this list: filepath, logger (no imports of
the package); oci; create_symlinks, update_ldcache, cudacompat (the hooks); cli; this one
(main). Mirrored:

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

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .cli import (
    APP,
    COMMANDS,
    GLOBAL_FLAGS,
    NOT_SIMULATED,
    PERSISTENT_FLAGS,
    env_flags,
    help_text,
    parse_flags,
)
from .create_symlinks import create_symlinks
from .cudacompat import enable_cuda_compat
from .logger import THRESHOLD, HookError, UsageError, log
from .oci import find_root
from .update_ldcache import update_ldcache

VERSION, COMMIT = "1.20.0", "5505e2f94d9aaa08561490db974ba3cd676af209"


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
