"""urfave/cli v3 as the hook uses it: flags per command, Go flag syntax, environment, help."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .logger import HookError, UsageError

APP = "NVIDIA CDI Hook"
NOT_SIMULATED = ("chmod", "disable-device-node-modification", "update-application-profile")

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
