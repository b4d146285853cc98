"""The command line: `unbounded-nvidia-setup [--root DIR] [--config FILE] COMMAND`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from . import __version__, log
from .config import Machine, load_config
from .log import EXIT_FAILED, Failure

T = TypeVar("T")


def _guarded(action: Callable[[], T]) -> T:
    """The single place expected failures become one line and an exit code."""
    try:
        return action()
    except Failure as e:
        log.error(e.message)
        if os.environ.get("NOTIFY_SOCKET"):
            log.status(f"Failed: {e.message}")
        sys.exit(e.code)
    except KeyboardInterrupt:
        sys.exit(130)


def _machine(ctx: click.Context) -> Machine:
    root: Path = ctx.obj["root"]
    config, _ = load_config(root, ctx.obj["config"])
    return Machine.create(root, config)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="unbounded-nvidia-setup")
@click.option("--root", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default="/", show_default=True,
              help="Resolve every path the tool reads or writes under DIR.", metavar="DIR")
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Config file [default: <root>/etc/unbounded/nvidia-setup.yaml].",
              metavar="FILE")
@click.option("-v", "--verbose", is_flag=True, help="Also log debug lines.")
@click.pass_context
def cli(ctx: click.Context, root: Path, config: Path | None, verbose: bool) -> None:
    """Build the NVIDIA driver root and CDI spec of a GPU node machine."""
    log.set_verbose(verbose)
    ctx.obj = {"root": Path(os.path.abspath(root)), "config": config}


@cli.command()
@click.option("--force", is_flag=True,
              help="Swap the driver root even while containerd or kubelet run.")
@click.pass_context
def run(ctx: click.Context, force: bool) -> None:
    """Reconcile: rebuild the driver root and the CDI spec from the staging mounts."""
    from .reconcile import reconcile

    _guarded(lambda: reconcile(_machine(ctx), force=force))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Validate the live state; change nothing. Exit 1 on problems."""
    from .check import collect
    from .lock import locked

    def action() -> int:
        machine = _machine(ctx)
        with locked(machine, exclusive=False):
            report = collect(machine)
        if as_json:
            import json

            click.echo(json.dumps(report.to_json(), indent=2))
        else:
            for p in report.problems:
                click.echo(f"{p.code}: {log.one_line(p.message)}")
            click.echo("ok" if report.ok else f"{len(report.problems)} problems")
        return 0 if report.ok else EXIT_FAILED

    sys.exit(_guarded(action))


@cli.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Summarize GPU, driver root, spec and problems."""
    from .check import collect, render_status
    from .lock import locked

    def action() -> None:
        machine = _machine(ctx)
        with locked(machine, exclusive=False):
            report = collect(machine)
        click.echo(render_status(machine, report))

    _guarded(action)


@cli.command()
@click.option("--force", is_flag=True,
              help="Remove the driver root even while containerd or kubelet run.")
@click.pass_context
def clean(ctx: click.Context, force: bool) -> None:
    """Remove the driver root, the CDI spec and the ld.so.conf drop-in."""
    from .reconcile import clean as do_clean

    _guarded(lambda: do_clean(_machine(ctx), force=force))
