"""``kvtier verify``: check a tiered stack end to end through its entry point."""

from __future__ import annotations

from kvtier.verify.run import VerifyOptions, verify

__all__ = ["VerifyOptions", "verify"]
