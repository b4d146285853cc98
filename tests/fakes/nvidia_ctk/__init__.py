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

Test knobs (environment): FAKE_NVIDIA_CTK_*, listed in knobs.py.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from .discover import device_edits
from .edits import Edits
from .filepath import go_ext
from .hooks import HOOK_APPLICATION_PROFILE, HOOKS_ALWAYS, HookCreator, resolve_hook_path
from .knobs import (
    KnobError,
    apply_process_knobs,
    corrupt,
    corruption,
    impersonated_version,
    log_invocation,
    parse_version,
    simulated_gpus,
)
from .logger import CtkError, Logger, UsageError
from .lookup import LIBRARY_SEARCH_DIRS, Driver, Locator
from .nvcdi import (
    CONTROL_DEVICE_PATTERNS,
    MANAGEMENT_BLOCKED_PREFIXES,
    MANAGEMENT_DEVICE_PATTERNS,
    device_names,
    driver_edits,
)
from .nvml import Nvml, init_sandboxutils
from .spec import minimum_cdi_version, save
from .version import KNOWN_COMMITS, V1_18, V1_19, V1_20, Version

MODES_ALWAYS = ("auto", "csv", "gds", "management", "mofed", "nvml", "wsl")
MODES_SINCE_1_18 = ("gdrcopy", "imex", "nvswitch")
SIMULATED_MODES = ("nvml", "management")


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


def generate_spec(opts: GenerateOptions, ctk: Version, log: Logger) -> dict[str, Any]:
    """cmd/nvidia-ctk/cdi/generate generateSpecs, for the nvml and management modes."""
    lib_locator = Locator(log, opts.driver_root, LIBRARY_SEARCH_DIRS, resolve=True)
    try:
        nvml_library: str | None = lib_locator.locate("libnvidia-ml.so.1")[0]
        log.info(f"Using {nvml_library}")
    except CtkError as exc:
        log.warning(f"Ignoring error in locating libnvidia-ml.so.1: {exc}")
        nvml_library = None
    gpus = simulated_gpus()
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
    how = corruption()
    apply_process_knobs()
    try:
        spec = generate_spec(opts, ctk, log)
    except CtkError as exc:
        raise CtkError(f"failed to generate CDI spec: {exc}") from exc
    save(corrupt(spec, how) if how else spec, opts.output, opts.format, log)
    log.info(f"Generated CDI spec with version {spec['cdiVersion']}")
    return 0


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
    version_text = impersonated_version()
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
