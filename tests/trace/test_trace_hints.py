"""Retention hints in traces: read (hostile values refused with the line), derived as a
router or an oracle would derive them, and honoured by the simulator on the trace's clock."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from trace_helpers import BT, mooncake_line, req, run_trace, write_lines

from kvtier.errors import ConfigError
from kvtier.trace.formats import Request, TraceFormatError, TraceReader, write_mooncake
from kvtier.trace.hints import apply_hints, next_in_session, parse_source, sessions
from kvtier.trace.simulate import HOST, Simulator, TierSpec


def line(**extra: Any) -> str:
    record = json.loads(mooncake_line(0, BT, [1]))
    return json.dumps({**record, **extra})


def test_hint_fields_are_read_and_written_back() -> None:
    reader = TraceReader("t", "mooncake")
    r = reader.parse(line(session_id=7, retention={"priority": 90, "duration_s": 30},
                          end=True, stop_reason="tool_calls"))
    assert r is not None
    assert (r.session, r.retention, r.end, r.stop_reason) == ("7", (90, 30.0), True,
                                                              "tool_calls")
    out = io.StringIO()
    write_mooncake([r], out)
    assert reader.parse(out.getvalue()) == r


@pytest.mark.parametrize(("extra", "message"), [
    ({"retention": {"priority": 101}}, r"priority must be in \[0, 100\]"),
    ({"retention": {"priority": 80, "duration_s": 0}}, "duration_s must be in"),
    ({"retention": {"priority": 80, "duration_s": -1}}, "duration_s must be in"),
    ({"retention": {"priority": 80, "duration_s": 1e300}}, "duration_s must be in"),
    ({"retention": {"priority": 80, "duration_s": "soon"}}, "duration_s must be a number"),
    ({"retention": {"priority": 80, "ttl": 5}}, "field 'retention' must be"),
    ({"retention": 80}, "field 'retention' must be"),
    ({"end": "yes"}, "field 'end' must be true or false"),
    ({"session_id": ["a"]}, "field 'session_id' must be"),
    ({"session_id": "x" * 201}, "field 'session_id' must be"),
    ({"stop_reason": 3}, "field 'stop_reason' must be"),
])
def test_hostile_hint_fields_are_refused_with_the_line(tmp_path: Path, extra: dict[str, Any],
                                                       message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [line(), line(**extra)])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: .*{message}"):
        run_trace("simulate", str(path), "--tier", "host=1024tok")


def test_a_nan_duration_is_refused(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [
        line()[:-1] + ', "retention": {"priority": 80, "duration_s": NaN}}'])
    with pytest.raises(TraceFormatError, match="duration_s must be in"):
        run_trace("simulate", str(path), "--tier", "host=1024tok")


def conversation() -> list[Request]:
    """Two conversations on system prompt 0: a (1, 2 then 1, 2, 3 at 10 s) and b (4 at 5 s,
    never continued); c shares only the system prompt with a, so it is its own."""
    return [req([0, 1, 2], 0.0), req([0, 4], 5.0), req([0, 1, 2, 3], 10.0), req([0, 9], 12.0),
            req([0, 1, 2, 3, 5], 100.0)]


def test_sessions_follow_conversations_or_the_trace_ids() -> None:
    reqs = conversation()
    s = sessions(reqs)
    assert s[0] == s[2] == s[4] and len({s[0], s[1], s[3]}) == 3
    assert next_in_session(reqs) == [2, None, 4, None, None]
    tagged = [Request(0, BT, 0, (i,), BT, session="x") for i in range(3)]
    assert next_in_session(tagged) == [1, 2, None]


def test_the_continues_oracle_retains_what_returns_within_t_and_releases_the_rest() -> None:
    hinted = apply_hints(conversation(), "continues:20", priority=90)
    assert [(r.retention, r.end) for r in hinted] == [
        ((90, 20.0), False), (None, True), (None, True), (None, True), (None, True)]
    longer = apply_hints(conversation(), "continues:inf")
    assert [r.end for r in longer] == [False, True, False, True, True]


def test_the_router_retains_after_tool_calls_only() -> None:
    reqs = [Request(0, BT, 0, (1,), BT, stop_reason="tool_calls"),
            Request(1, BT, 0, (2,), BT, stop_reason="stop"),
            Request(2, BT, 0, (3,), BT, stop_reason="tool_calls", end=True)]
    hinted = apply_hints(reqs, "router:30")
    assert [(r.retention, r.end) for r in hinted] == [((80, 30.0), False), (None, False),
                                                      (None, True)]
    assert [r.retention for r in apply_hints(hinted, "none")] == [None] * 3


@pytest.mark.parametrize("bad", ["oracle", "continues", "continues:0", "continues:-5",
                                 "router:nan", "router:1e9", "trace:5", "continues:soon"])
def test_bad_hint_sources_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="--hints"):
        parse_source(bad)


def replay(requests: list[Request], capacity: int) -> tuple[list[list[str]], Simulator]:
    sim = Simulator([TierSpec(HOST, capacity, "lru")], BT)
    return [sim.request(r) for r in requests], sim


def test_a_retained_prompt_outlives_newer_traffic_until_its_duration_ends() -> None:
    """Host of 3 blocks. r0's prompt [1, 2] is retained at 90 for 50 s; two newer one-block
    prompts come and go around it; at 40 s it is a hit; stored again at 100 s, it competes
    as an ordinary chunk: the newer traffic takes it out."""
    kept = (90, 50.0)
    served, sim = replay([
        Request(0.0, 2 * BT, 0, (1, 2), BT, retention=kept),
        req([7], 10.0), req([8], 20.0), req([9], 30.0),
        req([1, 2], 40.0),
        req([6], 95.0), req([5], 96.0), req([4], 97.0),
        req([1, 2], 98.0)], 3)
    assert served[4] == [HOST, HOST]
    assert served[8] == []  # its retention ended at 50 s: newer traffic took it out
    assert sim.host.books.policy.expired >= 2


def test_an_end_releases_the_prompt_first() -> None:
    """Host of 3 blocks: [2, 3] ends its session, so the next store takes its tail 3 (a
    released chain still leaves tail first), not the older [1] that LRU alone would take."""
    requests = [req([1], 0.0), Request(1.0, 2 * BT, 0, (2, 3), BT, end=True), req([4], 2.0),
                req([1], 3.0), req([2, 3], 4.0)]
    served, _sim = replay(requests, 3)
    assert served[3] == [HOST] and served[4] == [HOST]
    unhinted, _sim = replay(apply_hints(requests, "none"), 3)
    assert unhinted[3] == []


def test_simulate_hints_from_the_command_line(tmp_path: Path) -> None:
    """A conversation [1, 2] comes back after two one-off prompts; a host of 3 blocks
    keeps it only if told it continues: 2 hits of 7 blocks against 1."""
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        write_mooncake([req([1, 2], 0.0), req([3], 1.0), req([4], 2.0), req([1, 2, 5], 3.0)],
                       f)
    out = tmp_path / "o.json"
    assert run_trace("simulate", str(path), "--tier", "host=1536tok", "--hints",
                     "continues:inf", "--json", str(out)) == 0
    assert json.loads(out.read_text())["block_hit_ratio"] == pytest.approx(2 / 7)
    assert run_trace("simulate", str(path), "--tier", "host=1536tok", "--hints", "none",
                     "--json", str(out)) == 0
    assert json.loads(out.read_text())["block_hit_ratio"] == pytest.approx(1 / 7)
    with pytest.raises(ConfigError, match="--hint-priority"):
        run_trace("simulate", str(path), "--tier", "host=2048tok", "--hint-priority", "101")


def test_the_session_source_sets_at_finish_what_the_stop_reason_earns() -> None:
    """One session: a tool call, a lost stop reason, an end of turn, a tool call that ends
    it. ``session`` (the router told the tool-call tokens) sets nothing while a request runs
    and, at finish, what its own answer earns (nothing at the default); ``session-prev``
    (without them) gives each request what the previous answer earned as its retention (set
    while it runs and again at its end). A lost stop reason changes nothing; the end
    releases."""
    s = "a"
    reqs = [Request(0, BT, 0, (1,), BT, session=s, stop_reason="tool_use"),
            Request(5, BT, 0, (1, 2), BT, session=s),
            Request(9, BT, 0, (1, 2, 3), BT, session=s, stop_reason="end_turn"),
            Request(300, BT, 0, (1, 2, 3, 4), BT, session=s, stop_reason="tool_calls",
                    end=True)]
    hinted = apply_hints(reqs, "session")
    assert [(r.retention, r.finish, r.end) for r in hinted] == [
        (None, (80, 20.0), False), (None, None, False),
        (None, None, False), (None, None, True)]  # an end of turn earns the default: none
    prev = apply_hints(reqs, "session-prev:120,600,50")
    assert [(r.retention, r.finish, r.end) for r in prev] == [
        (None, None, False), ((80, 120.0), None, False),
        ((80, 120.0), None, False), ((50, 600.0), None, True)]
    tuned = apply_hints(reqs, "session:30,900,40", priority=90)
    assert [r.finish for r in tuned] == [(90, 30.0), None, (40, 900.0), None]
    assert [(r.retention, r.finish) for r in apply_hints(hinted, "none")] == [(None, None)] * 4


@pytest.mark.parametrize("bad", ["session:120", "session:1,2,3,4", "session:0,600",
                                 "session:120,soon", "session:120,600,101", "session:,",
                                 "session-prev:5"])
def test_bad_session_hints_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="--hints session"):
        parse_source(bad)


def test_a_session_whose_turn_ended_yields_to_one_in_a_tool_loop_and_both_expire() -> None:
    """Host of 5 blocks. Session a's answer ends in a tool call (80 for 120 s), b's ends its
    turn (50 for 600 s): one-off traffic at the default evicts neither while they last. At
    125 s a's retention has expired (back to 35) and the one-offs take it; b's (until
    601 s) stays. Without hints LRU keeps neither."""
    a = [Request(0.0, 2 * BT, 0, (1, 2), BT, session="a", stop_reason="tool_calls")]
    b = [Request(1.0, 2 * BT, 0, (3, 4), BT, session="b", stop_reason="stop")]
    one_off = [req([9], 10.0), req([8], 20.0), req([7], 125.0), req([6], 126.0),
               req([5], 127.0)]
    later = [Request(130.0, 2 * BT, 0, (3, 4), BT, session="b", stop_reason="stop"),
             Request(131.0, 2 * BT, 0, (1, 2), BT, session="a", stop_reason="stop")]
    served, _sim = replay(apply_hints(a + b + one_off + later, "session:120,600,50"), 5)
    assert served[-2] == [HOST, HOST]  # b kept at 50 until 601 s
    assert served[-1] == []  # a fell back to 35 at 120 s and the one-offs took it
    plain, _sim = replay(apply_hints(a + b + one_off + later, "none"), 5)
    assert plain[-2] == [] and plain[-1] == []


def test_a_finish_keeps_a_stronger_retention_the_prompt_held() -> None:
    """As the connector sets it (``keep_stronger``): a tool loop's 80 is not lowered by the
    end of turn's 50 that follows, so the prompt stays at 80 until its deadline and, the
    oldest among the 80s, leaves first when two more sessions' tool calls come."""
    reqs = [Request(0.0, BT, 0, (1,), BT, session="a", stop_reason="tool_calls"),
            Request(1.0, BT, 0, (1,), BT, session="a", stop_reason="stop"),
            Request(2.0, BT, 0, (2,), BT, session="b", stop_reason="tool_calls"),
            Request(3.0, BT, 0, (3,), BT, session="c", stop_reason="tool_calls")]
    _served, sim = replay(apply_hints(reqs, "session:120,600,50"), 3)
    assert sim.host.books.policy.retention(1) == (80, 120.0)
    _served, sim = replay(apply_hints(reqs, "session:120,600,50"), 2)
    policy = sim.host.books.policy
    assert 1 not in policy and policy.retention(2) == (80, 122.0)
