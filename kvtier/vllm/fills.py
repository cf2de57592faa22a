"""How one copy call goes through the bounded staging buffer (planning only, no torch).

A call moves the pages of some chunks between KV blocks and arena payloads. The staging
buffer holds ``capacity`` bytes; the call is cut into fills. A fill is a list of pieces (one
chunk's pages for a range of layers of one :class:`~kvtier.vllm.pages.LayerStack`, laid out
``[layer][position]``) and the byte segments between staging and the chunks' payloads, merged
wherever both sides are contiguous::

    staging:  | chunk 0, layers 0..39 | chunk 0, layers 40..79 | chunk 1, layers 0..39 |
    payload 0:| layer 0: [rank 0: B pages] .. layer 79 |   (one rank: a single segment)

A store gathers each piece of a fill into staging, then copies the fill's segments to the
host; a load copies them in, then scatters the pieces. Everything runs in order on one
stream, so the next fill reuses the buffer without further synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.vllm.metadata import PayloadLayout


@dataclass(frozen=True)
class StackSpan:
    first: int
    """Index of the stack's first layer in the payload."""
    layers: int


@dataclass(frozen=True)
class Piece:
    chunk: int
    stack: int
    start: int
    """First layer of the piece, counted inside its stack."""
    stop: int
    staging: int
    """Byte offset of the piece in the staging buffer."""
    pages: int
    """Pages per layer: the chunk's number of blocks in this call."""


@dataclass(frozen=True)
class Segment:
    chunk: int
    payload: int
    """Byte offset in the chunk's payload."""
    staging: int
    length: int


@dataclass
class Fill:
    pieces: list[Piece] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    used: int = 0


def staging_bytes(layout: PayloadLayout, cap: int) -> int:
    """Staging size: ``cap`` bytes, but at least one layer of one chunk and at most one
    chunk of one rank (a smaller model never needs more)."""
    one_layer = layout.blocks_per_chunk * layout.page_bytes
    return max(1, min(cap, one_layer * layout.num_layers) // one_layer) * one_layer


def plan_fills(positions: Sequence[Sequence[int]], stacks: Sequence[StackSpan],
               layout: PayloadLayout, rank: int, capacity: int) -> list[Fill]:
    """The fills of one call; ``positions[c]``: the index inside chunk ``c`` of each of its
    blocks, in the order of its block ids."""
    fills = [Fill()]
    for chunk, pos in enumerate(positions):
        per_layer = len(pos) * layout.page_bytes
        if not per_layer:
            continue
        if per_layer > capacity:
            raise ValueError(f"staging of {capacity} bytes cannot hold one layer of a chunk")
        runs = _position_runs(pos)
        for s, span in enumerate(stacks):
            start = 0
            while start < span.layers:
                fill = fills[-1]
                room = (capacity - fill.used) // per_layer
                if room == 0:
                    fills.append(Fill())
                    continue
                stop = min(span.layers, start + room)
                fill.pieces.append(Piece(chunk, s, start, stop, fill.used, len(pos)))
                for layer in range(start, stop):
                    base = fill.used + (layer - start) * per_layer
                    run_offset = layout.run_offset(span.first + layer, rank)
                    for i, p, n in runs:
                        _add(fill.segments, Segment(chunk, run_offset + p * layout.page_bytes,
                                                    base + i * layout.page_bytes,
                                                    n * layout.page_bytes))
                fill.used += (stop - start) * per_layer
                start = stop
    return [fill for fill in fills if fill.pieces]


def _position_runs(positions: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, position, count)`` for each run of consecutive positions."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(positions):
        if runs and runs[-1][1] + runs[-1][2] == p:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, p, 1))
    return runs


def _add(segments: list[Segment], seg: Segment) -> None:
    last = segments[-1] if segments else None
    if (last is not None and last.chunk == seg.chunk
            and last.payload + last.length == seg.payload
            and last.staging + last.length == seg.staging):
        segments[-1] = Segment(last.chunk, last.payload, last.staging, last.length + seg.length)
    else:
        segments.append(seg)
