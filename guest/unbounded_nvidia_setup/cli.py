"""The command line: `unbounded-nvidia-setup [--root DIR] [--config FILE] COMMAND`.

argparse, not click: click's imports cost ~12 ms before anything else happens, on every
boot of every GPU node. Usage errors are one line and exit 2, like every other failure."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from . import __version__, log
from .config import Machine, load_config
from .log import EXIT_FAILED, EXIT_USAGE, Failure, die

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

    from .state import Report

T = TypeVar("T")
PROG = "unbounded-nvidia-setup"


def _guarded(action: Callable[[], T]) -> T:
    """The single place expected failures become one line and an exit code."""
    try:
        try:
            return action()
        except PermissionError as e:
            # Not expected of root; but the unit's sandbox answers a call it blocks with
            # EPERM (SystemCallErrorNumber=), and so does a drop-in that narrows it.
            where = f" on {e.filename}" if e.filename else ""
            die(f"{e.strerror or 'permission denied'}{where}", hint="the unit's sandbox or "
                "a drop-in (SystemCallFilter=, CapabilityBoundingSet=, ReadWritePaths=) "
                "refused it: `systemctl cat unbounded-nvidia-setup` shows them")
    except Failure as e:
        log.error(e.message)
        # STATUS= only: the journal has the line already.
        log.status(f"Failed: {e.message}", journal=False)
        sys.exit(e.code)
    except KeyboardInterrupt:
        sys.exit(130)


def _machine(args: argparse.Namespace) -> Machine:
    config, _ = load_config(args.root, args.config)
    return Machine.create(args.root, config)


def _budgeted(args: argparse.Namespace) -> Machine:
    """The machine for a command that changes state: every wait in it shares one time
    budget (run_timeout_seconds) counted from now, so it ends in its own words before the
    unit's TimeoutStartSec (budget.py)."""
    start = time.monotonic()
    return _machine(args).with_budget(start)


def run(args: argparse.Namespace) -> int:
    from .metrics import RunRecord
    from .outcome import RELOAD
    from .reconcile import reconcile, refresh_spec

    record = RunRecord()

    def action() -> None:
        record.machine = _budgeted(args)
        try:
            if args.spec_only:
                record.command = RELOAD
                refresh_spec(record.machine, record=record)
            else:
                reconcile(record.machine, force=args.force, record=record)
        except Failure as e:
            record.error = e.message
            raise

    # The metrics say how the run ended, failures included: written here, where every
    # outcome has become its exit code, and unable to change it (metrics.write).
    code = 1  # an unexpected exception: Python exits 1 with its traceback
    try:
        _guarded(action)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        raise
    finally:
        record.finish(code)
    return 0


def check(args: argparse.Namespace) -> int:
    from .check import render_json, render_text
    from .lock import shared_or_busy
    from .state import DEGRADED, EXIT_DEGRADED, EXIT_NO_USABLE_GPU, NO_USABLE_GPU, collect_beside
    from .unit import unit_state

    def action() -> int:
        machine = _machine(args)
        # Never waits behind a run (lock.shared_or_busy says why): a host agent asking
        # "ready?" during a boot's setup gets "not ready yet" now, not in 300 s.
        with shared_or_busy(machine) as busy:
            report = collect_beside(machine, busy)
        report.unit = unit_state(machine)
        changed = True
        if args.metrics:
            from .metrics import write_check

            changed = write_check(machine, report, time.time())
        # The drift check's tick (stdout the journal) says nothing when nothing changed
        # since the last check; a person or a host agent always gets the report.
        quiet = not (changed or args.as_json or not log.is_journal(sys.stdout))
        if not quiet:
            print(render_json(report) if args.as_json else render_text(report))
        verdict = report.verdict
        if args.reload_if_degraded and verdict in (DEGRADED, NO_USABLE_GPU):
            _reload_if_due(machine, report, quiet)
        if report.ok:
            return 0
        return {DEGRADED: EXIT_DEGRADED, NO_USABLE_GPU: EXIT_NO_USABLE_GPU}.get(verdict,
                                                                               EXIT_FAILED)

    return _guarded(action)


def _reload_if_due(machine: Machine, report: Report, quiet: bool) -> None:
    from .drift import ask_for_reload, reload_due, reload_wait
    from .gpus import fingerprint
    from .outcome import when

    last = report.last_run
    if reload_due(last, time.time(), fingerprint(machine)):
        ask_for_reload(machine)
    elif last is not None:
        due = time.strftime("%H:%M:%S UTC", time.gmtime(last.last_attempt + reload_wait(last)))
        # A tick that changed nothing says nothing (the line is the same every tick).
        (log.debug if quiet else log.info)(
            f"the GPUs were last asked for at {when(last)}, {last.gpus.attempts} reloads "
            f"ago, and the kernel shows no change: the next reload is due at {due}")


def status(args: argparse.Namespace) -> int:
    from .check import render_status
    from .lock import shared_or_busy
    from .state import collect_beside
    from .unit import unit_state

    def action() -> None:
        try:
            machine = _machine(args)
        except Failure as e:
            # A summary exits 0 whatever it finds (README), a broken config included:
            # that is a line of it, beside what systemd says of the unit.
            from .config import Config

            unit = unit_state(Machine(root=args.root or Path("/"), config=Config(),
                                      arch=os.uname().machine))
            print(f"Config:         {log.one_line(e.message)}\n"
                  f"Setup:          {unit.describe() if unit is not None else 'not running'}")
            return
        # Like `check`, never waits behind a run: a person asking during a boot's setup
        # is told now that one is in progress, not after lock_timeout_seconds.
        with shared_or_busy(machine) as busy:
            report = collect_beside(machine, busy)
        report.unit = unit_state(machine)
        print(render_status(machine, report))

    _guarded(action)
    return 0


def clean(args: argparse.Namespace) -> int:
    from .reconcile import clean as do_clean

    _guarded(lambda: do_clean(_budgeted(args), force=args.force))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, exit 2 (argparse would print the usage block first)."""
        log.error(f"{message}; see `{PROG} --help`")
        sys.exit(EXIT_USAGE)

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """--help and --version output. argparse drops a failed write and exits 0; here it
        fails like any other output (__main__.main)."""
        if message:
            (file or sys.stderr).write(message)


def _directory(value: str) -> Path:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"directory {value!r} does not exist")
    return Path(os.path.abspath(value))


def _file(value: str) -> Path:
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory, not a config file")
    return Path(value)


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog=PROG, description="Build the NVIDIA driver root and CDI spec of a GPU "
                  "node machine.")
    top.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    top.add_argument("--root", type=_directory, default=Path("/"), metavar="DIR",
                     help="resolve every path the tool reads or writes under DIR "
                          "(default: /)")
    top.add_argument("--config", type=_file, default=None, metavar="FILE",
                     help="config file (default: <root>/etc/unbounded/nvidia-setup.yaml)")
    top.add_argument("-v", "--verbose", action="store_true", help="also log debug lines")
    commands = top.add_subparsers(metavar="COMMAND", required=True,
                                  parser_class=_Parser)

    def command(name: str, action: Callable[[argparse.Namespace], int],
                summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary + ".")
        sub.set_defaults(action=action)
        return sub

    run_parser = command("run", run, "reconcile: rebuild the driver root and the CDI spec "
                         "from the staging mounts")
    run_parser.add_argument(
        "--force", action="store_true",
        help="swap the driver root even while containerd or kubelet run")
    run_parser.add_argument(
        "--spec-only", action="store_true",
        help="only regenerate and install the CDI spec for the live driver root (what "
             "`systemctl reload` runs); fails, changing nothing, when the root no longer "
             "matches the staging")
    check_parser = command("check", check, "validate the live state; change nothing; "
                           "exit 1 on problems, 3 when degraded (serving fewer GPUs)")
    check_parser.add_argument(
        "--json", dest="as_json", action="store_true", help="print one JSON object")
    check_parser.add_argument(
        "--metrics", action="store_true",
        help="also write the result to unbounded_nvidia_setup.prom in metrics_dir")
    check_parser.add_argument(
        "--reload-if-degraded", action="store_true",
        help="when the verdict is degraded or no-usable-gpu (a GPU NVML cannot use), ask "
             "systemd to reload unbounded-nvidia-setup, which serves the GPU again once it "
             "is back; backs off from every 5 min to every hour while nothing changes (the "
             "drift check's timer does this)")
    command("status", status, "summarize GPU, driver root, spec and problems")
    command("clean", clean, "remove the driver root, the CDI spec and the ld.so.conf "
            "drop-in").add_argument(
        "--force", action="store_true",
        help="remove the driver root even while containerd or kubelet run")
    return top


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    log.set_verbose(args.verbose)
    action: Callable[[argparse.Namespace], int] = args.action
    return action(args)
