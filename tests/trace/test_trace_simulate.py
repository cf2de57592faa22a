"""The simulator on hand-made traces: every expected number is worked out in the docstring."""

from __future__ import annotations

import pytest
from trace_helpers import BT, req, trace_a

from kvtier.errors import ConfigError
from kvtier.trace.formats import Request
from kvtier.trace.simulate import HOST, SimResult, TierSpec, simulate


def host_only(capacity: int | None, policy: str = "lru") -> SimResult:
    return simulate(trace_a(), [TierSpec(HOST, capacity, policy)], BT)


def test_infinite_cache_prefix_hit_ratio() -> None:
    """Trace A with an unbounded host; a hit counts only while the prefix is contiguous.

    r1 [1,2,3]: nothing cached               -> 0 hits
    r2 [1,2,4]: 1, 2 cached, 4 not           -> 2 hits
    r3 [1,5]:   1 cached, 5 not              -> 1 hit
    r4 [1,2,3,6]: 1, 2, 3 cached, 6 not      -> 3 hits
    6 hits of 12 blocks = 0.5; every block is full, so tokens give 0.5 too;
    recomputed = 6 blocks * 512 = 3072 tokens.
    """
    result = host_only(None)
    assert result.counts.hit_blocks == 6
    assert result.block_hit_ratio == pytest.approx(0.5)
    assert result.token_hit_ratio == pytest.approx(0.5)
    assert result.counts.recomputed_tokens == 3072


def test_lru_capacity_two() -> None:
    """LRU host of 2 chunks on trace A (lists oldest first). Reserve takes slots head first
    and commit inserts tail first; a slot this reserve already holds cannot be taken back,
    so once both slots are reserved the rest of the request is refused.

    r1 [1,2,3]: prefix 0. 1 and 2 reserve the two free slots; 3 finds nothing to
                evict: refused. Commit 2 then 1 -> [2,1]                    0 hits
    r2 [1,2,4]: prefix 2; touch 2 then 1 -> [2,1]. 4 evicts 2 -> [1,4]      2 hits
    r3 [1,5]:   prefix 1; touch 1 -> [4,1]. 5 evicts 4 -> [1,5]             1 hit
    r4 [1,2,3,6]: prefix 1 (2 is gone); touch 1 -> [5,1]. 2 evicts 5, 3 evicts
                1, 6 refused; commit 3 then 2 -> [3,2]                      1 hit
    4 hits of 12 blocks; evictions 0 + 1 + 1 + 2 = 4; host writes 2 + 1 + 1 + 2 = 6.
    """
    result = host_only(2)
    host = result.tier(HOST)
    assert result.counts.hit_blocks == 4
    assert result.block_hit_ratio == pytest.approx(4 / 12)
    assert host.evictions == 4
    assert host.blocks_written == 6


def test_lru_capacity_three() -> None:
    """LRU host of 3 chunks on trace A.

    r1: [1,2,3]                                                        0 hits
    r2: prefix 2; touch 1, 2 -> [3,1,2]; 4 evicts 3 -> [1,2,4]         2 hits
    r3: prefix 1; touch 1 -> [2,4,1]; 5 evicts 2 -> [4,1,5]            1 hit
    r4: prefix 1 (2 was evicted); touch 1 -> [4,5,1]; 2, 3, 6 evict
        4, 5, 1 -> [2,3,6]                                             1 hit
    4 hits of 12 = 1/3.
    """
    result = host_only(3)
    assert result.counts.hit_blocks == 4
    assert result.block_hit_ratio == pytest.approx(1 / 3)
    assert result.tier(HOST).evictions == 5


def test_partial_last_block_is_never_a_token_hit() -> None:
    """Two identical 10-token prompts with 4-token blocks: ids [1, 2, 3], block 3 partial.

    Second request: all 3 blocks cached -> block hits 3 of 6 = 0.5.
    Token hits count full blocks only: 2 * 4 = 8 of 20 prompt tokens = 0.4.
    """
    requests = [req([1, 2, 3], tokens=10, bt=4), req([1, 2, 3], tokens=10, bt=4)]
    result = simulate(requests, [TierSpec(HOST, None)], 4)
    assert result.block_hit_ratio == pytest.approx(0.5)
    assert result.counts.hit_tokens == 8
    assert result.token_hit_ratio == pytest.approx(0.4)


def test_write_through_disk_promotion_and_leases() -> None:
    """Host 2 chunks, disk unbounded write-through admitting all; 1024 bytes per block.

    r1 [1,2]:   commit 2 then 1 -> host [2,1]; disk {2,1}                   0 hits
    r2 [1,2,3]: prefix 2: touch 2 then 1 -> [2,1]. 3 evicts 2 -> [1,3];
                disk += 3                                                   host 2
    r3 [4]:     4 evicts 1 -> [3,4]; disk += 4                              0 hits
    r4 [1,2,3]: all three are somewhere; 3, in host, is leased. 1 on disk: its
                slot evicts 4 -> [3]. 2 on disk, but the only host chunk left is
                leased: no slot, so the lease ends after 1 block, a disk hit
                -> [3,1]. 2 and 3 are recomputed with nothing leased any more:
                2 evicts 3, then 3 (gone now) evicts 1; commit 3 then 2
                -> [3,2]; disk has both                                     disk 1
    Hits: host 2, disk 1 -> 3 of 9. Host writes 2 + 1 + 1 + 3 = 7, evictions
    0 + 1 + 1 + 3 = 5. Disk writes 4 blocks = 4096 bytes, reads 1 block = 1024 bytes.
    """
    requests = [req([1, 2]), req([1, 2, 3]), req([4]), req([1, 2, 3])]
    tiers = [TierSpec(HOST, 2), TierSpec("disk", None)]
    result = simulate(requests, tiers, BT, block_bytes=1024)
    host, disk = result.tier(HOST), result.tier("disk")
    assert (host.hits, disk.hits) == (2, 1)
    assert result.block_hit_ratio == pytest.approx(3 / 9)
    assert (host.blocks_written, host.evictions) == (7, 5)
    assert (disk.bytes_written, disk.bytes_read) == (4096, 1024)
    assert disk.hit_ratio == pytest.approx(1 / 9)


def test_write_back_demotes_host_victims() -> None:
    """Host 1 chunk, disk unbounded write-back. A victim that must be written back keeps its
    slot until the copy is written (when the step ends), so the chunk that needed the slot
    is refused; a victim already on disk frees its slot at once.

    r1 [1]: host [1]                                                        0 hits
    r2 [2]: 2 evicts 1, which goes down: refused. Disk {1}, host []         0 hits
    r3 [2]: host [2]                                                        0 hits
    r4 [1]: 1 on disk, but its slot's victim 2 goes down first: no slot, the
            prefix ends at 0 and disk has {1,2}. 1 recomputed -> host [1]  0 hits
    r5 [2]: 2 on disk; its slot evicts 1, on disk already: free at once.
            A disk hit -> host [2]                                          disk 1
    1 hit of 5 blocks; disk written 2; host evictions 1 + 1 + 1 = 3, writes 4.
    """
    requests = [req([1]), req([2]), req([2]), req([1]), req([2])]
    tiers = [TierSpec(HOST, 1), TierSpec("disk", None, write="back")]
    result = simulate(requests, tiers, BT)
    host, disk = result.tier(HOST), result.tier("disk")
    assert (host.hits, disk.hits) == (0, 1)
    assert result.block_hit_ratio == pytest.approx(1 / 5)
    assert (disk.blocks_written, host.evictions, host.blocks_written) == (2, 3, 4)


def test_write_back_with_room_keeps_the_whole_prefix() -> None:
    """Host 2 chunks, disk unbounded write-back; [1,2] [3,4] [1,2].

    r1: commit 2 then 1 -> host [2,1].
    r2: 3 evicts 2 and 4 evicts 1; both go down, so both are refused. When the step ends
        the copies are written: disk {2,1}, host empty.
    r3: 1 and 2 on disk, and two free slots: both promoted, 2 disk hits -> host [2,1].
    2 disk hits of 6 blocks; disk written 2; host evictions 2.
    """
    requests = [req([1, 2]), req([3, 4]), req([1, 2])]
    tiers = [TierSpec(HOST, 2), TierSpec("disk", None, write="back")]
    result = simulate(requests, tiers, BT)
    assert result.tier("disk").hits == 2
    assert result.tier("disk").blocks_written == 2
    assert result.tier(HOST).evictions == 2
    assert result.block_hit_ratio == pytest.approx(2 / 6)


@pytest.mark.parametrize(("free_target", "disk_hits", "disk_written"), [(0.0, 1, 2), (0.5, 2, 3)])
def test_free_target_writes_back_ahead(free_target: float, disk_hits: int,
                                       disk_written: int) -> None:
    """Host 2 chunks, disk unbounded write-back; [1] [2] [3] [1] [3]. With free_target 0.5,
    every commit leaves one host slot free, writing its victim back ahead.

    0.0: r1 [1]; r2 [1,2]; r3: 3 evicts 1, which goes down: refused (disk {1}, host [2]);
         r4: 1 promoted into the free slot, a disk hit -> [2,1]; r5: 3 is nowhere, and
         evicts 2, which goes down: refused. 1 hit; disk written 1, 2.
    0.5: r1 [1]; r2 [1,2], then 1 goes down ahead -> [2]; r3 [2,3], 2 goes down -> [3];
         r4: 1 promoted, a disk hit -> [3,1], 3 goes down; r5: 3 promoted, a disk hit
         -> [1,3], then 1 (on disk already) is dropped ahead. 2 hits; disk written 1, 2, 3.
    """
    requests = [req([b]) for b in (1, 2, 3, 1, 3)]
    tiers = [TierSpec(HOST, 2, free_target=free_target), TierSpec("disk", None, write="back")]
    result = simulate(requests, tiers, BT)
    assert result.tier("disk").hits == disk_hits
    assert result.tier("disk").blocks_written == disk_written
    assert result.counts.hit_blocks == disk_hits


@pytest.mark.parametrize(
    ("admission", "disk_hits", "disk_written"),
    [((), 3, 2), ((("after_uses", 2),), 1, 2)],
)
def test_after_uses_admission(
    admission: tuple[tuple[str, int], ...], disk_hits: int, disk_written: int
) -> None:
    """Host 1 chunk, disk unbounded write-through; requests [1] [2] [1] [2] [1].

    always:       r1 writes 1, r2 writes 2 to disk; r3, r4, r5 are disk hits -> 3 of 5.
    after_uses=2: r1 uses 1 once, r2 uses 2 once: neither admitted. r3 recomputes 1 (2nd
                  use) -> written; r4 likewise writes 2; r5 hits 1 on disk -> 1 of 5.
    Both write 2 blocks; the rule only delays them here.
    """
    requests = [req([b]) for b in (1, 2, 1, 2, 1)]
    tiers = [TierSpec(HOST, 1), TierSpec("disk", None, admission=admission)]
    result = simulate(requests, tiers, BT)
    assert result.tier("disk").hits == disk_hits
    assert result.tier("disk").blocks_written == disk_written
    assert result.block_hit_ratio == pytest.approx(disk_hits / 5)


def test_a_chunk_being_copied_down_stays_in_host() -> None:
    """Host 2 chunks, disk unbounded write-through after_uses=2: a host chunk whose copy to
    disk is under way cannot be evicted (the store pins its slot while the copy reads it).

    r1 [5]:     5 -> host [5] (1st use, not admitted)
    r2 [2]:     2 -> host [5,2] (1st use)
    r3 [1,2,3]: 1 is nowhere: prefix 0. Reserve: 1 evicts 5 -> [2]; 2 is in host: touch
                it; its 2nd use admits it, so its copy starts and pins it; 3 finds only
                2, pinned: refused. The copy lands: disk {2}. Commit 1 -> host [2,1]
    r4 [1,2,3]: prefix 2: touch 2 (on disk already), then 1, whose 2nd use admits it ->
                disk {2,1}; host [2,1]: 2 host hits. 3 evicts 2 -> host [1,3]; its 2nd
                use admits it -> disk {2,1,3}
    2 hits of 8 (both host), disk written 3. Had 3 evicted 2 in r3, r4 would have hit
    all three blocks.
    """
    requests = [req([5]), req([2]), req([1, 2, 3]), req([1, 2, 3])]
    tiers = [TierSpec(HOST, 2), TierSpec("disk", None, admission=(("after_uses", 2),))]
    result = simulate(requests, tiers, BT)
    host, disk = result.tier(HOST), result.tier("disk")
    assert (host.hits, disk.hits) == (2, 0)
    assert disk.blocks_written == 3
    assert (host.blocks_written, host.evictions) == (4, 2)


def test_a_chunk_being_promoted_stays_in_its_tier() -> None:
    """Host 2 chunks, disk 1 chunk write-through after_uses=2: the lookup's tail-first
    copies never evict from disk a chunk that the same lookup is promoting from it.

    r1 [1]:   1 -> host [1] (1st use)
    r2 [1]:   host hit; 2nd use: copied -> disk {1}
    r3 [1,2]: 1 host hit; 2 recomputed (1st use) -> host [1,2]
    r4 [3]:   3 evicts 1 -> host [2,3]
    r5 [1,2]: 1 on disk, 2 in host (leased): prefix 2. 1's slot evicts 3 -> [2].
              Tail first: 2 is a host hit, its 2nd use admits it, but disk is full of
              1, being promoted: no room, not copied. 1 is a disk hit -> host [2,1]
    r6 [4]:   4 evicts 2 -> [1,4].  r7 [5]: 5 evicts 1 -> [4,5]
    r8 [1,2]: 1 on disk, 2 nowhere: prefix 1, a disk hit; 1's slot evicts 4 -> [5,1].
              2 recomputed: evicts 5 -> [1,2]; 3rd use: copied, evicting 1 -> disk {2}
    Hits: host 3 (r2, r3, r5), disk 2 (r5, r8): 5 of 11. Disk written 2, evicted 1.
    Had r5 evicted 1 from disk, r8 would have found nothing.
    """
    requests = [req(b) for b in ([1], [1], [1, 2], [3], [1, 2], [4], [5], [1, 2])]
    tiers = [TierSpec(HOST, 2), TierSpec("disk", 1, admission=(("after_uses", 2),))]
    result = simulate(requests, tiers, BT)
    host, disk = result.tier(HOST), result.tier("disk")
    assert (host.hits, disk.hits) == (3, 2)
    assert (disk.blocks_written, disk.evictions) == (2, 1)


def test_each_block_is_one_admission_use_per_request() -> None:
    """after_uses=3 on a write-through disk; host 2 chunks; [1,2] then [3,2].

    r1: 1 and 2 recomputed: one use each.
    r2: 3 is nowhere, so nothing is served; 2 sits in host behind the gap but is offered
        again like any recomputed block: its 2nd use, not its 3rd -> not admitted.
    Disk writes 0 (counting 2 at lookup and again when stored would have written it).
    """
    requests = [req([1, 2]), req([3, 2])]
    rules = (("after_uses", 3),)
    tiers = [TierSpec(HOST, 2), TierSpec("disk", None, admission=rules)]
    assert simulate(requests, tiers, BT).tier("disk").blocks_written == 0


def test_min_prefix_tokens_sees_the_block_position() -> None:
    """min_prefix_tokens=1024, 512-token blocks: block i completes (i+1)*512 tokens.

    Host 2 chunks, disk unbounded write-through.
    r1 [1,2]: commit 2 then 1 -> host [2,1]. Block 2 completes 1024 tokens: written;
              block 1 completes 512: refused.
    r2 [3]:   evicts 2 from host -> [1,3]; 3 refused.
    r3 [4]:   evicts 1 -> [3,4]; 4 refused.
    r4 [1,2]: 1 is nowhere, so prefix 0 and no hit: 2 on disk is useless behind it;
              both are recomputed; 2 is already on disk, not written again.
    Disk written 1 block, 0 hits.
    """
    requests = [req([1, 2]), req([3]), req([4]), req([1, 2])]
    rules = (("min_prefix_tokens", 1024),)
    tiers = [TierSpec(HOST, 2), TierSpec("disk", None, admission=rules)]
    result = simulate(requests, tiers, BT)
    assert result.tier("disk").blocks_written == 1
    assert result.counts.hit_blocks == 0


def test_access_log_keys_work_as_ids() -> None:
    """Byte ids (access log) behave like ints: [a, b] twice -> 2 hits of 4 blocks."""
    a, b = bytes.fromhex("00000000000000aa"), bytes.fromhex("00000000000000bb")
    requests = [Request(0.0, 1100, 0, (a, b), 512), Request(1.0, 1100, 0, (a, b), 512)]
    result = simulate(requests, [TierSpec(HOST, 2), TierSpec("disk", 4)], 512)
    assert result.counts.hit_blocks == 2
    # 2 * 512 hit tokens over 2 * 1100 prompt tokens (the 76-token tails have no block).
    assert result.token_hit_ratio == pytest.approx(1024 / 2200)


def test_zero_capacity_tier_holds_nothing() -> None:
    """A size below one chunk rounds down to 0 chunks: trace A gets no hit at all."""
    assert host_only(0).counts.hit_blocks == 0


def test_host_must_come_first() -> None:
    with pytest.raises(ConfigError, match="first tier must be host"):
        simulate(trace_a(), [TierSpec("disk", 3)], BT)
