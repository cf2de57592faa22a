"""The router: an aiohttp server in front of OpenAI-compatible backends.

::

    client ──► auth (401 before anything else) ──► strategy.choose(healthy candidates)
           ◄── stream / whole answer ◄── proxy.forward(backend) ──► retry elsewhere if it
                                                                   failed before any byte
    health monitor: /health, /v1/models, /metrics of each backend; /v1/namespaces of each
    node server, every --health-interval-s
    discovery (--backends-dns / --backends-file): the backends' set, every
    --discovery-interval-s; a newcomer is checked at once, one that left is drained

``/v1/*`` and ``/kvtier/backends`` (who is behind the router, for ``kvtier verify --url``:
internal addresses, so not for anyone) need ``Authorization: Bearer KEY`` when a key is
configured (the key names the client's tenant, :mod:`kvtier.router.tenants`); ``/health`` and
``/metrics`` do not (as in vLLM).
A body over ``max_body_bytes`` gets 413 before it is read whole; a tenant's body gets
its cache salt and priority cap before routing. Backend and node-server URLs are shown with
their credentials redacted (:mod:`kvtier.router.redact`). On :meth:`Router.drain` the router
stops listening, answers new requests on open connections with 503, and waits for the
requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.router.accounting import Accounting
from kvtier.router.backends import Backend, BackendPool, Membership
from kvtier.router.config import RouterConfig
from kvtier.router.cost import RECOMPUTED, estimate_header
from kvtier.router.discovery import Discovery, MemberWatch, make_source
from kvtier.router.health import HealthMonitor
from kvtier.router.history import DeviceHistory
from kvtier.router.holdings import Holdings
from kvtier.router.keys import Renderers
from kvtier.router.lag import LoopWatch
from kvtier.router.lookup import NodeLookups
from kvtier.router.metrics import RouterMetrics
from kvtier.router.parts import PartsCollector
from kvtier.router.proxy import (
    BACKEND_HEADER,
    ESTIMATE_HEADER,
    BackendFailed,
    error_response,
    forward,
    outgoing_headers,
)
from kvtier.router.redact import Scrubber, ScrubFilter, redact_url, userinfo
from kvtier.router.request import ENDPOINTS, BodyTooLarge, RoutedRequest, read_body
from kvtier.router.sessions import Sessions
from kvtier.router.sources import Resolver
from kvtier.router.strategies import STRATEGIES, Decision, RoutingContext, Strategy
from kvtier.router.tenants import OPEN, BadRequest, Tenant, Tenants

log = logging.getLogger("kvtier.router")
TENANT = web.RequestKey("tenant", Tenant)
BACKENDS_PATH = "/kvtier/backends"
"""Behind the API key like /v1/* (it tells what /metrics' labels tell, plus node URLs)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Router:
    def __init__(self, config: RouterConfig, resolve: Resolver | None = None) -> None:
        """``resolve``: how ``--backends-dns`` names are resolved (default: the system
        resolver; tests give their own)."""
        self.config = config
        self._resolve = resolve
        self.metrics = RouterMetrics()
        if config.parts_file:
            self.metrics.registry.register(PartsCollector(Path(config.parts_file)))
        self.pool = BackendPool(config)
        self.accounting = Accounting(self.metrics, config.cost.min_sample_tokens, self.pool)
        self.pool.listeners.append(self._on_health)
        self.renderers = Renderers()
        self.sessions = (Sessions(config.sessions, self.metrics) if config.sessions.retain
                         else None)
        self.history = DeviceHistory(config.cost.device_ttl_s)
        self.holdings = Holdings(config.cost.lookup_memory_s)
        self.members = MemberWatch(self.pool, self.metrics, self.history, self.holdings)
        self.pool.watchers.append(self.members)
        self.strategy_cls = STRATEGIES[config.strategy]  # unknown name: fail before binding
        self.tenants = config.tenants or Tenants({config.api_key: OPEN} if config.api_key
                                                 else {})
        self.scrub = Scrubber([*config.backends, *config.kvtier_servers])
        self._scrub_filter = ScrubFilter(self.scrub)
        self._node_headers = ({"Authorization": f"Bearer {config.node_token}"}
                              if config.node_token else {})
        backend_auth = (f"Bearer {config.backend_api_key}" if config.backend_api_key else None)
        self._backend_auth = backend_auth
        self._backend_headers = {"Authorization": backend_auth} if backend_auth else {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                              sock_read=config.request_timeout_s)
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.port: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._health: HealthMonitor | None = None
        self._watch = LoopWatch(self.metrics.loop_lag)
        self.strategy: Strategy | None = None
        self._lookups: NodeLookups | None = None
        self.discovery: Discovery | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Check every backend once, then listen; returns the port."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.scrub.active:
            log.addFilter(self._scrub_filter)
        lookups = NodeLookups(self._session, self.config.cost.lookup_timeout_s,
                              self.metrics.lookup_failures, self._node_headers,
                              self.metrics.lookup_time, self.metrics.lookups_spared,
                              self.holdings, self.metrics.lookups_recalled,
                              self.metrics.lookups_refreshed)
        self._lookups = self.members.lookups = lookups
        ctx = RoutingContext(self.config, self.pool, lookups, self.history)
        self.strategy = self.strategy_cls(ctx)
        self._health = HealthMonitor(self.pool, self._session, self.config.health_interval_s,
                                     self._backend_headers, self.renderers,
                                     self._node_headers)
        for backend in self.pool:
            self.metrics.up.labels(backend.name).set(0)
        await self._health.start()
        if self.config.discovery is not None:
            found = self.config.discovery
            self.discovery = Discovery(make_source(found, self._resolve), self.pool,
                                       found.interval_s, self.metrics,
                                       self._health.check_some)
            await self.discovery.start()
        await self._watch.start()
        app = web.Application(middlewares=[self._guard],
                              client_max_size=self.config.max_body_bytes)
        app.router.add_get("/health", self._health_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get(BACKENDS_PATH, self._backends_handler)
        app.router.add_get("/v1/models", self._models_handler)
        for path in ENDPOINTS:
            app.router.add_post(path, self._route_handler)
        # drain() waits for the requests in flight; cleanup then cancels what is left
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.host, self.config.port,
                                 reuse_address=True)
        await self._site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("kvtier route on http://%s:%d, strategy %s, %d/%d backends up",
                 self.config.host, self.port, self.config.strategy, len(self.pool.healthy()),
                 len(self.pool))
        return self.port

    async def drain(self) -> bool:
        """Stop accepting, let the requests in flight finish (up to ``drain_s``); True if
        they all did."""
        self.draining = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        log.info("draining: %d requests in flight, waiting up to %.0f s", self.active,
                 self.config.drain_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_s)
            return True
        except TimeoutError:
            log.warning("drain: %d requests still in flight after %.0f s", self.active,
                        self.config.drain_s)
            return False

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self._watch.stop()
        if self._health is not None:
            await self._health.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._lookups is not None:
            await self._lookups.close()
        if self._session is not None:
            await self._session.close()
        log.removeFilter(self._scrub_filter)

    # ------------------------------------------------------------------ handlers

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path == BACKENDS_PATH:
            tenant = self.tenants.identify(request.headers.get("Authorization", ""))
            if tenant is None:
                self.metrics.refused.labels("unauthorized").inc()
                return error_response(401, "a valid API key is required (Authorization: "
                                      "Bearer ...)", "invalid_request_error")
            request[TENANT] = tenant
            if self.draining:
                self.metrics.refused.labels("draining").inc()
                resp = error_response(503, "the router is shutting down")
                resp.headers["Connection"] = "close"
                return resp
        return await handler(request)

    async def _health_handler(self, request: web.Request) -> web.Response:
        up = len(self.pool.healthy())
        ok = up > 0 and not self.draining
        return web.json_response({"ok": ok, "draining": self.draining, "backends_up": up,
                                  "backends": len(self.pool)}, status=200 if ok else 503)

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        for b in self.pool:
            self.metrics.speed.labels(b.name).set(b.load.speed.value)
            self.metrics.others.labels(b.name).set(b.load.others)
        if self.sessions is not None:
            self.sessions.tick()
        slope = self.pool.steps.slope_s()
        if slope is not None:
            self.metrics.step_slope.set(slope)
        body = generate_latest(self.metrics.registry)
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def _backends_handler(self, request: web.Request) -> web.Response:
        """Who is behind the router (for ``kvtier verify --url``): each backend's URL, its
        node server's, whether it is in rotation and why not; credentials redacted, as in
        /metrics' labels."""
        doc = [{"url": b.name, "node": redact_url(b.node_url) if b.node_url else None,
                "up": b.healthy, "reason": b.reason} for b in self.pool]
        draining = [{"url": b.name, "in_flight": b.active} for b in self.pool.leaving.values()]
        return web.json_response({"backends": doc, "draining": draining})

    async def _models_handler(self, request: web.Request) -> web.Response:
        seen: dict[str, dict[str, Any]] = {}
        for backend in self.pool.healthy():
            for model in backend.models:
                seen.setdefault(str(model.get("id")), model)
        if not self.pool.healthy():
            return error_response(503, "no backend is up")
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def _route_handler(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        self.active += 1
        self._idle.clear()
        try:
            try:
                raw = await read_body(request, self.config.max_body_bytes)
                req = RoutedRequest.parse(request.path, raw,
                                          request.headers.get(self.config.session_header),
                                          self.renderers, request.get(TENANT, OPEN),
                                          self.tenants)
                self._hold_session(req, request)
            except BodyTooLarge as exc:
                self.metrics.refused.labels("too_large").inc()
                resp = error_response(413, str(exc), "invalid_request_error")
                resp.force_close()
                return resp
            except BadRequest as exc:
                self.metrics.refused.labels("bad_request").inc()
                return error_response(400, str(exc), "invalid_request_error")
            return await self._route(req, request, received)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def _hold_session(self, req: RoutedRequest, request: web.Request) -> None:
        """The request's session, and the retention it gets (:mod:`kvtier.router.sessions`)."""
        if self.sessions is None:
            return
        key, changed = self.sessions.on_request(
            req.tenant, request.headers.get(self.config.session_header),
            request.headers.get(self.config.sessions.end_header), req.body, req.endpoint)
        req.session_key = key
        if changed:
            req.rewritten(self.renderers)

    # ------------------------------------------------------------------ routing

    async def _route(self, req: RoutedRequest, request: web.Request,
                     received: float) -> web.StreamResponse:
        assert self.strategy is not None
        tried: list[int] = []
        while True:
            candidates = self.pool.candidates(req.model, tried)
            if not candidates and not tried and await self._backend_back(req.model, received):
                continue
            if not candidates:
                self.metrics.refused.labels("no_backend").inc()
                if tried:
                    return error_response(502, f"{len(tried)} backends failed this request")
                return error_response(503, "no backend is up")
            start = time.perf_counter()
            decision = await self.strategy.choose(req, candidates)
            self.metrics.decision_time.labels(self.strategy.name).observe(
                time.perf_counter() - start)
            if not tried and req.keys_of.keying_s:
                self.metrics.keying_time.observe(req.keys_of.keying_s)
            if decision.backend.membership is not Membership.MEMBER:
                continue  # it left while the strategy chose: choose again among members
            tried.append(decision.backend.index)
            self.metrics.decisions.labels(self.strategy.name, decision.reason).inc()
            self.pool.started(decision.backend)
            try:
                return await self._attempt(req, decision, request, received)
            except BackendFailed as exc:
                backend = decision.backend
                if not exc.retry:  # it may still be generating: never send it twice
                    log.warning("backend %s %s; not retried", backend.name, exc)
                    self.metrics.timeouts.labels(backend.name).inc()
                    resp = error_response(504, self.scrub(f"the backend {exc}"))
                    resp.headers[BACKEND_HEADER] = backend.name
                    return resp
                self.metrics.retries.labels(backend.name).inc()
                log.warning("backend %s failed before answering (%s); retrying elsewhere",
                            backend.name, exc)
                if exc.down:
                    self.pool.set_health(backend, False, self.scrub(str(exc)))
            finally:
                self.pool.finished(decision.backend)

    async def _backend_back(self, model: str | None, received: float) -> bool:
        """Whether a backend came back within ``no_backend_wait_s`` of the request's arrival
        (the ones that are out are checked at once, then every 0.25 s)."""
        if self.config.no_backend_wait_s <= 0:
            return False
        deadline = received + self.config.no_backend_wait_s
        while self._health is not None and not self.draining:
            await self._health.recheck_out()
            if self.pool.candidates(model):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.25, left))
        return False

    async def _attempt(self, req: RoutedRequest, decision: Decision, request: web.Request,
                       received: float) -> web.StreamResponse:
        backend = decision.backend
        pred = decision.prediction
        load = backend.load
        # without a prediction (the prompt could not be keyed), a typical prefill
        predicted = pred.load_s + pred.prefill_s if pred else load.mean_prefill_s.value
        fid = load.start(predicted, time.monotonic())
        self._remember(req, decision)
        gauge = self.metrics.in_flight.labels(backend.name)
        gauge.inc()
        # aiohttp sends a URL's credentials as Basic auth, and refuses a second Authorization
        keep = not self.tenants.need_key and userinfo(backend.url) is None
        headers = outgoing_headers(request.headers, self._backend_auth, keep_client_auth=keep)
        ours = {BACKEND_HEADER: backend.name}
        if pred is not None and req.tenant.may_see_tier_details:
            ours[ESTIMATE_HEADER] = estimate_header(pred, decision.crowd_s, decision.reason)
        try:
            response, outcome = await forward(
                self._session_or_fail(), backend.url + request.path_qs, ours, req.raw,
                headers, request, self._timeout, lambda t: load.first_byte(fid, t),
                strip_details=not req.tenant.may_see_tier_details)
        finally:
            flight = load.finish(fid, time.monotonic())
            gauge.dec()
        actual = self.accounting.record(req, decision, outcome, flight, received)
        if self.sessions is not None:
            self.sessions.on_answer(req.session_key, outcome.finish_reason)
        self._check_recall(decision, actual)
        if "cut" in outcome.extra:
            self.pool.set_health(backend, False, self.scrub(f"stream cut: {outcome.extra['cut']}"))
        elif "timed_out" in outcome.extra:  # slow, not gone: it stays in
            self.metrics.timeouts.labels(backend.name).inc()
        return response

    def _remember(self, req: RoutedRequest, decision: Decision) -> None:
        keys, backend = decision.keys, decision.backend
        if keys is None or backend.namespace_for(req.model) != keys.namespace:
            return
        device = backend.device_tokens or self.config.cost.device_tokens
        self.history.record(backend.index, keys.keys, device // keys.chunk_tokens)
        if backend.node_url is not None:
            self.holdings.sent(backend.node_url, keys.keys)

    def _check_recall(self, decision: Decision, actual: dict[str, int] | None) -> None:
        """A response that held a chunk or more less than predicted: what the router
        remembers its node server holds of the prompt is asked again next time."""
        pred, keys, url = decision.prediction, decision.keys, decision.backend.node_url
        if pred is None or keys is None or actual is None or url is None:
            return
        held = sum(tokens for source, tokens in actual.items() if source != RECOMPUTED)
        if held + keys.chunk_tokens <= pred.held_tokens:
            self.holdings.contradicted(url, keys.keys)

    def _session_or_fail(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() first"
        return self._session

    def _on_health(self, backend: Backend, healthy: bool) -> None:
        self.metrics.up.labels(backend.name).set(1 if healthy else 0)
        if not healthy:
            self.history.forget(backend.index)  # a restarted engine has an empty cache
            if backend.node_url is not None:
                self.holdings.forget(backend.node_url)
