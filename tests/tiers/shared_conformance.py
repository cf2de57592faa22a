"""The suite every shared tier passes, on top of :class:`LowerTierConformance`.

Subclass :class:`SharedTierConformance` and give it ``make_tier`` (a fresh, empty backend
for each test) and ``make_peer`` (a second tier object on the same backend: another server on
another node). The tests are the promises the servers' coordination stands on: namespaces kept
apart, notes listed in order, a peer seeing what another wrote at once, two writers of one key
never exposing a partial chunk, recency that a hit refreshes.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import codec
from kvtier.keys import ChunkKey
from kvtier.tiers.shared import SharedTier

from .conformance import (
    NAMESPACE,
    LowerTierConformance,
    key_of,
    page_buffer,
    read_back,
    sealed_chunk,
)

OTHER = hashlib.sha256(b"another namespace").digest()


def sealed_in(namespace: bytes, key: ChunkKey, payload_len: int = 2 * codec.PAGE) -> memoryview:
    buf = page_buffer(codec.stored_size(payload_len))
    codec.seal(buf, namespace, key, tokens=16, payload_len=payload_len)
    return buf


class SharedTierConformance(LowerTierConformance):
    def make_peer(self, tier: SharedTier) -> SharedTier:
        raise NotImplementedError

    @pytest.fixture
    def shared(self, tier: SharedTier) -> SharedTier:
        assert isinstance(tier, SharedTier) and tier.shared
        return tier

    @pytest.fixture
    def peer(self, shared: SharedTier) -> Iterator[SharedTier]:
        peer = self.make_peer(shared)
        yield peer
        peer.close()

    # ------------------------------------------------------------------ chunks

    def test_namespaces_are_kept_apart(self, shared: SharedTier) -> None:
        key = key_of("in two namespaces")
        shared.write(key, sealed_in(NAMESPACE, key))
        other = key_of("only in the other")
        shared.write(other, sealed_in(OTHER, other))
        assert sorted(shared.namespaces()) == sorted([NAMESPACE, OTHER])
        assert [c.key for c in shared.scan_namespace(OTHER)] == [other]
        assert shared.read_into(key, page_buffer(4 * codec.PAGE), namespace=OTHER) is None
        shared.delete(other, namespace=OTHER)
        assert [c.key for c in shared.scan_namespace(NAMESPACE)] == [key]

    def test_a_peer_sees_a_write_soon(self, shared: SharedTier, peer: SharedTier) -> None:
        """At once on a local folder, S3 and Redis; a network filesystem's client may cache a
        folder's listing for a moment (NFS attribute caching, FUSE entry timeouts)."""
        key = key_of("written by one server")
        data = sealed_chunk(key)
        shared.write(key, data)
        deadline = time.monotonic() + 5.0
        while (got := read_back(peer, key, len(data))) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == data
        peer.delete(key, namespace=NAMESPACE)
        assert shared.read_into(key, page_buffer(len(data)), namespace=NAMESPACE) is None

    def test_two_servers_writing_one_key_never_expose_a_partial_chunk(
            self, shared: SharedTier, peer: SharedTier) -> None:
        key = key_of("written by two servers")
        data = sealed_chunk(key, 48 * codec.PAGE, seed=5)  # same key, same bytes
        done = threading.Event()

        def write(tier: SharedTier) -> None:
            for _ in range(15):
                tier.write(key, data)

        writers = [threading.Thread(target=write, args=(t,)) for t in (shared, peer)]
        for w in writers:
            w.start()
        threading.Thread(target=lambda: [w.join() for w in writers] and done.set()).start()
        while not done.is_set():
            got = read_back(shared, key, len(data))  # verify() raises on a torn chunk
            assert got is None or got == data
            time.sleep(0.001)
        for w in writers:
            w.join()
        assert read_back(peer, key, len(data)) == data
        assert len(list(shared.scan_namespace(NAMESPACE))) == 1

    def test_a_hit_refreshes_recency(self, shared: SharedTier) -> None:
        old, hot = key_of("left alone"), key_of("hit later")
        for key in (old, hot):
            shared.write(key, sealed_chunk(key))
        time.sleep(1.1)  # object stores keep whole seconds
        shared.touch(hot, namespace=NAMESPACE)
        shared.touch(key_of("never written"), namespace=NAMESPACE)
        times = {c.key: c.mtime for c in shared.scan_namespace(NAMESPACE)}
        assert times[hot] > times[old]

    # ------------------------------------------------------------------ notes

    def test_notes_round_trip_and_list_in_order(self, shared: SharedTier, peer: SharedTier
                                                ) -> None:
        assert shared.list_notes("journal/") == []
        names = [f"journal/{i:013d}-s-{i:06d}" for i in (3, 1, 2)]
        for name in names:
            shared.put_note(name, name.encode())
        deadline = time.monotonic() + 5.0  # a mount may cache the folder's listing briefly
        while peer.list_notes("journal/") != sorted(names) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peer.list_notes("journal/") == sorted(names)
        assert peer.list_notes("journal/", start_after=sorted(names)[0]) == sorted(names)[1:]
        assert peer.get_note(names[0]) == names[0].encode()
        peer.put_note(names[0], b"replaced")
        assert shared.get_note(names[0]) == b"replaced"
        shared.delete_note(names[0])
        shared.delete_note("journal/never-written")
        assert shared.get_note(names[0]) is None
        assert shared.list_notes("servers/") == []
        assert all(name.startswith("journal/") for name in shared.list_notes("journal/"))

    def test_note_names_cannot_escape(self, shared: SharedTier) -> None:
        for bad in ("../outside", "journal/../../x", "/abs", "a b", ""):
            with pytest.raises(ValueError):
                shared.put_note(bad, b"x")

    def test_stale_temporaries_are_cleaned(self, shared: SharedTier, tmp_path: Path) -> None:
        assert shared.clean_stale_temps(3600) == 0  # nothing old: nothing removed
