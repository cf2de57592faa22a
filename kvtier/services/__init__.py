"""Local services for tests, benchmarks and demos: SeaweedFS (S3 and a FUSE mount) and Redis.

Each starts on loopback with ports of its own, waits until it answers, and is stopped by its
process id (SIGTERM, then SIGKILL); none outlives the Python process that started it. See
docs/services.md.
"""

from __future__ import annotations

from kvtier.services.mount import SeaweedMount
from kvtier.services.redis_cluster import RedisCluster
from kvtier.services.redis_server import RedisServer
from kvtier.services.seaweedfs import S3Credentials, SeaweedFS, SeaweedPorts

__all__ = ["RedisCluster", "RedisServer", "S3Credentials", "SeaweedFS", "SeaweedMount",
           "SeaweedPorts"]
