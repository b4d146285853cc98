"""internal/oci/state.go: the container's state and root, and running code chrooted there."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .filepath import go_join
from .logger import HookError, go_err


class Obj(list[tuple[str, Any]]):
    """A JSON object: encoding/json matches keys case-insensitively, the last match wins."""

    def get(self, name: str) -> Any:
        return next((v for k, v in reversed(self) if k.lower() == name.lower()), None)


def json_type(value: Any) -> str:
    if isinstance(value, bool | str | Obj):
        return {bool: "bool", str: "string", Obj: "object"}[type(value)]
    return "number" if isinstance(value, int | float) else "array"


STATE_FIELDS = {"ociVersion": (str, "string"), "id": (str, "string"), "status": (str, "string"),
                "pid": (int, "int"), "bundle": (str, "string"),
                "annotations": (Obj, "map[string]string")}
SPEC_FIELDS = {"root": (Obj, "specs.Root"), "root.path": (str, "string"),
               "root.readonly": (bool, "bool")}


def decode(text: str, go_type: str, fields: dict[str, tuple[type, str]]) -> Obj:
    """json.Decoder.Decode of the first value (null: the zero value), typed fields checked."""
    body = text.lstrip(" \t\r\n")
    try:
        value = json.JSONDecoder(object_pairs_hook=Obj).raw_decode(body)[0] if body else None
    except json.JSONDecodeError as exc:
        if exc.pos >= len(body.rstrip()) or exc.msg.startswith("Unterminated string"):
            raise ValueError("unexpected EOF") from exc
        if exc.msg == "Expecting value":
            raise ValueError(f"invalid character {body[exc.pos]!r} looking for beginning of "
                             "value") from exc
        raise ValueError(exc.msg) from exc
    if not body:
        raise ValueError("EOF")
    value = Obj() if value is None else value
    if not isinstance(value, Obj):
        raise ValueError(f"json: cannot unmarshal {json_type(value)} into Go value of type "
                         f"{go_type}")
    for path, (kind, kind_name) in fields.items():
        parent, _, name = path.rpartition(".")
        item = (value.get(parent) or Obj()).get(name) if parent else value.get(name)
        where = f"Root.{path}" if parent else f"{go_type.split('.')[1]}.{path}"
        if item is not None and (not isinstance(item, kind)
                                 or isinstance(item, bool) != (kind is bool)):
            raise ValueError(f"json: cannot unmarshal {json_type(item)} into Go struct field "
                             f"{where} of type {kind_name}")
    return value


def find_root(spec_file: str, ldcache: bool) -> str:
    """oci.LoadContainerState + State.GetContainerRoot (+ update-ldcache's own check)."""
    try:
        if spec_file in ("", "-"):
            text = sys.stdin.read()
        else:
            with open(spec_file, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        bundle: str = decode(text, "oci.State", STATE_FIELDS).get("bundle") or ""
    except OSError as exc:
        raise HookError(f"failed to load container state: failed to open file: open "
                        f"{spec_file}: {go_err(exc)}") from exc
    except ValueError as exc:
        raise HookError(f"failed to load container state: failed to decode container state: "
                        f"{exc}") from exc
    config = go_join(bundle, "config.json")
    try:
        with open(config, encoding="utf-8", errors="surrogateescape") as f:
            spec = decode(f.read(), "oci.minimalSpec", SPEC_FIELDS)
    except OSError as exc:
        raise HookError(f"failed to determined container root: failed to open OCI spec file: "
                        f"open {config}: {go_err(exc)}") from exc
    except ValueError as exc:
        raise HookError(f"failed to determined container root: failed to load minimal OCI "
                        f"spec: {exc}") from exc
    path: str = (spec.get("root") or Obj()).get("path") or ""
    root = path if path.startswith("/") else go_join(bundle, path)
    if ldcache and root in ("", "/"):
        raise HookError("failed to determined container root: <nil>")
    if not ldcache and root and os.path.realpath(root) == "/":
        raise HookError(f"container root {root} is the host's /: refused by this "
                        "nvidia-cdi-hook test stand-in (the real hook would change the host)")
    return root


def in_root(root_fd: int, action: Callable[[], None]) -> tuple[int, str]:
    """Runs the action in a child chrooted into the root (it may end in an exec). Returns the
    child's exit code (negative: the signal that killed it) and the HookError it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.fchdir(root_fd)
            os.chroot(".")
            os.chdir("/")
            action()
            code = 0
        except HookError as exc:
            os.write(write_end, str(exc).encode(errors="surrogateescape"))
        except BaseException as exc:
            os.write(write_end, f"stand-in failure: {exc!r}".encode())
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="surrogateescape")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), message
