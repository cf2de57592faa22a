"""Cutting a copy call into staging fills: bounded, and as few host copies as possible."""

from __future__ import annotations

import pytest

from kvtier.vllm.fills import Fill, Segment, StackSpan, plan_fills, staging_bytes
from kvtier.vllm.metadata import PayloadLayout

PAGE = 100
LAYOUT = PayloadLayout(num_layers=4, tp_size=1, blocks_per_chunk=2, page_bytes=PAGE)
ONE_STACK = [StackSpan(0, 4)]
CHUNK = 4 * 2 * PAGE


def covered(fills: list[Fill]) -> list[tuple[int, int]]:
    """(chunk, payload byte) pairs the segments touch, each once."""
    out = [(s.chunk, s.payload + i) for f in fills for s in f.segments for i in range(s.length)]
    assert len(out) == len(set(out))
    return sorted(out)


def test_one_rank_full_chunks_are_one_host_copy_each() -> None:
    fills = plan_fills([range(2), range(2)], ONE_STACK, LAYOUT, 0, capacity=CHUNK)
    assert [f.segments for f in fills] == [[Segment(0, 0, 0, CHUNK)], [Segment(1, 0, 0, CHUNK)]]
    assert covered(fills) == [(c, b) for c in (0, 1) for b in range(CHUNK)]


def test_a_small_staging_buffer_splits_a_chunk_by_layers() -> None:
    fills = plan_fills([range(2)], ONE_STACK, LAYOUT, 0, capacity=3 * 2 * PAGE + 50)
    assert [(p.start, p.stop) for f in fills for p in f.pieces] == [(0, 3), (3, 4)]
    assert all(f.used <= 3 * 2 * PAGE + 50 for f in fills)
    assert [f.segments for f in fills] == [[Segment(0, 0, 0, 600)], [Segment(0, 600, 0, 200)]]


def test_each_rank_copies_its_own_run_of_each_layer() -> None:
    tp2 = PayloadLayout(num_layers=4, tp_size=2, blocks_per_chunk=2, page_bytes=PAGE)
    (fill,) = plan_fills([range(2)], ONE_STACK, tp2, 1, capacity=CHUNK)
    assert [(s.payload, s.staging, s.length) for s in fill.segments] == [
        (tp2.run_offset(layer, 1), layer * 200, 200) for layer in range(4)]


def test_a_partial_load_copies_only_its_pages() -> None:
    (fill,) = plan_fills([[1]], ONE_STACK, LAYOUT, 0, capacity=CHUNK)
    assert [(s.payload, s.length) for s in fill.segments] == [
        (LAYOUT.run_offset(layer, 0) + PAGE, PAGE) for layer in range(4)]
    (fill,) = plan_fills([[1, 0]], ONE_STACK, LAYOUT, 0, capacity=CHUNK)  # out of order
    assert fill.segments[:2] == [Segment(0, PAGE, 0, PAGE), Segment(0, 0, PAGE, PAGE)]


def test_adjacent_stacks_still_make_one_host_copy() -> None:
    two = [StackSpan(0, 1), StackSpan(1, 3)]
    (fill,) = plan_fills([range(2)], two, LAYOUT, 0, capacity=CHUNK)
    assert [p.stack for p in fill.pieces] == [0, 1]
    assert fill.segments == [Segment(0, 0, 0, CHUNK)]


def test_staging_size_is_bounded_by_one_chunk_and_holds_one_layer() -> None:
    assert staging_bytes(LAYOUT, cap=1 << 30) == CHUNK
    assert staging_bytes(LAYOUT, cap=1) == 2 * PAGE
    assert staging_bytes(LAYOUT, cap=450) == 400  # whole layers of one chunk
    with pytest.raises(ValueError, match="one layer"):
        plan_fills([range(2)], ONE_STACK, LAYOUT, 0, capacity=PAGE)
