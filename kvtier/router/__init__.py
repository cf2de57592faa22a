"""``kvtier route``: an OpenAI-compatible router in front of vLLM instances with kvtier.

It passes ``/v1/chat/completions`` and ``/v1/completions`` (streamed chunk by chunk) to one
backend chosen by a strategy (``roundrobin``, ``session``, ``prefix``, ``cache``), merges
``/v1/models``, checks the backends' health, retries what failed before a byte reached the
client, and exposes its own ``/metrics``. The ``cache`` strategy asks each instance's node
server what it holds of the prompt and picks the lowest estimated time to first token. See
docs/router.md.
"""

from __future__ import annotations

from kvtier.router.config import CostModel, RouterConfig

__all__ = ["CostModel", "RouterConfig"]
