"""Options of the ``s3`` tier, parsed once from ``tiers[].options`` (see docs/shared.md#s3).

Secrets never come from here: the configuration is logged, shared and checked in, so a key in
it is refused with the reason, and the value is never repeated in an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta

from kvtier.bounds import Positive, check_bounds
from kvtier.config import ConfigStruct, parse, parse_size
from kvtier.errors import ConfigError
from kvtier.tiers.shared import SharingOptions, split_options

MiB = 1 << 20
MIN_PART = 5 * MiB
"""S3's smallest part of a multipart upload (all but the last)."""

EXPECT_WAIT_S = 1.0
"""How long botocore waits for "100 Continue" before it sends a PUT's body anyway."""

SECRET_KEYS = frozenset({
    "access_key", "secret_key", "access_key_id", "secret_access_key", "session_token",
    "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "secret", "password",
})
SIZE_KEYS = ("multipart_threshold", "multipart_part_size")

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX = re.compile(r"([A-Za-z0-9_.-]+/)*")
_SCHEME = re.compile(r"([a-z][a-z0-9+.-]*)://(.*)", re.IGNORECASE)


@dataclass(frozen=True)
class CredentialSource:
    """Where the tier's keys come from: ``env``, ``profile:NAME`` or ``file:PATH``."""

    kind: Literal["env", "profile", "file"]
    value: str = ""

    @classmethod
    def parse(cls, text: str) -> CredentialSource:
        kind, sep, value = text.partition(":")
        if text == "env":
            return cls("env")
        if sep and value and kind in ("profile", "file"):
            return cls("profile" if kind == "profile" else "file", value)
        # the value is not echoed: someone may have pasted a key here
        raise ConfigError("credentials: expected env, profile:NAME or file:PATH")

    def __str__(self) -> str:
        return self.kind if self.kind == "env" else f"{self.kind}:{self.value}"


class S3Options(ConfigStruct, frozen=True):
    bucket: str
    prefix: str = "kvtier/"
    """Every object of the tier is under this key prefix (``""`` or ending in ``/``)."""
    endpoint_url: str | None = None
    """``https://host:port`` (or ``host:port``, the scheme following ``tls``); unset: AWS."""
    region: str | None = None
    addressing: Literal["path", "virtual", "auto"] = "auto"
    tls: bool = True
    ca_bundle: str | None = None
    """A PEM file of the CAs that sign the endpoint's certificate (default: the system's)."""
    credentials: str = "env"
    max_connections: Annotated[int, Meta(ge=1, le=256)] = 16
    """Pooled connections, and the most transfers of this tier in flight at once."""
    connect_timeout_s: Positive = 2.0
    read_timeout_s: Positive = 5.0
    """Longest wait for any one socket read, a response's first byte included."""
    retries: Annotated[int, Meta(ge=0, le=10)] = 2
    """Attempts after the first one (botocore ``standard`` mode, jittered backoff)."""
    multipart_threshold: int = 64 * MiB
    multipart_part_size: int = 16 * MiB
    create_bucket: bool = False

    def __post_init__(self) -> None:
        check_bounds(self)
        if not _BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"bucket: {self.bucket!r} is not an S3 bucket name "
                              "(3-63 of a-z, 0-9, '.', '-')")
        if not _PREFIX.fullmatch(self.prefix):
            raise ConfigError(f"prefix: {self.prefix!r}: '' or '/'-separated parts of "
                              "letters, digits, '_', '.', '-', ending in '/'")
        if self.endpoint_url is not None:
            self._check_endpoint(self.endpoint_url)
        if self.ca_bundle is not None and not self.tls:
            raise ConfigError("ca_bundle: only used with tls: true")
        CredentialSource.parse(self.credentials)
        if self.multipart_part_size < MIN_PART:
            raise ConfigError("multipart_part_size must be at least 5MiB (S3's smallest part)")
        if self.multipart_threshold < self.multipart_part_size:
            raise ConfigError("multipart_threshold must be at least multipart_part_size")

    def _check_endpoint(self, url: str) -> None:
        match = _SCHEME.fullmatch(url)
        scheme, rest = (match[1].lower(), match[2]) if match else ("", url)
        if scheme not in ("", "http", "https"):
            raise ConfigError(f"endpoint_url: scheme {scheme!r}; allowed: http, https")
        if "@" in rest.split("/", 1)[0]:
            raise ConfigError("endpoint_url: no user or password in the URL; see credentials")
        if not rest or rest.startswith("/"):
            raise ConfigError(f"endpoint_url: {url!r} names no host")
        if scheme and (scheme == "https") != self.tls:
            raise ConfigError(f"endpoint_url: {scheme}:// but tls is {str(self.tls).lower()}; "
                              "make them agree (or give host:port alone)")

    @property
    def endpoint(self) -> str | None:
        """``endpoint_url`` with the scheme ``tls`` implies."""
        if self.endpoint_url is None or _SCHEME.fullmatch(self.endpoint_url):
            return self.endpoint_url
        return f"{'https' if self.tls else 'http'}://{self.endpoint_url}"

    @property
    def credential_source(self) -> CredentialSource:
        return CredentialSource.parse(self.credentials)

    @property
    def worst_case_s(self) -> float:
        """About the longest one request takes to fail against a hung server: every attempt
        waiting out the connect timeout, botocore's fixed 1 s for a PUT's "100 Continue"
        and the read timeout, plus the backoff between attempts (50 ms x 2^i at most)."""
        backoff = sum(min(0.05 * 2**i, 20.0) for i in range(self.retries))
        attempt = self.connect_timeout_s + EXPECT_WAIT_S + self.read_timeout_s
        return (self.retries + 1) * attempt + backoff


def parse_s3_options(options: Mapping[str, Any], where: str
                     ) -> tuple[S3Options, SharingOptions]:
    """The tier's own options and the sharing keys; a key holding a secret is refused."""
    for key in options:
        if str(key).lower() in SECRET_KEYS:
            raise ConfigError(
                f"{where}.{key}: S3 keys are never read from the configuration (it gets "
                "logged, shared and checked in); use credentials: env (AWS_* variables or "
                "the default chain), profile:NAME or file:PATH")
    own, sharing = split_options(options, where)
    for key in SIZE_KEYS:
        if key in own:
            own[key] = parse_size(own[key], f"{where}.{key}")
    return parse(S3Options, own, where), sharing
