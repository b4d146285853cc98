"""Log lines for journald, systemd STATUS=, and the single way out for user-facing errors.

Every message is one line. When stderr is not a terminal (the journal, a pipe) lines carry
sd-daemon priority prefixes (`<3>` … `<7>`) so journald files them at the right level.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: systemd retries, operators read "not yet", not "broken"

ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7
_LABELS = {ERR: "error: ", WARNING: "warning: "}

_verbose = False
_notifier: Any = None


class Failure(Exception):
    """An expected, operator-facing failure: one line of text and an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def die(what: str, *, hint: str | None = None, code: int = EXIT_FAILED) -> NoReturn:
    """Abort with one line: what is wrong and where (`what`), then what to do (`hint`)."""
    raise Failure(f"{what}; {hint}" if hint else what, code)


def set_verbose(verbose: bool) -> None:
    global _verbose
    _verbose = verbose


def one_line(text: str) -> str:
    # Staging file names are host-controlled and may hold newlines: never let one split a
    # log record in two.
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def log(priority: int, message: str) -> None:
    if priority == DEBUG and not _verbose:
        return
    line = one_line(message)
    if sys.stderr.isatty():
        sys.stderr.write(f"{_LABELS.get(priority, '')}{line}\n")
    else:
        sys.stderr.write(f"<{priority}>{line}\n")
    sys.stderr.flush()


def error(message: str) -> None:
    log(ERR, message)


def warn(message: str) -> None:
    log(WARNING, message)


def info(message: str) -> None:
    log(INFO, message)


def debug(message: str) -> None:
    log(DEBUG, message)


def status(message: str) -> None:
    """Show progress in `systemctl status` (STATUS=) and log it."""
    global _notifier
    info(message)
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    if _notifier is None:
        import sdnotify

        _notifier = sdnotify.SystemdNotifier()
    _notifier.notify(f"STATUS={one_line(message)}")
