"""Putting the redis tier's own keys back to the types they must have.

Any program with access to the Redis server can put a value of another type under one of the
tier's index keys (``P ns``, ``P nz:{P n}``, ``P z:{<ns>:<b>}``, ``P s:{<ns>:<b>}``:
:mod:`~kvtier.tiers.redis_layout`): a string where an index bucket belongs makes every write
into that bucket fail with ``WRONGTYPE``, so the breaker would bypass the tier for good, and
one where the namespace set belongs keeps every namespace out of listings. A write, delete or
note that meets a wrong type deletes the keys of another type it names (each check and delete
is one atomic script: a key of the right type made meanwhile is kept) and runs once more. What
such a key held was never the tier's index; the entries it loses cost misses, never a wrong
block (every read is verified) and never the tier.

On a Redis Cluster the commands and the keys they check share one hash slot (a chunk with its
index and size buckets, a note with the name index, the namespace set alone): the whole repair
runs on the node that serves that slot (:meth:`~kvtier.tiers.redis_routes.Routes.exec_typed`
passes its pool, and ``asking`` after an ASK redirect).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from kvtier.tiers.redis_index import is_wrongtype
from kvtier.tiers.redis_wire import Arg, transaction
from kvtier.tiers.skips import Skips

DROP_IF_OTHER_TYPE = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= ARGV[1] and t ~= 'none' then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""


def run_typed(pool: Any, commands: Sequence[Sequence[Arg]], typed: Mapping[str, str],
              skips: Skips, *, asking: bool = False) -> list[Any]:
    """``commands`` in one MULTI/EXEC; if one met a key of another type, the keys of
    ``typed`` (key → the type it must have) that have another are deleted (counted in
    ``skips``) and the commands run once more (raising what they raise then). ``asking``:
    each transaction is sent after ASKING (:func:`~kvtier.tiers.redis_wire.transaction`)."""
    replies = transaction(pool, commands, raise_errors=False, asking=asking)
    if not any(is_wrongtype(reply) for reply in replies):
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies
    dropped = transaction(pool, [(b"EVAL", DROP_IF_OTHER_TYPE, 1, key, kind)
                                 for key, kind in typed.items()], asking=asking)
    for key, gone in zip(typed, dropped, strict=True):
        if gone:
            skips.add("index keys of another type, replaced", where=key)
    return transaction(pool, commands, asking=asking)
