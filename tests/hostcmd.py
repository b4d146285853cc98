"""The host agent's commands, read from docs/host-integration.md (issue 11): the boot
suite runs exactly these, so the doc and the suite cannot drift.

Each is a fenced ``sh`` block right after a ``<!-- host-command: NAME -->`` marker, one
command line. The boot suite runs them in a booted machine with :func:`in_guest`: the host
here has no systemd as PID 1, so ``systemd-run --machine=M --wait --pipe --quiet ARGV``
becomes ARGV run inside the machine with nsenter, and ``systemctl --machine=M ARGS``
becomes ``systemctl ARGS`` run there; ``dpkg --root=ROOTFS -i DEB`` runs on the host with
the placeholders filled in (:func:`argv`). Plain module (no boot imports) so that
tests/test_contract.py can check the doc without booting anything."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "host-integration.md"
# Every command the boot suite runs, by name; test_contract checks the doc has exactly these.
USED = frozenset({"install", "validate", "is-active", "restart"})
_BLOCK = re.compile(r"<!-- host-command: ([a-z-]+) -->\n```sh\n([^\n]+)\n```\n")
_RUN = ["systemd-run", "--machine=M", "--wait", "--pipe", "--quiet"]
_SYSTEMCTL = ["systemctl", "--machine=M"]


def commands(doc: Path = DOC) -> dict[str, list[str]]:
    """NAME -> argv, as the doc writes it. A name given twice is an error."""
    found: dict[str, list[str]] = {}
    for name, line in _BLOCK.findall(doc.read_text()):
        assert name not in found, f"{doc}: host-command {name} given twice"
        found[name] = shlex.split(line)
    return found


def argv(name: str, **values: str) -> list[str]:
    """The doc's command NAME with placeholders (ROOTFS, DEB, M) replaced by `values`."""
    return [values.get(word, word) if word.isupper() else
            re.sub(r"=([A-Z]+)$", lambda m: "=" + values.get(m[1], m[1]), word)
            for word in commands()[name]]


def in_guest(command: list[str]) -> list[str]:
    """What to run inside the machine (nsenter) for a host command that names it with
    --machine=M; ValueError for any other shape, so the doc cannot hold a command that the
    suite would have to run some other way."""
    if command[:len(_RUN)] == _RUN and len(command) > len(_RUN):
        return command[len(_RUN):]
    if command[:len(_SYSTEMCTL)] == _SYSTEMCTL and len(command) > len(_SYSTEMCTL):
        return ["systemctl", *command[len(_SYSTEMCTL):]]
    raise ValueError(f"not a command this suite can run inside a machine: "
                     f"{shlex.join(command)}")
