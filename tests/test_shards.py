"""Sharded maps: a dict's and an ordered dict's behaviour, with no table holding many keys
and nothing for the garbage collector to walk."""

from __future__ import annotations

import gc
import os
import random
from collections import OrderedDict

import pytest

from kvtier.shards import EPOCH, SHARDS, EpochOrder, ShardedDict


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def test_a_sharded_dict_behaves_as_a_dict() -> None:
    """Random sets, overwrites, pops and deletes against a plain dict, step by step."""
    rng = random.Random(7)
    pool = keys(500)
    mine: ShardedDict[bytes, int] = ShardedDict()
    ref: dict[bytes, int] = {}
    for step in range(5000):
        key = rng.choice(pool)
        op = rng.randrange(4)
        if op == 0:
            mine[key] = ref[key] = step
        elif op == 1:
            assert mine.pop(key, None) == ref.pop(key, None)
        elif op == 2 and key in ref:
            del mine[key]
            del ref[key]
        else:
            assert mine.get(key) == ref.get(key)
        assert len(mine) == len(ref)
    assert dict(mine.items()) == ref and set(mine) == set(ref)
    assert mine.keys() == ref.keys()
    with pytest.raises(KeyError):
        mine.pop(b"absent")
    with pytest.raises(KeyError):
        del mine[b"absent"]


def test_no_shard_of_a_big_dict_holds_more_than_its_share() -> None:
    """100,000 keys: the fullest shard (what one insert rehashes at most) holds a small
    share, and the shards are plain dicts the garbage collector does not track."""
    mine: ShardedDict[bytes, int] = ShardedDict((k, 4096) for k in keys(100_000))
    assert mine.largest_shard() < 2 * 100_000 // SHARDS
    assert not any(gc.is_tracked(shard) for shard in mine._shards)


def test_an_epoch_order_keeps_an_ordered_dicts_order() -> None:
    """Adds, moves to the end and removes against an OrderedDict, across many epochs."""
    rng = random.Random(3)
    pool = keys(3 * EPOCH)
    order: EpochOrder[bytes] = EpochOrder()
    ref: OrderedDict[bytes, None] = OrderedDict()
    for _ in range(12 * EPOCH):
        key = rng.choice(pool)
        if key not in ref:
            order.add(key)
            ref[key] = None
        elif rng.random() < 0.7:
            order.move_to_end(key)
            ref.move_to_end(key)
        else:
            order.remove(key)
            del ref[key]
    assert list(order) == list(ref)
    assert len(order) == len(ref)
    assert all(key in order for key in ref)
    with pytest.raises(KeyError):
        order.add(next(iter(ref)))
    with pytest.raises(KeyError):
        order.remove(b"absent")


def test_an_epoch_order_never_builds_a_big_table_nor_keeps_empty_ones() -> None:
    """200,000 keys, then all but one from each epoch removed: no dict holds more than an
    epoch, and what is left are small compact epochs."""
    order: EpochOrder[bytes] = EpochOrder()
    added = keys(200_000)
    for key in added:
        order.add(key)
    assert order.largest_shard() <= EPOCH
    for i, key in enumerate(added):
        if i % EPOCH:
            order.remove(key)
    left = [k for i, k in enumerate(added) if i % EPOCH == 0]
    assert list(order) == left
    assert len(order._epochs) <= len(left) + 1
    assert all(len(epoch) <= EPOCH // 8 for epoch in order._epochs.values())
    assert not any(gc.is_tracked(epoch) for epoch in order._epochs.values())
