"""Log lines for journald, systemd STATUS=, and the single way out for user-facing errors.

Every message is one line. When stderr is the journal (a service under systemd) lines carry
sd-daemon priority prefixes (`<3>` … `<7>`) so journald files them at the right level;
elsewhere errors and warnings are labelled for people.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, NoReturn, TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL: systemd retries, operators read "not yet", not "broken"

ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7
_LABELS = {ERR: "error: ", WARNING: "warning: "}

_verbose = False
_notifier: Any = None
_journal: bool | None = None


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


# Every C0 and C1 control and DEL, escaped: staged file names and process names are the
# machine's, and a terminal obeys an escape sequence printed raw (issue 37).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}
_CONTROLS.update({ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r"})


def one_line(text: str) -> str:
    """`text` on one line with nothing a terminal or the journal would act on: staging
    file names are host-controlled and may hold newlines or escape sequences."""
    return text.translate(_CONTROLS)


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM=<dev>:<inode> for a service whose stderr is the journal
    (sd_journal_stream_fd(3)); a child with redirected stderr inherits the variable, so the
    descriptor itself is compared."""
    global _journal
    if _journal is None:
        _journal = is_journal(sys.stderr)
    return _journal


def is_journal(stream: TextIO) -> bool:
    """Whether `stream` is the journal's stream that systemd named in JOURNAL_STREAM."""
    try:
        dev, ino = (int(part) for part in os.environ["JOURNAL_STREAM"].split(":"))
        st = os.fstat(stream.fileno())
    except (KeyError, ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def log(priority: int, message: str) -> None:
    if priority == DEBUG and not _verbose:
        return
    line = one_line(message)
    prefix = f"<{priority}>" if stderr_is_journal() else _LABELS.get(priority, "")
    # A full disk or a restarting journald must not turn a log line into a crash: the
    # line is lost, the run goes on (its outcome also reaches systemd as STATUS=).
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{prefix}{line}\n")
        sys.stderr.flush()


def error(message: str) -> None:
    log(ERR, message)


def warn(message: str) -> None:
    log(WARNING, message)


def info(message: str) -> None:
    log(INFO, message)


def debug(message: str) -> None:
    log(DEBUG, message)


def status(message: str, *, journal: bool = True) -> None:
    """Show progress in `systemctl status` (STATUS=), and log it unless `journal` is False
    (a line the journal already has, or a wait's every second)."""
    global _notifier
    if journal:
        info(message)
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    if _notifier is None:
        import sdnotify

        _notifier = sdnotify.SystemdNotifier()
    _notifier.notify(f"STATUS={one_line(message)}")
