"""Tenants, played as the hostile tenant: B never learns of or loads A's prefix (its salt
differs, lookups for it report none of A's chunks, its own cache_salt cannot pick A's), its
priority is capped, tier details are stripped from its answers (whole and streamed), and the
tenants file is checked before the router starts."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from store_helpers import NS
from stubs import EngineModel, completion, node, post, router_config, running_router, stubs

from kvtier.errors import ConfigError
from kvtier.keys import chunk_keys
from kvtier.router.lookup import NodeLookups
from kvtier.router.tenants import Tenant, Tenants, load_tenants

KEY_A = "alice-key-0123456789abcdef"
KEY_B = "bob-key-fedcba9876543210"
PROMPT = list(range(1000, 1160))  # 10 chunks of 16 tokens


def tenants_file(tmp_path: Path, doc: dict[str, Any] | None = None, mode: int = 0o600) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(doc or {"tenants": {
        "alice": {"api_keys": [KEY_A], "max_priority": 100, "may_see_tier_details": True},
        "bob": {"api_keys": [KEY_B], "max_priority": 10}}}))
    path.chmod(mode)
    return path


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def salt_keys(tenants: Tenants, name: str, client_salt: str | None = None) -> list[Any]:
    tenant = next(t for t in tenants._by_digest.values() if t.name == name)
    return chunk_keys(NS, PROMPT, 16, (f"salt:{tenants.salt(tenant, client_salt)}",))


def sample(router: Any, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def test_tenant_b_never_sees_or_loads_tenant_a_prefix(tmp_path: Path) -> None:
    tenants = load_tenants(str(tenants_file(tmp_path)), None, b"router-salt-secret-0123")

    async def main() -> None:
        server = node(tmp_path / "node", slots=64)
        try:
            engine = EngineModel(server, chunk_tokens=16, speed=20000)
            engine.register()
            node_url = f"http://127.0.0.1:{server.metrics_port}"
            async with stubs(1) as backends, running_router(router_config(
                    backends, strategy="cache", kvtier_servers=[node_url],
                    tenants=tenants)) as router, aiohttp.ClientSession() as s:
                backends[0].engine = engine
                await asyncio.sleep(0.3)  # a health round reads the namespaces
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                status, doc, _ = await post(s, url, completion(PROMPT), auth(KEY_A))
                assert status == 200 and doc["kv_transfer_params"]["kvtier"]["tokens"] == {
                    "device": 0, "recomputed": 160}
                status, doc, h = await post(s, url, completion(PROMPT), auth(KEY_A))
                assert doc["kv_transfer_params"]["kvtier"]["tokens"]["arena"] == 160, \
                    "A sees its own hits"
                assert "held=160;" in h["X-Kvtier-Estimate"], "and the router's estimate"
                lookups = NodeLookups(s, 2.0)
                held_a, _ = await lookups.one(node_url, salt_keys(tenants, "alice"))
                held_b, _ = await lookups.one(node_url, salt_keys(tenants, "bob"))
                assert len(held_a) == 10 and held_b == (), "B's keys name none of A's chunks"

                a_salt = backends[0].seen[0]["body"]["cache_salt"]
                for own_salt in (None, a_salt):  # B even sends A's salt as its own
                    body = completion(PROMPT, **({"cache_salt": own_salt} if own_salt else {}))
                    status, doc, h = await post(s, url, body, auth(KEY_B))
                    assert status == 200 and doc.get("kv_transfer_params") is None, \
                        "B gets no tier details"
                    assert "X-Kvtier-Estimate" not in h, "nor what the router estimated"
                    sent = backends[0].seen[-1]["body"]["cache_salt"]
                    assert sent != a_salt and sent == tenants.salt(
                        next(t for t in tenants._by_digest.values() if t.name == "bob"),
                        own_salt)
                assert sample(router, "kvtier_router_actual_tokens_total",
                              backend=backends[0].url, source="recomputed") == 160 * 3, \
                    "B recomputed every token both times: it loaded nothing of A's"
                assert sample(router, "kvtier_router_actual_tokens_total",
                              backend=backends[0].url, source="arena") == 160
                assert sample(router, "kvtier_router_decisions_total", strategy="cache",
                              reason="cold") == 3, "the router predicted nothing held for B"
                assert all(b["headers"].get("Authorization") is None
                           for b in backends[0].seen), "tenant keys never reach a backend"
        finally:
            server.stop()
    asyncio.run(main())


def test_priority_is_capped_and_bad_values_are_refused(tmp_path: Path) -> None:
    tenants = load_tenants(str(tenants_file(tmp_path)), None, None)

    async def main() -> None:
        async with stubs(1) as backends, running_router(router_config(
                backends, tenants=tenants)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"

            def with_priority(p: Any) -> dict[str, Any]:
                return completion(kv_transfer_params={"kvtier": {"priority": p, "load": True}})
            for key, asked, got, name in ((KEY_B, 90, 10, "bob"), (KEY_B, 5, 5, "bob"),
                                          (KEY_A, 90, 90, "alice")):
                status, _doc, _ = await post(s, url, with_priority(asked), auth(key))
                assert status == 200
                sent = backends[0].seen[-1]["body"]["kv_transfer_params"]["kvtier"]
                assert sent == {"priority": got, "load": True, "tenant": name}
            seen = len(backends[0].seen)
            for bad in ("100", 100.0, True, -1, 101):
                status, doc, _ = await post(s, url, with_priority(bad), auth(KEY_B))
                assert status == 400 and "priority" in doc["error"]["message"], bad
            for bad_salt in ("a/b", "", 7, "x" * 129):
                status, doc, _ = await post(s, url, completion(cache_salt=bad_salt),
                                            auth(KEY_B))
                assert status == 400 and "cache_salt" in doc["error"]["message"]
            async with s.post(url, data=b"[1, 2]", headers=auth(KEY_B)) as resp:
                assert resp.status == 400, "a tenant's body must be a JSON object"
            assert len(backends[0].seen) == seen, "refused bodies never reach a backend"
            for headers in ({}, auth("nobody"), {"Authorization": f"Basic {KEY_A}"}):
                status, _doc, _ = await post(s, url, completion(), headers)
                assert status == 401
    asyncio.run(main())


def test_retention_priorities_are_capped_and_bad_retentions_refused(tmp_path: Path) -> None:
    """Bob (cap 10) asks for a retention at 90 for his prompt, a range and decode: each is
    lowered to 10 before the backend sees it; a bad duration or range never reaches it."""
    tenants = load_tenants(str(tenants_file(tmp_path)), None, None)

    async def main() -> None:
        async with stubs(1) as backends, running_router(router_config(
                backends, tenants=tenants)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"

            def asking(kvtier: dict[str, Any]) -> dict[str, Any]:
                return completion(kv_transfer_params={"kvtier": kvtier})
            retention = {"priority": 90, "duration_s": 30, "decode_priority": 90,
                         "ranges": [{"start": 0, "end": 64, "priority": 90}]}
            status, _doc, _ = await post(s, url, asking({"retention": retention}), auth(KEY_B))
            assert status == 200
            sent = backends[0].seen[-1]["body"]["kv_transfer_params"]["kvtier"]["retention"]
            assert sent == {"priority": 10, "duration_s": 30, "decode_priority": 10,
                            "ranges": [{"start": 0, "end": 64, "priority": 10}]}
            status, _doc, _ = await post(s, url, asking({"release": True}), auth(KEY_B))
            assert status == 200
            seen = len(backends[0].seen)
            for bad, key in (({"retention": {"priority": 50, "duration_s": 0}}, "duration_s"),
                             ({"retention": {"priority": 50, "duration_s": 1e9}}, "duration_s"),
                             ({"retention": {"ranges": [{"start": 9, "end": 3,
                                                         "priority": 5}]}}, "end"),
                             ({"retention": {"ranges": [{"priority": "high"}]}}, "priority"),
                             ({"retention": {"priority": 5}, "release": True}, "release"),
                             ({"release": "yes"}, "release")):
                status, doc, _ = await post(s, url, asking(bad), auth(KEY_B))
                assert status == 400 and key in doc["error"]["message"], bad
            assert len(backends[0].seen) == seen, "refused bodies never reach a backend"
    asyncio.run(main())


def test_a_release_never_reaches_another_tenants_prefix(tmp_path: Path) -> None:
    """Scenario: Alice keeps a system prompt; Bob sends the same prompt with release. Bob's
    release reaches the engine under Bob's salt only (it names none of Alice's chunks); a
    tenant that shares its cache with others (no salt of its own) gets 400 naming the key."""
    tenants = load_tenants(str(tenants_file(tmp_path)), None, None)
    shared = Tenants({KEY_A: Tenant("shared", 50, isolated=False)})
    release = {"kv_transfer_params": {"kvtier": {"release": True}}}

    async def main() -> None:
        async with stubs(1) as backends, running_router(router_config(
                backends, tenants=tenants)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            salts = []
            for key, name in ((KEY_A, "alice"), (KEY_B, "bob")):
                status, _doc, _ = await post(s, url, completion(**release), auth(key))
                assert status == 200
                sent = backends[0].seen[-1]["body"]
                assert sent["kv_transfer_params"] == {"kvtier": {"release": True,
                                                                 "tenant": name}}
                salts.append(sent["cache_salt"])
            assert salts[0] != salts[1]
        async with stubs(1) as backends, running_router(router_config(
                backends, tenants=shared)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            status, doc, _ = await post(s, url, completion(**release), auth(KEY_A))
            assert status == 400
            assert "kv_transfer_params.kvtier.release" in doc["error"]["message"]
            assert "own cache salt" in doc["error"]["message"]
            assert backends[0].seen == []
    asyncio.run(main())


def test_tier_details_are_stripped_from_streams_for_tenants_not_allowed(
        tmp_path: Path) -> None:
    tenants = load_tenants(str(tenants_file(tmp_path)), None, None)

    async def main() -> None:
        async with stubs(1, stream_details=True, tokens=3) as backends, running_router(
                router_config(backends, tenants=tenants)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            texts = {}
            for key in (KEY_A, KEY_B):
                async with s.post(url, json=completion(stream=True), headers=auth(key)) as r:
                    assert r.status == 200
                    texts[key] = (await r.read()).decode()
            assert '"kvtier"' in texts[KEY_A] and '"arena": 16' in texts[KEY_A]
            assert '"kvtier"' not in texts[KEY_B] and "arena" not in texts[KEY_B]
            assert '"other": 1' in texts[KEY_B], "the rest of kv_transfer_params stays"
            events = [line for line in texts[KEY_B].split("\n") if line.startswith("data:")]
            assert len(events) == 5 and events[-1] == "data: [DONE]", "every event whole"
            for event in events[:-1]:
                json.loads(event[5:])
    asyncio.run(main())


def test_single_key_options_stay_one_open_tenant() -> None:
    async def main() -> None:
        async with stubs(1, stream_details=True) as backends, running_router(router_config(
                backends, api_key=KEY_A)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            body = completion(cache_salt="mine", kv_transfer_params={"kvtier": {"priority": 99}})
            status, _doc, _ = await post(s, url, body, auth(KEY_A))
            assert status == 200 and backends[0].seen[-1]["body"] == body, "sent untouched"
            async with s.post(url, json=completion(stream=True), headers=auth(KEY_A)) as r:
                assert '"kvtier"' in (await r.text()), "the open tenant sees details"
    asyncio.run(main())


def test_tenants_file_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="others may read it"):
        load_tenants(str(tenants_file(tmp_path, mode=0o644)), None, None)
    dup = {"tenants": {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_A]}}}
    with pytest.raises(ConfigError, match="a key names one tenant") as err:
        load_tenants(str(tenants_file(tmp_path, dup)), None, None)
    assert KEY_A not in str(err.value)
    for doc, match in (({"tenants": {"a": {"api_keys": [KEY_A], "admin": True}}}, "unknown"),
                       ({"tenants": {"a": {"api_keys": [KEY_A], "max_priority": 101}}},
                        "max_priority"),
                       ({"tenants": {"a": {}}}, "no API key"),
                       ({"tenants": {"a b": {"api_keys": [KEY_A]}}}, "tenant name"),
                       ({"tenants": {}}, "at least one tenant")):
        with pytest.raises(ConfigError, match=match):
            load_tenants(str(tenants_file(tmp_path, doc)), None, None)
    with pytest.raises(ConfigError, match="'default' is the --api-key"):
        load_tenants(str(tenants_file(tmp_path, {"tenants": {"default": {
            "api_keys": [KEY_B]}}})), KEY_A, None)
    key_file = tmp_path / "bob.keys"
    key_file.write_text(f"# bob\n{KEY_B}\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("CAROL_KEYS", "carol-1,carol-2")
    path = tenants_file(tmp_path, {"tenants": {"bob": {"api_key_file": str(key_file)},
                                               "carol": {"api_key_env": "CAROL_KEYS"}}},
                        mode=0o644)  # no key inside: others may read it
    tenants = load_tenants(str(path), KEY_A, None)
    assert tenants.names == ["bob", "carol", "default"]
    assert (tenants.identify(f"Bearer {KEY_B}") or _none()).name == "bob"
    assert (tenants.identify("bearer carol-2") or _none()).name == "carol"
    default = tenants.identify(f"Bearer {KEY_A}") or _none()
    assert default.name == "default" and default.isolated and default.may_see_tier_details
    assert tenants.identify("Bearer carol-3") is None and tenants.identify("") is None
    bob = tenants.identify(f"Bearer {KEY_B}") or _none()
    assert bob.max_priority == 35 and not bob.may_see_tier_details, "defaults are strict"
    assert KEY_B not in repr(tenants)
    secret = load_tenants(str(path), KEY_A, b"another-secret-0123456")
    assert secret.salt(bob, None) != tenants.salt(bob, None), "the secret keys the salt"
    assert len(tenants.salt(bob, "x" * 128)) <= 128


def test_tenants_from_the_command_line(tmp_path: Path) -> None:
    from kvtier.cli import build_parser
    from kvtier.router.config import RouterConfig

    path = tenants_file(tmp_path)
    args = build_parser().parse_args(["route", "--backends", "http://a:1",
                                      "--tenants-file", str(path)])
    config = RouterConfig.from_args(args)
    assert config.tenants is not None and config.tenants.names == ["alice", "bob"]
    assert KEY_A not in repr(config)
    os.chmod(path, 0o644)
    from kvtier.cli import main

    assert main(["route", "--backends", "http://a:1", "--tenants-file", str(path)]) == 2


def _none() -> Any:
    raise AssertionError("no tenant")
