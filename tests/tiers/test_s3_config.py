"""The s3 tier's options and credentials: every bad value named, keys never taken from the
config, and no secret in describe(), in a repr, in a log line or in an error, even when the
server refuses a wrong one (checked against the real SeaweedFS)."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import Bucket

from kvtier.config import TierConfig
from kvtier.errors import ConfigError, TierIOError
from kvtier.tiers import TIERS
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3_credentials import Keys, read_key_file

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .s3_helpers import key_file, s3_tier, tier_config

WRONG = "wrong-secret-0123456789abcdef"


def build(**options: Any) -> S3Tier:
    """A tier on a made-up endpoint: building one makes no request."""
    tier = S3Tier.from_config("shared", tier_config(
        {"bucket": "kvtier-test", "endpoint_url": "http://127.0.0.1:9", "tls": False,
         **options}))
    assert isinstance(tier, S3Tier)
    return tier


def everything_said(exc: BaseException, caplog: pytest.LogCaptureFixture) -> str:
    """The error with its whole chain (as a traceback prints it) and every log line."""
    return "".join(traceback.format_exception(exc)) + "\n".join(
        f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


def test_the_s3_tier_is_registered() -> None:
    assert TIERS["s3"] is S3Tier


@pytest.mark.parametrize(("options", "message"), [
    ({"buckett": "x"}, r"shared\.options\.buckett: unknown key; allowed: addressing, bucket"),
    ({"addressing": "dns"}, r"addressing: got 'dns'; allowed: path, virtual, auto"),
    ({"bucket": "Not_A_Bucket"}, r"shared\.options\.bucket: 'Not_A_Bucket' is not an S3"),
    ({"prefix": "/abs/"}, r"prefix: '/abs/'"),
    ({"prefix": "no-slash"}, r"prefix: 'no-slash'"),
    ({"retries": 11}, r"retries must be in \[0, 10\]"),
    ({"max_connections": 0}, r"max_connections must be in \[1, 256\]"),
    ({"read_timeout_s": 0}, r"read_timeout_s must be positive"),
    ({"multipart_part_size": "1MiB"}, r"at least 5MiB"),
    ({"multipart_threshold": "8MiB", "multipart_part_size": "16MiB"},
     r"multipart_threshold must be at least multipart_part_size"),
    ({"multipart_threshold": "lots"}, r"multipart_threshold: expected a size"),
    ({"endpoint_url": "ftp://host"}, r"endpoint_url: scheme 'ftp'"),
    ({"endpoint_url": "https://host:443", "tls": False}, r"https:// but tls is false"),
    ({"endpoint_url": "http://host:80", "tls": True}, r"http:// but tls is true"),
    ({"endpoint_url": "http://user:pw@host"}, r"no user or password in the URL"),
    ({"ca_bundle": "/etc/hostname"}, r"ca_bundle: only used with tls: true"),
    ({"credentials": "vault"}, r"credentials: expected env, profile:NAME or file:PATH"),
    ({"poll_s": 0}, r"poll_s must be positive"),
])
def test_bad_options_name_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(**options)


def test_options_parse_sizes_endpoints_and_sharing_keys() -> None:
    tier = build(multipart_threshold="128MiB", endpoint_url="127.0.0.1:9", tls=False,
                 namespace_bytes="1GiB", poll_s=0.25)
    assert tier.options.multipart_threshold == 128 << 20
    assert tier.options.endpoint == "http://127.0.0.1:9"
    assert build(endpoint_url="s3.example:443", tls=True).options.endpoint == (
        "https://s3.example:443")
    assert tier.sharing.namespace_bytes == 1 << 30 and tier.sharing.poll_s == 0.25
    assert tier.options.worst_case_s == pytest.approx(3 * (2.0 + 1.0 + 5.0) + 0.05 + 0.1)


def test_an_io_timeout_shorter_than_a_failing_call_is_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    options = {"bucket": "kvtier-test", "endpoint_url": "http://127.0.0.1:9", "tls": False}
    with caplog.at_level(logging.WARNING, "kvtier.tiers"):
        S3Tier.from_config("shared", TierConfig(type="s3", name="shared", capacity_bytes=1,
                                                io_timeout_s=5, options=options))
    assert any("io_timeout_s 5.0 s is shorter" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvtier.tiers"):
        build()  # the defaults: 24 s at worst, under the store's 30 s
    assert caplog.records == []


def test_a_custom_ca_bundle_must_be_readable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ca_bundle: cannot read '.*missing\.pem'"):
        build(endpoint_url="https://127.0.0.1:9", tls=True,
              ca_bundle=str(tmp_path / "missing.pem"))
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    tier = build(endpoint_url="https://127.0.0.1:9", tls=True, ca_bundle=str(ca))
    assert tier.describe()["ca_bundle"] == str(ca) and tier.describe()["tls"] is True


@pytest.mark.parametrize("name", ["secret_key", "access_key", "aws_secret_access_key",
                                  "session_token", "Secret_Key"])
def test_keys_in_the_config_are_refused_and_never_repeated(name: str) -> None:
    with pytest.raises(ConfigError, match="never read from the configuration") as caught:
        build(**{name: WRONG})
    assert WRONG not in "".join(traceback.format_exception(caught.value))
    assert "credentials: env" in str(caught.value)


def test_a_key_pasted_as_the_credentials_source_is_not_repeated() -> None:
    with pytest.raises(ConfigError, match="credentials") as caught:
        build(credentials=f"AKIAEXAMPLE:{WRONG}")
    assert WRONG not in "".join(traceback.format_exception(caught.value))


def test_key_files_in_both_formats(tmp_path: Path) -> None:
    env_style = tmp_path / "env.keys"
    env_style.write_text(f"# keys\n\nAWS_ACCESS_KEY_ID=AKIDEXAMPLE\n"
                         f"AWS_SECRET_ACCESS_KEY='{WRONG}'\nAWS_SESSION_TOKEN=tok\n")
    ini = tmp_path / "credentials"
    ini.write_text(f"[other]\naws_access_key_id = X\naws_secret_access_key = Y\n\n"
                   f"[default]\naws_access_key_id = AKIDEXAMPLE\naws_secret_access_key = {WRONG}\n")
    for path in (env_style, ini):
        keys = read_key_file(str(path), "here")
        assert (keys.access_key, keys.secret_key) == ("AKIDEXAMPLE", WRONG)
        assert WRONG not in repr(keys)
    assert read_key_file(str(env_style), "here").session_token == "tok"
    assert repr(Keys("a", WRONG, "tok")) == "Keys(access_key='a')"


def test_bad_key_files_are_named_but_never_quoted(tmp_path: Path) -> None:
    broken = tmp_path / "broken.ini"
    broken.write_text(f"[default]\naws_secret_access_key {WRONG}\n[unclosed\n")
    no_secret = tmp_path / "no-secret.keys"
    no_secret.write_text("AWS_ACCESS_KEY_ID=AKIDEXAMPLE\n")
    several = tmp_path / "several.ini"
    several.write_text("[a]\naws_access_key_id=x\n[b]\naws_access_key_id=y\n")
    cases = [(broken, "is not a valid INI file"), (no_secret, "lacks an access key id or a "
             "secret"), (several, "several sections and no"),
             (tmp_path / "missing", "cannot read the key file")]
    for path, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            build(credentials=f"file:{path}")
        assert str(path) in str(caught.value)
        assert WRONG not in "".join(traceback.format_exception(caught.value))


def test_an_unknown_profile_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=r"credentials: profile:nosuch: .*nosuch"):
        build(credentials="profile:nosuch")


def test_a_readable_key_file_is_warned_about(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "open.keys"
    path.write_text(f"AWS_ACCESS_KEY_ID=a\nAWS_SECRET_ACCESS_KEY={WRONG}\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, "kvtier.tiers"):
        build(credentials=f"file:{path}")
    assert any("readable by others" in r.getMessage() for r in caplog.records)
    assert all(WRONG not in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- against SeaweedFS


@pytest.mark.services
def test_every_credential_source_works(s3_bucket: Bucket, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    creds = s3_bucket.credentials
    ini = key_file(tmp_path / "ini", creds, ini=True)
    profiles = tmp_path / "aws-credentials"
    profiles.write_text(f"[kvtier-test]\naws_access_key_id = {creds.access_key}\n"
                        f"aws_secret_access_key = {creds.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(profiles))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    sources = {"file-ini": {"credentials": f"file:{ini}"},
               "profile": {"credentials": "profile:kvtier-test"}}
    for label, options in sources.items():
        tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, None, **options)
        tier.put_note(f"servers/{label}", label.encode())
        assert tier.get_note(f"servers/{label}") == label.encode()
        assert tier.describe()["credentials"] == options["credentials"]
        tier.close()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret_key)
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, None)  # credentials: env
    key = key_of("keys from the environment")
    data = sealed_chunk(key)
    tier.write(key, data)
    assert read_back(tier, key, len(data)) == data
    assert tier.describe()["credentials"] == "env"
    tier.close()


@pytest.mark.services
@pytest.mark.parametrize("wrong", ["secret", "access key", "secret in the environment"])
def test_wrong_credentials_are_a_clear_error_that_leaks_nothing(
        s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    creds = s3_bucket.credentials
    keys: Path | None = None
    if wrong == "secret":
        keys = key_file(tmp_path, creds, secret=WRONG)
    elif wrong == "access key":
        keys = key_file(tmp_path, creds, access_key="nobody")
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG)
    caplog.set_level(logging.DEBUG)  # botocore and urllib3 at their most talkative
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys, retries=0)
    key = key_of("refused")
    calls = [lambda: tier.write(key, sealed_chunk(key)), lambda: list(tier.scan()),
             lambda: tier.get_note("servers/x"),
             lambda: tier.read_into(key, page_buffer(1 << 16), namespace=NAMESPACE)]
    code = "InvalidAccessKeyId" if wrong == "access key" else "SignatureDoesNotMatch"
    source = "env" if keys is None else "file:"
    for call in calls:
        with pytest.raises(TierIOError, match=f"refused the credentials from {source}.*{code}"
                           ) as caught:
            call()
        said = everything_said(caught.value, caplog)
        assert WRONG not in said and creds.secret_key not in said
    assert caplog.records, "DEBUG logging was captured"
    facts = repr(tier.describe()) + repr(tier.options)
    assert WRONG not in facts and creds.secret_key not in facts
    tier.close()


@pytest.mark.services
def test_no_credentials_at_all(s3_bucket: Bucket, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, None)
    with pytest.raises(TierIOError, match="no usable S3 credentials from env"):
        tier.get_note("servers/x")
    tier.close()


@pytest.mark.services
def test_a_missing_bucket_is_named_or_created(s3_bucket: Bucket, tmp_path: Path) -> None:
    keys = key_file(tmp_path, s3_bucket.credentials)
    name = f"{s3_bucket.name}-made"
    tier = s3_tier(s3_bucket.endpoint, name, keys)
    # (reads and lists: SeaweedFS creates a missing bucket on an admin's first PUT)
    for call in (lambda: tier.get_note("servers/x"), lambda: list(tier.scan())):
        with pytest.raises(TierIOError, match=f"bucket '{name}' does not exist.*create_b"):
            call()
    made = s3_tier(s3_bucket.endpoint, name, keys, create_bucket=True)
    try:
        made.put_note("servers/x", b"x")
        assert tier.get_note("servers/x") == b"x"
        again = s3_tier(s3_bucket.endpoint, name, keys, create_bucket=True)  # already there
        assert again.list_notes("servers/") == ["servers/x"]
        again.close()
    finally:
        made.delete_note("servers/x")
        s3_bucket.client().delete_bucket(Bucket=name)
        made.close()
        tier.close()
