"""internal/edits: container edits, their spec form, and dropping what common edits hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .filepath import go_clean

MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")


@dataclass
class Edits:
    env: list[str] = field(default_factory=list)
    device_nodes: list[dict[str, Any]] = field(default_factory=list)
    hooks: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    additional_gids: list[int] = field(default_factory=list)

    def extend(self, other: Edits) -> None:
        self.env += other.env
        self.device_nodes += other.device_nodes
        self.hooks += other.hooks
        self.mounts += other.mounts
        self.additional_gids += other.additional_gids

    def without(self, common: Edits) -> Edits:
        """Drop entries already in common edits, and duplicates (the spec simplifier)."""
        return Edits(
            _dedupe(self.env, common.env),
            _dedupe(self.device_nodes, common.device_nodes),
            _dedupe(self.hooks, common.hooks),
            _dedupe(self.mounts, common.mounts),
            _dedupe(self.additional_gids, common.additional_gids),
        )

    def sort(self) -> None:
        """pkg/nvcdi/transform/sorter.go (part of the simplifier since 1.14): device nodes
        and mounts by the depth of their container path, then the path."""
        self.device_nodes.sort(key=lambda n: _depth_key(str(n["path"])))
        self.mounts.sort(key=lambda m: _depth_key(str(m["containerPath"])))

    def to_spec(self) -> dict[str, Any]:
        """specs-go ContainerEdits, every field omitempty."""
        out: dict[str, Any] = {}
        for key, value in (
            ("env", self.env),
            ("deviceNodes", self.device_nodes),
            ("hooks", self.hooks),
            ("mounts", self.mounts),
            ("additionalGids", self.additional_gids),
        ):
            if value:
                out[key] = value
        return out


def _depth_key(path: str) -> tuple[int, str]:
    return go_clean(path).count("/"), path


def _dedupe(items: list[Any], exclude: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item not in exclude and item not in out:
            out.append(item)
    return out
