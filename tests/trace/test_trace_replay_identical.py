"""Replays give the same results as before the simulator and the policies were made faster.

A small generated trace (answers alternately ending in tool calls and turns) is replayed with
each hint source, under each eviction policy, through one host tier and through a host over a
write-back disk. Per tier the hits, evictions and blocks written, and a digest of the tier
that served every block of every prefix and of each tier's final eviction order, must equal
what the code gave before it was sped up (the main branch for ``none``, ``continues`` and
``router``; the first version of ``session``). A change that alters any decision changes
them; one that only makes the replay faster does not.
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
    ("session", "lru", 1): ([(5920, 10734, 11034)], "b521dbd3b64c5d4d"),
    ("session", "lru", 2): ([(3381, 8786, 8929), (2508, 5141, 5541)], "045af71dc1943d45"),
    ("session", "arc", 1): ([(5732, 10870, 11170)], "0453f262848364ae"),
    ("session", "arc", 2): ([(3515, 8649, 8792), (2259, 5150, 5550)], "72857d6ef5192b9e"),
    ("session", "s3fifo", 1): ([(5539, 11005, 11305)], "6ef4d1a59e7ae0b9"),
    ("session", "s3fifo", 2): ([(3225, 8959, 9102), (2494, 5256, 5656)], "d092d9b5958d8511"),
    ("session", "prefix", 1): ([(6252, 10511, 10811)], "0722d812e3cf489a"),
    ("session", "prefix", 2): ([(3639, 8523, 8666), (2201, 5235, 5635)], "a4c0ae64cd3a3d2d"),
    ("session:20,100,40", "lru", 1):
        ([(6134, 10668, 10968)], "bf523844b66d5a61"),
    ("session:20,100,40", "lru", 2):
        ([(3543, 8939, 9082), (2749, 4902, 5302)], "d5e63ec466edee16"),
    ("session:20,100,40", "arc", 1):
        ([(5952, 10711, 11011)], "8ff17d3ff6cb170d"),
    ("session:20,100,40", "arc", 2):
        ([(3534, 8880, 9023), (2684, 4973, 5373)], "f8a8fbfd8ef7d56f"),
    ("session:20,100,40", "s3fifo", 1):
        ([(6197, 10560, 10860)], "12c15ff3f8be4929"),
    ("session:20,100,40", "s3fifo", 2):
        ([(3525, 8907, 9050), (2721, 5010, 5410)], "736dbf65f9664d8a"),
    ("session:20,100,40", "prefix", 1):
        ([(6202, 10565, 10865)], "58d14561071c8c16"),
    ("session:20,100,40", "prefix", 2):
        ([(3781, 8846, 8989), (2699, 5004, 5404)], "bea67f53939325c4"),
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
