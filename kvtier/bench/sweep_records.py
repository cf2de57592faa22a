"""Each finished run of a sweep in a file of its own, so that a killed sweep loses none.

The moment a run ends, :func:`keep` writes ``OUT/runs/<config>-h<history>-u<users>-r<repeat>.json``
(to a temporary name, then renamed: a file is whole or absent) with the run's figures, the
point it belongs to, a digest of the sweep's settings and the invocation that ran it (command,
commit, machine, start time). ``sweep.json`` is written after it, from memory; a sweep killed
between the two, or while writing, still has the run. On the next start :func:`recover` puts
every kept run that ``sweep.json`` lacks back into it, so the rerun skips it.

A record made with other settings is refused (the sweep's points would not be comparable);
a file that is too large, no regular file (a link, a FIFO) or does not parse is skipped with a
warning, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.mr_output import write_json
from kvtier.bench.sweep_runs import find, put_run
from kvtier.errors import ConfigError

RUNS = "runs"
MAX_RECORD_BYTES = 1 << 20


def digest(settings: dict[str, Any]) -> str:
    """The settings' fingerprint (canonical JSON, sha256)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def name_of(config: str, users: int, history: int, repeat: int) -> str:
    return f"{config.replace('+', '_')}-h{history}-u{users}-r{repeat}.json"


def keep(out: Path, config: str, description: str, users: int, history: int,
         run: dict[str, Any], settings_sha256: str, invocation: dict[str, Any]) -> Path:
    """Write the record of one finished run (atomically) and return its path."""
    path = out / RUNS / name_of(config, users, history, int(run["repeat"]))
    write_json({"config": config, "description": description, "users": users,
                "history_tokens": history,
                "settings_sha256": settings_sha256, "invocation": invocation, "run": run},
               path)
    return path


def recover(out: Path, doc: dict[str, Any], settings_sha256: str) -> int:
    """Put the runs recorded under ``out/runs`` that ``doc`` lacks into it; returns how many.
    Raises ``ConfigError`` when a record was made with other settings."""
    folder = out / RUNS
    if not folder.is_dir():
        return 0
    added = 0
    for path in sorted(folder.glob("*.json")):
        record = _read(path)
        if record is None:
            continue
        if record["settings_sha256"] != settings_sha256:
            raise ConfigError(f"{path} was made with other settings than this sweep's; "
                              "use --fresh to start over or another --out")
        if _has(doc, record):
            continue
        cfg = doc["configs"].setdefault(record["config"], {
            "description": record.get("description", ""), "points": [], "failure": None})
        run = dict(record["run"])
        run["invocation"] = _invocation_index(doc, record["invocation"])
        put_run(cfg["points"], record["users"], record["history_tokens"], run)
        added += 1
    return added


def forget(out: Path) -> None:
    """Drop every record (``--fresh``); other files of the folder stay."""
    folder = out / RUNS
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)


def _has(doc: dict[str, Any], record: dict[str, Any]) -> bool:
    cfg = doc["configs"].get(record["config"])
    point = find(cfg["points"], record["users"], record["history_tokens"]) if cfg else None
    return point is not None and any(r.get("repeat") == record["run"]["repeat"]
                                     for r in point["runs"])


def _invocation_index(doc: dict[str, Any], invocation: dict[str, Any]) -> int:
    invocations = doc.setdefault("invocations", [])
    if invocation not in invocations:  # the killed process never saved sweep.json
        invocations.append(invocation)
    return int(invocations.index(invocation))


def _read(path: Path) -> dict[str, Any] | None:
    """A record, or None (with a warning) when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
        record = json.loads(raw)
        if not (isinstance(record, dict) and isinstance(record.get("config"), str)
                and isinstance(record.get("users"), int)
                and isinstance(record.get("history_tokens"), int)
                and isinstance(record.get("settings_sha256"), str)
                and isinstance(record.get("invocation"), dict)
                and isinstance(record.get("run"), dict)
                and isinstance(record["run"].get("repeat"), int)):
            raise ValueError("not a sweep run record")
    except (OSError, ValueError) as exc:
        print(f"kvtier bench sweep: skipping {path}: {exc}", file=sys.stderr)
        return None
    return record
