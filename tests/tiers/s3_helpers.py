"""Building s3 tiers on the test SeaweedFS: a key file (the tier never takes a key in its
config) and the tier's options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import TierConfig
from kvtier.services import S3Credentials
from kvtier.tiers.s3 import S3Tier


def key_file(folder: Path, credentials: S3Credentials, *, secret: str | None = None,
             access_key: str | None = None, ini: bool = False) -> Path:
    """A mode-0600 key file for ``credentials`` (``secret``/``access_key`` override them)."""
    access = access_key or credentials.access_key
    secret = secret or credentials.secret_key
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("credentials.ini" if ini else "s3.keys")
    text = (f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n"
            if ini else
            f"# kvtier test keys\nAWS_ACCESS_KEY_ID={access}\nAWS_SECRET_ACCESS_KEY={secret}\n")
    path.write_text(text)
    path.chmod(0o600)
    return path


def tier_config(options: dict[str, Any], name: str = "shared") -> TierConfig:
    return TierConfig(type="s3", name=name, capacity_bytes=1 << 30, options=options)


def s3_tier(endpoint: str, bucket: str, keys: Path | None, name: str = "shared",
            **options: Any) -> S3Tier:
    base: dict[str, Any] = {"bucket": bucket, "endpoint_url": endpoint,
                            "tls": endpoint.startswith("https:")}
    if keys is not None:
        base["credentials"] = f"file:{keys}"
    tier = S3Tier.from_config(name, tier_config({**base, **options}, name))
    assert isinstance(tier, S3Tier)
    return tier


def peer_of(tier: S3Tier, name: str = "peer") -> S3Tier:
    """A second tier object on the same bucket and prefix: another server."""
    peer = S3Tier.from_config(name, tier_config(dict(tier.config.options), name))
    assert isinstance(peer, S3Tier)
    return peer


def make_certificates(folder: Path, hosts: list[str]) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signs for ``hosts`` (IPs or names), made
    with the openssl command: (ca.pem, server.pem, server.key)."""
    import ipaddress
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr = folder / "server.pem", folder / "server.key", folder / "server.csr"
    names = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            names.append(f"IP:{host}")
        except ValueError:
            names.append(f"DNS:{host}")
    ext = folder / "ext.cnf"
    ext.write_text(f"subjectAltName={','.join(names)}\nbasicConstraints=CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
         "-subj", "/CN=kvtier test CA"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={hosts[0]}"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ]
    for step in steps:
        subprocess.run(["openssl", *map(str, step)], check=True, capture_output=True,
                       timeout=30)
    return ca, cert, key
