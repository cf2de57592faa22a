"""``kvtier serve --instances N --shared-local s3|redis``: a local backend for the demo.

Starts SeaweedFS (an S3 gateway on loopback, with keys of its own) or redis-server through
:mod:`kvtier.services`, and gives the ``--shared`` SPEC that points at it, plus the
environment the instances need for it (the S3 keys: the ``s3`` tier reads them from the
environment, never from its config). The service is stopped with the stack.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.launch.shared_spec import shared_tier
from kvtier.launch.summary import say
from kvtier.services.base import Service

BUCKET = "kvtier"
_PROBE = {"s3": "s3://kvtier", "redis": "redis://127.0.0.1:6379/0"}


def check_local_shared(kind: str) -> None:
    """Fail before anything starts if this kvtier lacks the tier ``kind`` serves."""
    if kind not in _PROBE:
        raise ConfigError(f"--shared-local: expected s3 or redis, got {kind!r}")
    shared_tier(_PROBE[kind], 1)


def start_local_shared(kind: str, run_dir: Path, services: ExitStack
                       ) -> tuple[str, dict[str, str], Service]:
    """(SPEC, environment for the instances, the service); the service is registered in
    ``services`` (closed with it) and restarted by the stack's supervisor on its ports."""
    check_local_shared(kind)
    if kind == "s3":
        from kvtier.services import SeaweedFS

        s3 = services.enter_context(SeaweedFS(workdir=run_dir / "seaweedfs"))
        say(f"  local SeaweedFS (S3) at {s3.endpoint}, data in {s3.data_dir}")
        env = s3.client_env()
        return f"s3://{BUCKET}/stack?endpoint={s3.endpoint}&create_bucket=1", env, s3
    from kvtier.services import RedisServer

    redis = services.enter_context(RedisServer(workdir=run_dir / "redis"))
    say(f"  local redis-server at {redis.url}")
    return redis.url, {}, redis
