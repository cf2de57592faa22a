"""kvtier: a tiered KV cache for LLM serving engines."""

from __future__ import annotations

__version__ = "0.1.0"
