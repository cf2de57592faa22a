"""Tenants: who a client is (its API key), and what the router enforces for it.

::

    Authorization: Bearer KEY ──sha256──► tenant ──► cache_salt := tenant salt (client's folded in)
                                                 ──► kv_transfer_params.kvtier.priority <= cap
                                                 ──► answer: kv_transfer_params.kvtier kept
                                                     only if may_see_tier_details

A tenant's salt is ``"t" + hex(HMAC-SHA256(K, json([tenant, client_salt])))`` where ``K`` is
derived from the router's salt secret (or a fixed public constant without one). vLLM folds
``cache_salt`` into the hash of a prompt's first block and the kvtier connector into the root
of its chunk keys, so two tenants never share a block or a chunk, and the router computes its
own keys (lookups, the ``prefix`` and ``cache`` strategies) from the rewritten body: the same
salt the engine sees. A client cannot pick the salt the engine sees: its own ``cache_salt`` only
splits its tenant's cache further.

Without a tenants file there is one open tenant, ``default`` (today's behaviour): bodies go
through untouched, answers whole. The tenants file (YAML or JSON) is described in
docs/router.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvtier.auth import read_private_file, read_secrets
from kvtier.config import parse
from kvtier.errors import ConfigError
from kvtier.hints import FinishRetention, parse_retention

DEFAULT_TENANT = "default"
DEFAULT_MAX_PRIORITY = 35
"""A tenant's cap when its entry does not say: the connector's default retention priority."""
MAX_TENANTS_FILE_BYTES = 1 << 20
SALT_MAX_CHARS = 128
SALT_FORBIDDEN = frozenset("@/\\\x00")
"""vLLM 0.32's rules for ``cache_salt`` (validate_cache_salt)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PUBLIC_SALT_KEY = b"kvtier tenant salt v1 (no secret)"
_SALT_CONTEXT = b"kvtier tenant salt v1"
_FIELDS = {"api_keys", "api_key_file", "api_key_env", "max_priority", "may_see_tier_details"}


class BadRequest(Exception):
    """The body breaks a rule the router enforces (answered with 400)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    max_priority: int = 100
    """The highest ``kv_transfer_params.kvtier.priority`` it may set; higher is lowered."""
    may_see_tier_details: bool = True
    """Whether answers keep ``kv_transfer_params.kvtier`` (where each prompt token came from)."""
    isolated: bool = False
    """Its requests get the tenant's cache salt (every tenant from a tenants file)."""

    @property
    def enforced(self) -> bool:
        """Whether its bodies are checked and rewritten (else they go through untouched)."""
        return self.isolated or self.max_priority < 100


OPEN = Tenant(DEFAULT_TENANT)
"""The one tenant of a router without a tenants file."""


class Tenants:
    """API keys to tenants, and the salt each tenant's requests carry."""

    def __init__(self, by_key: Mapping[str, Tenant], salt_secret: bytes | None = None) -> None:
        self._by_digest = {_digest(k): t for k, t in by_key.items()}
        self._salt_key = (hmac.new(salt_secret, _SALT_CONTEXT, hashlib.sha256).digest()
                          if salt_secret else _PUBLIC_SALT_KEY)
        self.names = sorted({t.name for t in by_key.values()})
        self.salt_secret_set = salt_secret is not None

    def __repr__(self) -> str:  # names only: never a key or the secret
        return f"Tenants({self.names})"

    @property
    def need_key(self) -> bool:
        return bool(self._by_digest)

    def identify(self, authorization: str) -> Tenant | None:
        """The tenant whose key is the bearer token of this ``Authorization`` header; with no
        key configured at all, the open tenant. The token is hashed before the lookup, so
        its timing says nothing about the keys."""
        if not self._by_digest:
            return OPEN
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_digest.get(_digest(token.strip()))

    def salt(self, tenant: Tenant, client_salt: str | None) -> str:
        msg = json.dumps([tenant.name, client_salt]).encode()
        return "t" + hmac.new(self._salt_key, msg, hashlib.sha256).hexdigest()

    def enforce(self, tenant: Tenant, body: dict[str, Any]) -> bool:
        """Applies the tenant's salt and priority cap to ``body`` in place; True if it changed
        (or must be re-encoded). Raises :class:`BadRequest` for a salt or priority vLLM or the
        connector would not accept."""
        changed = _cap_priority(body, tenant.max_priority)
        changed = stamp_tenant(body, tenant) | changed
        _check_release(tenant, body)
        if tenant.isolated:
            client_salt = body.get("cache_salt")
            check_salt(client_salt)
            body["cache_salt"] = self.salt(tenant, client_salt)
            changed = True
        return changed


def check_salt(salt: object) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > SALT_MAX_CHARS \
            or SALT_FORBIDDEN & set(salt):
        raise BadRequest("cache_salt: must be a non-empty string of at most 128 characters "
                         "without '@', '/', '\\' or NUL")


def _cap_priority(body: dict[str, Any], cap: int) -> bool:
    """Lower every priority the request's ``kvtier`` options set (its own, its retention's,
    each token range's, decode's) to the tenant's ``cap``; a retention or release the
    connector would not accept is a :class:`BadRequest` naming the key."""
    params = body.get("kv_transfer_params")
    options = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(options, dict):
        return False
    _check_retention(options)
    changed = _cap(options, "priority", cap, "kv_transfer_params.kvtier.priority")
    retention = options.get("retention")
    if isinstance(retention, dict):
        where = "kv_transfer_params.kvtier.retention"
        changed = _cap(retention, "priority", cap, f"{where}.priority") | changed
        changed = _cap(retention, "decode_priority", cap, f"{where}.decode_priority") | changed
        for i, token_range in enumerate(retention.get("ranges") or ()):
            changed = _cap(token_range, "priority", cap,
                           f"{where}.ranges[{i}].priority") | changed
    finish = options.get("finish")
    if isinstance(finish, dict):
        for reason, retain in finish.items():
            if isinstance(retain, dict):
                changed = _cap(retain, "priority", cap, "kv_transfer_params.kvtier.finish."
                               f"{reason}.priority") | changed
    return changed


def stamp_tenant(body: dict[str, Any], tenant: Tenant) -> bool:
    """Name the tenant in the request's ``kvtier`` options, if it has any (the store counts
    retention above the default against that tenant's quota): a client never names another.
    The open tenant is the store's ``default``: the name is taken out. True if changed."""
    params = body.get("kv_transfer_params")
    options = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(options, dict):
        return False
    if tenant is OPEN or (tenant.name == DEFAULT_TENANT and not tenant.isolated):
        return options.pop("tenant", None) is not None
    if options.get("tenant") == tenant.name:
        return False
    options["tenant"] = tenant.name
    return True


def _check_release(tenant: Tenant, body: dict[str, Any]) -> None:
    """A release drops a prefix to priority 0 in every tier: only for a tenant whose cache is
    its own (its salt), never for one that shares keys with others."""
    params = body.get("kv_transfer_params")
    options = params.get("kvtier") if isinstance(params, dict) else None
    if isinstance(options, dict) and options.get("release") is True and not tenant.isolated:
        raise BadRequest(f"kv_transfer_params.kvtier.release: tenant {tenant.name!r} shares "
                         "its cache with others; only a tenant with its own cache salt may "
                         "release a prefix")


def _check_retention(options: dict[str, Any]) -> None:
    if options.get("retention") is not None:
        try:
            parse_retention(options["retention"])
        except ConfigError as exc:
            raise BadRequest(str(exc)) from exc
    if options.get("finish") is not None:
        try:
            parse(FinishRetention, options["finish"], "kv_transfer_params.kvtier.finish")
        except ConfigError as exc:
            raise BadRequest(str(exc)) from exc
    release = options.get("release", False)
    if type(release) is not bool:
        raise BadRequest("kv_transfer_params.kvtier.release: expected true or false, got "
                         f"{json.dumps(release)[:40]}")
    if release and options.get("retention") is not None:
        raise BadRequest("kv_transfer_params.kvtier: release and retention exclude each other")


def _cap(options: dict[str, Any], key: str, cap: int, where: str) -> bool:
    priority = options.get(key)
    if priority is None:
        return False
    if type(priority) is not int or not 0 <= priority <= 100:
        raise BadRequest(f"{where}: expected an integer in [0, 100], got "
                         f"{json.dumps(priority)[:40]}")
    if priority <= cap:
        return False
    options[key] = cap
    return True


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# ---------------------------------------------------------------------- the tenants file


def load_tenants(path: str, legacy_key: str | None, salt_secret: bytes | None,
                 environ: Mapping[str, str] | None = None) -> Tenants:
    """Reads ``--tenants-file``. The single ``--api-key-*`` key, if given too, is the tenant
    ``default`` (isolated like the others, may see tier details, no priority cap)."""
    env = dict(os.environ if environ is None else environ)
    doc, private = _read_file(path)
    entries = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"--tenants-file {path}: expected a mapping 'tenants: {{NAME: "
                          "{api_keys: [...], max_priority: N, may_see_tier_details: "
                          "bool}}}' with at least one tenant")
    extra = set(doc) - {"tenants"}
    if extra:
        raise ConfigError(f"--tenants-file {path}: unknown key(s) {sorted(extra)}; allowed: "
                          "tenants")
    by_key: dict[str, Tenant] = {}
    if legacy_key:
        if DEFAULT_TENANT in entries:
            raise ConfigError(f"--tenants-file {path}: tenant '{DEFAULT_TENANT}' is the "
                              "--api-key-* key's; rename it or drop that option")
        by_key[legacy_key] = Tenant(DEFAULT_TENANT, 100, True, isolated=True)
    for name, spec in entries.items():
        tenant, keys = _tenant(path, name, spec, private, env)
        for key in keys:
            if key in by_key:
                raise ConfigError(f"--tenants-file {path}: tenant {name!r} has a key that "
                                  f"{by_key[key].name!r} has too; a key names one tenant")
            by_key[key] = tenant
    return Tenants(by_key, salt_secret)


def _read_file(path: str) -> tuple[Any, bool]:
    """The parsed file, and whether only its owner may read it."""
    text, private = read_private_file(path, "--tenants-file", MAX_TENANTS_FILE_BYTES,
                                      owner_only=False)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--tenants-file {path}: not YAML or JSON: {exc}") from exc
    return doc, private


def _tenant(path: str, name: object, spec: object, private: bool,
            env: dict[str, str]) -> tuple[Tenant, list[str]]:
    where = f"--tenants-file {path}: tenants.{name}"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"--tenants-file {path}: tenant name {name!r}: use 1-64 letters, "
                          "digits, '_', '.', '-'")
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: expected a mapping with {sorted(_FIELDS)}")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: "
                          f"{sorted(_FIELDS)}")
    cap = spec.get("max_priority", DEFAULT_MAX_PRIORITY)
    if type(cap) is not int or not 0 <= cap <= 100:
        raise ConfigError(f"{where}.max_priority: expected an integer in [0, 100]")
    see = spec.get("may_see_tier_details", False)
    if not isinstance(see, bool):
        raise ConfigError(f"{where}.may_see_tier_details: expected true or false")
    keys = _keys(where, spec, private, env)
    return Tenant(name, cap, see, isolated=True), keys


def _keys(where: str, spec: dict[str, Any], private: bool, env: dict[str, str]) -> list[str]:
    inline = spec.get("api_keys", [])
    if not isinstance(inline, list) or not all(isinstance(k, str) and k.strip()
                                               for k in inline):
        raise ConfigError(f"{where}.api_keys: expected a list of non-empty strings")
    if inline and not private:
        raise ConfigError(f"{where}.api_keys: the file holds keys but others may read it; "
                          "chmod 600 it, or use api_key_file / api_key_env")
    keys = [k.strip() for k in inline]
    file, var = spec.get("api_key_file"), spec.get("api_key_env")
    for value, key in ((file, "api_key_file"), (var, "api_key_env")):
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"{where}.{key}: expected a file path / variable name")
    if file:
        keys += [s.decode(errors="replace")
                 for s in read_secrets(None, file, f"{where}.api_key_file")]
    if var:
        found = read_secrets(var, None, environ=env)
        if not found:
            raise ConfigError(f"{where}.api_key_env: environment variable {var} is not set "
                              "or empty")
        keys += [s.decode(errors="replace") for s in found]
    if not keys:
        raise ConfigError(f"{where}: no API key (give api_keys, api_key_file or api_key_env)")
    return keys
