"""cmd/nvidia-ctk/cdi/generate: its flags, their validation, and the spec it writes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cli import FlagSpec, FlagValue, parse_flags
from .discover import device_edits
from .edits import Edits
from .filepath import go_ext
from .hooks import HOOK_APPLICATION_PROFILE, HOOKS_ALWAYS, HookCreator, resolve_hook_path
from .knobs import apply_process_knobs, corrupt, corruption
from .libnvml import NvmlDevices
from .logger import CtkError, Logger, UsageError
from .lookup import LIBRARY_SEARCH_DIRS, Driver, Locator
from .nvcdi import (
    CONTROL_DEVICE_PATTERNS,
    MANAGEMENT_BLOCKED_PREFIXES,
    MANAGEMENT_DEVICE_PATTERNS,
    driver_edits,
)
from .nvml import NvmlLib, init_sandboxutils
from .spec import minimum_cdi_version, save, validate
from .version import V1_18, V1_19, V1_20, Version

MODES_ALWAYS = ("auto", "csv", "gds", "management", "mofed", "nvml", "wsl")
MODES_SINCE_1_18 = ("gdrcopy", "imex", "nvswitch")
SIMULATED_MODES = ("nvml", "management")

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
    device_ids: list[str]


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
    device_ids = _list(values, "device-id") if "device-id" in values else ["all"]
    no_all_device = bool(values.get("no-all-device", False))
    if "none" in device_ids and not no_all_device:
        log.warning("Disabling generation of 'all' device")
        no_all_device = True
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
        no_all_device=no_all_device,
        device_ids=device_ids,
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
    nvml = NvmlLib(nvml_library)
    nvml_devices = NvmlDevices(log, nvml, opts.dev_root, opts.strategies, ctk)

    mode = opts.mode
    if mode == "auto":
        if nvml_library is None:
            log.warning("Unsupported platform detected: unknown; assuming nvml")
        else:
            nvml_devices.has_an_integrated_gpu()
        mode = "nvml"
        log.info(f"Auto-detected mode as '{mode}'")
    nvml_version = driver_version(log, nvml)
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
        try:
            generators = nvml_devices.generators(opts.device_ids)
        except CtkError as exc:
            raise CtkError(
                f"failed to create device CDI specs: failed to construct device spec "
                f"generators: {exc}"
            ) from exc
        init_sandboxutils(log, opts.driver_root)
        try:
            devices += nvml_devices.device_specs(generators)
        except CtkError as exc:
            raise CtkError(f"failed to create device CDI specs: {exc}") from exc
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

    # pkg/nvcdi/spec's builder: the simplifier (dedupe, drop what the common edits hold,
    # sort), then the merged `all` device, then the simplifier again.
    device_specs = sorted(((name, edits.without(common)) for name, edits in devices),
                          key=lambda d: d[0])
    if not opts.no_all_device and all(n != "all" for n, _ in device_specs):
        merged = Edits()
        for _, edits in device_specs:
            merged.extend(edits)
        device_specs.append(("all", merged.without(Edits())))
        device_specs.sort(key=lambda d: d[0])
    common.sort()
    for _, edits in device_specs:
        edits.sort()
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


def driver_version(log: Logger, nvml: NvmlLib) -> str:
    """root.New's versioner: nvsandboxutils (never available here), then NVML (its init,
    nvmlSystemGetDriverVersion and shutdown); '' when neither answers."""
    errors = ["libnvsandboxutils is not available"]
    ret = nvml.init()
    if ret != 0:
        errors.append(f"failed to initialize nvml: {nvml.error_string(ret)}")
    else:
        try:
            version, ret = nvml.driver_version()
            if ret == 0:
                return version
            errors.append(f"failed to get driver version: {nvml.error_string(ret)}")
        finally:
            nvml.shutdown()
    log.warning("Could not determine driver version: " + "\n".join(errors))
    return ""


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
    log.info(f"Generated CDI spec with version {spec['cdiVersion']}")
    try:
        validate(spec)
    except CtkError as exc:
        if not opts.output:
            raise CtkError(f"failed to write CDI spec to STDOUT: {exc}") from exc
        raise
    save(corrupt(spec, how) if how else spec, opts.output, opts.format, log)
    return 0
