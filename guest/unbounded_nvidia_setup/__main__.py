"""Entry point. `--version` answers before anything heavy is imported: it is what tools
probe on the boot path."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing itself costs `--version` ~4 ms of imports
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    try:
        code: object = _command(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    except BrokenPipeError:  # stdout's reader went away: the only pipe this process writes
        code = 1
    _exit(code)


def _command(argv: list[str]) -> int:
    if argv == ["--version"]:
        from . import __version__

        print(f"unbounded-nvidia-setup {__version__}")
        return 0
    from .cli import main as cli

    return cli(argv)


def _exit(code: object) -> NoReturn:
    """Exit like `sys.exit(code)`, without the interpreter's teardown: freeing the ~200
    modules a run imports costs ~15 ms on every boot, for memory the kernel is about to
    take back anyway. Nothing else is pending by now: children were waited for, copy
    threads joined and files closed by their context managers; only the standard
    streams hold buffered text. Output that cannot be written (the reader of a pipe went
    away) fails the command with 1."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        status = status or 1
    try:  # noqa: SIM105 (contextlib would cost `--version` ~4 ms of imports)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # nowhere left to say anything
    os._exit(status)


if __name__ == "__main__":
    main()
