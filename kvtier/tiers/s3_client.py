"""The boto3 client of an ``s3`` tier, built once from its options.

One pooled client per tier (boto3 clients are thread safe): ``max_connections`` connections,
connect and read timeouts, botocore's ``standard`` retry mode (jittered exponential backoff, a
retry quota that stops retrying when most calls fail), path or virtual-host addressing, TLS
with the system's or a given CA bundle. S3's own checksums are off unless an operation
requires them: the store verifies every chunk it reads with the chunk's own checksum, so a
CRC over each body on both sides would cost CPU and catch nothing more.
"""

from __future__ import annotations

import os
from typing import Any

from botocore.config import Config

from kvtier.errors import ConfigError
from kvtier.tiers.s3_credentials import make_session
from kvtier.tiers.s3_options import S3Options


def make_client(options: S3Options, where: str) -> Any:
    if options.ca_bundle is not None and not os.access(options.ca_bundle, os.R_OK):
        raise ConfigError(f"{where}.ca_bundle: cannot read {options.ca_bundle!r}")
    session = make_session(options.credential_source, f"{where}.credentials")
    config = Config(
        region_name=options.region or session.region_name or "us-east-1",
        s3={"addressing_style": options.addressing},
        max_pool_connections=options.max_connections,
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": options.retries + 1},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    verify: str | bool = options.ca_bundle if options.ca_bundle is not None else True
    try:
        return session.client("s3", endpoint_url=options.endpoint, use_ssl=options.tls,
                              verify=verify, config=config)
    except ValueError as exc:  # botocore: "Invalid endpoint: ..."
        raise ConfigError(f"{where}.endpoint_url: {exc}") from exc
