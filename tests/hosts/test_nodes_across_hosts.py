"""Two node servers on two hosts share a tier on a third; a router's host asks them over HTTP.

No vLLM: chunks are stored through node A's socket (as an engine on A would), found by node B
through the shared tier, and looked up from the router's host with the node token; without it,
or with a wrong one, the lookup is refused. Every part binds its host's own address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from store_helpers import client_load, client_store, keys, pattern

from hosts.netns import Host, Network, wait_for
from hosts.services import (
    SHARING,
    HostRedis,
    HostSeaweedFS,
    NodeServer,
    http,
    key_file,
    make_bucket,
    secret,
)
from kvtier.client import KvtierClient

pytestmark = [pytest.mark.services]
CHUNKS = 4


def shared_tier(kind: str, shared: Host, asker: Host, root: Path) -> tuple[Any, dict[str, Any]]:
    """Start the shared tier's service on ``shared``; (service, tier config for nodes)."""
    if kind == "s3":
        weed = HostSeaweedFS(shared).start()
        make_bucket(asker, weed, "kvtier")
        options = {"bucket": "kvtier", "endpoint_url": weed.endpoint, "tls": False,
                   "credentials": f"file:{key_file(root / 'keys', weed)}"}
        service: Any = weed
    else:
        service = HostRedis(shared, password=secret("redis")[:32]).start()
        options = {"url": service.url}
    return service, {"type": kind, "name": "shared", "capacity_bytes": 1 << 30,
                     "io_threads": 2, "options": {**options, **SHARING}}


@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_a_chunk_stored_on_one_host_is_found_and_loaded_on_another(
        network: Network, tmp_path: Path, kind: str) -> None:
    shared, one, two, router = (network.add_host(n) for n in ("shared", "n1", "n2", "router"))
    token, cluster = secret("token"), secret("cluster")
    service, tier = shared_tier(kind, shared, one, tmp_path)
    nodes = [NodeServer(host, tmp_path / host.name, [tier], token, cluster)
             for host in (one, two)]
    try:
        for node in nodes:
            node.start()
        k = keys(CHUNKS, f"hosts-{kind}")
        with KvtierClient(nodes[0].socket_path, name="engine-a") as a:
            assert client_store(a, k) != [None] * CHUNKS
        body = {"keys": [x.hex() for x in k]}

        def found_on_two() -> Any:
            status, doc = router.call(http, nodes[1].url + "/v1/lookup", body, token=token)
            assert status == 200, (status, doc)
            return doc if doc["tiers"] == ["shared"] * CHUNKS else None

        doc = wait_for(found_on_two, timeout_s=20, every_s=0.2, what="B finds A's chunks",
                       popen=nodes[1].popen, log=nodes[1].log)
        assert doc["shared"] == ["shared"]
        # what B loads from the shared tier is what A stored, byte for byte
        with KvtierClient(nodes[1].socket_path, name="engine-b") as b:
            loaded = client_load(b, k)
        assert [bytes(pattern(x)) for x in k] == loaded
        # the router's host: health for anyone, lookups only with the node token
        for node in nodes:
            status, health = router.call(http, node.url + "/healthz")
            assert status == 200 and health["ok"], health
            for wrong in (None, token[:-1] + ("0" if token[-1] != "0" else "1")):
                status, refused = router.call(http, node.url + "/v1/lookup", body, token=wrong)
                assert status == 401, (status, refused)
                assert "tiers" not in refused
    finally:
        for node in nodes:
            node.stop()
        service.close()
    for node in nodes:
        assert node.popen is not None and node.popen.returncode == 0, node.tail()
