"""Replays give the same results as before the simulator and the policies were made faster.

A small generated trace (answers alternately ending in tool calls and turns) is replayed with
each hint source, under each eviction policy, through one host tier and through a host over a
write-back disk. Per tier the hits, evictions and blocks written, and a digest of the tier
that served every block of every prefix and of each tier's final eviction order, must equal
what the code gave before it was sped up (the main branch for ``none``, ``continues`` and
``router``; for ``session`` and ``session-prev``, the version that modelled the router's
finish retention as the connector applies it, keep-stronger). A change that alters any
decision changes them; one that only makes the replay faster does not.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvtier.trace.formats import Request
from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.hints import apply_hints
from kvtier.trace.simulate import Simulator, TierSpec

GOLDEN = {
    ("none", "lru", 1): ([(6818, 10139, 10439)], "1e7faf3ae10c412c"),
    ("none", "lru", 2): ([(4068, 8214, 8357), (2191, 5159, 5559)], "1c83561098d7afb7"),
    ("none", "arc", 1): ([(6969, 9732, 10032)], "8b442c45b59c38fb"),
    ("none", "arc", 2): ([(4404, 7964, 8107), (2085, 5129, 5529)], "1c42c6dec8156d6c"),
    ("none", "s3fifo", 1): ([(6991, 9940, 10240)], "3aea6e9455f0a284"),
    ("none", "s3fifo", 2): ([(4679, 7840, 7983), (2288, 4926, 5326)], "6b269a00b1134e5a"),
    ("none", "prefix", 1): ([(6896, 10061, 10361)], "77af8bc4799d3d16"),
    ("none", "prefix", 2): ([(4332, 8129, 8272), (2331, 5298, 5698)], "e5002b40e38913ca"),
    ("continues:60", "lru", 1): ([(7175, 9777, 10077)], "6b98ee3d9d0e13bd"),
    ("continues:60", "lru", 2): ([(4389, 8361, 8504), (2710, 4792, 5192)], "b8d396b63f279a7e"),
    ("continues:60", "arc", 1): ([(7559, 9363, 9663)], "00ef797b4045ae44"),
    ("continues:60", "arc", 2): ([(4754, 8001, 8144), (2086, 4788, 5188)], "e7e8fd6953b383f0"),
    ("continues:60", "s3fifo", 1): ([(7618, 9305, 9605)], "b31407767366605a"),
    ("continues:60", "s3fifo", 2): ([(5090, 7945, 8088), (2412, 4647, 5047)], "9cad4c837846d5aa"),
    ("continues:60", "prefix", 1): ([(7351, 9606, 9906)], "b0ab763e23407117"),
    ("continues:60", "prefix", 2): ([(4524, 8301, 8444), (2337, 4867, 5267)], "0dfc3f79d5043c9d"),
    ("router:30", "lru", 1): ([(6749, 10176, 10476)], "390ecfa177fbed37"),
    ("router:30", "lru", 2): ([(4088, 8401, 8544), (2339, 5101, 5501)], "b17d1ea4179ec60f"),
    ("router:30", "arc", 1): ([(6688, 10095, 10395)], "10d1f78a5cd73095"),
    ("router:30", "arc", 2): ([(4132, 8389, 8532), (2260, 5053, 5453)], "da5890a29910b6fb"),
    ("router:30", "s3fifo", 1): ([(6825, 10094, 10394)], "95f79e280d5cf4b5"),
    ("router:30", "s3fifo", 2): ([(4506, 8160, 8303), (2197, 4961, 5361)], "2ef6d36f9e804d03"),
    ("router:30", "prefix", 1): ([(7011, 9936, 10236)], "d7e3e2f76d0453b7"),
    ("router:30", "prefix", 2): ([(4319, 8324, 8467), (2169, 5030, 5430)], "7dda979c0d813913"),
    ("session", "lru", 1):
        ([(6746, 10211, 10511)], "ae2fcc1f448569a7"),
    ("session", "lru", 2):
        ([(4206, 8336, 8479), (2213, 5138, 5538)], "e23826764d45eeba"),
    ("session", "arc", 1):
        ([(6505, 10181, 10481)], "6ebab9f3f311634e"),
    ("session", "arc", 2):
        ([(4279, 8358, 8501), (2199, 5046, 5446)], "b163388958ccb8f6"),
    ("session", "s3fifo", 1):
        ([(6802, 10134, 10434)], "6193bd650190c36e"),
    ("session", "s3fifo", 2):
        ([(4574, 8069, 8212), (2073, 5137, 5537)], "1dffb1b0152a572a"),
    ("session", "prefix", 1):
        ([(6989, 9966, 10266)], "e25ffab2d122bd9a"),
    ("session", "prefix", 2):
        ([(4182, 8389, 8532), (2142, 5193, 5593)], "f4456f0174d8aeba"),
    ("session:20,100,40", "lru", 1):
        ([(6795, 10162, 10462)], "850176cd0f788437"),
    ("session:20,100,40", "lru", 2):
        ([(4247, 8482, 8625), (2080, 5103, 5503)], "7a7206282bd30c20"),
    ("session:20,100,40", "arc", 1):
        ([(6766, 10068, 10368)], "e00b77a085c636b9"),
    ("session:20,100,40", "arc", 2):
        ([(4286, 8299, 8442), (2027, 5129, 5529)], "b76d659c3108a8ab"),
    ("session:20,100,40", "s3fifo", 1):
        ([(6893, 10018, 10318)], "3f23db2be7f92b7f"),
    ("session:20,100,40", "s3fifo", 2):
        ([(4503, 8297, 8440), (2115, 5059, 5459)], "7afbbee14f2cb057"),
    ("session:20,100,40", "prefix", 1):
        ([(6989, 9966, 10266)], "d310b79e572212eb"),
    ("session:20,100,40", "prefix", 2):
        ([(4188, 8530, 8673), (2078, 5141, 5541)], "01ec5164a6b3c797"),
    ("session-prev:120,600,50", "lru", 1):
        ([(6939, 9977, 10277)], "df50901f2a4658ab"),
    ("session-prev:120,600,50", "lru", 2):
        ([(4256, 8091, 8234), (1955, 5245, 5645)], "47f5b35edfe88c5c"),
    ("session-prev:120,600,50", "arc", 1):
        ([(6669, 9968, 10268)], "66e447e9469bbd0e"),
    ("session-prev:120,600,50", "arc", 2):
        ([(4616, 7573, 7716), (1414, 5267, 5667)], "aa612b18cbfb8b4b"),
    ("session-prev:120,600,50", "s3fifo", 1):
        ([(6976, 9928, 10228)], "d2fd16f11a23796b"),
    ("session-prev:120,600,50", "s3fifo", 2):
        ([(4726, 7668, 7811), (1597, 5213, 5613)], "1a16bac131ea9ba3"),
    ("session-prev:120,600,50", "prefix", 1):
        ([(7030, 9916, 10216)], "4b133a6464ce4b58"),
    ("session-prev:120,600,50", "prefix", 2):
        ([(4591, 7849, 7992), (1798, 5214, 5614)], "502e85090fc5859d"),
}


def _trace() -> list[Request]:
    reqs = generate(GenConfig(sessions=120, seed=5, block_tokens=64, system_prompt_tokens=512,
                              user_tokens=200, output_tokens=100, think_time_s=20, turns=5,
                              session_rate=2.0))
    return [dataclasses.replace(r, stop_reason="tool_calls" if i % 3 else "stop")
            for i, r in enumerate(reqs)]


TRACE = _trace()


@pytest.mark.parametrize(("hints", "eviction", "tiers"), list(GOLDEN))
def test_replay_is_what_it_was(hints: str, eviction: str, tiers: int) -> None:
    specs = [TierSpec("host", 300, eviction)] if tiers == 1 else [
        TierSpec("host", 150, eviction), TierSpec("disk", 400, eviction, write="back")]
    sim = Simulator(specs, 64)
    served = [tuple(sim.request(r)) for r in apply_hints(TRACE, hints)]
    result = sim.result()
    order = [tuple(t.books.policy.order()) for t in sim.tiers]
    digest = hashlib.sha256(repr((served, order)).encode()).hexdigest()[:16]
    counts = [(t.hits, t.evictions, t.blocks_written) for t in result.tiers]
    assert (counts, digest) == GOLDEN[hints, eviction, tiers]
