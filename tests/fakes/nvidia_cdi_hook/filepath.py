"""Go's filepath.Clean and filepath.Join."""

from __future__ import annotations

import posixpath


def go_clean(path: str) -> str:
    """filepath.Clean (posixpath.normpath keeps a leading '//', Go does not)."""
    cleaned = posixpath.normpath(path) if path else "."
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


def go_join(*parts: str) -> str:
    nonempty = [p for p in parts if p]
    return go_clean("/".join(nonempty)) if nonempty else ""
