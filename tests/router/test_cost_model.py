"""The pieces of the cache strategy's estimate: the cost model, the queue, the device
history, the hash ring."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.cli import build_parser
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.router.backends import BackendPool
from kvtier.router.config import RouterConfig
from kvtier.router.cost import Holding, estimate
from kvtier.router.history import DeviceHistory
from kvtier.router.load import BackendLoad, StepModel
from kvtier.router.ring import HashRing
from kvtier.router.scrape import engine_gauges


def k(i: int) -> ChunkKey:
    return ChunkKey(hashlib.sha256(str(i).encode()).digest())


def test_estimate_loads_what_arrives_before_recomputing_it_would_end() -> None:
    speed = 1000.0  # tokens/s: a 256-token chunk costs 0.256 s to recompute
    cold = estimate(1000, 256, Holding(), speed, wait_s=0.5)
    assert cold.ttft_s == 0.5 + 1.0 and cold.sources == {"recomputed": 1000}
    arena = estimate(1000, 256, Holding(0, ("arena",) * 3, (0.0,) * 3), speed, 0.0)
    assert arena.sources == {"arena": 768, "recomputed": 232}
    assert abs(arena.ttft_s - 0.232) < 1e-9 and arena.dominant == "arena"
    # the third chunk arrives at 0.9 s: loading it would end later than recomputing it
    slow = estimate(1000, 256, Holding(0, ("arena", "disk", "disk"), (0.0, 0.1, 0.9)),
                    speed, 0.0)
    assert slow.sources == {"arena": 256, "disk": 256, "recomputed": 488}
    assert abs(slow.load_s - 0.1) < 1e-9
    device = estimate(1000, 256, Holding(3, ("arena",), (0.0,)), speed, 0.0)
    assert device.sources == {"device": 768, "recomputed": 232} and device.load_s == 0.0
    for p in (cold, arena, slow, device):
        assert sum(p.sources.values()) == 1000
        assert abs(p.ttft_s - (p.wait_s + p.load_s + p.prefill_s)) < 1e-9


def test_the_queue_is_the_prefill_work_ahead() -> None:
    load = BackendLoad(prefill_tokens_per_s=1000, alpha=0.5)
    a = load.start(0.4, now=10.0)
    b = load.start(0.2, now=10.0)
    assert abs(load.wait_s(10.1) - 0.5) < 1e-9, "0.6 s of work sent at 10.0"
    load.first_byte(a, now=10.2)  # a prefilled sooner than predicted: b is next
    assert abs(load.wait_s(10.2) - 0.2) < 1e-9
    load.finish(a, 10.3)
    load.finish(b, 10.3)
    assert load.wait_s(10.3) == 0.0 and load.in_flight == 0
    load.observe(running=3, waiting=1)  # four the router did not send
    assert load.others == 4 and load.wait_s(10.3) > 0
    first = load.start(0.1, 11.0)
    second = load.start(0.1, 11.0)
    assert not load.finish(first, 11.2).alone and not load.finish(second, 11.2).alone


def test_device_history_expires_by_time_and_size() -> None:
    now = [0.0]
    history = DeviceHistory(ttl_s=10, clock=lambda: now[0])
    history.record(0, [k(1), k(2), k(3)], capacity_chunks=4)
    assert history.held(0, [k(1), k(2), k(3), k(4)]) == 3
    assert history.held(1, [k(1)]) == 0
    history.record(0, [k(1), k(5)], capacity_chunks=3)  # k(2) is now the oldest: out
    assert history.size(0) == 3 and history.held(0, [k(1), k(2)]) == 1
    now[0] = 10.5
    assert history.held(0, [k(1)]) == 0, "older than the TTL"
    history.forget(0)
    assert history.size(0) == 0


def test_a_member_leaving_the_ring_moves_only_its_keys() -> None:
    members = ["a", "b", "c", "d"]
    ring = HashRing(members)
    keys = [f"s{i}".encode() for i in range(400)]
    before = {key: ring.pick(key, lambda _m: True) for key in keys}
    assert set(before.values()) == set(members)
    counts = [list(before.values()).count(m) for m in members]
    assert min(counts) > 50, f"virtual nodes spread keys: {counts}"
    after = {key: ring.pick(key, lambda m: m != "b") for key in keys}
    for key in keys:
        if before[key] != "b":
            assert after[key] == before[key]
        else:
            assert after[key] != "b"
    assert ring.pick(b"x", lambda _m: False) is None


def test_engine_gauges_from_vllm_metrics() -> None:
    text = ('# HELP vllm:num_requests_running ...\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
    gauges = engine_gauges(text)
    assert (gauges.running, gauges.waiting, gauges.device_tokens) == (2, 3, 16000)
    assert engine_gauges("").device_tokens is None


def test_the_decode_weight_is_a_finite_share() -> None:
    parser = build_parser()

    def config(weight: str) -> RouterConfig:
        return RouterConfig.from_args(parser.parse_args(
            ["route", "--backends", "http://a:1", "--decode-weight", weight]))

    assert config("0").cost.decode_weight == 0.0
    assert RouterConfig.from_args(parser.parse_args(
        ["route", "--backends", "http://a:1"])).cost.decode_weight == 1.0, "as measured"
    assert config("0.25").cost.decode_weight == 0.25
    for bad in ("-0.1", "nan", "inf", "1e9"):
        with pytest.raises(ConfigError, match="--decode-weight: must be between 0 and 100"):
            config(bad)


def test_a_backend_learns_how_long_its_requests_decode() -> None:
    load = BackendLoad(5000.0, 0.5)
    a = load.start(0.1, now=0.0)
    load.first_byte(a, now=0.1)
    load.finish(a, now=0.5)
    assert load.in_flight == 0
    assert load.decode_s.value == 0.0, "learnt from streamed answers (accounting), not flights"
    load.decode_s.add(0.4)
    load.decode_s.add(0.2)
    assert abs(load.decode_s.value - 0.3) < 1e-9


def test_the_step_model_is_the_slope_of_step_time_over_streams() -> None:
    steps = StepModel(alpha=0.5)
    assert steps.slope_s() is None, "nothing measured"
    for _ in range(3):
        steps.add(1, 0.004)
    assert steps.slope_s() is None, "one count says nothing about the next stream"
    steps.add(2, 0.006)
    steps.add(3, 0.008)
    slope = steps.slope_s()
    assert slope is not None and abs(slope - 0.002) < 1e-9
    steps.add(3.4, 0.0088)  # on the line, kept with 3 (its mean streams move)
    assert steps.points[3] == pytest.approx((3.2, 0.0084))
    assert steps.slope_s() == pytest.approx(0.002)
    for streams, step in ((0, 0.5), (-3, 0.5), (2, 0.0), (2, -1.0), (2, float("nan")),
                          (float("nan"), 0.5)):
        steps.add(streams, step)  # nonsense from a broken clock or count: dropped
    assert set(steps.points) == {1, 2, 3}
    steps.add(10_000, 0.5)
    assert max(steps.points) == StepModel.MAX_STREAMS, "a huge count is the largest kept"


def test_a_step_time_that_falls_with_more_streams_counts_no_crowding() -> None:
    steps = StepModel(alpha=1.0)
    steps.add(1, 0.010)
    steps.add(4, 0.008)
    assert steps.slope_s() == 0.0
    close = StepModel(alpha=1.0)
    close.add(1.0, 0.010)
    close.add(1.4, 0.030)
    assert close.slope_s() is None, "samples a fraction of a stream apart: no slope yet"


def test_a_flight_knows_how_many_streams_decoded_beside_it() -> None:
    load = BackendLoad(5000.0, 1.0)
    a, b = load.start(0.1, now=0.0), load.start(0.1, now=0.0)
    load.first_byte(a, now=1.0)
    assert load.decoding == 1
    load.first_byte(b, now=2.0)
    assert load.decoding == 2
    load.observe(running=4, waiting=0, now=3.0)  # a, b and two the router did not send
    assert load.others == 2 and load.decoding == 4
    done = load.finish(a, now=5.0)
    # a decoded 1 s alone, 1 s beside b, 2 s beside b and the two others
    assert done is not None and done.mean_decoding == pytest.approx((1 + 2 + 8) / 4)
    late = load.start(0.1, now=5.0)
    assert load.finish(late, now=6.0).mean_decoding is None, "never streamed a byte"


def test_crowding_is_what_the_streams_beside_a_newcomer_cost_it_and_it_them() -> None:
    load = BackendLoad(5000.0, 1.0)
    load.start(0.1, now=0.0)
    assert load.crowding_s(0.0) == 0.0, "nothing measured yet: not counted"
    load.observe(running=3, waiting=0)  # one of the router's and two it did not send
    assert load.others == 2
    load.itl_s.add(0.010)
    load.decode_s.add(0.32)  # 32 steps an answer
    load.steps.add(1, 0.004)
    load.steps.add(3, 0.008)  # 2 ms a stream
    # the newcomer waits 0.1 s (the flight) + 2 x 0.1 s (the others' mean prefill), then
    # prefills 0.1 s: it decodes from 0.4 s; the flight from 0.1 s to 0.42 s: 2 steps shared
    # (2 x 2), and the two others 1.5 answers each (2 x 1.5 x 32)
    assert load.crowding_s(0.0) == pytest.approx(0.002 * (2 * 2 + 2 * 1.5 * 32))


def test_a_stream_about_to_end_crowds_a_newcomer_less_than_one_starting() -> None:
    """The steps a newcomer would share with a stream, not a stream: a backend whose two
    streams are near their ends is less crowded for it than one whose one request is still
    prefilling its whole answer ahead (counting streams alike sent newcomers to queue behind
    a prefill beside an instance about to be free, and cost `cache` its p99 on a fast
    shared tier)."""
    pool = BackendPool(RouterConfig(("http://a:1", "http://b:1"), (None, None)))
    starting, ending = (backend.load for backend in pool)
    for load in (starting, ending):
        load.itl_s.add(0.010)
        load.decode_s.add(0.32)
    pool.steps.add(1, 0.004)
    pool.steps.add(3, 0.008)  # 2 ms a stream
    for sent in (0.0, 0.1):
        fid = ending.start(0.1, now=sent)
        ending.first_byte(fid, sent + 0.1)
    starting.start(0.1, now=0.5)
    # at 0.55: `ending`'s streams end at 0.42 and 0.52, before a newcomer could decode
    # there (0.65); `starting`'s flight decodes from 0.6 to 0.92, a newcomer, queued behind
    # it, from 0.7: 22 steps shared
    assert ending.crowding_s(0.55) == 0.0
    assert starting.crowding_s(0.55) == pytest.approx(0.002 * 2 * 22)
    # still prefilling past its prediction: its answer is still all ahead, none of it spent
    assert starting.crowding_s(0.7) == pytest.approx(starting.crowding_s(0.55))


def test_a_pool_measures_one_step_model_for_all_its_backends() -> None:
    """Samples from either backend fit one slope: a backend whose own answers have not
    spread over counts yet still has its streams counted (a fit per backend left one at
    0 crowding while the other's was measured, and drew every request)."""
    pool = BackendPool(RouterConfig(("http://a:1", "http://b:1"), (None, None)))
    a, b = (backend.load for backend in pool)
    assert a.steps is b.steps is pool.steps
    for load in (a, b):
        load.itl_s.add(0.010)
        load.decode_s.add(0.32)
    a.steps.add(1, 0.004)
    assert b.crowding_s(0.0) == 0.0, "one count: no slope yet"
    b.steps.add(3, 0.008)
    for load, streams in ((a, 1), (b, 2)):
        for _ in range(streams):
            load.first_byte(load.start(0.1, now=0.0), 0.0)
    # each stream decodes from 0 to 0.32, a newcomer from 0.1 (a mean prefill): 22 steps
    assert a.crowding_s(0.0) == pytest.approx(0.002 * 2 * 22)
    assert b.crowding_s(0.0) == pytest.approx(2 * a.crowding_s(0.0))


def test_a_backend_not_measured_yet_takes_its_peers_prefill_speed() -> None:
    """Until its own first sample, a backend's prefill speed is its measured peers' mean,
    not --prefill-tokens-per-s: a default twice the measured speed made recomputing there
    look twice as quick as it was, and drew a burst away from the backend holding it."""
    from kvtier.router.accounting import Accounting
    from kvtier.router.backends import Backend
    from kvtier.router.cost import Prediction
    from kvtier.router.keys import Renderers
    from kvtier.router.metrics import RouterMetrics
    from kvtier.router.proxy import Outcome
    from kvtier.router.request import RoutedRequest
    from kvtier.router.strategies import Decision

    config = RouterConfig(("http://a:1", "http://b:1", "http://c:1"), (None, None, None))
    pool = BackendPool(config)
    a, b, c = pool
    assert b.load.speed.value == config.cost.prefill_tokens_per_s
    accounting = Accounting(RouterMetrics(), config.cost.min_sample_tokens, pool)
    req = RoutedRequest.parse("/v1/completions", b'{"prompt": [1, 2, 3]}', None, Renderers())

    def answered(backend: Backend, prefill_s: float) -> None:
        pred = Prediction(2500, prefill_s, 0.0, 0.0, prefill_s, {"recomputed": 2500})
        fid = backend.load.start(prefill_s, now=0.0)
        flight = backend.load.finish(fid, now=prefill_s)
        assert flight is not None
        outcome = Outcome(status=200, streamed=True, first_byte=flight.sent + prefill_s)
        accounting.record(req, Decision(backend, "cold", pred), outcome, flight, 0.0)

    answered(a, 1.0)  # 2,500 tokens/s
    assert a.load.speed.value == pytest.approx(2500)
    assert b.load.speed.value == c.load.speed.value == pytest.approx(2500)
    answered(b, 0.5)  # 5,000 tokens/s: b's own from now on
    assert b.load.speed.value == pytest.approx(5000)
    assert c.load.speed.value == pytest.approx(3750), "the mean of the measured"
    assert a.load.speed.value == pytest.approx(2500), "a measured speed is its own"
