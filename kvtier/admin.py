"""``kvtier ls`` / ``kvtier gc`` / ``kvtier rm``: what the tiers hold, and making room.

Each reads the tiers of a server config straight from their backends (a server need not
run), so it sees every server's chunks on a shared tier::

    kvtier ls --config server.yaml [--json]              namespaces, chunks, bytes, ages per tier
    kvtier gc --config server.yaml [--dry-run] [--json]  one sweep of each shared tier now
    kvtier rm --config server.yaml --namespace HEX [--tier NAME] [--dry-run]

What ``gc`` and ``rm`` delete on a shared tier goes into its journal, so running servers forget
it within a poll. A node-local tier (``disk``) belongs to its server's books: ``rm`` refuses to
touch it while that server answers on its socket, and ``gc`` leaves it to the server.
"""

from __future__ import annotations

import argparse
import functools
import json
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.auth import Keyring, load_keyring
from kvtier.config import ServerConfig, TierConfig
from kvtier.errors import ConfigError, TierError
from kvtier.store import journal
from kvtier.store.sweeper import sweep
from kvtier.tables import table
from kvtier.tiers import TIERS, LowerTier, StoredChunk
from kvtier.tiers.shared import SharedTier

JOURNAL_BATCH = 4096
"""Records per journal note ``gc`` and ``rm`` write."""


@dataclass
class Usage:
    tier: str
    kind: str
    shared: bool
    namespace: str
    chunks: int = 0
    bytes: int = 0
    oldest_s: float = 0.0
    newest_s: float = 0.0


def register(sub: argparse._SubParsersAction) -> None:
    for name, func, text in (("ls", run_ls, "namespaces, chunks, bytes and ages per tier"),
                             ("gc", run_gc, "sweep the shared tiers now"),
                             ("rm", run_rm, "delete every chunk of a namespace")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="the node server's YAML config")
        p.add_argument("--tier", help="only this tier (default: all below the arena)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name != "ls":
            p.add_argument("--dry-run", action="store_true", help="say what would go")
        if name == "rm":
            p.add_argument("--namespace", required=True,
                           help="the namespace fingerprint (64 hex, or a unique prefix)")
        p.set_defaults(func=func)


def _tiers(args: argparse.Namespace) -> Iterator[tuple[TierConfig, LowerTier]]:
    config = ServerConfig.from_yaml(args.config)
    chosen = [t for t in config.tiers if args.tier in (None, t.name)]
    if args.tier and not chosen:
        raise ConfigError(f"--tier {args.tier}: no such tier; the config has "
                          f"{[t.name for t in config.tiers]}")
    for tier_config in chosen:
        tier = TIERS[tier_config.type].from_config(tier_config.name, tier_config)
        try:
            yield tier_config, tier
        finally:
            tier.close()


def run_ls(args: argparse.Namespace) -> int:
    now = time.time()
    rows: list[Usage] = []
    for config, tier in _tiers(args):
        by_ns: dict[bytes, Usage] = {}
        for chunk in tier.scan():
            row = by_ns.setdefault(chunk.namespace, Usage(
                config.name, config.type, tier.shared, chunk.namespace.hex(),
                oldest_s=0.0, newest_s=float("inf")))
            row.chunks += 1
            row.bytes += chunk.size
            row.oldest_s = max(row.oldest_s, now - chunk.mtime)
            row.newest_s = min(row.newest_s, now - chunk.mtime)
        rows += by_ns.values() or [Usage(config.name, config.type, tier.shared, "-")]
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    print(table(["tier", "type", "where", "namespace", "chunks", "bytes", "oldest", "newest"],
                [_ls_cells(r) for r in rows], align="llllrrrr"))
    return 0


def _ls_cells(r: Usage) -> list[str]:
    ages = [_age(r.oldest_s), _age(r.newest_s)] if r.chunks else ["-", "-"]
    return [r.tier, r.kind, "shared" if r.shared else "local", r.namespace[:16], str(r.chunks),
            f"{r.bytes:,}", *ages]


def run_gc(args: argparse.Namespace) -> int:
    out: list[dict[str, object]] = []
    for config, tier in _tiers(args):
        if not isinstance(tier, SharedTier):
            out.append({"tier": config.name, "skipped": "a local tier is kept by its server"})
            continue
        keyring = _keyring(args)
        report = sweep(tier, config.capacity_bytes, dry_run=args.dry_run,
                       deleted=functools.partial(_journal, tier, keyring=keyring),
                       keyring=keyring)
        out.append({"tier": config.name, "dry_run": args.dry_run,
                    "usage": {ns.hex(): used for ns, used in report.usage.items()},
                    "deleted_chunks": len(report.deleted),
                    "deleted_bytes": report.deleted_bytes,
                    "notes_deleted": report.notes_deleted,
                    "temps_deleted": report.temps_deleted})
    _print(out, args.json, "would delete" if args.dry_run else "deleted")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    """Resolve the namespace across every chosen tier first (ambiguous: nothing deleted),
    then delete tier by tier."""
    prefix = args.namespace.lower()
    found: dict[str, list[StoredChunk]] = {}
    for config, tier in _tiers(args):
        if not tier.shared and _server_answers(args.config):
            raise ConfigError(f"tier {config.name} is local and its server is running: stop "
                              "it first (its books would no longer match the files)")
        found[config.name] = [c for c in tier.scan() if c.namespace.hex().startswith(prefix)]
    spaces = {c.namespace for chunks in found.values() for c in chunks}
    if len(spaces) > 1:
        raise ConfigError(f"--namespace {args.namespace} matches {len(spaces)} namespaces "
                          "across the tiers: give more of it (nothing was deleted)")
    out: list[dict[str, object]] = []
    for config, tier in _tiers(args):
        chunks = found.get(config.name, [])
        if not args.dry_run:
            for chunk in chunks:
                tier.delete(chunk.key, namespace=chunk.namespace)
            if isinstance(tier, SharedTier):
                _journal(tier, chunks, keyring=_keyring(args))
        out.append({"tier": config.name, "dry_run": args.dry_run,
                    "deleted_chunks": len(chunks),
                    "deleted_bytes": sum(c.size for c in chunks)})
    _print(out, args.json, "would delete" if args.dry_run else "deleted")
    return 0


def _keyring(args: argparse.Namespace) -> Keyring | None:
    """The cluster secret the config names (its notes must be signed as the servers' are)."""
    auth = ServerConfig.from_yaml(args.config).auth
    return load_keyring(auth.shared_secret_env, auth.shared_secret_file)


def _journal(tier: SharedTier, chunks: list[StoredChunk], *,
             keyring: Keyring | None = None) -> None:
    """Tell running servers what went (as a server of its own would), in notes of at most
    JOURNAL_BATCH records (a server's notes are no bigger), signed with the cluster secret
    when there is one."""
    server = "c" + secrets.token_hex(7)
    for seq, start in enumerate(range(0, len(chunks), JOURNAL_BATCH)):
        records = [journal.Record("-", c.namespace, c.key)
                   for c in chunks[start : start + JOURNAL_BATCH]]
        name = journal.note_name(int(time.time() * 1000), server, seq)
        try:
            data = journal.encode(records)
            tier.put_note(name, data if keyring is None
                          else keyring.sign_note(tier.note_scope, name, data))
        except TierError as exc:
            print(f"kvtier: could not journal {len(chunks) - start} deletes on {tier.name} "
                  f"({exc}); servers find them missing on their next read", file=sys.stderr)
            return


def _server_answers(config_path: str) -> bool:
    config = ServerConfig.from_yaml(config_path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(config.socket_path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _print(rows: list[dict[str, object]], as_json: bool, verb: str) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        if "skipped" in row:
            print(f"{row['tier']}: skipped ({row['skipped']})")
        else:
            print(f"{row['tier']}: {verb} {row['deleted_chunks']} chunks, "
                  f"{row['deleted_bytes']:,} bytes")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
