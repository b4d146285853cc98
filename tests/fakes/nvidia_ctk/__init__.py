"""Test stand-in for NVIDIA's ``nvidia-ctk`` (``--version`` and ``cdi generate`` only), run
through the launcher tests/fakes/nvidia-ctk.

The real tool cannot be installed on the test machines, so this script re-implements the
parts of its behaviour the product depends on, following the NVIDIA Container Toolkit
sources (v1.17.8 .. v1.20.0: cmd/nvidia-ctk/cdi/generate, pkg/nvcdi, internal/discover,
internal/lookup, pkg/lookup).  It must fail wherever the real tool fails; it is not a
"accept anything" mock.  Points mirrored on purpose:

* ``--dev-root`` defaults to ``--driver-root``; device nodes must be character devices.
* Library discovery: glob under fixed search dirs below the driver root, drop candidates
  ``os.stat`` cannot follow (dangling links), resolve with ``realpath`` in *this* process's
  mount namespace, then make paths root-relative by plain prefix stripping.  A library whose
  real path lies outside the root therefore drops out of the spec silently.
* The driver version comes from NVML when it "works", else from the file name suffix of
  ``libcuda.so.<ver>`` and then ``libnvidia-ml.so.<ver>``; neither found -> failure.
* SONAME links are only emitted (create-symlinks hook) when a symlink named like the
  library's DT_SONAME exists next to it (DT_SONAME is read from the ELF file).
* ``--output``: ``.json`` -> JSON whatever ``--format`` says, any name not ending in
  ``.yaml``/``.json`` gets the format's extension appended; written via temp file + rename.

Deliberate simplifications (documented, deterministic under tests):

* NVML: the ``libnvidia-ml.so.1`` found under the driver root is loaded (ctypes, as
  go-nvml: ``RTLD_LAZY|RTLD_GLOBAL``) and its ``nvmlInit_v2`` (else ``nvmlInit``) called.
  A library lacking both kills the process as it kills the real tool: ``<argv0>: symbol
  lookup error: <argv0>: undefined symbol: nvmlInit``, exit status 127 (the real tool is a
  lazily bound cgo binary); ``libnvidia-sandboxutils.so.1`` without ``nvSandboxUtilsInit``
  likewise. No library, or one that cannot be loaded: ERROR_LIBRARY_NOT_FOUND. The init
  runs in a child chrooted into an empty directory (the real library, as root, mknods
  ``/dev/nvidiactl`` in the caller's /dev) and answers ERROR_DRIVER_NOT_LOADED on a
  machine without a GPU, real library or simulated. Only ``FAKE_NVIDIA_CTK_GPUS`` makes
  NVML "initialise", listing those GPUs; its driver version is then the version suffix of
  the file that link resolves to.
* ``--mode=auto``: the real tool asks go-nvlib for the platform (NVML / Tegra / WSL) and
  falls back to nvml ("Unsupported platform detected ... assuming nvml").  Tegra and WSL are
  not simulated, so auto always resolves to nvml here, exactly as on a non-Tegra, non-WSL
  host; management mode is used only when asked for.
* The ``<root>/etc/ld.so.cache`` fallback of the library locator is not implemented.
* The hook path in the spec (``--nvidia-cdi-hook-path``) follows
  ``config.ResolveNVIDIACDIHookPath``: absolute = as given; else the first executable
  ``nvidia-cdi-hook`` (or the given name) in ``$PATH`` + the default PATH dirs, else
  ``/usr/bin/nvidia-cdi-hook`` (``nvidia-ctk``: ``/usr/bin/nvidia-ctk``, args ``nvidia-ctk
  hook ...``). Glob characters in a ``$PATH`` entry are taken literally here.
* Helper binaries are searched only below the driver root in the default PATH dirs (the
  real tool also searches ``$PATH`` and the caller's own ``/usr/bin`` etc.).
* Graphics files (EGL/Vulkan ICD json, Xorg modules), the MPS pipe dir, nvsandboxutils'
  init (loaded and checked, then reported as failing, which the real tool ignores)
  and CSV/WSL/GDS/MOFED/gdrcopy/imex/nvswitch modes are not simulated (those modes fail
  with a "not simulated" error); so do ``--library-search-path``, ``--config-search-path``,
  ``--csv.*``, ``--feature-flag`` and ``--device-id`` values other than ``all``.
* Unknown hook names in ``--disable-hook``/``--enable-hook`` are an error here (the real
  tool ignores them silently); stricter, so a typo in the product cannot pass unnoticed.

Test knobs (environment):

  FAKE_NVIDIA_CTK_VERSION=1.17.8   version to impersonate (default 1.20.0)
  FAKE_NVIDIA_CTK_GPUS=GPU-a,GPU-b simulated NVML GPUs (see above; the library must
                                   still load and export its init function)
  FAKE_NVIDIA_CTK_LOG=<file>       append ``json.dumps(sys.argv[1:])`` + newline per call
  FAKE_NVIDIA_CTK_HANG=1           ``cdi generate`` sleeps forever before discovery/writing
  FAKE_NVIDIA_CTK_SIGNAL=KILL|SEGV ``cdi generate`` kills itself with that signal
  FAKE_NVIDIA_CTK_CORRUPT=garbage|nokind|wrongkind|nodevices|staging
                                   after a successful generation, write a broken spec
                                   instead (unparsable / no kind / kind example.com/device /
                                   no devices / libcuda's mount hostPath under
                                   /run/host-nvidia/0) and exit 0
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from .discover import device_edits, is_lib_name, locate_mounts, symlink_links
from .edits import MOUNT_OPTIONS, Edits
from .filepath import go_clean, go_ext, go_join, trim_prefix, unique
from .hooks import HOOK_APPLICATION_PROFILE, HOOKS_ALWAYS, HookCreator, resolve_hook_path
from .logger import CtkError, Logger, UsageError
from .lookup import EXECUTABLE_SEARCH_DIRS, LIBRARY_SEARCH_DIRS, Driver, Locator, assert_executable
from .version import DEFAULT_VERSION, KNOWN_COMMITS, V1_18, V1_19, V1_20, Version

DRIVER_BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
MANAGEMENT_DEVICE_PATTERNS = (
    "/dev/nvidia*",
    "/dev/nvidia-caps/nvidia-cap*",
    "/dev/nvidia-modeset",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-uvm",
    "/dev/nvidiactl",
    "/dev/nvidia-caps-imex-channels/channel*",
)
MANAGEMENT_BLOCKED_PREFIXES = ("nvidia-fs", "nvidia-nvswitch", "nvidia-nvlink")
CONTROL_DEVICE_PATTERNS = (
    "/dev/nvidia-modeset",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-uvm",
    "/dev/nvidiactl",
)

MODES_ALWAYS = ("auto", "csv", "gds", "management", "mofed", "nvml", "wsl")
MODES_SINCE_1_18 = ("gdrcopy", "imex", "nvswitch")
SIMULATED_MODES = ("nvml", "management")

CORRUPTIONS = ("garbage", "nokind", "wrongkind", "nodevices", "staging")
GARBAGE_SPEC = '---\ncdiVersion: "0.5.0\nkind: nvidia.com/gpu\ndevices: [\n  {name: all,\n'
STAGING_PREFIX = "/run/host-nvidia/0"


class KnobError(Exception):
    """Misuse of this stand-in's own FAKE_NVIDIA_CTK_* knobs (exit 2)."""


# go-nvml's names for the NVML return codes the stand-in can meet.
NVML_RETURNS = {0: "SUCCESS", 1: "ERROR_UNINITIALIZED", 2: "ERROR_INVALID_ARGUMENT",
                3: "ERROR_NOT_SUPPORTED", 9: "ERROR_DRIVER_NOT_LOADED",
                12: "ERROR_LIBRARY_NOT_FOUND", 13: "ERROR_FUNCTION_NOT_FOUND",
                999: "ERROR_UNKNOWN"}
SANDBOXUTILS_LIBRARY = "libnvidia-sandboxutils.so.1"


def symbol_lookup_error(symbol: str) -> NoReturn:
    """How the real tool dies when a library it loaded lacks a function it calls: it is
    a cgo binary, lazily bound, so glibc's ld.so fails the call itself, prints this line
    and exits 127 (FACTS.md). No Go log line, no cleanup."""
    prog = sys.argv[0] if sys.argv and sys.argv[0] else "nvidia-ctk"
    sys.stdout.flush()
    sys.stderr.write(f"{prog}: symbol lookup error: {prog}: undefined symbol: {symbol}\n")
    sys.stderr.flush()
    os._exit(127)


def load_library(path: str) -> Any:
    """dlopen(path, RTLD_LAZY|RTLD_GLOBAL) as go-nvml's dl package does; None when it
    cannot be loaded (another architecture, not ELF, missing dependencies)."""
    import ctypes

    try:
        return ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_GLOBAL)
    except OSError:
        return None


_SCRATCH_PREFIX = ".nvidia-ctk-nvml."


def _remove_stale_scratch(tmp: str) -> None:
    """Empty roots of stand-ins that were SIGKILLed in the instant between making theirs
    and removing it (the product kills an nvidia-ctk whose answer it no longer needs)."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(_SCRATCH_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_SCRATCH_PREFIX):].split(".", 1)[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(tmp, name))
        except (ValueError, PermissionError):
            continue


def call_isolated(function: Callable[[], int]) -> int:
    """Call an NVML init function and return its result, in a child process that, when it
    may, chroots into an empty directory first. The real libnvidia-ml, run as root,
    mknods /dev/nvidiactl, unlinks /dev/char/<major>:<minor> and looks for modprobe in
    the caller's root (seen with Debian's 535.309.01): on a test machine that must not
    happen. In an empty root it finds no /proc, /sys or /dev and answers what it answers
    without a loaded kernel module. The directory is removed as soon as the child is in
    it (nothing can be made in a removed directory). Where chroot is not permitted (the
    unit's capability bounding set in a booted test machine) the call happens in place,
    as the real tool's would."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    _remove_stale_scratch(tmp)
    empty = os.path.join(tmp, f"{_SCRATCH_PREFIX}{os.getpid()}.{time.monotonic_ns()}")
    os.mkdir(empty, 0o700)
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            try:
                os.close(read_end)
                try:
                    os.chroot(empty)
                    os.chdir("/")
                except PermissionError:
                    pass
                os.write(write_end, b"\n")  # in its root: the parent may remove it
                os.write(write_end, str(function()).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer:
            ready = answer.read(1)
            os.rmdir(empty)
            text = answer.read().decode() if ready else ""
        os.waitpid(pid, 0)
    finally:
        if os.path.isdir(empty):
            os.rmdir(empty)
    return int(text) if text.strip().lstrip("-").isdigit() else 999


@dataclass
class Nvml:
    """go-nvml against the libnvidia-ml.so.1 found in the driver root.

    The library is loaded as go-nvml loads it and its init function is resolved as
    go-nvml's updateVersionedSymbols does (nvmlInit_v2, else nvmlInit). A library
    without either kills the process like the real tool (symbol_lookup_error); one that
    cannot be loaded is ERROR_LIBRARY_NOT_FOUND. The init is then really called
    (call_isolated): 9, ERROR_DRIVER_NOT_LOADED, from the real and the simulated library
    on a machine without a GPU. FAKE_NVIDIA_CTK_GPUS stands for a GPU machine: NVML
    initialises and lists those GPUs, without calling the library's init."""

    library: str | None
    gpus: list[str]
    result: int = 12

    @classmethod
    def load(cls, library: str | None, gpus: list[str]) -> Nvml:
        nvml = cls(library, gpus)
        loaded = load_library(library) if library is not None else None
        if loaded is None:
            return nvml
        name = next((n for n in ("nvmlInit_v2", "nvmlInit") if hasattr(loaded, n)), None)
        if name is None:
            symbol_lookup_error("nvmlInit")
        init: Callable[[], int] = getattr(loaded, name)
        nvml.result = 0 if gpus else call_isolated(init)
        return nvml

    def init_error(self) -> str | None:
        if self.result == 0:
            return None
        return NVML_RETURNS.get(self.result, f"unknown return value: {self.result}")

    def driver_version(self) -> str:
        error = self.init_error()
        if error is not None:
            raise CtkError(f"failed to initialize nvml: {error}")
        assert self.library is not None
        version = trim_prefix(os.path.basename(self.library), "libnvidia-ml.so.")
        if not re.fullmatch(r"\d+(\.\d+)+", version):
            raise CtkError("failed to get driver version: ERROR_UNKNOWN")
        return version


def init_sandboxutils(log: Logger, root: str) -> None:
    """nvsandboxutils, when the driver root has it: loaded and its nvSandboxUtilsInit
    resolved like NVML's init (missing: the same death). Its init takes a versioned
    struct this stand-in does not build; it is reported as failing, which the real tool
    ignores with this warning (it then finds the driver files without it)."""
    locator = Locator(log, root, LIBRARY_SEARCH_DIRS, resolve=True, required=False)
    found = locator.locate(SANDBOXUTILS_LIBRARY)
    loaded = load_library(found[0]) if found else None
    if loaded is None:
        return
    if not hasattr(loaded, "nvSandboxUtilsInit"):
        symbol_lookup_error("nvSandboxUtilsInit")
    log.warning("Failed to init nvsandboxutils: ERROR_NOT_SUPPORTED (not simulated by this "
                "test stand-in); ignoring")


def firmware_search_paths(log: Logger) -> list[str]:
    paths: list[str] = []
    try:
        with open("/sys/module/firmware_class/parameters/path", encoding="utf-8") as f:
            custom = f.read().strip()
    except OSError as exc:
        log.warning(f"failed to get custom firmware class path: {exc}")
        custom = ""
    if custom:
        paths.append(custom)
    release = os.uname().release
    return [
        *paths,
        go_join("/lib/firmware/updates/", release),
        "/lib/firmware/updates/",
        go_join("/lib/firmware/", release),
        "/lib/firmware/",
    ]


def driver_edits(log: Logger, driver: Driver, hooks: HookCreator, ctk: Version) -> Edits:
    """pkg/nvcdi/driver-nvml.go newDriverVersionDiscoverer."""
    try:
        version = driver.version()
    except CtkError as exc:
        raise CtkError(f'failed to determine driver version (""): {exc}') from exc
    log.info(f"Using driver version {version}")
    root = driver.root

    libs = driver.driver_library_locator("vdpau").locate(f"*.so.{version}")
    if root != "/":
        libs = [trim_prefix(lib, root) for lib in libs]
    library_mounts = locate_mounts(log, Locator(log, root), root, libs)
    library_mounts += locate_mounts(
        log, driver.driver_library_locator(), root, ["libnvidia-nvvm70.so.*"]
    )

    edits = Edits()
    edits.mounts += [m.to_spec() for m in library_mounts]
    folders = unique(posixpath.dirname(m.path) for m in library_mounts if is_lib_name(m.path))
    hook_list = [
        hooks.create("create-symlinks", symlink_links(log, library_mounts)),
        hooks.create("enable-cuda-compat", [f"--host-driver-version={version}"]),
        hooks.create("update-ldcache", folders) if folders else None,
    ]
    if ctk >= V1_18:
        hook_list.append(hooks.create("disable-device-node-modification"))
        edits.env.append("NVIDIA_CTK_LIBCUDA_DIR=" + ":".join(driver.lib_dirs()))
    edits.hooks += [h for h in hook_list if h is not None]

    ipc = Locator(log, root, ("/run", "/var/run"), count=1)
    firmware = Locator(log, root, firmware_search_paths(log))
    binaries = Locator(log, root, EXECUTABLE_SEARCH_DIRS, filter=assert_executable, count=1)
    for locator, patterns in (
        (ipc, ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket")),
        (firmware, (go_join("nvidia", version, "gsp*.bin"),)),
        (binaries, DRIVER_BINARIES),
    ):
        edits.mounts += [m.to_spec() for m in locate_mounts(log, locator, root, patterns)]
    return edits


@dataclass(frozen=True)
class FlagSpec:
    name: str
    kind: Literal["string", "slice", "bool"] = "string"
    aliases: tuple[str, ...] = ()
    since: Version = (0, 0, 0)
    env: str | None = None
    default: str | list[str] | bool = ""


GENERATE_FLAGS = (
    FlagSpec(
        "config-search-path", "slice", env="NVIDIA_CTK_CDI_GENERATE_CONFIG_SEARCH_PATHS", default=[]
    ),
    FlagSpec("output", env="NVIDIA_CTK_CDI_OUTPUT_FILE_PATH"),
    FlagSpec("format", env="NVIDIA_CTK_CDI_GENERATE_OUTPUT_FORMAT", default="yaml"),
    FlagSpec(
        "mode", aliases=("discovery-mode",), env="NVIDIA_CTK_CDI_GENERATE_MODE", default="auto"
    ),
    FlagSpec("dev-root", env="NVIDIA_CTK_DEV_ROOT"),
    FlagSpec(
        "device-name-strategy",
        "slice",
        env="NVIDIA_CTK_CDI_GENERATE_DEVICE_NAME_STRATEGIES",
        default=["index", "uuid"],
    ),
    FlagSpec("driver-root", env="NVIDIA_CTK_DRIVER_ROOT"),
    FlagSpec(
        "library-search-path",
        "slice",
        env="NVIDIA_CTK_CDI_GENERATE_LIBRARY_SEARCH_PATHS",
        default=[],
    ),
    FlagSpec("nvidia-cdi-hook-path", aliases=("nvidia-ctk-path",), env="NVIDIA_CTK_CDI_HOOK_PATH"),
    FlagSpec("ldconfig-path", env="NVIDIA_CTK_CDI_GENERATE_LDCONFIG_PATH"),
    FlagSpec(
        "vendor",
        aliases=("cdi-vendor",),
        env="NVIDIA_CTK_CDI_GENERATE_VENDOR",
        default="nvidia.com",
    ),
    FlagSpec("class", aliases=("cdi-class",), env="NVIDIA_CTK_CDI_GENERATE_CLASS", default="gpu"),
    FlagSpec("csv.file", "slice", env="NVIDIA_CTK_CDI_GENERATE_CSV_FILES", default=[]),
    FlagSpec(
        "csv.ignore-pattern", "slice", env="NVIDIA_CTK_CDI_GENERATE_CSV_IGNORE_PATTERNS", default=[]
    ),
    FlagSpec(
        "csv.compat-container-root",
        since=V1_19,
        env="NVIDIA_CTK_CDI_GENERATE_CSV_CONTAINER_COMPAT_ROOT",
    ),
    FlagSpec(
        "disable-hook",
        "slice",
        aliases=("disable-hooks",),
        since=V1_18,
        env="NVIDIA_CTK_CDI_GENERATE_DISABLED_HOOKS",
        default=[],
    ),
    FlagSpec(
        "enable-hook",
        "slice",
        aliases=("enable-hooks",),
        since=V1_18,
        env="NVIDIA_CTK_CDI_GENERATE_ENABLED_HOOKS",
        default=[],
    ),
    FlagSpec(
        "feature-flag",
        "slice",
        aliases=("feature-flags",),
        since=V1_18,
        env="NVIDIA_CTK_CDI_GENERATE_FEATURE_FLAGS",
        default=[],
    ),
    FlagSpec(
        "no-all-device",
        "bool",
        since=V1_19,
        env="NVIDIA_CTK_CDI_GENERATE_NO_ALL_DEVICE",
        default=False,
    ),
    FlagSpec(
        "device-id",
        "slice",
        aliases=("device-ids", "device", "devices"),
        since=V1_19,
        env="NVIDIA_CTK_CDI_GENERATE_DEVICE_IDS",
        default=["all"],
    ),
    FlagSpec("help", "bool", aliases=("h",), default=False),
)
# Flags the stand-in parses (so they are known/unknown exactly like the real tool) but
# does not simulate: setting them is an error here.
NOT_SIMULATED_FLAGS = (
    "config-search-path",
    "library-search-path",
    "csv.file",
    "csv.ignore-pattern",
    "csv.compat-container-root",
    "feature-flag",
)

FlagValue = str | list[str] | bool


def parse_flags(
    args: Sequence[str], specs: Sequence[FlagSpec], ctk: Version
) -> tuple[dict[str, FlagValue], set[str], list[str]]:
    """Go flag-package style parsing: -x/--x, =value or next argument, stop at '--'."""
    by_name: dict[str, FlagSpec] = {}
    for spec in specs:
        if spec.since <= ctk:
            for name in (spec.name, *spec.aliases):
                by_name[name] = spec
    values: dict[str, FlagValue] = {}
    explicit: set[str] = set()
    positional: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg == "--":
            positional += args[index:]
            break
        if not arg.startswith("-") or arg == "-":
            positional.append(arg)
            continue
        body = arg[2:] if arg.startswith("--") else arg[1:]
        if not body or body.startswith("-") or body.startswith("="):
            raise UsageError(f"bad flag syntax: {arg}")
        name, has_value, value = body.partition("=")
        flag = by_name.get(name)
        if flag is None:
            raise UsageError(f"flag provided but not defined: -{name}")
        if flag.kind == "bool":
            if has_value and value.lower() not in ("true", "false", "1", "0", "t", "f"):
                raise UsageError(f'invalid boolean value "{value}" for -{name}')
            values[flag.name] = not has_value or value.lower() in ("true", "1", "t")
        else:
            if not has_value:
                if index >= len(args):
                    raise UsageError(f"flag needs an argument: -{name}")
                value = args[index]
                index += 1
            if flag.kind == "slice":
                previous = values.get(flag.name) if flag.name in explicit else []
                assert isinstance(previous, list)
                values[flag.name] = previous + [v.strip() for v in value.split(",")]
            else:
                values[flag.name] = value
        explicit.add(flag.name)
    for spec in specs:
        if spec.name in explicit or spec.since > ctk:
            continue
        env_value = os.environ.get(spec.env) if spec.env else None
        if env_value is not None:
            explicit.add(spec.name)
            if spec.kind == "slice":
                values[spec.name] = [v.strip() for v in env_value.split(",")]
            elif spec.kind == "bool":
                values[spec.name] = env_value.lower() in ("true", "1", "t")
            else:
                values[spec.name] = env_value
        else:
            values[spec.name] = (
                list(spec.default) if isinstance(spec.default, list) else (spec.default)
            )
    return values, explicit, positional


def _str(values: dict[str, FlagValue], name: str) -> str:
    value = values[name]
    assert isinstance(value, str)
    return value


def _list(values: dict[str, FlagValue], name: str) -> list[str]:
    value = values[name]
    assert isinstance(value, list)
    return value


NAME_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


@dataclass
class GenerateOptions:
    output: str
    format: str
    format_explicit: bool
    mode: str
    driver_root: str
    dev_root: str
    strategies: list[str]
    hook_path: str
    ldconfig_path: str
    vendor: str
    cdi_class: str
    disabled_hooks: list[str]
    enabled_hooks: list[str]
    no_all_device: bool


def validate_generate(
    values: dict[str, FlagValue], explicit: set[str], ctk: Version, log: Logger
) -> GenerateOptions:
    """cmd/nvidia-ctk/cdi/generate validateFlags (plus this stand-in's own limits)."""
    fmt = _str(values, "format").lower()
    if fmt not in ("json", "yaml"):
        raise CtkError(f"invalid output format: {fmt}")
    mode = _str(values, "mode").lower()
    valid_modes = MODES_ALWAYS + (MODES_SINCE_1_18 if ctk >= V1_18 else ())
    if mode not in valid_modes:
        raise CtkError(f"invalid discovery mode: {mode}")
    strategies = _list(values, "device-name-strategy")
    for strategy in strategies:
        if strategy not in ("index", "uuid", "type-index"):
            raise CtkError(f"invalid device name strategy: {strategy}")
    output = _str(values, "output")
    implied = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(go_ext(output).lower())
    if implied:
        if "format" not in explicit:
            fmt = implied
        elif implied != fmt:
            log.warning(
                f'Requested output format "{fmt}" does not match format implied by '
                f'output file name: "{implied}"'
            )
    vendor, cdi_class = _str(values, "vendor"), _str(values, "class")
    if not NAME_RE.match(vendor):
        raise CtkError(f'invalid CDI vendor name: invalid vendor "{vendor}"')
    if not NAME_RE.match(cdi_class):
        raise CtkError(f'invalid CDI class name: invalid class "{cdi_class}"')
    disabled = _list(values, "disable-hook") if "disable-hook" in values else []
    enabled = _list(values, "enable-hook") if "enable-hook" in values else []
    if "all" in enabled:
        raise CtkError("enabling all hooks is not supported")
    known = HOOKS_ALWAYS + ((HOOK_APPLICATION_PROFILE,) if ctk >= V1_20 else ())
    for hook in [*disabled, *enabled]:
        if hook != "all" and hook not in known:
            raise CtkError(
                f'unknown hook name "{hook}" (this stand-in is strict; known: {", ".join(known)})'
            )
    for name in NOT_SIMULATED_FLAGS:
        if name in explicit and values.get(name):
            raise CtkError(f"--{name} is not simulated by this nvidia-ctk test stand-in")
    device_ids = values.get("device-id", ["all"])
    if device_ids != ["all"]:
        raise CtkError(f"--device-id {device_ids} is not simulated by this test stand-in")
    driver_root = _str(values, "driver-root") or "/"
    hook_path = resolve_hook_path(log, _str(values, "nvidia-cdi-hook-path"))
    return GenerateOptions(
        output=output,
        format=fmt,
        format_explicit="format" in explicit,
        mode=mode,
        driver_root=driver_root,
        dev_root=_str(values, "dev-root") or driver_root,
        strategies=strategies,
        hook_path=hook_path,
        ldconfig_path=_str(values, "ldconfig-path"),
        vendor=vendor,
        cdi_class=cdi_class,
        disabled_hooks=disabled,
        enabled_hooks=enabled,
        no_all_device=bool(values.get("no-all-device", False)),
    )


def device_names(strategies: Sequence[str], index: int, uuid: str) -> list[str]:
    names = {"index": str(index), "uuid": uuid, "type-index": f"gpu{index}"}
    return [names[s] for s in strategies]


def minimum_cdi_version(spec: dict[str, Any]) -> str:
    """specs-go version.go: the lowest spec version that can express this spec."""
    all_edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"]]
    if any(e.get("additionalGids") for e in all_edits):
        return "0.7.0"
    if any(d.get("annotations") for d in spec["devices"]) or "." in spec["kind"].split("/")[-1]:
        return "0.6.0"
    if any(d["name"][:1].isdigit() for d in spec["devices"]) or any(
        n.get("hostPath") for e in all_edits for n in e.get("deviceNodes", [])
    ):
        return "0.5.0"
    if any(m.get("type") for e in all_edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def generate_spec(opts: GenerateOptions, ctk: Version, log: Logger) -> dict[str, Any]:
    """cmd/nvidia-ctk/cdi/generate generateSpecs, for the nvml and management modes."""
    lib_locator = Locator(log, opts.driver_root, LIBRARY_SEARCH_DIRS, resolve=True)
    try:
        nvml_library: str | None = lib_locator.locate("libnvidia-ml.so.1")[0]
        log.info(f"Using {nvml_library}")
    except CtkError as exc:
        log.warning(f"Ignoring error in locating libnvidia-ml.so.1: {exc}")
        nvml_library = None
    gpus = [g.strip() for g in os.environ.get("FAKE_NVIDIA_CTK_GPUS", "").split(",") if g.strip()]
    nvml = Nvml.load(nvml_library, gpus)
    try:
        nvml_version = nvml.driver_version()
    except CtkError as exc:
        log.warning(f"Could not determine driver version: {exc}")
        nvml_version = ""

    mode = opts.mode
    if mode == "auto":
        if nvml_library is None:
            log.warning("Unsupported platform detected: unknown; assuming nvml")
        mode = "nvml"
        log.info(f"Auto-detected mode as '{mode}'")
    if mode not in SIMULATED_MODES:
        raise CtkError(
            f'failed to create CDI library: unsupported mode "{mode}" '
            "(not simulated by this nvidia-ctk test stand-in)"
        )
    disabled = list(opts.disabled_hooks)
    if mode == "management":
        disabled.append("disable-device-node-modification")
    hooks = HookCreator(opts.hook_path, opts.ldconfig_path, disabled, opts.enabled_hooks)
    driver = Driver(log, opts.driver_root, opts.dev_root, nvml_version)

    devices: list[tuple[str, Edits]] = []
    if mode == "management":
        nodes = device_edits(
            log, opts.dev_root, MANAGEMENT_DEVICE_PATTERNS, ctk, MANAGEMENT_BLOCKED_PREFIXES
        )
        if not nodes.device_nodes:
            raise CtkError("failed to create device CDI specs: no NVIDIA device nodes found")
        devices.append(("all", nodes))
        init_sandboxutils(log, opts.driver_root)
        try:
            common = driver_edits(log, driver, hooks, ctk)
        except CtkError as exc:
            raise CtkError(
                "failed to create edits common for entities: "
                f"failed to create driver library discoverer: {exc}"
            ) from exc
    else:
        error = nvml.init_error()
        if error is not None:
            raise CtkError(
                "failed to create device CDI specs: failed to construct device spec "
                f"generators: failed to initialize NVML: {error}"
            )
        init_sandboxutils(log, opts.driver_root)
        for index, uuid in enumerate(nvml.gpus):
            gpu_edits = device_edits(log, opts.dev_root, [f"/dev/nvidia{index}"], ctk)
            for name in device_names(opts.strategies, index, uuid):
                devices.append((name, gpu_edits))
        common = device_edits(log, opts.dev_root, CONTROL_DEVICE_PATTERNS, ctk)
        try:
            common.extend(driver_edits(log, driver, hooks, ctk))
        except CtkError as exc:
            raise CtkError(
                "failed to create edits common for entities: failed to create discoverer "
                f"for common entities: failed to create discoverer for driver files: {exc}"
            ) from exc
        if ctk >= V1_20:
            profile = hooks.create(HOOK_APPLICATION_PROFILE)
            if profile is not None:
                common.hooks.append(profile)
    common.env.append("NVIDIA_VISIBLE_DEVICES=void")

    device_specs = [(name, edits.without(common)) for name, edits in devices]
    if not opts.no_all_device and all(name != "all" for name, _ in device_specs):
        merged = Edits()
        for _, edits in device_specs:
            merged.extend(edits)
        device_specs.append(("all", merged.without(Edits())))
    for name, _ in device_specs:
        if not DEVICE_NAME_RE.match(name):
            raise CtkError(f'invalid device name "{name}"')
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": f"{opts.vendor}/{opts.cdi_class}",
        "devices": [{"name": n, "containerEdits": e.to_spec()} for n, e in device_specs],
        "containerEdits": common.to_spec(),
    }
    spec["cdiVersion"] = minimum_cdi_version(spec)
    return spec


def render(spec: dict[str, Any] | str, fmt: str) -> str:
    if isinstance(spec, str):
        return spec
    if fmt == "json":
        return json.dumps(spec, separators=(",", ":"))
    import yaml  # here, not at the top: --version and the failure paths do not pay for it

    # libyaml's emitter writes what yaml.safe_dump writes, ~25 ms sooner per spec.
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return "---\n" + yaml.dump(spec, Dumper=dumper, sort_keys=True, default_flow_style=False,
                               width=4096)


def corrupt(spec: dict[str, Any], how: str) -> dict[str, Any] | str:
    if how == "garbage":
        return GARBAGE_SPEC
    if how == "nokind":
        del spec["kind"]
    elif how == "wrongkind":
        spec["kind"] = "example.com/device"
    elif how == "nodevices":
        spec["devices"] = []
    elif how == "staging":
        mounts = spec["containerEdits"].setdefault("mounts", [])
        target = next((m for m in mounts if "/libcuda.so." in m["containerPath"]), None)
        if target is None:
            target = {
                "containerPath": "/lib/x86_64-linux-gnu/libcuda.so.1",
                "options": list(MOUNT_OPTIONS),
            }
            mounts.append(target)
        target["hostPath"] = go_join(STAGING_PREFIX, posixpath.basename(target["containerPath"]))
    return spec


def save(spec: dict[str, Any] | str, opts: GenerateOptions, log: Logger) -> None:
    """pkg/nvcdi/spec Save + the CDI cache's WriteSpec (temp file, rename, chmod 0644)."""
    if not opts.output:
        sys.stdout.write(render(spec, opts.format))
        sys.stdout.flush()
        return
    path = opts.output
    if go_ext(path) not in (".yaml", ".json"):
        path += ".json" if opts.format == "json" else ".yaml"
    if go_clean(os.path.dirname(path) or ".") == ".":
        path = os.path.join(os.getcwd(), path)
    data = render(spec, "json" if go_ext(path) == ".json" else "yaml")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        # Go's os.CreateTemp: a fresh name, O_EXCL, 0600 (tempfile costs ~5 ms to import)
        tmp = os.path.join(directory, f"spec.{os.getpid()}.{time.monotonic_ns()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CtkError(f"failed to write spec: {exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.rename(tmp, path)
        os.chmod(path, 0o644)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise CtkError(f"failed to write spec: {exc}") from exc
    log.info(f"Wrote CDI spec to {path}")


def apply_process_knobs() -> None:
    """FAKE_NVIDIA_CTK_SIGNAL / FAKE_NVIDIA_CTK_HANG (before anything is discovered/written)."""
    name = os.environ.get("FAKE_NVIDIA_CTK_SIGNAL", "")
    if name:
        signum = {"KILL": signal.SIGKILL, "SEGV": signal.SIGSEGV}.get(name.upper())
        if signum is None:
            raise KnobError(f"FAKE_NVIDIA_CTK_SIGNAL={name}: expected KILL or SEGV")
        sys.stdout.flush()
        sys.stderr.flush()
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)  # also overrides faulthandler's handler
        os.kill(os.getpid(), signum)
        time.sleep(5)  # not reached: the signal is delivered first
    if os.environ.get("FAKE_NVIDIA_CTK_HANG", "") not in ("", "0"):
        while True:
            time.sleep(3600)


def run_generate(args: Sequence[str], ctk: Version, log: Logger) -> int:
    values, explicit, positional = parse_flags(args, GENERATE_FLAGS, ctk)
    if values.get("help"):
        print(
            "NAME:\n   nvidia-ctk cdi generate - Generate CDI specifications for use with "
            "CDI-enabled runtimes\n\nUSAGE:\n   nvidia-ctk cdi generate [options]"
        )
        return 0
    if positional:
        raise UsageError(f"unexpected arguments: {' '.join(positional)} (stand-in is strict)")
    opts = validate_generate(values, explicit, ctk, log)
    how = os.environ.get("FAKE_NVIDIA_CTK_CORRUPT", "")
    if how and how not in CORRUPTIONS:
        raise KnobError(f"FAKE_NVIDIA_CTK_CORRUPT={how}: expected one of {CORRUPTIONS}")
    apply_process_knobs()
    try:
        spec = generate_spec(opts, ctk, log)
    except CtkError as exc:
        raise CtkError(f"failed to generate CDI spec: {exc}") from exc
    save(corrupt(spec, how) if how else spec, opts, log)
    log.info(f"Generated CDI spec with version {spec['cdiVersion']}")
    return 0


def parse_version(text: str) -> Version:
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.-]*)?", text)
    if not match:
        raise KnobError(f"FAKE_NVIDIA_CTK_VERSION={text!r} is not a version like 1.20.0")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def log_invocation(argv: Sequence[str]) -> None:
    path = os.environ.get("FAKE_NVIDIA_CTK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(list(argv)) + "\n")


GLOBAL_FLAGS = (
    FlagSpec("debug", "bool", aliases=("d",), default=False),
    FlagSpec("quiet", "bool", default=False),
    FlagSpec("config", aliases=("c",)),
    FlagSpec("version", "bool", aliases=("v",), default=False),
    FlagSpec("help", "bool", aliases=("h",), default=False),
)


def split_global(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split '[global flags] command ...' (global string flags take a value)."""
    index = 0
    while index < len(args) and args[index].startswith("-") and args[index] != "--":
        name = args[index].lstrip("-").partition("=")[0]
        takes_value = name in ("config", "c") and "=" not in args[index]
        index += 2 if takes_value else 1
    return list(args[:index]), list(args[index:])


def fail_usage(log: Logger, message: str) -> NoReturn:
    sys.stderr.write(f"Incorrect Usage: {message}\n\n")
    sys.stderr.write("USAGE:\n   nvidia-ctk [global options] command [command options]\n\n")
    log.error(message)
    sys.exit(1)


def main(argv: Sequence[str]) -> int:
    log_invocation(argv)
    version_text = os.environ.get("FAKE_NVIDIA_CTK_VERSION", DEFAULT_VERSION)
    log = Logger()
    try:
        ctk = parse_version(version_text)
        global_args, rest = split_global(argv)
        values, _, _ = parse_flags(global_args, GLOBAL_FLAGS, ctk)
        if values["debug"]:
            log = Logger("debug")
        elif values["quiet"]:
            log = Logger("error")
        if values["version"]:
            import hashlib

            commit = (
                KNOWN_COMMITS.get(version_text) or hashlib.sha1(version_text.encode()).hexdigest()
            )
            print(f"NVIDIA Container Toolkit CLI version {version_text}\ncommit: {commit}")
            return 0
        if not rest or values["help"]:
            print(
                "NAME:\n   NVIDIA Container Toolkit CLI - Tools to configure the NVIDIA "
                "Container Toolkit\n\nUSAGE:\n   nvidia-ctk [global options] command"
            )
            return 0
        if rest[:2] == ["cdi", "generate"]:
            return run_generate(rest[2:], ctk, log)
        sys.stderr.write(
            f"No help topic for '{' '.join(rest[:2])}' (test stand-in supports "
            "only --version and cdi generate)\n"
        )
        return 3
    except UsageError as exc:
        fail_usage(log, str(exc))
    except CtkError as exc:
        log.error(str(exc))
        return 1
    except KnobError as exc:
        sys.stderr.write(f"nvidia-ctk test stand-in: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
