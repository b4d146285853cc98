"""Go's filepath.Clean/Join/Ext and strings.TrimPrefix, and an order-keeping unique."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable


def go_clean(path: str) -> str:
    """filepath.Clean (posixpath.normpath keeps a leading '//', Go does not)."""
    if not path:
        return "."
    cleaned = posixpath.normpath(path)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    return cleaned


def go_join(*parts: str) -> str:
    """filepath.Join: joins the non-empty parts with '/' and cleans the result."""
    nonempty = [p for p in parts if p]
    if not nonempty:
        return ""
    return go_clean("/".join(nonempty))


def go_ext(path: str) -> str:
    """filepath.Ext: the suffix from the final dot of the last element ('' if none)."""
    base = path.rsplit("/", 1)[-1]
    index = base.rfind(".")
    return base[index:] if index >= 0 else ""


def trim_prefix(value: str, prefix: str) -> str:
    """strings.TrimPrefix."""
    return value[len(prefix) :] if prefix and value.startswith(prefix) else value


def unique(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
