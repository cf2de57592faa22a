"""The s3 tier against SeaweedFS servers of the tests' own: virtual-host and path addressing,
TLS with a custom CA, and outages (stopped, paused) that must fail within the configured
timeouts and heal when the server is back."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import TierIOError, TierTimeout
from kvtier.services import SeaweedFS
from kvtier.tiers.s3 import S3Tier

from .conformance import NAMESPACE, key_of, read_back, sealed_chunk
from .s3_helpers import key_file, make_certificates, s3_tier

pytestmark = pytest.mark.services
MakeWeed = Callable[..., SeaweedFS]


def requested_urls(tier: S3Tier) -> list[str]:
    urls: list[str] = []
    tier._client.meta.events.register("before-send",
                                      lambda request, **_: urls.append(request.url))
    return urls


def round_trip(tier: S3Tier, label: str) -> None:
    key = key_of(label)
    data = sealed_chunk(key)
    tier.write(key, data)
    assert read_back(tier, key, len(data)) == data
    assert [c.key for c in tier.scan()] == [key]


def test_virtual_host_addressing_with_bucket_dns_faked(
        make_seaweedfs: MakeWeed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SeaweedFS serves ``<bucket>.localhost`` with -s3.domainName=localhost; only the name
    lookup is faked (this machine resolves no ``*.localhost``), the requests are real."""
    weed = make_seaweedfs(extra_args=["-s3.domainName=localhost"])
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        local = isinstance(host, str) and host.endswith(".localhost")
        return real("127.0.0.1" if local else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    endpoint = f"http://localhost:{weed.ports.s3}"
    keys = key_file(tmp_path, weed.credentials)
    virtual = s3_tier(endpoint, "bucket-v", keys, addressing="virtual", create_bucket=True)
    urls = requested_urls(virtual)
    round_trip(virtual, "virtual host")
    assert urls and all(u.startswith(f"http://bucket-v.localhost:{weed.ports.s3}/")
                        for u in urls)
    path = s3_tier(endpoint, "bucket-v", keys, addressing="path", prefix="path/")
    urls = requested_urls(path)
    round_trip(path, "path style")
    assert urls and all(u.startswith(f"{endpoint}/bucket-v") for u in urls)
    for tier in (virtual, path):
        tier.close()


def test_tls_with_a_custom_ca_bundle(make_seaweedfs: MakeWeed, tmp_path: Path) -> None:
    ca, cert, key = make_certificates(tmp_path / "pki", ["127.0.0.1", "localhost"])
    weed = make_seaweedfs(extra_args=[f"-s3.cert.file={cert}", f"-s3.key.file={key}"])
    endpoint = f"https://127.0.0.1:{weed.ports.s3}"
    keys = key_file(tmp_path, weed.credentials)
    tier = s3_tier(endpoint, "bucket-tls", keys, ca_bundle=str(ca), create_bucket=True)
    round_trip(tier, "over TLS")
    assert tier.describe()["tls"] is True and tier.describe()["endpoint"] == endpoint
    untrusted = s3_tier(endpoint, "bucket-tls", keys, retries=0)  # the system's CAs only
    with pytest.raises(TierIOError, match=r"TLS failed.*CERTIFICATE_VERIFY_FAILED"):
        untrusted.read_into(key_of("over TLS"), memoryview(bytearray(1 << 16)),
                            namespace=NAMESPACE)
    plain = s3_tier(f"http://127.0.0.1:{weed.ports.s3}", "bucket-tls", keys, retries=0)
    with pytest.raises(TierIOError):
        plain.get_note("servers/x")
    for t in (tier, untrusted, plain):
        t.close()


HEAL_S = 20.0
"""A restarted weed answers S3 a moment before its volume server has registered again: reads
fail (HTTP 500, a TierIOError) until it has; the tier heals without being reopened."""


def healed(call: Callable[[], bytes]) -> bytes:
    deadline = time.monotonic() + HEAL_S
    while True:
        try:
            return call()
        except TierIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def test_outages_fail_within_the_timeouts_and_heal(make_seaweedfs: MakeWeed,
                                                   tmp_path: Path) -> None:
    weed = make_seaweedfs()
    tier = s3_tier(weed.endpoint, "bucket-out", key_file(tmp_path, weed.credentials),
                   create_bucket=True, connect_timeout_s=0.5, read_timeout_s=0.5, retries=1)
    bound = tier.options.worst_case_s + 1.0  # 2 attempts x (0.5 + 1 + 0.5) s + backoff, + slack
    key = key_of("survives outages")
    data = sealed_chunk(key)
    tier.write(key, data)
    calls: dict[str, Callable[[], object]] = {
        "write": lambda: tier.write(key, data),
        "read": lambda: tier.read_into(key, memoryview(bytearray(len(data))),
                                       namespace=NAMESPACE),
        "scan": lambda: list(tier.scan()),
        "note": lambda: tier.put_note("servers/a", b"alive"),
    }

    def all_fail(expected: type[TierIOError]) -> list[float]:
        took = []
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(expected):
                call()
            took.append(time.monotonic() - start)
            assert took[-1] < bound, f"{name} took {took[-1]:.1f} s, bound {bound:.1f} s"
        return took

    weed.stop()  # refused at once: no timeout to wait for
    all_fail(TierIOError)
    weed.start()
    assert healed(lambda: read_back(tier, key, len(data))) == data, "back, with its data"
    weed.pause()  # accepts, never answers: the read timeout decides
    try:
        took = all_fail(TierTimeout)
    finally:
        weed.resume()
    assert min(took) >= tier.options.read_timeout_s, "it waited for the server's answer"
    assert healed(lambda: read_back(tier, key, len(data))) == data
    tier.put_note("servers/a", b"alive")
    assert tier.get_note("servers/a") == b"alive"
    tier.close()
