"""Run inside a network namespace of the test's own (``test_discovery_netns.py``): stub
backends on 127.0.0.2-4, port 8000, behind ``fleet.kvd.test`` in the namespace's hosts file,
and a router that finds them with the system resolver (``--backends-dns``). Prints one JSON
line of what it saw; changes /etc/hosts (the namespace's own, bind-mounted) in place."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stubs import StubBackend, completion, post

from kvtier.router.app import Router
from kvtier.router.config import DiscoveryConfig, RouterConfig
from kvtier.router.sources import DnsName

NAME = "fleet.kvd.test"
PORT = 8000
INTERVAL_S = 0.5


def hosts(*addresses: str) -> str:
    return "127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addresses)


async def main() -> dict[str, object]:
    backends = {a: await StubBackend(host=a, _port=PORT).start()
                for a in ("127.0.0.2", "127.0.0.3", "127.0.0.4")}
    found = DiscoveryConfig(dns=DnsName.parse(f"http://{NAME}:{PORT}"), node_port=8100,
                            interval_s=INTERVAL_S)
    router = Router(RouterConfig(backends=(), kvtier_servers=(), port=0, discovery=found,
                                 health_interval_s=5.0))
    await router.start()
    out: dict[str, object] = {}
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}"
            first = [(await post(s, f"{url}/v1/completions", completion()))[2]
                     ["X-Kvtier-Backend"] for _ in range(8)]
            out["first"] = sorted(set(first))
            async with s.get(f"{url}/kvtier/backends") as resp:
                out["nodes"] = sorted(r["node"] for r in (await resp.json())["backends"])
            with open("/etc/hosts", "w") as f:  # in place: the bind mount keeps the inode
                f.write(hosts("127.0.0.3", "127.0.0.4"))
            changed = time.monotonic()
            newcomer = backends["127.0.0.4"]
            while not newcomer.seen and time.monotonic() - changed < INTERVAL_S + 2:
                await post(s, f"{url}/v1/completions", completion())
                await asyncio.sleep(0.01)
            out["joined_after_s"] = (newcomer.seen[0]["at"] - changed) if newcomer.seen \
                else None
            await asyncio.sleep(0.1)
            applied = time.monotonic()
            after = [(await post(s, f"{url}/v1/completions", completion()))[2]
                     ["X-Kvtier-Backend"] for _ in range(8)]
            out["after"] = sorted(set(after))
            gone = backends["127.0.0.2"]
            out["late_at_gone"] = len([r for r in gone.seen if r["at"] > applied])
            out["interval_s"] = INTERVAL_S
    finally:
        await router.close()
        for b in backends.values():
            await b.stop()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
