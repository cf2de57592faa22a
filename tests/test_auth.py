"""The one reader of secret files (kvtier.auth.read_private_file) and the cluster secret's
sources: hostile files are refused with the path and the problem, never the content."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.auth import load_keyring, read_private_file, read_secrets
from kvtier.errors import ConfigError

SECRET = b"a-cluster-secret-0123456789abcdef"


def private(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_an_owner_only_file_is_read_with_its_privacy(tmp_path: Path) -> None:
    assert read_private_file(private(tmp_path / "s", SECRET), "x") == (SECRET, True)
    shared = private(tmp_path / "t", b"tenants: {}", 0o644)
    assert read_private_file(shared, "--tenants-file", owner_only=False) == (b"tenants: {}",
                                                                             False)


def test_a_file_others_may_read_is_refused_without_its_content(tmp_path: Path) -> None:
    path = private(tmp_path / "s", SECRET, 0o640)
    with pytest.raises(ConfigError, match=r"the thing: .* readable by others \(mode 0640\)"
                       r"; chmod 600") as refused:
        read_private_file(path, "the thing")
    assert SECRET.decode() not in str(refused.value)


def test_links_fifos_folders_and_huge_files_are_refused(tmp_path: Path) -> None:
    target = private(tmp_path / "real", SECRET)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ConfigError, match="cannot open"):
        read_private_file(str(tmp_path / "link"), "x")  # never through a link
    os.mkfifo(tmp_path / "fifo", 0o600)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        read_private_file(str(tmp_path / "fifo"), "x")  # no writer: a blocking open would hang
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match=r"not a regular file|cannot open"):
        read_private_file(str(tmp_path), "x")
    big = private(tmp_path / "big", b"x" * 100)
    with pytest.raises(ConfigError, match="larger than 64 bytes"):
        read_private_file(big, "x", 64)


def test_the_secret_file_needs_a_secret_and_gives_a_keyring(tmp_path: Path) -> None:
    empty = private(tmp_path / "empty", b"# only a comment\n\n")
    with pytest.raises(ConfigError, match="holds no secret"):
        read_secrets(None, empty)
    rotated = private(tmp_path / "rotated", SECRET + b"\n# old one:\n" + SECRET[::-1] + b"\n")
    assert read_secrets(None, rotated) == [SECRET, SECRET[::-1]]
    assert load_keyring(None, rotated) is not None
    assert load_keyring(None, None, environ={}) is None
