"""Entry point. `--version` answers before anything heavy is imported: it is what tools
probe on the boot path."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from . import __version__

        print(f"unbounded-nvidia-setup {__version__}")
        return
    from .cli import cli

    cli(prog_name="unbounded-nvidia-setup")


if __name__ == "__main__":
    main()
