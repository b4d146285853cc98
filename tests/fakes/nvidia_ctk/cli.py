"""urfave/cli's flag parsing (Go flag syntax) and nvidia-ctk's global options."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

from .logger import Logger, UsageError
from .version import Version


@dataclass(frozen=True)
class FlagSpec:
    name: str
    kind: Literal["string", "slice", "bool"] = "string"
    aliases: tuple[str, ...] = ()
    since: Version = (0, 0, 0)
    env: str | None = None
    default: str | list[str] | bool = ""


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
