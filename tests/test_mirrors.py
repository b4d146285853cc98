"""tests/mirrors.py: the Debian archive and security URIs read from apt's source files."""

from __future__ import annotations

from pathlib import Path

import pytest

import mirrors
from mirrors import Source

DEB822 = """\
# The machine's own Debian sources.
Types: deb
# a note about the mirror
URIs: http://mirror-a.example/debian/ http://mirror-b.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

# Sources only: not a place to download binaries from.
Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mQINBGOZ
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
Enabled: no
URIs: http://disabled.example/debian
Suites: trixie
"""

ONE_LINE = """\
# deb http://commented.example/debian bookworm main
deb [signed-by=/usr/share/keyrings/x.gpg arch=amd64] http://vendor.example/apt stable main
deb-src http://src.example/debian bookworm main
deb [ signed-by=/k.gpg ] http://mirror.example/debian/ trixie main non-free
deb http://mirror.example/debian-security trixie-security main  # security
"""


def test_deb822_stanzas_uris_and_comments() -> None:
    assert mirrors.parse_deb822(DEB822) == [
        Source("http://mirror-a.example/debian", ("bookworm", "bookworm-updates")),
        Source("http://mirror-b.example/debian", ("bookworm", "bookworm-updates")),
        Source("http://security.example/debian-security", ("bookworm-security",)),
    ]
    sources = mirrors.parse_deb822(DEB822)
    assert mirrors.archive_uri(sources) == "http://mirror-a.example/debian"
    assert mirrors.security_uri(sources) == "http://security.example/debian-security"


def test_one_line_entries_with_options() -> None:
    sources = mirrors.parse_one_line(ONE_LINE)
    assert sources == [
        Source("http://vendor.example/apt", ("stable",)),
        Source("http://mirror.example/debian", ("trixie",)),
        Source("http://mirror.example/debian-security", ("trixie-security",)),
    ]
    # The vendor's plain "stable" comes first, but only trixie has a -security entry.
    assert mirrors.archive_uri(sources) == "http://mirror.example/debian"
    assert mirrors.security_uri(sources) == "http://mirror.example/debian-security"


def test_no_entries() -> None:
    assert mirrors.parse_deb822("") == []
    assert mirrors.parse_deb822("# nothing here\n\n") == []
    assert mirrors.parse_one_line("# deb http://x.example/debian bookworm main\n") == []
    assert mirrors.archive_uri([]) is None
    assert mirrors.security_uri([]) is None
    only_updates = [Source("http://x.example/debian", ("bookworm-updates",))]
    assert mirrors.archive_uri(only_updates) is None
    assert mirrors.security_uri(only_updates) is None


def test_plain_release_without_security_entry() -> None:
    sources = [Source("http://x.example/debian", ("sid",))]
    assert mirrors.archive_uri(sources) == "http://x.example/debian"


def test_read_sources_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mirrors.ARCHIVE_ENV, raising=False)
    monkeypatch.delenv(mirrors.SECURITY_ENV, raising=False)
    (tmp_path / "sources.list.d").mkdir()
    with pytest.raises(mirrors.MirrorNotFound, match=mirrors.ARCHIVE_ENV):
        mirrors.debian_archive(etc=tmp_path)
    with pytest.raises(mirrors.MirrorNotFound, match=mirrors.SECURITY_ENV):
        mirrors.debian_security(etc=tmp_path)
    (tmp_path / "sources.list").write_text("# empty\n")
    (tmp_path / "sources.list.d/debian.sources").write_text(DEB822)
    (tmp_path / "sources.list.d/vendor.list").write_text(ONE_LINE)
    (tmp_path / "sources.list.d/old.list.disabled").write_text("deb http://no.example/d sid main\n")
    assert [s.uri for s in mirrors.read_sources(tmp_path)] == [
        "http://mirror-a.example/debian",
        "http://mirror-b.example/debian",
        "http://security.example/debian-security",
        "http://vendor.example/apt",
        "http://mirror.example/debian",
        "http://mirror.example/debian-security",
    ]
    assert mirrors.debian_archive(etc=tmp_path) == "http://mirror-a.example/debian"
    assert mirrors.debian_security(etc=tmp_path) == "http://security.example/debian-security"


def test_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mirrors.ARCHIVE_ENV, "http://env.example/debian/")
    monkeypatch.setenv(mirrors.SECURITY_ENV, "http://env.example/debian-security")
    assert mirrors.debian_archive(etc=tmp_path) == "http://env.example/debian"
    assert mirrors.debian_security(etc=tmp_path) == "http://env.example/debian-security"
    # Callers may name their own variables, first set one wins.
    monkeypatch.setenv("OTHER_MIRROR", "http://other.example/debian")
    assert mirrors.debian_archive("OTHER_MIRROR", mirrors.ARCHIVE_ENV,
                                  etc=tmp_path) == "http://other.example/debian"
    monkeypatch.delenv("OTHER_MIRROR")
    assert mirrors.debian_archive("OTHER_MIRROR", mirrors.ARCHIVE_ENV,
                                  etc=tmp_path) == "http://env.example/debian"
    monkeypatch.delenv(mirrors.ARCHIVE_ENV)
    with pytest.raises(mirrors.MirrorNotFound, match="OTHER_MIRROR or UNB_DEBIAN_MIRROR"):
        mirrors.debian_archive("OTHER_MIRROR", mirrors.ARCHIVE_ENV, etc=tmp_path)
