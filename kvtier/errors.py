"""The kvtier exception tree.

Expected outcomes (a miss, a full tier, a refused admission) are return values, never
exceptions. What remains is drawn here::

    KvtierError
    ├── ConfigError(ValueError)          bad configuration: names the key and what is allowed
    ├── UnknownBackendError(KeyError)    a registry name that does not exist: lists the known ones
    ├── BackendUnavailableError(ImportError)  an optional dependency is missing (says what to add)
    ├── InvalidRequest(ValueError)       a request's arguments are wrong: says what is allowed;
    │                                    nothing stored was changed
    ├── ProtocolError                    a malformed, oversized or unexpected control message
    ├── ClientError                      raised to engine-side clients
    │   ├── ServerUnavailable            the node server cannot be reached (turn into misses)
    │   └── RequestRejected              the server refused a request and said why
    ├── TierError                        a lower tier failed
    │   ├── TierIOError(OSError)         an I/O error from a tier's backing store
    │   │   ├── TierTimeout              the backing store did not answer in time
    │   │   └── TierFull                 the backing store itself is out of space (ENOSPC)
    │   ├── CorruptChunkError            header or checksum mismatch: never served
    │   │   ├── ChunkTooLarge            larger than this reader's slot: a plain miss
    │   │   └── UnauthenticatedChunk     no valid MAC under an accepted cluster secret
    │   └── NoteTooLarge                 a shared tier's note is over its size cap: skipped
    ├── IntegrityError(RuntimeError)     check_integrity() found broken bookkeeping
    └── ServiceError                     a local service for tests and demos (kvtier.services)
        ├── ServiceMissing               its binary or FUSE is not available: says how to install
        └── ServiceStartError            it did not come up in time: binary, ports, last log lines
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class UnknownBackendError(KvtierError, KeyError):
    """A registry lookup used a name that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message.
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(KvtierError, ImportError):
    """A registered backend needs an optional dependency that is not installed."""


class InvalidRequest(KvtierError, ValueError):
    """A request's arguments are invalid (a client's mistake); nothing was changed."""


class ProtocolError(KvtierError):
    """A control message could not be decoded, was too large, or made no sense."""


class ClientError(KvtierError):
    """Base for errors an engine-side client sees."""


class ServerUnavailable(ClientError):
    """The node server is not reachable; callers treat every chunk as a miss."""


class RequestRejected(ClientError):
    """The request was refused; ``code`` names the rule (``bad_request``, ``internal``,
    ``version``, ``protocol``) and the message says why."""

    def __init__(self, message: str, *, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


class TierError(KvtierError):
    """A storage tier below the arena failed."""


class TierIOError(TierError, OSError):
    """The backing store of a tier raised an I/O error."""


class TierTimeout(TierIOError):
    """The backing store did not answer within its time budget."""


class TierFull(TierIOError):
    """The backing store has no space left (independent of kvtier's own capacity)."""


class CorruptChunkError(TierError):
    """A stored chunk failed header or checksum verification."""


class ChunkTooLarge(CorruptChunkError):
    """A stored chunk is larger than the buffer given to read it into: not this reader's
    chunk size (a server with bigger slots may have written it), not proof of corruption."""


class UnauthenticatedChunk(CorruptChunkError):
    """A chunk of a shared tier carries no MAC, or none that an accepted cluster secret
    makes: another writer may have chosen its bytes. Never served."""


class NoteTooLarge(TierError):
    """A note on a shared tier is larger than the cap for what it is (checked from its
    size before it is read): written by a buggy or hostile peer; skipped and counted, and
    not a failure of the tier (the breaker does not count it)."""


class IntegrityError(KvtierError, RuntimeError):
    """Internal bookkeeping disagrees with itself; raised by check_integrity()."""


class ServiceError(KvtierError):
    """A local service that kvtier.services starts (SeaweedFS, redis-server) failed."""


class ServiceMissing(ServiceError):
    """A service cannot run here: its binary is not installed or FUSE is unavailable."""


class ServiceStartError(ServiceError):
    """A service did not start or answer in time; the message has its command and log tail."""
