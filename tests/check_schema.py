"""The `check --json` contract (issue 11), in one place for every test that reads that
output: the unit, failure, hostile, concurrency and crash tests under --root, the
packaging test in an offline rootfs and the boot suite in a booted machine all parse it
with :func:`parse_check`, which validates it against docs/check.schema.json (the file the
package installs as /usr/share/unbounded-nvidia-setup/check.schema.json).

Validation is strict here and lenient in the shipped schema: the shipped schema allows
unknown keys (consumers must ignore them, docs/problems.md), but the tests forbid any key
the schema does not describe, so a key added to the output without its description fails
every test that sees it.

The problem codes "in the code" (:func:`codes_in_source`) come from the product's source,
read with `ast`, by this rule: the first argument of every ``Problem(...)`` call is either
a string literal; or a name that the same function binds only to expressions whose string
literals are codes (``code = "a" if x else "b"``); or ``codes[...]``, a lookup in the
tables ``*_CODES`` of spec.py, whose values are all codes. Any other first argument (an
f-string, a call) is reported as unreadable and fails the consistency test, so a code can
never be built in a way this scan would miss."""

from __future__ import annotations

import ast
import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
SCHEMA_FILE = REPO / "docs" / "check.schema.json"
PRODUCT = REPO / "guest" / "unbounded_nvidia_setup"
PROBLEMS_DOC = REPO / "docs" / "problems.md"
VERDICTS = ("ready", "degraded", "no-usable-gpu", "no-gpu", "not-ready-yet", "broken",
            "image")


def load_schema(path: Path = SCHEMA_FILE) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every described object closed to keys it does not describe."""
    out = copy.deepcopy(schema)

    def close(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(out)
    return out


@cache
def _validator(path: Path) -> Any:
    from jsonschema import Draft202012Validator

    schema = load_schema(path)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(strict(schema))


def validate(report: object, schema_file: Path = SCHEMA_FILE) -> None:
    """AssertionError naming every way `report` breaks the schema (strictly read)."""
    errors = sorted(_validator(schema_file).iter_errors(report), key=lambda e: list(e.path))
    assert not errors, "check --json does not match the schema:\n" + "\n".join(
        f"  at /{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def parse_check(stdout: str, code: int | None = None,
                schema_file: Path = SCHEMA_FILE) -> dict[str, Any]:
    """The object `check --json` printed, validated against the schema and against the
    rules the schema cannot state: exit status 0 exactly when ok, 3 when degraded
    (serving fewer GPUs), 4 when no-usable-gpu, else 1; ok exactly when there are no
    problems (nor pending ones) and the verdict is ready, no-gpu or image."""
    report: dict[str, Any] = json.loads(stdout)
    validate(report, schema_file)
    ok = report["ok"]
    assert ok == (report["problems"] == [] and report.get("pending", []) == []), report
    # Nothing pending without a cause first (issue 36).
    assert report["problems"] or not report.get("pending"), report
    assert (report["verdict"] in ("ready", "no-gpu", "image")) == ok, report
    assert (report["verdict"] == "no-gpu") == (
        ok and not report["gpu"] and report["verdict"] != "image"), report
    if code is not None:
        assert code == (0 if ok else {"degraded": 3, "no-usable-gpu": 4}.get(
            report["verdict"], 1)), (code, report)
    return report


# -- the three lists of problem codes ---------------------------------------------------


def _table_values(tree: ast.Module) -> set[str]:
    """The values of the module-level ``*_CODES = {...}`` tables."""
    found: set[str] = set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id.endswith("_CODES")
                        for t in node.targets)):
            for value in node.value.values:
                assert isinstance(value, ast.Constant) and isinstance(value.value, str)
                found.add(value.value)
    return found


def _bound_literals(function: ast.AST, name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found |= {c.value for c in ast.walk(node.value)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return found


def codes_in_source(package: Path = PRODUCT) -> tuple[set[str], list[str]]:
    """(every code the product can emit, the Problem(...) calls this rule cannot read)."""
    codes: set[str] = set()
    unreadable: list[str] = []
    for source in sorted(package.glob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        codes |= _table_values(tree)
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id == "Problem"):
                    continue
                first = call.args[0] if call.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    codes.add(first.value)
                elif isinstance(first, ast.Name) and _bound_literals(function, first.id):
                    codes |= _bound_literals(function, first.id)
                elif (isinstance(first, ast.Subscript) and isinstance(first.value, ast.Name)
                      and first.value.id == "codes"):
                    pass  # a *_CODES table's value (taken above)
                else:
                    unreadable.append(f"{source.name}:{call.lineno}")
    return codes, unreadable


def codes_in_schema(path: Path = SCHEMA_FILE) -> set[str]:
    item = load_schema(path)["properties"]["problems"]["items"]
    return set(item["properties"]["code"]["enum"])


def codes_in_docs(path: Path = PROBLEMS_DOC) -> set[str]:
    """The first column of the table under "## Codes"."""
    text = path.read_text().split("\n## Codes\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z][a-z-]*)` \|", text, re.M))


class _Ran(Protocol):
    code: int
    stdout: str


def check_report(out: _Ran) -> dict[str, Any]:
    """:func:`parse_check` of a finished `check --json` (conftest.Outcome)."""
    return parse_check(out.stdout, out.code)
