"""No package registry's address is written in the code: mirrors come from the machine's
own apt configuration (tests/mirrors.py). Every URL in guest/, tests/, bench/ and
packaging/ must be a documentation or specification link, an address reserved for
examples, or this machine's loopback."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import mirrors
from conftest import unmet

REPO = Path(__file__).resolve().parent.parent
DIRS = ("guest", "tests", "bench", "packaging")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s\"'<>)`\]]+", re.I)
# Links to documentation or specifications, by what they document.
RESERVED = ("example", "example.com", "example.net", "example.org", "invalid", "test")  # RFC 2606
DOCUMENTATION = {
    "www.apache.org": "/licenses/",  # the license text debian/copyright names
    "www.debian.org": "/doc/",  # the machine-readable copyright format
    "json-schema.org": "/draft/",  # the JSON Schema dialect of docs/check.schema.json
    "kubernetes.io": "/docs/",  # Documentation= of the test rootfs's kubelet unit
    "containerd.io": "",  # Documentation= of the test rootfs's containerd unit
}


def allowed(url: str) -> bool:
    parts = urlsplit(url)
    host = parts.hostname or ""
    # file: and unix: (a local socket, as gRPC names one) reach no other machine.
    if parts.scheme in ("file", "unix") or host in ("127.0.0.1", "localhost", "::1"):
        return True
    if any(host == name or host.endswith("." + name) for name in RESERVED):
        return True
    prefix = DOCUMENTATION.get(host)
    return prefix is not None and parts.path.startswith(prefix)


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", *DIRS],
                         capture_output=True, check=False)
    if out.returncode != 0:
        unmet("not a git checkout (or git missing)")
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def urls_in(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except (OSError, IsADirectoryError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {u}" for u in URL.findall(line)]
    return found


def test_every_url_is_documentation_an_example_or_loopback() -> None:
    bad = [hit for hit in urls_in(tracked_files()) if not allowed(hit.split(": ", 1)[1])]
    assert bad == []


def test_the_rule_catches_a_mirror() -> None:
    scheme = "https"  # spelled apart, or this file would break its own rule
    assert not allowed(f"{scheme}://ftp.debian.org/debian")
    assert not allowed(f"{scheme}://www.apache.org/dist/")
    assert allowed(f"{scheme}://mirror-a.example/debian")
    assert allowed(f"{scheme}://mirror.example.org/debian")
    assert allowed(f"{scheme}://kubernetes.io/docs/")


def test_no_host_of_this_machines_apt_sources_is_written_anywhere() -> None:
    hosts = {urlsplit(source.uri).hostname for source in mirrors.read_sources()} - {None, ""}
    if not hosts:
        unmet("this machine's apt configuration names no source")
    hits = []
    for path in tracked_files():
        text = path.read_text(errors="replace")
        hits += [f"{path.relative_to(REPO)}: {h}" for h in hosts if h and h in text]
    assert hits == []
