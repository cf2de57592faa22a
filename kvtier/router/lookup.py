"""Asking node servers what they hold of a prompt (``POST /v1/lookup``), in parallel.

A server that does not answer within ``timeout_s`` (or answers with an error) counts as
holding nothing: a lookup must never make routing slower than routing without it. One that
fails :data:`FAILURES_TO_OPEN` lookups in a row is not asked for a while (:class:`Breaker`;
logged once when it stops and once when it answers again), so that a node server that hangs
does not add the timeout to every decision. A strategy need not wait for every answer:
:meth:`NodeLookups.many` returns as soon as the answers in hand settle the choice (the
``cache`` strategy's bound), and sends none when what the router knows settles it already.
With a node token every lookup carries ``Authorization: Bearer TOKEN``; failures are counted
under the server's URL with its credentials redacted.

With :class:`~kvtier.router.holdings.Holdings`, every answer (waited for or not) is
remembered, and :meth:`NodeLookups.many` sends only the lookups that memory cannot answer
(counted in ``recalled``). One memory answered at a lower tier's pace older than a second is
sent anyway, in the background, to renew it (counted in ``refreshed``; at most one at a time
per node server): the decision does not wait for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import aiohttp
from prometheus_client import Counter, Histogram

from kvtier.keys import ChunkKey
from kvtier.router.holdings import Answer, Holdings, shared_tiers
from kvtier.router.redact import redact_url

log = logging.getLogger("kvtier.router")

__all__ = ["NOTHING", "Answer", "Breaker", "NodeLookups"]

NOTHING: Answer = ((), ())
FAILURES_TO_OPEN = 3
ASK, PROBE = "ask", "probe"
ANSWER_BYTES_PER_KEY = 64
ANSWER_BYTES = 4096
"""An answer larger than this plus :data:`ANSWER_BYTES_PER_KEY` a key asked is refused
unread (a node server answers each key with a tier name and an arrival time)."""
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class NodeLookups:
    def __init__(self, session: aiohttp.ClientSession, timeout_s: float,
                 failures: Counter | None = None, headers: Mapping[str, str] | None = None,
                 took: Histogram | None = None, spared: Counter | None = None,
                 holdings: Holdings | None = None, recalled: Counter | None = None,
                 refreshed: Counter | None = None) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures = failures
        self.headers = dict(headers or {})
        self.took = took
        self.spared = spared
        self.holdings = holdings
        self.recalled = recalled
        self.refreshed = refreshed
        self._breakers: dict[str, Breaker] = {}
        self._background: set[asyncio.Future[Answer]] = set()
        self._refreshing: set[str] = set()
        """Node servers with a background lookup out (renewing a remembered pace)."""

    async def many(self, asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]],
                   enough: Callable[[Mapping[tuple[str, bytes], Answer]], bool] | None = None
                   ) -> dict[tuple[str, bytes], Answer]:
        """One lookup per (node server URL, namespace) pair, all at once, but for those the
        holdings answer (one they answer at an old pace is also asked in the background, not
        waited for: :meth:`_refresh`). Returns when all have answered, or as soon as
        ``enough(answers so far)`` says the others cannot change anything (asked first with
        the recalled ones only: then none is sent). Those not waited for finish in the
        background (bounded by ``timeout_s``; their connections go back to the pool). Both
        are counted in ``spared``; the time waited goes to ``took``."""
        answers: dict[tuple[str, bytes], Answer] = {}
        due: frozenset[tuple[str, bytes]] = frozenset()
        if self.holdings is not None:
            recalled = self.holdings.recall_all(asks)
            answers, due = dict(recalled.answers), recalled.due
            if answers and self.recalled is not None:
                self.recalled.inc(len(answers))
        rest = {ask: keys for ask, keys in asks.items() if ask not in answers}
        if not rest or (enough is not None and enough(answers)):
            if rest and self.spared is not None:
                self.spared.inc(len(rest))
            self._renew(due, asks, set())
            return answers
        self._renew(due, asks, {url for url, _ in rest})
        start = time.perf_counter()
        tasks = {asyncio.ensure_future(self.one(ask[0], keys)): ask
                 for ask, keys in rest.items()}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answers[tasks[task]] = task.result()
                if pending and enough is not None and enough(answers):
                    break
        finally:
            for task in pending:  # not cancelled: that would close their connections
                self._keep(task)
        if pending and self.spared is not None:
            self.spared.inc(len(pending))
        if self.took is not None and tasks:
            self.took.observe(time.perf_counter() - start)
        return answers

    def keep(self, urls: Iterable[str]) -> None:
        """Forget the breakers of every node server but ``urls`` (the backends' set
        changed)."""
        kept = set(urls)
        for url in [u for u in self._breakers if u not in kept]:
            del self._breakers[url]

    async def close(self) -> None:
        """Cancels the lookups still out in the background (before the session closes: they
        would fail against it, and count as the node server's failures)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _renew(self, due: Iterable[tuple[str, bytes]],
               asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]], asking: set[str]) -> None:
        """Refreshes the node servers of ``due`` but those being asked now (``asking``:
        their answers renew the pace anyway)."""
        for ask in due:
            if ask[0] not in asking:
                self._refresh(ask[0], asks[ask])

    def _refresh(self, url: str, keys: Sequence[ChunkKey]) -> None:
        """Asks ``url`` about ``keys`` in the background (its answer goes to the memory),
        unless a lookup sent so is out there already."""
        if url in self._refreshing:
            return
        self._refreshing.add(url)
        task = self._keep(asyncio.ensure_future(self.one(url, keys)))
        task.add_done_callback(lambda _: self._refreshing.discard(url))
        if self.refreshed is not None:
            self.refreshed.inc()

    def _keep(self, task: asyncio.Future[Answer]) -> asyncio.Future[Answer]:
        """Holds a lookup left to finish in the background until it does (:meth:`close`
        cancels those still out)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def one(self, url: str, keys: Sequence[ChunkKey]) -> Answer:
        """What ``url`` holds of ``keys``; NOTHING when it fails (whatever the failure: a
        lookup never fails a request) or is not asked (:class:`Breaker`)."""
        if not keys:
            return NOTHING
        breaker = self._breakers.setdefault(url, Breaker())
        ticket = breaker.ask(time.monotonic())
        if ticket is None:
            return NOTHING
        probe = ticket == PROBE
        asked_at = self.holdings.clock() if self.holdings is not None else None
        body = {"keys": [k.hex() for k in keys]}
        cap = ANSWER_BYTES_PER_KEY * len(keys) + ANSWER_BYTES
        try:
            async with self.session.post(f"{url}/v1/lookup", json=body, headers=self.headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > cap:
                        raise ValueError(f"an answer over {cap} bytes for {len(keys)} keys")
            doc = json.loads(raw)
            tiers = tuple(str(t) for t in doc["tiers"][:len(keys)])
            arrival = tuple(float(a) for a in (doc.get("arrival_s")
                                               or [0.0] * len(tiers))[:len(keys)])
        except asyncio.CancelledError:
            if probe:
                breaker.probing = False  # not an answer either way: the next one probes
            raise
        except Exception as exc:  # refused, timed out, an error, or nonsense: nothing held
            if self.failures is not None:
                self.failures.labels(redact_url(url)).inc()
            log.debug("lookup on %s failed: %s: %s", redact_url(url), type(exc).__name__, exc)
            if breaker.failed(time.monotonic(), probe):
                log.warning("node server %s failed %d lookups in a row (last: %s); its "
                            "backend is routed as holding nothing, asked again in %.0f s",
                            redact_url(url), FAILURES_TO_OPEN, type(exc).__name__,
                            breaker.backoff_s)
            return NOTHING
        if breaker.answered():
            log.info("node server %s answers lookups again", redact_url(url))
        n = min(len(tiers), len(arrival))
        answer = tiers[:n], arrival[:n]
        if self.holdings is not None:
            self.holdings.learn(url, keys, answer, shared_tiers(doc.get("shared")), asked_at)
        return answer


class Breaker:
    """One node server's lookups: after :data:`FAILURES_TO_OPEN` failures in a row (refused,
    an error, or no answer within the timeout) it is not asked for ``backoff_s`` (1 s, then
    doubled up to :data:`MAX_BACKOFF_S` each time the one lookup let through at its end, the
    probe, fails too): a node server that hangs must not add the lookup timeout to every
    decision."""

    def __init__(self) -> None:
        self.failures = 0
        self.backoff_s = 0.0
        self.until = 0.0
        self.open = False
        self.probing = False

    def ask(self, now: float) -> str | None:
        """:data:`ASK` (closed), :data:`PROBE` (open, its backoff over, no probe out), or
        None: not asked."""
        if not self.open:
            return ASK
        if now < self.until or self.probing:
            return None
        self.probing = True  # one probe; the others are not asked until it answers
        return PROBE

    def failed(self, now: float, probe: bool) -> bool:
        """Counts a failure; True when it opens the breaker (from closed). While it is
        open only the probe's failure counts (the others were sent before it opened): the
        backoff doubles."""
        if self.open:
            if probe:
                self.probing = False
                self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
                self.until = now + self.backoff_s
            return False
        self.failures += 1
        if self.failures < FAILURES_TO_OPEN:
            return False
        self.open, self.backoff_s = True, FIRST_BACKOFF_S
        self.until = now + self.backoff_s
        return True

    def answered(self) -> bool:
        """Counts an answer; True when it closes the breaker."""
        was, self.open, self.probing, self.failures = self.open, False, False, 0
        return was
