"""Toolkit releases: the one impersonated by default, their commits, where behaviour changes."""

from __future__ import annotations

Version = tuple[int, int, int]

DEFAULT_VERSION = "1.20.0"
# Release commits of the tags (git rev-list -n1 <tag>); other versions get a derived hash.
KNOWN_COMMITS = {
    "1.17.8": "f202b80a9b9d0db00d9b1d73c0128c8962c55f4d",
    "1.18.0": "f8daa5e26de9fd7eb79259040b6dd5a52060048c",
    "1.19.0": "ec7b4e2fa2caecad6d89be4a26029b831fe7503a",
    "1.20.0": "5505e2f94d9aaa08561490db974ba3cd676af209",
}

V1_18: Version = (1, 18, 0)
V1_19: Version = (1, 19, 0)
V1_20: Version = (1, 20, 0)
