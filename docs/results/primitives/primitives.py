"""One core's throughput of the three payload checks a chunk read can use, interleaved.

- GMAC: what kvtier's keyring computes for a chunk (``Keyring.chunk_tag``: AES-256-GCM with
  the short header as plaintext and the payload as associated data, only the tag kept).
- keyed BLAKE3: the ``blake3`` package with a 32-byte key, the MAC DESIGN.md first named.
- xxh3-64: the payload checksum every stored chunk carries (``codec``), what a read verifies
  without a cluster secret.

Each round times every primitive once over the same payload (GMAC, BLAKE3, xxh3 in turn),
``--rounds`` rounds; every round's GB/s is printed and written, and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import blake3
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def _primitives(payload: bytes) -> dict[str, Callable[[], object]]:
    gcm = AESGCM(os.urandom(32))
    nonce, header = os.urandom(12), os.urandom(96)
    key = os.urandom(32)
    return {"gmac": lambda: gcm.encrypt(nonce, header, payload),
            "blake3_keyed": lambda: blake3.blake3(payload, key=key).digest(),
            "xxh3_64": lambda: xxhash.xxh3_64_intdigest(payload)}


def _gbps(fn: Callable[[], object], nbytes: int, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls * nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bytes-per-round-mib", type=int, default=512)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    out: dict[str, dict[str, list[float]]] = {}
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        payload = os.urandom(mib << 20)
        prims = _primitives(payload)
        calls = max(1, args.bytes_per_round_mib // mib)
        for fn in prims.values():
            fn()
        rounds: dict[str, list[float]] = {name: [] for name in prims}
        for _ in range(args.rounds):
            for name, fn in prims.items():
                rounds[name].append(round(_gbps(fn, len(payload), calls), 2))
        out[f"{mib}MiB"] = rounds
        for name, values in rounds.items():
            print(f"{mib} MiB  {name:13s} GB/s  median {statistics.median(values):6.2f}  "
                  f"rounds {', '.join(f'{v:.2f}' for v in values)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
