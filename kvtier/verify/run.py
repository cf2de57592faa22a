"""``kvtier verify``: the seed's five-step check of a tiered stack, automated.

Against any OpenAI-compatible entry point in front of kvtier instances (``kvtier route``,
vllm-router, or one instance):

1. **entry point** — it answers (and so do the node servers and instances named);
2. **long prefix** — a request with a long, fresh prefix is served (and stored);
3. **shared tier** — chunks of it appear in the shared tier (node servers' ``/v1/stats``,
   or the files under ``--shared-path``);
4. **similar request** — the same prefix with a new suffix is served from cache, faster;
5. **another instance** — an instance known to differ from the one that computed the prefix
   serves it from the shared tier (the request of step 4 if it went elsewhere, else up to
   ``attempts`` more until one does). When who served step 2 is not known, the instance
   must differ from the one that served step 4, and step 4's own request does not count;
   when neither is known, the step fails (nothing shows a second instance). An entry point
   that keeps sending the prefix to the instance holding it (a cache-aware router does, by
   design) is not a failure: when the instances' own URLs are known, the last request goes
   to another instance directly, and the step says so.

Each step prints what it saw; the exit status is 0 only if all five passed, and a failed
step is named. Where a prompt's KV came from is read from the response
(``kv_transfer_params.kvtier``, ``usage.prompt_tokens_details.cached_tokens``) and from the
node servers' counters, whichever the entry point lets through.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.httpjson import HttpError, get_json, post_json
from kvtier.verify.observe import InstanceView, Snapshot, chunk_files, hits_by_tier, served_by

STEPS = ("entry point", "long prefix", "shared tier", "similar request", "another instance")


@dataclass(frozen=True)
class VerifyOptions:
    url: str
    kvtier_servers: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    """The instances' own URLs, in the order of ``kvtier_servers`` (tells who served)."""
    shared_path: Path | None = None
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Never shown (not in the repr, never printed)."""
    node_token: str | None = field(default=None, repr=False)
    """The bearer token of the node servers' HTTP APIs; never shown either."""
    api: str = "completions"
    prefix_chars: int = 12000
    max_tokens: int = 4
    attempts: int = 4
    """Requests sent in step 5 to land on another instance."""
    wait_s: float = 30.0
    """How long step 3 waits for the shared tier's writes."""
    timeout_s: float = 300.0

    @classmethod
    def from_stack(cls, state: Mapping[str, Any], **overrides: Any) -> VerifyOptions:
        """The options for a stack ``kvtier serve --instances`` runs (its stack.json)."""
        instances = list(state.get("instances") or [])
        router = (state.get("router") or {}).get("url")
        shared = state.get("shared") or {}
        path = (shared.get("options") or {}).get("path") if shared.get("type") == "fs" else None
        values: dict[str, Any] = {
            "url": router or (instances[0]["url"] if instances else ""),
            "kvtier_servers": tuple(i["node"] for i in instances),
            "backends": tuple(i["url"] for i in instances),
            "shared_path": Path(path) if path else None,
        }
        values.update(overrides)
        return cls(**values)


@dataclass
class Sent:
    """One request and what was seen of it."""

    seconds: float
    response: dict[str, Any]
    instance: int | None
    node_hits: dict[str, int]

    @property
    def usage(self) -> dict[str, Any]:
        return dict(self.response.get("usage") or {})

    @property
    def accounting(self) -> dict[str, Any]:
        return dict((self.response.get("kv_transfer_params") or {}).get("kvtier") or {})

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return int(value) if isinstance(value, int) else None

    def tokens_from(self) -> dict[str, int]:
        """Prompt tokens by where their KV came from (kvtier's accounting), else {}."""
        tokens = self.accounting.get("tokens") or {}
        return {k: int(v) for k, v in tokens.items() if v}

    def cache_tokens(self, chunk_tokens: int) -> int:
        """Prompt tokens not recomputed, from the best evidence at hand."""
        tokens = self.tokens_from()
        if tokens:
            return sum(v for k, v in tokens.items() if k != "recomputed")
        if self.cached_tokens is not None:
            return self.cached_tokens
        return sum(self.node_hits.values()) * chunk_tokens

    def where(self) -> str:
        parts = []
        if self.instance is not None:
            parts.append(f"on instance {self.instance}")
        tokens = self.tokens_from()
        if tokens:
            parts.append("prompt tokens " + ", ".join(f"{k} {v}" for k, v in tokens.items()))
        if self.cached_tokens is not None:
            parts.append(f"cached_tokens {self.cached_tokens}")
        if self.node_hits:
            parts.append("node server leased " + ", ".join(
                f"{n} chunk(s) from {t}" for t, n in self.node_hits.items()))
        return "; ".join(parts) or "no cache accounting visible"


@dataclass
class Verification:
    o: VerifyOptions
    say: Callable[[str], None] = print
    views: list[InstanceView] = field(default_factory=list)
    model: str = ""
    shared: set[str] = field(default_factory=set)
    chunk_tokens: int = 256
    prefix: str = ""
    failed: list[str] = field(default_factory=list)
    _before: Snapshot = field(default_factory=Snapshot)
    _files_before: int = 0

    def __post_init__(self) -> None:
        n = max(len(self.o.kvtier_servers), len(self.o.backends))
        self.views = [InstanceView(i, _at(self.o.kvtier_servers, i), _at(self.o.backends, i),
                                   self.o.node_token) for i in range(n)]

    # ------------------------------------------------------------------ plumbing

    @property
    def headers(self) -> dict[str, str]:
        key = self.o.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def report(self, step: int, ok: bool, text: str) -> bool:
        self.say(f"[{step}/5] {STEPS[step - 1]:<16} {'ok  ' if ok else 'FAIL'} {text}")
        if not ok:
            self.failed.append(f"{step} ({STEPS[step - 1]})")
        return ok

    def send(self, suffix: str, user: str | None = None, *, url: str | None = None) -> Sent:
        """The prefix with ``suffix``, to the entry point (or to ``url``, an instance: the
        entry point's API key is not sent there, it is the router's tenants' secret)."""
        prompt = f"{self.prefix}\n{suffix}"
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.o.max_tokens,
                                "temperature": 0.0}
        if self.o.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        if user is not None:
            body["user"] = user
        before = Snapshot.take(self.views)
        start = time.perf_counter()
        response = post_json(f"{url or self.o.url}{path}", body, timeout_s=self.o.timeout_s,
                             headers=self.headers if url is None else {})
        seconds = time.perf_counter() - start
        time.sleep(0.2)  # counters settle (vLLM's /metrics lags a request by a moment)
        after = Snapshot.take(self.views)
        who = served_by(before, after)
        hits = hits_by_tier(before, after, who) if who is not None else {}
        return Sent(seconds, dict(response), who, hits)

    def shared_tokens(self, sent: Sent) -> int:
        """Tokens of ``sent`` that came from a shared tier."""
        from_acct = sum(v for k, v in sent.tokens_from().items() if k in self.shared)
        from_node = sum(n for t, n in sent.node_hits.items() if t in self.shared)
        return max(from_acct, from_node * self.chunk_tokens)

    # ------------------------------------------------------------------ the steps

    def run(self) -> int:
        self.say(f"kvtier verify: {self.o.url}")
        if not self.entry_point():
            return self._verdict()
        first = self.long_prefix()
        if first is None:
            return self._verdict()
        self.shared_tier(first)
        second = self.similar(first)
        self.another_instance(first, second)
        return self._verdict()

    def entry_point(self) -> bool:
        try:
            models = get_json(f"{self.o.url}/v1/models", headers=self.headers)
            self.model = self.o.model or str(models["data"][0]["id"])
        except (HttpError, KeyError, IndexError, TypeError) as exc:
            return self.report(1, False, f"{self.o.url}/v1/models: {exc}")
        seen = [f"model {self.model!r}"]
        missing = []
        for view in self.views:
            shared = view.shared_tiers() if view.node else {}
            if view.node and view.stats() is None:
                missing.append(view.stats_or_error()[1] or view.node)
            self.shared |= set(shared)
            self.chunk_tokens = _chunk_tokens(view) or self.chunk_tokens
        if self.views:
            seen.append(f"{len(self.views)} instance(s)")
        if missing:
            return self.report(1, False, f"node server(s) not answering: {'; '.join(missing)}")
        seen.append("shared tier(s) " + (", ".join(sorted(self.shared)) or "none seen"))
        return self.report(1, True, "; ".join(seen))

    def long_prefix(self) -> Sent | None:
        from kvtier.demo.model import corpus_text

        text = corpus_text()
        body = (text * (self.o.prefix_chars // max(1, len(text)) + 1))[: self.o.prefix_chars]
        self.prefix = f"kvtier verify {uuid.uuid4().hex}\n{body}"
        self._before = Snapshot.take(self.views)
        self._files_before = chunk_files(self.o.shared_path) if self.o.shared_path else 0
        try:
            sent = self.send("Question 1: what is this text about?")
        except HttpError as exc:
            self.report(2, False, str(exc))
            return None
        tokens = int(sent.usage.get("prompt_tokens") or 0)
        if tokens and tokens < 2 * self.chunk_tokens:
            self.report(2, False, f"only {tokens} prompt tokens: too short to store a chunk "
                        "(raise --prefix-chars)")
            return None
        stored = sent.accounting.get("stored_chunks")
        extra = f"; stored {stored} chunk(s)" if stored is not None else ""
        self.report(2, True, f"{tokens or '?'} prompt tokens in {sent.seconds:.2f} s; "
                    f"{sent.where()}{extra}")
        return sent

    def shared_tier(self, first: Sent) -> bool:
        if not self.shared and self.o.shared_path is None:
            why = ("no kvtier server has a shared tier" if self.views
                   else "nothing to look in: give --kvtier-servers or --shared-path")
            return self.report(3, False, why)
        tokens = int(first.usage.get("prompt_tokens") or 0)
        want = max(1, tokens // self.chunk_tokens)
        deadline = time.monotonic() + self.o.wait_s
        while True:  # every instance must see them: the next request may go anywhere
            seen = self._shared_growth()
            if (seen and min(seen.values()) >= want) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        ok = bool(seen) and min(seen.values()) > 0
        text = "; ".join(f"{where}: +{n}" for where, n in seen.items()) or "nothing"
        return self.report(3, ok, f"new chunks (of {want} in the prompt): {text}")

    def _shared_growth(self) -> dict[str, int]:
        """New chunks in each shared tier as each instance's node server counts them, and
        new files under --shared-path."""
        out: dict[str, int] = {}
        now = Snapshot.take(self.views)
        for name in sorted(self.shared):
            for i in range(len(self.views)):
                key = f"chunks|{name}"
                if key in now.samples[i]:
                    rise = now.samples[i][key] - self._before.samples[i].get(key, 0.0)
                    out[f"{name!r} seen by instance {i}"] = int(rise)
        if self.o.shared_path is not None:
            out[f"files in {self.o.shared_path}"] = (chunk_files(self.o.shared_path)
                                                     - self._files_before)
        return out

    def similar(self, first: Sent) -> Sent | None:
        try:
            sent = self.send("Question 2: and what comes next?")
        except HttpError as exc:
            self.report(4, False, str(exc))
            return None
        prompt = int(sent.usage.get("prompt_tokens") or 0)
        cached = sent.cache_tokens(self.chunk_tokens)
        faster = sent.seconds < first.seconds
        ok = faster and cached >= max(1, prompt // 2)
        self.report(4, ok, f"same prefix, new suffix: {sent.seconds:.2f} s vs "
                    f"{first.seconds:.2f} s ({first.seconds / max(sent.seconds, 1e-6):.1f}x); "
                    f"{cached} of {prompt or '?'} prompt tokens from cache; {sent.where()}")
        return sent

    def another_instance(self, first: Sent, second: Sent | None) -> bool:
        """Step 5: a request served by an instance known to differ from the one that computed
        the prefix (step 2's), or — when that one is not known — from the one that served
        step 4, with prompt tokens from the shared tier. Step 4's own request counts only
        when it is known to have gone elsewhere than step 2's."""
        home = first.instance
        ref = home if home is not None else (second.instance if second is not None else None)
        if ref is None:
            return self.report(5, False, "cannot tell which instance served steps 2 and 4, so "
                               "not whether another one serves now (give --backends or "
                               "--kvtier-servers, or --stack)")
        tried = [second] if second is not None and home is not None else []
        for k in range(self.o.attempts):
            if any(s.instance is not None and s.instance != ref for s in tried):
                break
            try:
                tried.append(self.send(f"Question {3 + k}: once more?", user=f"verify-{k}"))
            except HttpError as exc:
                return self.report(5, False, str(exc))
        elsewhere = [s for s in tried if s.instance is not None and s.instance != ref]
        what = "which computed it" if home is not None else "which served step 4"
        how = ""
        if not elsewhere:
            other = next((v for v in self.views if v.index != ref and v.backend), None)
            if other is None or other.backend is None:
                return self.report(5, False, f"all {len(tried)} similar request(s) went to "
                                   f"instance {ref} ({what}) or to an instance not known")
            try:
                sent = self.send("Question 9: asked directly?", url=other.backend)
            except HttpError as exc:
                return self.report(5, False, f"instance {other.index} directly: {exc}")
            elsewhere = [replace(sent, instance=other.index)]
            how = (f"the entry point sent all {len(tried)} similar request(s) to instance "
                   f"{ref}, which holds it, so instance {other.index} was asked directly; ")
        sent = max(elsewhere, key=self.shared_tokens)
        n = self.shared_tokens(sent)
        return self.report(5, n > 0, f"{how}instance {sent.instance} (not instance {ref}, "
                           f"{what}) served {n} prompt tokens from the shared tier; "
                           f"{sent.where()}")

    def _verdict(self) -> int:
        if self.failed:
            self.say(f"kvtier verify: FAILED step {', '.join(self.failed)}")
            return 1
        self.say("kvtier verify: all 5 steps passed")
        return 0


def verify(options: VerifyOptions, say: Callable[[str], None] = print) -> int:
    return Verification(options, say).run()


def api_key_from_env() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _at(items: tuple[str, ...], i: int) -> str | None:
    return items[i].rstrip("/") if i < len(items) and items[i] else None


def _chunk_tokens(view: InstanceView) -> int | None:
    if view.node is None:
        return None
    try:
        namespaces = view.node_json("/v1/namespaces")
    except HttpError:
        return None
    for ns in namespaces if isinstance(namespaces, list) else []:
        if isinstance(ns, dict) and isinstance(ns.get("chunk_tokens"), int):
            return int(ns["chunk_tokens"])
    return None
