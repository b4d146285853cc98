"""The Debian archive and security archive URIs that this machine's apt configuration names.

The tests fetch Debian packages (tests/realdriver.py) and debootstrap a rootfs
(tests/rootfs.py) from the mirrors the machine already uses, so no mirror is written in
the code. Both source formats count: deb822 stanzas in ``sources.list.d/*.sources``
(``Types``/``URIs``/``Suites``, several URIs per stanza possible) and one-line
``deb [opts] URI suite comps`` entries in ``sources.list`` and ``sources.list.d/*.list``.
The archive is a ``deb`` entry with a plain release suite (``bookworm``, ``stable``), the
security archive one whose suite ends in ``-security``. An environment variable
(:data:`ARCHIVE_ENV`, :data:`SECURITY_ENV`) overrides either.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

APT_ETC = Path("/etc/apt")
ARCHIVE_ENV = "UNB_DEBIAN_MIRROR"
SECURITY_ENV = "UNB_DEBIAN_SECURITY_MIRROR"


class MirrorNotFound(RuntimeError):
    """The apt configuration names no such mirror and no environment variable is set."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One ``deb`` entry: a URI and its suites (a deb822 stanza gives one per URI)."""

    uri: str
    suites: tuple[str, ...]


def parse_deb822(text: str) -> list[Source]:
    """The ``deb`` entries of a ``.sources`` file (``Enabled: no`` stanzas left out)."""
    sources: list[Source] = []
    for stanza in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0] in " \t" and key is not None:  # continuation of a multi-line field
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() in ("no", "false", "0"):
            continue
        suites = tuple(fields.get("suites", "").split())
        for uri in fields.get("uris", "").split():
            sources.append(Source(uri.rstrip("/"), suites))
    return sources


def parse_one_line(text: str) -> list[Source]:
    """The ``deb`` entries of a one-line ``sources.list`` (``deb-src`` left out)."""
    sources: list[Source] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0]
        line = re.sub(r"\[[^\]]*\]", " ", line)  # [arch=amd64 signed-by=...]
        words = line.split()
        if len(words) >= 3 and words[0] == "deb":
            sources.append(Source(words[1].rstrip("/"), (words[2],)))
    return sources


def read_sources(etc: Path = APT_ETC) -> list[Source]:
    """Every ``deb`` entry of the apt configuration under ``etc``, in apt's file order
    (``sources.list``, then ``sources.list.d/`` by name); unreadable files count as empty."""
    files = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*"))]
    sources: list[Source] = []
    for path in files:
        parse = {".list": parse_one_line, ".sources": parse_deb822}.get(path.suffix)
        if path.name == "sources.list":
            parse = parse_one_line
        if parse is None or not path.is_file():
            continue
        try:
            sources += parse(path.read_text(errors="replace"))
        except OSError:
            continue
    return sources


def _is_release(suite: str) -> bool:
    """A release's own suite (``bookworm``, ``sid``), not ``-updates``/``-security``/paths."""
    return re.fullmatch(r"[a-z]+", suite) is not None


def archive_uri(sources: Sequence[Source]) -> str | None:
    """The URI of the Debian archive among ``sources``: an entry with a plain release
    suite, preferring one whose release also has a ``-security`` entry (which tells
    Debian's archive from a third-party repository with a plain suite name)."""
    every = {s for src in sources for s in src.suites}
    candidates = [src for src in sources if any(_is_release(s) for s in src.suites)]
    for src in candidates:
        if any(_is_release(s) and f"{s}-security" in every for s in src.suites):
            return src.uri
    return candidates[0].uri if candidates else None


def security_uri(sources: Sequence[Source]) -> str | None:
    """The URI of the first entry with a ``<release>-security`` suite."""
    for src in sources:
        if any(s.endswith("-security") for s in src.suites):
            return src.uri
    return None


def _pick(env_names: Sequence[str], found: str | None, what: str, etc: Path) -> str:
    for name in env_names:
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    if found is None:
        raise MirrorNotFound(
            f"no {what} in the apt configuration under {etc} (sources.list, "
            f"sources.list.d/*.list, *.sources): set {' or '.join(env_names)} to its URI"
        )
    return found


def debian_archive(*env_names: str, etc: Path = APT_ETC) -> str:
    """The Debian archive URI: the first set variable of ``env_names`` (default
    :data:`ARCHIVE_ENV`), else the apt configuration's; MirrorNotFound when neither."""
    names = env_names or (ARCHIVE_ENV,)
    return _pick(names, archive_uri(read_sources(etc)), "Debian archive", etc)


def debian_security(*env_names: str, etc: Path = APT_ETC) -> str:
    """The Debian security archive URI, like :func:`debian_archive` (default variable
    :data:`SECURITY_ENV`)."""
    names = env_names or (SECURITY_ENV,)
    return _pick(names, security_uri(read_sources(etc)), "Debian security archive", etc)
