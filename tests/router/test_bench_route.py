"""``kvtier bench route`` runs the stub, the router and the client, and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.router.cli import STRATEGY_NAMES
from kvtier.router.strategies import STRATEGIES


def test_bench_route_prints_and_writes_the_figures(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "route.json"
    assert main(["bench", "route", "--requests", "20", "--concurrency", "4",
                 "--duration-s", "0.5", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for name in ("whole", "stream_first_chunk"):
        row = figures[name]
        assert 0 < row["direct"]["p50_ms"] <= row["direct"]["p99_ms"]
        assert row["routed"]["p50_ms"] > 0 and "added_p99_ms" in row
    assert figures["throughput"]["direct_rps"] > 0 and figures["throughput"]["routed_rps"] > 0
    assert figures["throughput"]["router_cpu_ms_per_request"] > 0
    work = figures["strategy_work"]
    assert work["decision_ms"] > 0 and work["keying_ms"] is None, "round robin keys nothing"
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "stream_first_chunk" in printed
    assert "router CPU per routed request" in printed


def test_a_keyed_strategy_is_measured_with_a_node_server_and_a_real_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``cache`` keys a chat prompt with the demo model's tokenizer (the namespace a node
    server has registered) and asks the node server on every request: both are timed."""
    out = tmp_path / "route.json"
    assert main(["bench", "route", "--strategy", "cache", "--requests", "10",
                 "--concurrency", "2", "--duration-s", "0.5", "--prompt-tokens", "300",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    work = figures["strategy_work"]
    assert work["keying_ms"] > 0 and work["lookups_ms"] > 0
    assert work["decision_ms"] >= work["lookups_ms"], "a decision includes its lookups"
    assert "keyed" in figures["prompt"]
    assert "node lookups" in capsys.readouterr().out


def test_a_prompt_of_no_tokens_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "route", "--prompt-tokens", "0"]) == 2
    assert "--prompt-tokens" in capsys.readouterr().err
    assert main(["bench", "route", "--turns", "0"]) == 2
    assert "--turns must be at least 1" in capsys.readouterr().err


def test_the_command_offers_every_registered_strategy() -> None:
    assert sorted(STRATEGY_NAMES) == sorted(STRATEGIES)


def test_keyed_prompts_are_chats_that_grow_turn_by_turn() -> None:
    """Each request is the next turn of one of CHATS chats: it extends that chat's previous
    turn (what the router's segment reuse meets in production); chats do not share text."""
    from kvtier.bench.route import CHATS, TURNS, Chats

    chats = Chats(400)
    sent = [chats.next_messages() for _ in range(2 * CHATS * TURNS)]
    openings = [m for m in sent if len(m) == 1]
    assert len(openings) == 2 * CHATS  # one request in TURNS opens a chat
    assert len({m[0]["content"] for m in openings}) == len(openings)
    assert all(1000 < len(m[0]["content"]) <= 1600 for m in openings)
    for i, messages in enumerate(sent):
        turn = (i // CHATS) % TURNS
        assert len(messages) == 1 + 2 * turn
        if turn:
            assert messages[:-2] == sent[i - CHATS]  # the same chat's turn before


def test_one_turn_a_chat_makes_every_prompt_new() -> None:
    from kvtier.bench.route import Chats

    chats = Chats(300, turns=1)
    sent = [chats.next_messages() for _ in range(50)]
    assert all(len(m) == 1 for m in sent)
    assert len({m[0]["content"] for m in sent}) == 50
