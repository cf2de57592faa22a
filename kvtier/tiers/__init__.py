"""Storage tiers: the arena (host RAM) and the registered tiers below it."""

from __future__ import annotations

from kvtier.registry import Registry
from kvtier.tiers.base import LowerTier, Space, StoredChunk

TIERS: Registry[LowerTier] = Registry("tier type")
TIERS.register("disk", "kvtier.tiers.disk:DiskTier")
TIERS.register("fs", "kvtier.tiers.fs:FsTier")
TIERS.register("s3", "kvtier.tiers.s3:S3Tier", install_hint="pip install 'kvtier[shared]'")
TIERS.register("redis", "kvtier.tiers.redis:RedisTier",
               install_hint="pip install 'kvtier[shared]'")

__all__ = ["TIERS", "LowerTier", "Space", "StoredChunk"]
