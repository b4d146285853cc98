"""The config file and the machine the tool works on (`--root`)."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .budget import MIN_SECONDS, Budget, Limit
from .log import EXIT_USAGE, die

DEFAULT_CONFIG = "/etc/unbounded/nvidia-setup.yaml"
LOCK_FILE = "/run/unbounded-nvidia-setup.lock"
LDCONF_DROPIN = "/etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
WORK_DIR = "/run/unbounded-nvidia-setup"
# How the last run ended (outcome.py); on /run, so a boot starts without one.
LAST_RUN = "/run/unbounded-nvidia-setup.last-run"
PLUGIN_SPEC = "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"  # imex.py
MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


@dataclass(frozen=True)
class Config:
    driver_root: str = "/run/nvidia/driver"
    staging_glob: str = "/run/host-nvidia/*"
    cdi_spec: str = "/etc/cdi/nvidia.yaml"
    nvidia_ctk: str = "nvidia-ctk"
    nvidia_ctk_args: tuple[str, ...] = ()
    # Not in the original key list: a hung nvidia-ctk must not hold the boot forever.
    nvidia_ctk_timeout_seconds: float = 120.0
    # An addition (issue 35): after a generate that failed or hung on a GPU, how long one
    # NVML call for one GPU may go unanswered before that GPU counts as unusable (a GPU
    # whose GSP stopped answering blocks NVML for ever). A healthy call takes
    # milliseconds; nvmlInit, which can take seconds, is not bound by it.
    nvml_gpu_timeout_seconds: float = 10.0
    ldconfig: str = "ldconfig"
    # Also an addition: ldconfig stats every directory ld.so.conf names, and one on a hung
    # network filesystem holds it (and the boot) as long as nothing kills it.
    ldconfig_timeout_seconds: float = 120.0
    arch: str = "auto"
    staging_wait_seconds: float = 60.0
    # Was 300 s, the unit's whole TimeoutStartSec: a waiter was killed by systemd before it
    # could say why. Every run now ends within its own budget, so a lock held for longer
    # than a minute is held by something stuck; exiting 75 and being retried by systemd is
    # as good as waiting longer, and leaves the rest of the budget for the work.
    lock_timeout_seconds: float = 60.0
    # An addition too (issue 16): one budget for a whole `run` or `clean`, every wait in
    # it included, so whatever hangs ends in the tool's own words. It must stay below the
    # unit's TimeoutStartSec (5 min) with a margin (tests/test_budget.py checks that).
    run_timeout_seconds: float = 240.0
    extra_library_prefixes: tuple[str, ...] = ()
    # node_exporter's textfile directory (Debian's prometheus-node-exporter); "" = off.
    metrics_dir: str = "/var/lib/prometheus/node-exporter"


_ABSOLUTE_KEYS = ("driver_root", "staging_glob", "cdi_spec")
_NUMBER_KEYS = ("nvidia_ctk_timeout_seconds", "nvml_gpu_timeout_seconds",
                "ldconfig_timeout_seconds", "staging_wait_seconds", "lock_timeout_seconds",
                "run_timeout_seconds")
_LIST_KEYS = ("nvidia_ctk_args", "extra_library_prefixes")


def _bad(path: Path, key: str, why: str) -> Any:
    die(f"config {path}: key '{key}' {why}", hint="fix the file", code=EXIT_USAGE)


def parse_config(data: object, path: Path) -> Config:
    """Validate a parsed YAML document; every mistake names its key (exit 2)."""
    if data is None:
        return Config()
    if not isinstance(data, dict):
        die(f"config {path}: expected a mapping of keys, got {type(data).__name__}",
            hint="see the keys in docs/configuration", code=EXIT_USAGE)
    known = {f.name for f in dataclasses.fields(Config)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            _bad(path, str(key), f"is unknown (known keys: {', '.join(sorted(known))})")
        if key in _NUMBER_KEYS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                _bad(path, key, "must be a non-negative number of seconds")
            values[key] = float(value)
        elif key in _LIST_KEYS:
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                _bad(path, key, "must be a list of non-empty strings")
            values[key] = tuple(value)
        elif key == "metrics_dir":
            if not isinstance(value, str) or (value and not value.startswith("/")):
                _bad(path, key, "must be an absolute path, or '' to turn metrics off")
            values[key] = value
        else:
            if not isinstance(value, str) or not value:
                _bad(path, key, "must be a non-empty string")
            values[key] = value
    if "run_timeout_seconds" in values and not (
            MIN_SECONDS <= values["run_timeout_seconds"] < math.inf):
        _bad(path, "run_timeout_seconds", f"must be at least {MIN_SECONDS:g} s and "
             "finite: the whole run must fit in it (and it in the unit's TimeoutStartSec)")
    for key in _ABSOLUTE_KEYS:
        if key in values and not values[key].startswith("/"):
            _bad(path, key, "must be an absolute path")
    if "cdi_spec" in values and not values["cdi_spec"].endswith((".yaml", ".json")):
        _bad(path, "cdi_spec", "must end in .yaml or .json (containerd reads only those)")
    if values.get("arch", "auto") not in ("auto", *MULTIARCH):
        _bad(path, "arch", "must be auto, x86_64 or aarch64")
    for key in ("driver_root", "cdi_spec"):
        if key in values and os.path.normpath(values[key]) in ("/", "/etc", "/run", "/usr"):
            _bad(path, key, "must not be a system directory")
    for key in ("nvidia_ctk", "ldconfig"):  # never relative to the caller's directory
        if "/" in values.get(key, "x") and not values[key].startswith("/"):
            _bad(path, key, "must be a program name or an absolute path")
    return Config(**values)


def load_config(root: Path, explicit: Path | None) -> tuple[Config, Path]:
    path = explicit if explicit is not None else under(root, DEFAULT_CONFIG)
    try:
        text = _read_trusted(path)
    except FileNotFoundError:
        if explicit is not None:
            die(f"config file {path} does not exist", hint="pass an existing file to --config",
                code=EXIT_USAGE)
        return Config(), path
    except (OSError, UnicodeDecodeError) as e:
        die(f"cannot read config file {path}: {e}", hint="fix its permissions or content",
            code=EXIT_USAGE)
    import yaml

    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        die(f"config file {path} is not valid YAML{where}", hint="fix its syntax",
            code=EXIT_USAGE)
    return parse_config(data, path), path


def _read_trusted(path: Path) -> str:
    """The config's text. It names the programs root runs, so it must be a regular file
    (a FIFO must not hang a boot) of a sane size, owned by root or by whoever runs this,
    and writable by nobody else (issue 37): else exit 2, naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            die(f"config file {path} is not a regular file", hint="make it one",
                code=EXIT_USAGE)
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            die(f"config file {path} is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}: it names the programs root runs",
                hint=f"chown root:root {path} && chmod go-w {path}", code=EXIT_USAGE)
        data = os.read(fd, _CONFIG_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > _CONFIG_MAX:
        die(f"config file {path} is larger than {_CONFIG_MAX} bytes",
            hint="it holds a few keys; check what was written there", code=EXIT_USAGE)
    return data.decode()


_CONFIG_MAX = 1 << 16


def load_yaml(text: str | bytes) -> Any:
    """yaml.safe_load, with libyaml's parser when PyYAML has it (several times faster on
    the ~40-mount specs read on every boot)."""
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def under(root: Path, path: str) -> Path:
    """`path` (absolute, as seen inside the machine) resolved under `root`."""
    return root / path.lstrip("/")


def glob_parent(pattern: str) -> str:
    """The longest leading part of a glob that has no wildcard: `/run/host-nvidia`."""
    parts: list[str] = []
    for part in pattern.split("/"):
        if any(c in part for c in "*?["):
            break
        parts.append(part)
    return "/".join(parts) or "/"


@dataclass(frozen=True)
class Machine:
    """Where everything is, for one invocation: the config plus `--root`."""

    root: Path
    config: Config
    arch: str
    # The time budget of a command that changes state (cli.run, cli.clean); None for
    # `check` and `status`, whose waits keep their own limits.
    budget: Budget | None = None

    @classmethod
    def create(cls, root: Path, config: Config) -> Machine:
        arch = config.arch
        if arch == "auto":
            # platform.machine() is this on Linux; platform costs a boot ~8M instructions.
            machine = os.uname().machine
            arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)
            if arch not in MULTIARCH:
                die(f"unsupported machine architecture {machine}",
                    hint="set arch: x86_64 or aarch64 in the config", code=EXIT_USAGE)
        return cls(root=root, config=config, arch=arch)

    def at(self, path: str) -> Path:
        return under(self.root, path)

    def with_budget(self, start: float) -> Machine:
        """This machine for a command whose every wait shares run_timeout_seconds from
        `start` (time.monotonic())."""
        return dataclasses.replace(
            self, budget=Budget.starting(self.config.run_timeout_seconds, start))

    def limit(self, own: float | None, *, rollback: bool = False) -> Limit:
        """How long a wait may take: `own` (None: no limit of its own), capped by what is
        left of the budget when there is one."""
        if self.budget is None:
            return Limit(own)
        return self.budget.limit(own, rollback=rollback)

    @property
    def multiarch(self) -> str:
        return MULTIARCH[self.arch]

    @property
    def driver_root(self) -> Path:
        return self.at(self.config.driver_root)

    @property
    def libdir(self) -> str:
        """The library directory inside the driver root, relative to it."""
        return f"lib/{self.multiarch}"

    @property
    def cdi_spec(self) -> Path:
        return self.at(self.config.cdi_spec)

    @property
    def staging_parent(self) -> str:
        return glob_parent(self.config.staging_glob)

    @property
    def ldconf_dropin(self) -> Path:
        return self.at(LDCONF_DROPIN)

    @property
    def lock_file(self) -> Path:
        return self.at(LOCK_FILE)

    @property
    def work_dir(self) -> Path:
        return self.at(WORK_DIR)

    @property
    def last_run(self) -> Path:
        return self.at(LAST_RUN)

    @property
    def metrics_dir(self) -> Path | None:
        """node_exporter's textfile directory, or None when metrics are off."""
        return self.at(self.config.metrics_dir) if self.config.metrics_dir else None

    @property
    def plugin_spec(self) -> Path:
        return self.at(PLUGIN_SPEC)

    @property
    def is_live(self) -> bool:
        """True when working on the running system itself, not a tree under --root."""
        return self.root == Path("/")
