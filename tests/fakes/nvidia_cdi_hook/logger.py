"""logrus text lines on stderr, the errors a hook returns, Go's spelling of system errors."""

from __future__ import annotations

import json
import os
import sys
import time


class HookError(Exception):
    """An error a hook returns (``level=error msg=...``, exit 1), or its child's failure."""


class UsageError(HookError):
    """A flag error (urfave/cli's usage-error path)."""


LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3}
THRESHOLD = {"level": 1}  # set from --debug / --quiet


def log(level: str, msg: str) -> None:
    """A logrus TextFormatter line on stderr."""
    if LEVELS[level] >= THRESHOLD["level"]:
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        zone = "Z" if now.endswith("+0000") else f"{now[-5:-2]}:{now[-2:]}"
        sys.stderr.write(f'time="{now[:-5]}{zone}" level={level} msg={json.dumps(msg)}\n')
        sys.stderr.flush()


def go_err(error: OSError | str) -> str:
    """Go spells errno and signal texts in lower case ('no such file or directory')."""
    text = error if isinstance(error, str) else error.strerror or os.strerror(error.errno or 0)
    return text[:1].lower() + text[1:]
