"""Retention in the store: a request's priority for its prefix, in the arena and below."""

from __future__ import annotations

from pathlib import Path

from store_helpers import CHUNK_BYTES, MakeStore, keys, store_chunks


def test_a_reprioritised_prefix_leaves_the_arena_tail_first(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    """Scenario: a request lowers its whole prefix; the next store must take its tail, not
    its head (a head gone first leaves the rest unreachable), and so must the disk tier."""
    store = make_store(tmp_path, slots=5, disk_bytes=6 * CHUNK_BYTES)
    chain = keys(4)
    store_chunks(store, chain)
    store_chunks(store, keys(1, "cold"))
    store.flush(5.0)
    store.set_priority(chain, 10)
    store_chunks(store, keys(1, "new"))
    store.flush(5.0)
    assert [store.lookup([key]) for key in chain] == [["arena"]] * 3 + [["disk"]]
    disk = store.tiers[0].policy.order()
    assert disk[:4] == chain[::-1]  # the disk's order: the tail leaves first there too
    store.check_integrity()
