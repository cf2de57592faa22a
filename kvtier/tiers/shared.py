"""The contract of a shared tier: one store seen by the kvtier servers of many nodes.

A shared tier (``fs`` on an NFS-style mount, ``s3``, ``redis``) is a lower tier whose chunks any
server may write, read and delete. On top of :class:`~kvtier.tiers.base.LowerTier` it stores
small *notes* — named byte strings the servers use to coordinate without talking to each
other (:mod:`kvtier.store.sharing`): a journal of what each server wrote and deleted, and
heartbeats that elect the one server that sweeps. Layout, the same on every backend::

    chunks/<namespace hex>/<key hex[:2]>/<key hex>.kvc    one chunk: header page + payload
    notes/journal/<ms>-<server>-<seq>                      batched records of puts, deletes, touches
    notes/servers/<server>                                 heartbeat (time, version)
    tmp/...                                                writes in flight (backends that need it)

Namespaces stay apart so usage can be listed and budgeted per namespace. Every chunk read is
verified by the store, so whatever a backend returns — a torn object, another writer's newer
copy, a deleted object — is at worst a miss (and with a cluster secret, a chunk resealed by a
writer without it too: :mod:`kvtier.auth`). Calls block on the network or the mount; the
store bounds them with ``io_timeout_s`` and never calls a tier under its lock.

Everything a backend lists or returns was written by *other* writers and is untrusted input
(docs/security.md). Every implementation keeps these rules:

- sizes are checked before anything is read (stat, ContentLength, STRLEN): a note over
  ``max_bytes`` raises :class:`~kvtier.errors.NoteTooLarge`, a chunk over the buffer
  :class:`~kvtier.errors.ChunkTooLarge`; nothing larger is ever held in memory;
- one bad entry (a name that does not parse, an entry of the wrong type, garbage in an
  index) is skipped, never fails a listing, a scan, a sweep or a start;
- listings are bounded: :meth:`SharedTier.list_notes` returns at most ``limit`` names;
- fs: entries are opened without following links and without blocking, regular files only;
- nothing outside the tier's own prefix (folder, key prefix) is ever listed or deleted.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvtier.bounds import Positive, check_bounds
from kvtier.config import ConfigStruct, Size, parse, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, ChunkKey
from kvtier.policies.retention import MAX_RETAIN_S
from kvtier.tiers.base import LowerTier, StoredChunk

NOTE_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
NAMESPACE_HEX = re.compile(r"[0-9a-f]{64}")
CHUNK_FILE = re.compile(r"([0-9a-f]{64})\.kvc")
TIER_ID = re.compile(r"[\x21-\x7e]{1,200}")
MAX_NOTE_BYTES = 1 << 20
"""The largest note a reader accepts by default: a journal note holds at most
``journal.MAX_RECORDS`` records of about 80 bytes; a heartbeat is tiny."""
MAX_LISTED_NOTES = 10_000
"""The most names one :meth:`SharedTier.list_notes` call returns by default."""


class SharingOptions(ConfigStruct, frozen=True):
    """How the servers sharing one tier keep their views of it in step (every shared tier's
    ``options`` accept these keys besides its own)."""

    namespace_bytes: Size | None = None
    """Byte budget of each namespace (default: the tier's ``capacity_bytes``)."""
    journal_interval_s: Positive = 0.2
    """A server's own puts, deletes and touches are published at most this late."""
    poll_s: Positive = 0.5
    """How often a server reads the others' journal: a chunk written elsewhere is found
    within about ``journal_interval_s + poll_s``."""
    touch_interval_s: Positive = 60.0
    """A hit refreshes a chunk's recency on the tier at most this often per server."""
    sweep_interval_s: Positive = 30.0
    """How often the sweeping server enforces namespace budgets and cleans up."""
    journal_keep_s: Positive = 300.0
    """Journal notes older than this are deleted; a server further behind rescans."""
    stale_temp_s: Positive = 600.0
    """Temporary objects of writes older than this were left by killed writers."""
    max_clock_skew_s: Positive = 30.0
    """Heartbeats and notes dated further than this ahead of this server's clock are
    ignored (a wrong or forged clock must not win the sweeper election) and swept."""
    max_peer_priority: Annotated[int, Meta(ge=0, le=100)] = 80
    """The highest retention priority (0-100) this server's books give a chunk because
    another server's journal retained it; higher is capped to this."""
    max_peer_retention_s: Annotated[float, Meta(gt=0, le=MAX_RETAIN_S)] = 600.0
    """The longest a peer's retention holds here (seconds; longer, or until changed, is
    capped to this)."""
    tier_id: str | None = None
    """Names this tier in the MACs of its notes (with a cluster secret), the same string on
    every server of the tier and a different one on every other tier signed with the same
    secret. Default: where the backend keeps the tier (S3 bucket and prefix, Redis database
    and key prefix, the fs tier's path); set it where that differs between nodes (an fs
    tier mounted at different paths) or names two tiers alike."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.namespace_bytes is not None:
            msgspec.structs.force_setattr(self, "namespace_bytes",
                                          parse_size(self.namespace_bytes, "namespace_bytes"))
        if self.journal_keep_s < 10 * self.poll_s:
            raise ConfigError("journal_keep_s must be at least 10 x poll_s")
        if self.tier_id is not None and not TIER_ID.fullmatch(self.tier_id):
            raise ConfigError(f"tier_id: {self.tier_id!r}: 1-200 printable ASCII characters")


SHARING_KEYS = frozenset(SharingOptions.__struct_fields__)


def split_options(options: Mapping[str, Any], where: str
                  ) -> tuple[dict[str, Any], SharingOptions]:
    """A shared tier's ``options``: (its own keys, the sharing keys parsed)."""
    own = {k: v for k, v in options.items() if k not in SHARING_KEYS}
    sharing = {k: v for k, v in options.items() if k in SHARING_KEYS}
    return own, parse(SharingOptions, sharing, where)


class SharedTier(LowerTier):
    """A lower tier other servers see too; see the module docstring."""

    shared = True
    scan_priority = False
    sharing: SharingOptions

    @property
    def note_scope(self) -> str:
        """What names this tier in its notes' MACs (:mod:`kvtier.auth`): ``id:`` and the
        configured ``tier_id``, else :meth:`backend_scope`. Configuration, never read from
        the tier: a writer of the tier cannot choose it."""
        if self.sharing.tier_id is not None:
            return f"id:{self.sharing.tier_id}"
        return self.backend_scope()

    @abstractmethod
    def backend_scope(self) -> str:
        """Where the backend keeps this tier, written the same on every node (not an
        endpoint's host name, which may differ between nodes)."""

    @abstractmethod
    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        """Every chunk of one namespace (for budgets and ``kvtier rm``)."""

    @abstractmethod
    def namespaces(self) -> list[bytes]:
        """The namespaces that hold chunks now."""

    @abstractmethod
    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        """Refresh the chunk's recency as the backend sees it (best effort; a missing
        chunk is not an error)."""

    @abstractmethod
    def put_note(self, name: str, data: bytes) -> None:
        """Store a small note under ``name`` (replacing any)."""

    @abstractmethod
    def get_note(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        """The note's bytes, ``None`` if there is none. Its size is checked before it is
        read: a note over ``max_bytes`` raises NoteTooLarge (and is not read); an entry of
        another kind under that name (fs: a folder, a FIFO, a link) is ``None``."""

    @abstractmethod
    def list_notes(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        """The first ``limit`` names under ``prefix`` (a folder such as ``journal/``)
        sorting after ``start_after``, in order. Names that are not valid note names
        (:func:`check_note_name`) are left out."""

    def iter_notes(self, prefix: str, start_after: str = "",
                   max_pages: int | None = None) -> Iterator[str]:
        """Every name under ``prefix`` after ``start_after``, in order, one bounded
        :meth:`list_notes` page at a time (at most ``max_pages`` of them)."""
        pages = 0
        while max_pages is None or pages < max_pages:
            names = self.list_notes(prefix, start_after)
            yield from names
            pages += 1
            if len(names) < MAX_LISTED_NOTES:
                return
            start_after = names[-1]

    @abstractmethod
    def delete_note(self, name: str) -> None:
        """A missing note is not an error."""

    def clean_stale_temps(self, older_than_s: float) -> int:
        """Remove what killed writers left behind (temp files, unfinished uploads) older
        than ``older_than_s``; returns how many. Default: the backend leaves nothing."""
        return 0


def check_note_name(name: str) -> str:
    if not NOTE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"note name {name!r}: letters, digits, '_', '.', '-' in '/' parts")
    return name


def namespace_hex(namespace: bytes) -> str:
    if len(namespace) != 32:
        raise ValueError(f"a namespace fingerprint is 32 bytes, got {len(namespace)}")
    return namespace.hex()


def key_hex(key: ChunkKey) -> str:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
    return key.hex()


def chunk_name(namespace: bytes, key: ChunkKey) -> str:
    """``chunks/<ns>/<kk>/<key>.kvc``: the chunk's name on every shared backend."""
    hexkey = key_hex(key)
    return f"chunks/{namespace_hex(namespace)}/{hexkey[:2]}/{hexkey}.kvc"
