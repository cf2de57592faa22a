"""S3 credentials for the ``s3`` tier: from the environment, a profile or a key file.

``file:PATH`` reads one of two formats (docs/shared.md#s3):

- an AWS shared-credentials file: an INI ``[default]`` section (or the file's only section)
  with ``aws_access_key_id``, ``aws_secret_access_key`` and optionally ``aws_session_token``;
- a key file of ``NAME=VALUE`` lines: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
  optionally ``AWS_SESSION_TOKEN``; blank lines and ``#`` comments are ignored.

The file is read once, when the tier starts. No error raised here contains a line of it.
"""

from __future__ import annotations

import configparser
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError

from kvtier.errors import ConfigError
from kvtier.tiers.s3_options import CredentialSource

log = logging.getLogger("kvtier.tiers")

_INI_NAMES = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_ENV_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@dataclass(frozen=True)
class Keys:
    access_key: str
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def session_kwargs(self) -> dict[str, Any]:
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key,
                "aws_session_token": self.session_token}


def read_key_file(path: str, where: str) -> Keys:
    """The keys in ``path`` (either format above); ConfigError naming the file, never its
    contents."""
    try:
        text = _read_private(path)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the key file {path!r}: {exc.strerror}") from None
    first = next((ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.strip().startswith(("#", ";"))), "")
    values = _ini_values(text, path, where) if first.startswith("[") else _env_values(text)
    access, secret, token = values
    if not access or not secret:
        raise ConfigError(f"{where}: the key file {path!r} lacks an access key id or a secret "
                          "access key (see docs/shared.md#s3 for its format)")
    return Keys(access, secret, token or None)


def _read_private(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("s3 key file %s is readable by others (mode %o); chmod 600 it",
                        path, stat.S_IMODE(mode))
        return f.read()


def _ini_values(text: str, path: str, where: str) -> tuple[str, str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error:
        # its message quotes the offending line, which may hold a secret
        raise ConfigError(f"{where}: the key file {path!r} is not a valid INI file") from None
    sections = parser.sections()
    name = "default" if "default" in sections else (sections[0] if len(sections) == 1 else "")
    if not name:
        raise ConfigError(f"{where}: the key file {path!r} has several sections and no "
                          "[default]")
    section = parser[name]
    return (section.get(_INI_NAMES[0], ""), section.get(_INI_NAMES[1], ""),
            section.get(_INI_NAMES[2], ""))


def _env_values(text: str) -> tuple[str, str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() in _ENV_NAMES:
            found[name.strip()] = value.strip().strip("'\"")
    return (found.get(_ENV_NAMES[0], ""), found.get(_ENV_NAMES[1], ""),
            found.get(_ENV_NAMES[2], ""))


def make_session(source: CredentialSource, where: str) -> Any:
    """A boto3 session whose credentials come from ``source``."""
    try:
        if source.kind == "profile":
            return boto3.Session(profile_name=source.value)
        if source.kind == "file":
            return boto3.Session(**read_key_file(source.value, where).session_kwargs())
        return boto3.Session()
    except BotoCoreError as exc:  # ProfileNotFound, a broken config file: no secrets in these
        raise ConfigError(f"{where}: {source}: {exc}") from exc
