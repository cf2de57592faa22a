"""Who may write a shared tier: the cluster secret and the MACs made with it.

Every server of a shared tier reads what the others wrote. Checksums (xxh3, :mod:`kvtier.codec`)
catch accidents, not a writer who picks the bytes. With a cluster secret every chunk and note a
server writes to a shared tier carries a MAC over everything that decides what it means — for
a chunk the header (namespace, key, token count, payload length) and the payload, for a note the
tier it was written for, its name and its bytes — and what fails it is never served or
applied::

    secrets (env or an owner-only file, one per line)  ──derive──►  per secret:
        chunk key  = HMAC-SHA256(secret, "kvtier chunk MAC v1")     AES-256 key
        note key   = HMAC-SHA256(secret, "kvtier note MAC v2")
        key id     = HMAC-SHA256(secret, "kvtier key id v1")[:8]    names the secret, not it

    chunk MAC: GMAC (AES-256-GCM, a fresh random 96-bit nonce per seal) over the header and
               the payload; 13-16 GB/s on one core with AES-NI, against 4 GB/s for keyed
               BLAKE3 and 20 GB/s for the xxh3 checksum it replaces on authenticated reads
    note MAC:  HMAC-SHA256 over the tier's scope, the note's name and its bytes (notes are
               small); the scope (``SharedTier.note_scope``: S3 bucket and prefix, Redis
               database and key prefix, the fs path or ``tier_id``) is configuration, the same
               on every server of a tier, so a note copied from another tier fails it

The first secret signs; every listed secret is accepted (rotation: add the new one second on
every server, then move it first, then drop the old one). The secrets never enter the config,
a log line, ``describe()`` or ``repr``. Without a secret nothing is signed or checked and a
server trusts every writer of its shared tiers (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import ConfigError

MIN_SECRET_BYTES = 16
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
NOTE_MAC_BYTES = 32
MAX_SCOPE_BYTES = 1024
NOTE_MAGIC = b"KVT2"
OLD_NOTE_MAGIC = b"KVTN"
"""Notes signed before notes were bound to their tier: refused (:class:`NoteRefusal`)."""
NOTE_OVERHEAD = len(NOTE_MAGIC) + KEY_ID_BYTES + 2 + NOTE_MAC_BYTES
"""A signed note's frame, besides its scope and its bytes."""
_CHUNK_CONTEXT = b"kvtier chunk MAC v1"
_NOTE_CONTEXT = b"kvtier note MAC v2"
_ID_CONTEXT = b"kvtier key id v1"


def _derive(context: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, context, hashlib.sha256).digest()


@dataclass(frozen=True, repr=False)
class _Key:
    key_id: bytes
    chunk: AESGCM
    note: bytes

    def note_mac(self, scope: str, name: str, data: bytes) -> bytes:
        where = scope.encode()
        message = len(where).to_bytes(4, "big") + where + name.encode() + b"\0" + data
        return hmac.new(self.note, message, hashlib.sha256).digest()


class Why(Enum):
    """Why a note was not opened; the value is its ``kvtier_untrusted_total`` ``what``."""

    UNSIGNED = "note_unsigned"
    """No signature, a secret not accepted here, or a MAC that fails: a forgery or damage."""
    OTHER_TIER = "note_other_tier"
    """Signed with an accepted secret for another tier (a copy from another tier of the
    cluster, or a server of this tier whose ``tier_id`` or fs path differs)."""
    OLD_FORMAT = "note_old_format"
    """Framed as a kvtier from before notes named their tier framed them (its servers during
    a rolling upgrade, or a copy of one): refused unchecked, as it could be from any tier."""


@dataclass(frozen=True)
class NoteRefusal:
    """A note not opened, and why; ``scope`` is the tier an ``OTHER_TIER`` note names."""

    why: Why
    scope: str = ""


@dataclass(frozen=True, repr=False)
class Keyring:
    """The accepted secrets, derived into MAC keys; the first one signs."""

    _keys: tuple[_Key, ...]
    _by_id: dict[bytes, _Key] = field(init=False)

    def __post_init__(self) -> None:
        if not self._keys:
            raise ValueError("a keyring needs at least one secret")
        object.__setattr__(self, "_by_id", {k.key_id: k for k in self._keys})

    @classmethod
    def from_secrets(cls, secrets: Sequence[bytes]) -> Keyring:
        for i, secret in enumerate(secrets):
            if len(secret) < MIN_SECRET_BYTES:
                raise ConfigError(f"cluster secret #{i + 1} is {len(secret)} bytes; at least "
                                  f"{MIN_SECRET_BYTES} are required")
        return cls(tuple(_Key(_derive(_ID_CONTEXT, s)[:KEY_ID_BYTES],
                              AESGCM(_derive(_CHUNK_CONTEXT, s)), _derive(_NOTE_CONTEXT, s))
                         for s in secrets))

    def __repr__(self) -> str:
        return f"Keyring({len(self._keys)} secrets, signing key id {self.signing_id.hex()})"

    @property
    def signing_id(self) -> bytes:
        return self._keys[0].key_id

    @property
    def key_ids(self) -> list[str]:
        """The accepted key ids in hex (safe to show: they do not reveal the secrets)."""
        return [k.key_id.hex() for k in self._keys]

    # ------------------------------------------------------------------ chunks

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def chunk_tag(self, key_id: bytes, nonce: bytes, header: bytes,
                  payload: bytes | memoryview) -> bytes | None:
        """The GMAC tag of ``header`` and ``payload`` under the secret named ``key_id``
        (``None`` for a key id that is not accepted). ``header`` is the GCM plaintext
        (short; its ciphertext is dropped), ``payload`` the associated data, so the one tag
        binds both."""
        key = self._by_id.get(bytes(key_id))
        if key is None:
            return None
        return key.chunk.encrypt(bytes(nonce), header, payload)[-TAG_BYTES:]

    # ------------------------------------------------------------------ notes

    def sign_note(self, scope: str, name: str, data: bytes) -> bytes:
        """``data`` framed with the signing key's id, the tier's ``scope`` and a MAC over
        the scope, the note's name and its bytes: a signed note cannot be replayed under
        another name or date, nor in another tier."""
        key = self._keys[0]
        where = scope.encode()
        if len(where) > MAX_SCOPE_BYTES:
            raise ValueError(f"a tier's scope is at most {MAX_SCOPE_BYTES} bytes")
        return (NOTE_MAGIC + key.key_id + len(where).to_bytes(2, "big") + where
                + key.note_mac(scope, name, data) + data)

    def open_note(self, scope: str, name: str, blob: bytes) -> bytes | NoteRefusal:
        """The bytes of a note signed by an accepted secret for the tier ``scope`` under
        ``name``; otherwise why not."""
        if blob.startswith(OLD_NOTE_MAGIC):
            return NoteRefusal(Why.OLD_FORMAT)
        if len(blob) < NOTE_OVERHEAD or not blob.startswith(NOTE_MAGIC):
            return NoteRefusal(Why.UNSIGNED)
        at = len(NOTE_MAGIC)
        key = self._by_id.get(blob[at:at + KEY_ID_BYTES])
        at += KEY_ID_BYTES
        size = int.from_bytes(blob[at:at + 2], "big")
        at += 2
        if key is None or len(blob) < NOTE_OVERHEAD + size:
            return NoteRefusal(Why.UNSIGNED)
        try:
            signed_for = blob[at:at + size].decode()
        except UnicodeDecodeError:
            return NoteRefusal(Why.UNSIGNED)
        at += size
        mac, data = blob[at:at + NOTE_MAC_BYTES], blob[at + NOTE_MAC_BYTES:]
        if not hmac.compare_digest(mac, key.note_mac(signed_for, name, data)):
            return NoteRefusal(Why.UNSIGNED)
        if signed_for != scope:
            return NoteRefusal(Why.OTHER_TIER, signed_for)
        return data


def read_secrets(env_name: str | None, file: str | None, what: str = "cluster secret",
                 environ: dict[str, str] | None = None) -> list[bytes]:
    """Secrets from an owner-only file (one per line) if ``file`` is set, else from the
    environment variable ``env_name`` (separated by commas); ``[]`` when neither is set.
    Errors name the source, never a secret."""
    environ = dict(os.environ) if environ is None else environ
    if file:
        return _from_file(file, what)
    raw = environ.get(env_name or "", "")
    return [s.strip().encode() for s in raw.split(",") if s.strip()]


MAX_SECRET_FILE_BYTES = 64 << 10


def read_private_file(path: str, what: str, max_bytes: int = MAX_SECRET_FILE_BYTES, *,
                      owner_only: bool = True) -> tuple[bytes, bool]:
    """The bytes of the regular file at ``path``, and whether only its owner may read it.

    The one reader of files that hold secrets (the cluster secret, the node token, a Redis
    password, the router's tenants): never through a symbolic link, never blocking on a FIFO,
    at most ``max_bytes``; with ``owner_only`` a file others may read is refused (chmod 600).
    Errors name ``what`` and the path, never the content.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what}: {path} is not a regular file")
        private = not info.st_mode & 0o077
        if owner_only and not private:
            raise ConfigError(f"{what}: {path} is readable by others (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(f"{what}: {path} is larger than {max_bytes} bytes")
    return data, private


def _from_file(path: str, what: str) -> list[bytes]:
    text, _ = read_private_file(path, f"{what} file")
    secrets = [line.strip() for line in text.splitlines()]
    found = [s for s in secrets if s and not s.startswith(b"#")]
    if not found:
        raise ConfigError(f"{what} file {path}: holds no secret")
    return found


def load_keyring(env_name: str | None, file: str | None,
                 environ: dict[str, str] | None = None) -> Keyring | None:
    """The cluster keyring from its sources, ``None`` when no secret is configured."""
    secrets = read_secrets(env_name, file, environ=environ)
    return Keyring.from_secrets(secrets) if secrets else None
