"""SeaweedFS's S3 gateway, driven with boto3 the way the s3 tier will drive it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from service_fixtures import Bucket

from kvtier.errors import ServiceStartError
from kvtier.services import SeaweedFS

from .procnet import listening

pytestmark = pytest.mark.services
MiB = 1 << 20


def error_code(exc: ClientError) -> str:
    return str(exc.response["Error"]["Code"])


def test_put_get_head_list_delete(s3_bucket: Bucket) -> None:
    s3 = s3_bucket.client()
    body = os.urandom(MiB)
    s3.put_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1", Body=body)
    s3.put_object(Bucket=s3_bucket.name, Key="ns/cd/chunk2", Body=b"two")
    assert s3.get_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1")["Body"].read() == body
    assert s3.head_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1")["ContentLength"] == MiB
    ranged = s3.get_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1", Range="bytes=10-19")
    assert ranged["Body"].read() == body[10:20]
    listed = s3.list_objects_v2(Bucket=s3_bucket.name, Prefix="ns/")
    assert sorted(o["Key"] for o in listed["Contents"]) == ["ns/ab/chunk1", "ns/cd/chunk2"]
    s3.delete_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1")
    with pytest.raises(ClientError) as missing:
        s3.head_object(Bucket=s3_bucket.name, Key="ns/ab/chunk1")
    assert error_code(missing.value) in ("404", "NoSuchKey")


def test_conditional_put_if_none_match_refuses_the_second_writer(s3_bucket: Bucket) -> None:
    s3 = s3_bucket.client()
    s3.put_object(Bucket=s3_bucket.name, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=s3_bucket.name, Key="k", Body=b"second", IfNoneMatch="*")
    assert error_code(refused.value) in ("PreconditionFailed", "412")
    assert s3.get_object(Bucket=s3_bucket.name, Key="k")["Body"].read() == b"first"


def test_multipart_upload_reassembles_the_parts(s3_bucket: Bucket) -> None:
    s3 = s3_bucket.client()
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(123)]
    upload = s3.create_multipart_upload(Bucket=s3_bucket.name, Key="big")
    etags = [
        {"PartNumber": n, "ETag": s3.upload_part(Bucket=s3_bucket.name, Key="big", PartNumber=n,
                                                 UploadId=upload["UploadId"], Body=part)["ETag"]}
        for n, part in enumerate(parts, start=1)
    ]
    s3.complete_multipart_upload(Bucket=s3_bucket.name, Key="big", UploadId=upload["UploadId"],
                                 MultipartUpload={"Parts": etags})
    assert s3.get_object(Bucket=s3_bucket.name, Key="big")["Body"].read() == b"".join(parts)


def test_credentials_come_from_the_environment_and_are_enforced(
        seaweedfs: SeaweedFS, s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in seaweedfs.client_env().items():
        monkeypatch.setenv(name, value)
    s3 = boto3.session.Session().client("s3")  # endpoint, region, keys: all from the env
    s3.put_object(Bucket=s3_bucket.name, Key="env", Body=b"ok")
    assert s3.get_object(Bucket=s3_bucket.name, Key="env")["Body"].read() == b"ok"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ClientError) as denied:
        boto3.session.Session().client("s3").get_object(Bucket=s3_bucket.name, Key="env")
    assert error_code(denied.value) in ("SignatureDoesNotMatch", "AccessDenied", "403")
    assert seaweedfs.credentials.secret_key not in repr(seaweedfs.credentials)


def test_listens_on_loopback_and_only_on_its_pinned_ports(seaweedfs: SeaweedFS) -> None:
    assert seaweedfs.pid is not None
    sockets = listening(seaweedfs.pid)
    assert {addr for addr, _ in sockets} == {"127.0.0.1"}
    assert {port for _, port in sockets} == set(astuple(seaweedfs.ports))


def test_outage_stop_pause_and_restart_keep_the_data(
        make_seaweedfs: Callable[..., SeaweedFS]) -> None:
    weed = make_seaweedfs()
    bucket = Bucket("outage", weed.endpoint, weed.credentials)
    s3 = bucket.client(connect_timeout=1, read_timeout=1, retries={"max_attempts": 0})
    s3.create_bucket(Bucket="outage")
    s3.put_object(Bucket="outage", Key="k", Body=b"kept")

    weed.stop()
    started = time.monotonic()
    with pytest.raises((EndpointConnectionError, ConnectTimeoutError)):
        s3.get_object(Bucket="outage", Key="k")
    assert time.monotonic() - started < 2, "a stopped server refuses connections at once"

    weed.start()
    assert eventually_get(s3, "outage", "k") == b"kept"

    weed.pause()
    started = time.monotonic()
    with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
        s3.get_object(Bucket="outage", Key="k")
    assert time.monotonic() - started < 5, "a hung server costs the client its timeout"
    weed.resume()
    assert eventually_get(s3, "outage", "k") == b"kept"


def eventually_get(s3: Any, bucket: str, key: str, timeout_s: float = 20.0) -> bytes:
    """The object, once the restarted server serves it: its S3 gateway answers a moment
    before its volume server does (InternalError meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_close_leaves_no_process_socket_or_folder(
        make_seaweedfs: Callable[..., SeaweedFS]) -> None:
    weed = make_seaweedfs()
    pid, workdir, ports = weed.pid, weed.workdir, astuple(weed.ports)

    def weed_sockets() -> list[Path]:
        return [p for port in ports for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]

    assert pid is not None and weed_sockets(), "weed puts its gRPC sockets in /tmp"
    weed.close()
    assert not Path(f"/proc/{pid}").exists()
    assert not workdir.exists()
    assert not weed_sockets()


def test_two_servers_run_side_by_side(seaweedfs: SeaweedFS,
                                      make_seaweedfs: Callable[..., SeaweedFS]) -> None:
    other = make_seaweedfs()
    assert not set(astuple(other.ports)) & set(astuple(seaweedfs.ports))
    a = Bucket("side-a", seaweedfs.endpoint, seaweedfs.credentials).client()
    b = Bucket("side-b", other.endpoint, other.credentials).client()
    a.create_bucket(Bucket="side-a")
    b.create_bucket(Bucket="side-b")
    assert "side-b" not in [x["Name"] for x in a.list_buckets()["Buckets"]]
    a.delete_bucket(Bucket="side-a")


def test_a_failed_start_names_the_command_and_shows_the_log() -> None:
    weed = SeaweedFS(extra_args=["-no.such.flag=1"], start_timeout_s=20)
    try:
        with pytest.raises(ServiceStartError) as failed:
            weed.start()
        message = str(failed.value)
        assert "exited while starting" in message and "no.such.flag" in message
        assert weed.credentials.secret_key not in message
    finally:
        weed.close()
    assert not weed.workdir.exists()
