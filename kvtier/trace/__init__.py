"""Trace analysis and offline simulation: size the tiers before buying memory.

Read Mooncake JSONL traces or kvtier's access log (:mod:`~kvtier.trace.formats`), analyze
sharing and reuse (:mod:`~kvtier.trace.analyze`), replay through the store's policy classes
(:mod:`~kvtier.trace.simulate`) against the offline optimum (:mod:`~kvtier.trace.belady`), and
generate synthetic chat traces (:mod:`~kvtier.trace.generate`). ``kvtier trace`` is the CLI.
"""

from __future__ import annotations

from kvtier.trace.belady import belady
from kvtier.trace.formats import BlockId, Request, Trace, TraceFormatError, load_trace
from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.hits import HitCounts
from kvtier.trace.results import SimResult, TierResult
from kvtier.trace.simulate import Simulator, TierSpec, simulate

__all__ = [
    "BlockId",
    "GenConfig",
    "HitCounts",
    "Request",
    "SimResult",
    "Simulator",
    "TierResult",
    "TierSpec",
    "Trace",
    "TraceFormatError",
    "belady",
    "generate",
    "load_trace",
    "simulate",
]
