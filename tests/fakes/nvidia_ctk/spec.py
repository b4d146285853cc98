"""pkg/nvcdi/spec: a spec's minimum CDI version, its YAML or JSON text, and saving it."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from .filepath import go_clean, go_ext
from .logger import CtkError, Logger


def minimum_cdi_version(spec: dict[str, Any]) -> str:
    """specs-go version.go: the lowest spec version that can express this spec."""
    all_edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"]]
    if any(e.get("additionalGids") for e in all_edits):
        return "0.7.0"
    if any(d.get("annotations") for d in spec["devices"]) or "." in spec["kind"].split("/")[-1]:
        return "0.6.0"
    if any(d["name"][:1].isdigit() for d in spec["devices"]) or any(
        n.get("hostPath") for e in all_edits for n in e.get("deviceNodes", [])
    ):
        return "0.5.0"
    if any(m.get("type") for e in all_edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def validate(spec: dict[str, Any]) -> None:
    """What the CDI library checks of a spec before 1.20 writes it (to a file or to
    stdout alike): a device with no edits at all (a GPU whose /dev/nvidia<minor> is not
    there gets none) is an invalid spec, the first such device in order named."""
    for device in spec["devices"]:
        if not any(device["containerEdits"].values()):
            raise CtkError(f'failed to write spec: invalid CDI Spec: failed add device '
                           f'"{device["name"]}": invalid device, empty device edits')


def render(spec: dict[str, Any] | str, fmt: str) -> str:
    if isinstance(spec, str):
        return spec
    if fmt == "json":
        return json.dumps(spec, separators=(",", ":"))
    import yaml  # here, not at the top: --version and the failure paths do not pay for it

    # libyaml's emitter writes what yaml.safe_dump writes, ~25 ms sooner per spec.
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return "---\n" + yaml.dump(spec, Dumper=dumper, sort_keys=True, default_flow_style=False,
                               width=4096)


def save(spec: dict[str, Any] | str, output: str, fmt: str, log: Logger) -> None:
    """pkg/nvcdi/spec Save + the CDI cache's WriteSpec (temp file, rename, chmod 0644)."""
    if not output:
        sys.stdout.write(render(spec, fmt))
        sys.stdout.flush()
        return
    path = output
    if go_ext(path) not in (".yaml", ".json"):
        path += ".json" if fmt == "json" else ".yaml"
    if go_clean(os.path.dirname(path) or ".") == ".":
        path = os.path.join(os.getcwd(), path)
    data = render(spec, "json" if go_ext(path) == ".json" else "yaml")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        # Go's os.CreateTemp: a fresh name, O_EXCL, 0600 (tempfile costs ~5 ms to import)
        tmp = os.path.join(directory, f"spec.{os.getpid()}.{time.monotonic_ns()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CtkError(f"failed to write spec: {exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.rename(tmp, path)
        os.chmod(path, 0o644)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise CtkError(f"failed to write spec: {exc}") from exc
    log.info(f"Wrote CDI spec to {path}")
