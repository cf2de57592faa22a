"""The redis tier's logins and TLS, against a real redis-server with a password: every password
source works, a wrong one fails fast and says so, and the secret never shows anywhere."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from service_fixtures import ALLOW_MISSING

from kvtier.errors import ConfigError, TierIOError
from kvtier.ports import free_ports
from kvtier.services import RedisServer
from kvtier.tiers.redis import RedisTier

from .conformance import key_of, read_back, sealed_chunk
from .redis_helpers import redis_tier

pytestmark = pytest.mark.services
SECRET = "Hunter2-kvtier-S3cret"
WRONG = "Wrong-kvtier-Guess9"
MakeRedis = Callable[..., RedisServer]


def secret_file(tmp_path: Path, text: str = SECRET, mode: int = 0o600) -> Path:
    path = tmp_path / "redis.password"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def no_password_url(server: RedisServer) -> str:
    return f"redis://{server.host}:{server.port}/0"


def round_trip(tier: RedisTier) -> None:
    key = key_of("auth")
    data = sealed_chunk(key)
    tier.write(key, data)
    assert read_back(tier, key, len(data)) == data


def test_password_file(make_redis: MakeRedis, tmp_path: Path) -> None:
    server = make_redis(password=SECRET)
    tier = redis_tier(no_password_url(server), password_file=str(secret_file(tmp_path)))
    round_trip(tier)
    assert tier.describe()["password_source"] == "password_file"
    tier.close()


def test_a_password_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = secret_file(tmp_path, mode=0o644)
    with pytest.raises(ConfigError, match=r"shared\.options\.password_file: .*chmod 600"):
        redis_tier("redis://127.0.0.1:1/0", password_file=str(path))
    with pytest.raises(ConfigError, match="cannot open"):
        redis_tier("redis://127.0.0.1:1/0", password_file=str(tmp_path / "absent"))


def test_password_env(make_redis: MakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    server = make_redis(password=SECRET)
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", SECRET)
    tier = redis_tier(no_password_url(server), password_env="KVTIER_TEST_REDIS_PASSWORD")
    round_trip(tier)
    tier.close()
    monkeypatch.delenv("KVTIER_TEST_REDIS_PASSWORD")
    with pytest.raises(ConfigError, match="KVTIER_TEST_REDIS_PASSWORD is not set"):
        redis_tier(no_password_url(server), password_env="KVTIER_TEST_REDIS_PASSWORD")


def test_a_password_in_the_url_works_and_is_redacted(make_redis: MakeRedis) -> None:
    server = make_redis(password=SECRET)
    tier = redis_tier(server.url)  # redis://:<password>@127.0.0.1:port/0
    round_trip(tier)
    assert tier.describe()["url"] == no_password_url(server)
    assert tier.describe()["password_source"] == "url"
    tier.close()


@pytest.mark.parametrize("login", ["wrong password", "no password"])
def test_a_refused_login_fails_fast_and_clearly(make_redis: MakeRedis, tmp_path: Path,
                                                login: str) -> None:
    server = make_redis(password=SECRET)
    options = ({"password_file": str(secret_file(tmp_path, WRONG))}
               if login == "wrong password" else {})
    tier = redis_tier(no_password_url(server), **options)  # a warning, not an error: the
    key = key_of("refused")                                # store's breaker decides
    start = time.monotonic()
    with pytest.raises(TierIOError, match="refused the login") as raised:
        tier.write(key, sealed_chunk(key))
    # redis-py's own retries with backoff would take seconds
    assert time.monotonic() - start < 1.5, "no retries with backoff on a refused login"
    assert raised.value.__cause__ is not None
    tier.close()


def test_secrets_never_show(make_redis: MakeRedis, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch,
                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server = make_redis(password=SECRET)
    base = no_password_url(server)
    monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", WRONG)
    wrong_url = f"redis://:{quote(WRONG)}@{server.host}:{server.port}/0"
    shown: list[str] = []
    logins: list[tuple[str, dict[str, Any]]] = [
        (server.url, {}), (wrong_url, {}),
        (base, {"password_file": str(secret_file(tmp_path))}),
        (base, {"password_env": "KVTIER_TEST_REDIS_PASSWORD"}),
    ]
    for url, options in logins:
        tier = redis_tier(url, **options)
        shown += [repr(tier.describe()), repr(tier.options), repr(tier.endpoint),
                  repr(tier.nodes.client_for("k")),
                  repr(tier.nodes.client_for("k").connection_pool)]
        try:
            round_trip(tier)
            tier.put_note("servers/me", b"alive")
        except TierIOError as exc:
            shown += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
        tier.close()
    server.stop()
    tier = redis_tier(server.url)
    with pytest.raises(TierIOError) as down:
        round_trip(tier)
    shown += [str(down.value), "".join(traceback.format_exception(down.value))]
    tier.close()
    with pytest.raises(ConfigError) as refused:
        redis_tier(base, password=SECRET)
    shown.append(str(refused.value))
    assert "never read from the config" in str(refused.value)
    shown.append(caplog.text)
    assert caplog.text, "the tiers logged (a wrong login, Redis down)"
    for text in shown:
        assert SECRET not in text and WRONG not in text and quote(WRONG) not in text


def _self_signed(folder: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        message = "the TLS test needs the openssl command (Debian: apt-get install openssl)"
        if os.environ.get(ALLOW_MISSING) == "1":
            pytest.skip(message)
        pytest.fail(message, pytrace=False)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    return cert, key


def test_tls_with_a_ca_bundle_and_verification(make_redis: MakeRedis, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    (tls_port,) = free_ports(1)
    server = make_redis(password=SECRET, extra_config={
        "tls-port": str(tls_port), "tls-cert-file": str(cert), "tls-key-file": str(key),
        "tls-ca-cert-file": str(cert), "tls-auth-clients": "no"})
    url = f"rediss://127.0.0.1:{tls_port}/0"
    password = {"password_file": str(secret_file(tmp_path))}
    tier = redis_tier(url, ca_bundle=str(cert), **password)
    round_trip(tier)
    assert tier.describe()["tls"] is True
    tier.close()
    untrusted = redis_tier(url, **password)  # the system's CAs do not know this one
    with pytest.raises(TierIOError, match="certificate verify failed"):
        round_trip(untrusted)
    untrusted.close()
    unverified = redis_tier(url, verify=False, **password)
    round_trip(unverified)
    unverified.close()
    with pytest.raises(ConfigError, match="only for TLS"):
        redis_tier(no_password_url(server), ca_bundle=str(cert))


def test_an_acl_user_who_may_not_run_config(make_redis: MakeRedis, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A managed service's usual user: its own keys only, no CONFIG (a @dangerous command)."""
    caplog.set_level(logging.INFO, "kvtier.tiers.redis")
    server = make_redis(password=WRONG, extra_config={
        "user": f"kvuser on >{SECRET} ~kvtier:* &* +@all -@dangerous"})
    tier = redis_tier(no_password_url(server), username="kvuser",
                      password_file=str(secret_file(tmp_path)))
    round_trip(tier)
    assert tier.describe()["maxmemory_policy"] is None
    assert "CONFIG GET refused" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    tier.close()
    outside = redis_tier(no_password_url(server), username="kvuser", key_prefix="other:",
                         password_file=str(secret_file(tmp_path)))
    with pytest.raises(TierIOError, match="refused the login or the command"):
        round_trip(outside)  # NOPERM: keys outside its pattern
    outside.close()
