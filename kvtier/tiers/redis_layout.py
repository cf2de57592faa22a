"""The redis tier's key names, laid out by hash slot (``P`` is ``options.key_prefix``)::

    P c:{<ns>:<b>}:<key>   string  one sealed chunk (header page + payload), written by SET
    P z:{<ns>:<b>}         zset    index bucket <b> of the namespace: member <key>, score =
                                   last write or touch (unix seconds)
    P s:{<ns>:<b>}         hash    <key> -> the chunk's estimated footprint in Redis's memory
    P ns                   set     namespaces that have (had) chunks
    P n:{P n}:<name>       string  a note (journal, heartbeats)
    P nz:{P n}             zset    note names, score 0: listed in order with ZRANGEBYLEX

``<b>`` is the key's first two hex digits: each namespace's index is cut into 256 buckets. A
Redis Cluster hashes only the part in braces (the hash tag), so a chunk, its index entry and
its size entry share a slot and are written in one MULTI/EXEC, while a namespace's buckets
spread over the cluster's primaries (no index is one hot key). Notes and their name index share
one slot: notes are few and small, and one sorted index lists them in order. On a single server
the braces mean nothing and the layout is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

BUCKETS = tuple(f"{i:02x}" for i in range(256))
"""Index buckets of a namespace: the first two hex digits of the keys they hold."""


def bucket_of(hexkey: str) -> str:
    return hexkey[:2]


@dataclass(frozen=True)
class Layout:
    """Key names under one prefix (see the module docstring)."""

    prefix: str

    def chunk(self, ns: str, key: str) -> str:
        return f"{self.prefix}c:{{{ns}:{bucket_of(key)}}}:{key}"

    def index(self, ns: str, bucket: str) -> str:
        return f"{self.prefix}z:{{{ns}:{bucket}}}"

    def sizes(self, ns: str, bucket: str) -> str:
        return f"{self.prefix}s:{{{ns}:{bucket}}}"

    def note(self, name: str) -> str:
        return f"{self.prefix}n:{{{self.prefix}n}}:{name}"

    @property
    def namespaces(self) -> str:
        return f"{self.prefix}ns"

    @property
    def notes(self) -> str:
        return f"{self.prefix}nz:{{{self.prefix}n}}"
