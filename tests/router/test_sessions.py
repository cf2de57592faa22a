"""Sessions through the router to stub backends: told the model's tool-call tokens, the
router asks the connector for a retention per kind of answer; without them an agent's tool
loop gets the short, high retention after each tool call and the soft one after its turn
ends; the client's own retention and its tenant's cap win; an explicit end or an idle
session lets go; a hostile client cannot grow the table or pass a bad session header."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from stubs import MODEL, StubBackend, completion, post, router_config, running_router, stubs

from kvtier.errors import ConfigError
from kvtier.router.finish import FinishWatch, of_doc
from kvtier.router.sessions import SessionConfig
from kvtier.router.tenants import load_tenants

TURN = {"priority": 50, "duration_s": 600.0}
TOOL = {"priority": 80, "duration_s": 120.0}
ON = SessionConfig(retain=True, tool_s=120.0, turn_priority=50)
"""Without tool-call tokens: by the previous answer (a soft turn retention set, to see it)."""


def sent(backend: StubBackend, i: int = -1) -> dict[str, Any] | None:
    """What the router put in ``kv_transfer_params.kvtier`` of the backend's i-th request."""
    params = backend.seen[i]["body"].get("kv_transfer_params") or {}
    return params.get("kvtier")


def tenants_with(tmp_path: Path, **caps: int | None) -> Any:
    """Tenants from a file: each name's API key is ``NAME-key-0123456789``, its
    max_priority the given cap (None: none)."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {
        name: {"api_keys": [f"{name}-key-0123456789"],
               **({} if cap is None else {"max_priority": cap})}
        for name, cap in caps.items()}}))
    path.chmod(0o600)
    return load_tenants(str(path), None, None)


def sample(router: Any, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def chat(*messages: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": m} for m in messages],
            "max_tokens": 4, **kw}


async def ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
              headers: dict[str, str] | None = None) -> int:
    if body.get("stream"):
        async with http.post(url, json=body, headers=headers or {}) as resp:
            await resp.read()
            return resp.status
    status, _, _ = await post(http, url, body, headers)
    return status


def test_a_tool_loop_keeps_its_prefix_high_then_soft_when_the_turn_ends() -> None:
    """Without tool-call tokens: turn 1 (a fresh session) gets the soft turn retention; its
    streamed answer calls a tool, so turn 2 gets the short high one (the connector sets a
    request's retention again when it ends); turn 2's whole answer ends the turn, so turn 3
    is soft again."""

    async def main() -> None:
        async with stubs(1) as (backend,), running_router(router_config(
                [backend], sessions=ON)) as router, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            who = {"X-Session-Id": "agent-7"}
            backend.finish_reason = "tool_calls"
            assert await ask(http, url, completion("p", stream=True), who) == 200
            assert sent(backend) == {"retention": TURN}  # set again when it ends
            backend.finish_reason = "stop"
            assert await ask(http, url, completion("p more"), who) == 200
            assert sent(backend) == {"retention": TOOL}
            assert await ask(http, url, completion("p more more", stream=True), who) == 200
            assert sent(backend)["retention"] == TURN  # type: ignore[index]
            assert sample(router, "kvtier_router_sessions_retentions_total",
                          reason="tool_calls") == 1
            assert sample(router, "kvtier_router_sessions_retentions_total", reason="turn") == 2
            assert sample(router, "kvtier_router_sessions_live") == 1
            assert router.sessions is not None
            router.sessions.check_integrity()

    asyncio.run(main())


def test_sessions_are_known_by_user_or_by_their_first_messages() -> None:
    """Without a header: the body's ``user``, else the conversation's first messages (a
    later turn repeats them); another conversation is another session."""

    async def main() -> None:
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend], sessions=ON)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
            await ask(http, url, chat("system", "task"))
            await ask(http, url, chat("system", "task", "tool result"))
            assert sent(backend)["retention"] == TOOL  # type: ignore[index]
            await ask(http, url, chat("system", "another task"))
            assert sent(backend)["retention"] == TURN  # type: ignore[index]
            await ask(http, url, chat("x", user="u-1"))
            await ask(http, url, chat("y", user="u-1"))
            assert sent(backend)["retention"] == TOOL  # type: ignore[index]
            assert sample(router, "kvtier_router_sessions_live") == 3

    asyncio.run(main())


def test_the_clients_retention_and_the_tenants_cap_win(tmp_path: Path) -> None:
    """A client's own retention goes through (capped, as any), with nothing added; the
    router's own priorities are capped at the tenant's max_priority; a cap at the default
    leaves nothing to set."""
    tenants = tenants_with(tmp_path, capped=60, plain=None)

    async def main() -> None:
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend], sessions=ON, tenants=tenants)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            capped = {"Authorization": "Bearer capped-key-0123456789", "X-Session-Id": "s"}
            own = {"kvtier": {"retention": {"priority": 90, "duration_s": 5},
                              "tenant": "plain"}}  # not its own name: the router's wins
            assert await ask(http, url, completion(kv_transfer_params=own), capped) == 200
            assert sent(backend) == {"retention": {"priority": 60, "duration_s": 5},
                                     "tenant": "capped"}
            await ask(http, url, completion(), capped)  # after a tool call: 80, capped
            assert sent(backend) == {"retention": {"priority": 60, "duration_s": 120.0},
                                     "tenant": "capped"}
            own = {"kvtier": {"finish": {"stop": {"priority": 100, "duration_s": 9}}}}
            await ask(http, url, completion(kv_transfer_params=own), capped)
            assert sent(backend) == {"finish": {"stop": {"priority": 60, "duration_s": 9}},
                                     "tenant": "capped"}, "a finish retention is capped too"
            for bad in ({"tool_calls": {"priority": 1}}, {"stop": {"priority": "high"}}):
                own = {"kvtier": {"finish": bad}}
                async with http.post(url, json=completion(kv_transfer_params=own),
                                     headers=capped) as resp:
                    assert resp.status == 400
                    assert "kv_transfer_params.kvtier.finish" in await resp.text()
            plain = {"Authorization": "Bearer plain-key-0123456789", "X-Session-Id": "s"}
            await ask(http, url, completion(), plain)
            assert sent(backend) is None
            assert sample(router, "kvtier_router_sessions_retentions_total",
                          reason="client") == 2
            assert sample(router, "kvtier_router_sessions_retentions_total",
                          reason="capped") == 1
            assert sample(router, "kvtier_router_sessions_live") == 2  # "s" of each tenant

    asyncio.run(main())


def test_an_ended_or_idle_session_lets_go() -> None:
    """``X-Session-End: 1`` sets nothing and forgets the session (its next request starts
    afresh, soft); a session idle past --session-idle-s is forgotten the same way."""

    async def main() -> None:
        config = SessionConfig(retain=True, idle_s=0.3, turn_priority=50)
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend], sessions=config)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            who = {"X-Session-Id": "a"}
            await ask(http, url, completion(), who)
            await ask(http, url, completion(), {**who, "X-Session-End": "1"})
            assert sent(backend) is None
            assert sample(router, "kvtier_router_sessions_ended_total", reason="end") == 1
            await ask(http, url, completion(), who)
            assert sent(backend)["retention"] == TURN  # type: ignore[index]
            await asyncio.sleep(0.4)
            async with http.get(f"http://127.0.0.1:{router.port}/metrics") as resp:
                text = await resp.text()
            assert "kvtier_router_sessions_live 0.0" in text, "a scrape forgets idle ones"
            await ask(http, url, completion(), who)
            assert sent(backend)["retention"] == TURN  # type: ignore[index]
            assert sample(router, "kvtier_router_sessions_ended_total", reason="idle") == 1

    asyncio.run(main())


def test_a_hostile_client_cannot_grow_the_table_or_pass_a_bad_session() -> None:
    """A thousand session ids keep at most --max-sessions; a header too long, with spaces
    or not ASCII is refused with 400 naming the rule, before any backend sees it."""

    async def main() -> None:
        config = SessionConfig(retain=True, max_sessions=8, tool_s=120.0)
        async with stubs(1) as (backend,), running_router(router_config(
                [backend], sessions=config)) as router, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            for i in range(40):
                assert await ask(http, url, completion(), {"X-Session-Id": f"s{i}"}) == 200
            assert router.sessions is not None and len(router.sessions) == 8
            router.sessions.check_integrity()
            assert sample(router, "kvtier_router_sessions_ended_total", reason="evicted") == 32
            for bad in ("x" * 129, "two words", "caf\u00e9"):
                async with http.post(url, json=completion(),
                                     headers={"X-Session-Id": bad.encode().decode("latin-1")}
                                     ) as resp:
                    assert resp.status == 400
                    assert "visible ASCII" in (await resp.json())["error"]["message"]
            assert len(backend.seen) == 40

    asyncio.run(main())


def test_without_session_retention_bodies_go_through_untouched() -> None:
    """... except a tenant's name, which only the router gives (an open router's clients
    are the store's ``default``)."""

    async def main() -> None:
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend])) as router, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            await ask(http, url, completion(), {"X-Session-Id": "x" * 500})
            await ask(http, url, completion(), {"X-Session-Id": "x" * 500})
            assert sent(backend) is None and router.sessions is None
            claim = {"kvtier": {"priority": 90, "tenant": "alice"}}
            await ask(http, url, completion(kv_transfer_params=claim))
            assert sent(backend) == {"priority": 90}
            async with http.post(url, data=json.dumps(completion(
                    kv_transfer_params=claim)).replace('"tenant"', '"ten\\u0061nt"'),
                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
            assert sent(backend) == {"priority": 90}, "an escaped name is the same name"

    asyncio.run(main())


def test_the_finish_reason_is_read_from_streams_cut_anywhere() -> None:
    events = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
              b'data: {"choices":[{"index":0,"finish_reason":"tool_calls"},'
              b'{"index":1,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    for cut in range(1, len(events)):
        watch = FinishWatch()
        watch.feed(events[:cut])
        watch.feed(events[cut:])
        assert watch.reason == "tool_calls", cut
    watch = FinishWatch()
    watch.feed(b"data: " + b"x" * (1 << 20))  # an endless line is dropped, not kept
    watch.feed(b'\ndata: {"choices":[{"finish_reason":"stop"}]}\n')
    assert watch.reason == "stop"
    assert of_doc({"choices": [{"finish_reason": "length"}]}) == "length"
    assert of_doc({"choices": "nonsense"}) is None


def test_session_options_are_checked() -> None:
    for kw, word in (({"max_sessions": 0}, "--max-sessions"),
                     ({"tool_priority": 101}, "--session-tool-priority"),
                     ({"turn_s": 0.0}, "--session-turn-s"),
                     ({"idle_s": float("nan")}, "--session-idle-s"),
                     ({"end_header": "a b"}, "--session-end-header")):
        with pytest.raises(ConfigError, match=word):
            SessionConfig(retain=True, **kw)  # type: ignore[arg-type]


def test_session_options_from_the_command_line() -> None:
    from kvtier.cli import build_parser, main
    from kvtier.router.config import RouterConfig

    parser = build_parser()
    base = ["route", "--backends", "http://a:1"]
    assert RouterConfig.from_args(parser.parse_args(base)).sessions.retain is False
    config = RouterConfig.from_args(parser.parse_args([
        *base, "--session-retention", "--max-sessions", "50", "--session-tool-s", "30",
        "--session-turn-priority", "40", "--session-end-header", "X-Done",
        "--session-tool-tokens", "151657, 7"]))
    assert config.sessions == SessionConfig(retain=True, max_sessions=50, tool_s=30.0,
                                            turn_priority=40, end_header="X-Done",
                                            tool_tokens=(151657, 7))
    with pytest.raises(ConfigError, match="--session-tool-tokens needs --session-retention"):
        RouterConfig.from_args(parser.parse_args([*base, "--session-tool-tokens", "151657"]))
    for bad in ("<tool_call>", "-1", ",".join(["1"] * 17)):
        with pytest.raises(ConfigError, match="--session-tool-tokens"):
            RouterConfig.from_args(parser.parse_args(
                [*base, "--session-retention", "--session-tool-tokens", bad]))
    with pytest.raises(ConfigError, match="--session-tool-priority"):
        RouterConfig.from_args(parser.parse_args(
            [*base, "--session-retention", "--session-tool-priority", "300"]))
    assert main([*base, "--session-retention", "--session-idle-s", "-1"]) == 2


def test_one_tenants_many_sessions_never_push_out_anothers(tmp_path: Path) -> None:
    """Each tenant has its own table of --max-sessions: a tenant cycling session ids pushes
    out its own, and another tenant's session is still known after (its tool loop still
    gets the tool call's retention)."""
    tenants = tenants_with(tmp_path, noisy=90, quiet=90)

    async def main() -> None:
        config = SessionConfig(retain=True, max_sessions=8, tool_s=120.0)
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend], sessions=config, tenants=tenants)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            quiet = {"Authorization": "Bearer quiet-key-0123456789", "X-Session-Id": "q"}
            assert await ask(http, url, completion(), quiet) == 200
            for i in range(40):
                noisy = {"Authorization": "Bearer noisy-key-0123456789",
                         "X-Session-Id": f"n{i}"}
                assert await ask(http, url, completion(), noisy) == 200
            assert router.sessions is not None and len(router.sessions) == 9
            router.sessions.check_integrity()
            assert sample(router, "kvtier_router_sessions_ended_total", reason="evicted") == 32
            await ask(http, url, completion(), quiet)
            retention = (sent(backend) or {}).get("retention")
            assert retention == {"priority": 80, "duration_s": 120.0}, retention

    asyncio.run(main())


def test_told_the_tool_call_tokens_the_router_asks_for_a_retention_per_kind_of_answer(
        caplog: pytest.LogCaptureFixture) -> None:
    """With --session-tool-tokens every session request carries ``finish`` only (the answer's
    kind is known when it ends, not before: no retention while it runs): ``tool_calls`` with
    the markers, the turn's for ``stop`` and ``length`` when one is set; the defaults set
    none after an end of turn. Without markers the router warns."""
    tools = SessionConfig(retain=True, tool_tokens=(151657,))

    async def main() -> None:
        async with stubs(1, finish_reason="tool_calls") as (backend,), running_router(
                router_config([backend], sessions=tools)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            who = {"X-Session-Id": "agent-1"}
            for _ in range(2):  # the previous answer changes nothing
                assert await ask(http, url, completion("p"), who) == 200
                assert sent(backend) == {"finish": {
                    "tool_calls": {"priority": 80, "duration_s": 20.0},
                    "tool_call_tokens": [151657]}}
            assert sample(router, "kvtier_router_sessions_retentions_total",
                          reason="finish") == 2

    caplog.set_level("WARNING", logger="kvtier.router")
    asyncio.run(main())
    assert "--session-tool-tokens" not in caplog.text
    turn = SessionConfig(retain=True, tool_tokens=(1, 2), turn_priority=50, turn_s=60.0)

    async def with_turn() -> None:
        async with stubs(1) as (backend,), running_router(router_config(
                [backend], sessions=turn)) as router, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            assert await ask(http, url, completion("q"), {"X-Session-Id": "a"}) == 200
            soft = {"priority": 50, "duration_s": 60.0}
            assert sent(backend) == {"finish": {
                "stop": soft, "length": soft, "tool_calls": {"priority": 80, "duration_s": 20.0},
                "tool_call_tokens": [1, 2]}}
            assert router.sessions is not None

    asyncio.run(with_turn())
    asyncio.run(_without_markers_warns())
    assert "--session-tool-tokens" in caplog.text


def test_with_tool_call_tokens_the_tenants_cap_lowers_what_the_router_asks(
        tmp_path: Path) -> None:
    """A tenant capped at 60 gets ``tool_calls`` at 60; one capped at the default gets nothing
    (``capped``); a client's own ``finish.tool_calls`` is capped the same way and passes
    with its own tokens, the router adding nothing."""
    tenants = tenants_with(tmp_path, sixty=60, flat=35)
    tools = SessionConfig(retain=True, tool_tokens=(151657,))

    async def main() -> None:
        async with stubs(1) as (backend,), running_router(router_config(
                [backend], sessions=tools, tenants=tenants)) as router, \
                aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            sixty = {"Authorization": "Bearer sixty-key-0123456789", "X-Session-Id": "s"}
            assert await ask(http, url, completion(), sixty) == 200
            assert sent(backend) == {"finish": {
                "tool_calls": {"priority": 60, "duration_s": 20.0},
                "tool_call_tokens": [151657]}, "tenant": "sixty"}
            own = {"kvtier": {"finish": {"tool_calls": {"priority": 99, "duration_s": 5},
                                         "tool_call_tokens": [7]}}}
            assert await ask(http, url, completion(kv_transfer_params=own), sixty) == 200
            assert sent(backend) == {"finish": {"tool_calls": {"priority": 60, "duration_s": 5},
                                                "tool_call_tokens": [7]}, "tenant": "sixty"}
            flat = {"Authorization": "Bearer flat-key-0123456789", "X-Session-Id": "f"}
            assert await ask(http, url, completion(), flat) == 200
            assert sent(backend) is None
            assert sample(router, "kvtier_router_sessions_retentions_total",
                          reason="capped") == 1

    asyncio.run(main())


async def _without_markers_warns() -> None:
    async with stubs(1) as (backend,), running_router(router_config(
            [backend], sessions=SessionConfig(retain=True))):
        pass
