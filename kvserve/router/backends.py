"""The router's backends: their health and load, kept fresh by a probe loop.

Every ``health_interval_s`` each backend's ``/health`` is probed and, when it
answers 200, its ``/metrics`` read for kvserve's gauges (requests running and
waiting, KV-cache usage; a backend without them counts only the router's own
in-flight requests). ``unhealthy_after`` failed probes in a row take a backend
out; one good probe puts it back (and the routing policy forgets what it knew
of its cache, since a backend that went away may have restarted empty). A
request that cannot reach a backend takes it out at once. This module owns
the state and the probing; what to send where is ``policy.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.policy import Candidate

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_INTERVAL_S = 2.0
DEFAULT_UNHEALTHY_AFTER = 2
PROBE_TIMEOUT_S = 5.0
RUNNING = "kvserve:num_requests_running"
WAITING = "kvserve:num_requests_waiting"
KV_USAGE = "kvserve:kv_cache_usage_perc"


def check_backend_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it is http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--backend {url!r} is invalid: write http://HOST:PORT")
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError as exc:
        raise ValueError(f"--backend {url!r} is invalid: {exc}") from None
    if parts.path.strip("/"):
        raise ValueError(f"--backend {url!r} is invalid: give the server's root, without a "
                         f"path (not {parts.path!r})")
    return url.rstrip("/")


@dataclass
class Backend:
    """One backend server as the router sees it."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    failures: int = 0
    last_error: str = "not probed yet"

    @property
    def load(self) -> float:
        """Requests on it (the router's own count when its metrics lag behind),
        plus its KV-cache usage (0..1) to break ties."""
        return max(float(self.in_flight), self.running + self.waiting) + self.kv_usage

    def read_metrics(self, text: str) -> None:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (RUNNING, WAITING, KV_USAGE):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        self.running = values.get(RUNNING, 0.0)
        self.waiting = values.get(WAITING, 0.0)
        self.kv_usage = values.get(KV_USAGE, 0.0)


class BackendPool:
    """The backends, their probe loop, and who may get a request now."""

    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient,
                 health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
                 unhealthy_after: int = DEFAULT_UNHEALTHY_AFTER,
                 on_recovered: Callable[[str], None] | None = None) -> None:
        if not health_interval_s > 0:
            raise ValueError(f"--health-interval-s={health_interval_s} is invalid: must be > 0")
        self.backends = [Backend(url) for url in urls]
        self.by_url = {backend.url: backend for backend in self.backends}
        self.client = client
        self.health_interval_s = health_interval_s
        self.unhealthy_after = unhealthy_after
        self.on_recovered = on_recovered
        self._task: asyncio.Task[None] | None = None

    def candidates(self, exclude: set[str]) -> list[Candidate]:
        return [Candidate(b.url, b.load) for b in self.backends
                if b.healthy and b.url not in exclude]

    @property
    def num_healthy(self) -> int:
        return sum(backend.healthy for backend in self.backends)

    def mark_down(self, backend: Backend, reason: str) -> None:
        if backend.healthy:
            logger.warning("backend %s is out: %s", backend.url, reason)
        backend.healthy = False
        backend.failures = max(backend.failures, self.unhealthy_after)
        backend.last_error = reason

    async def probe(self, backend: Backend) -> None:
        """Probe one backend and update its state."""
        try:
            health = await self.client.get(backend.url + "/health", timeout=PROBE_TIMEOUT_S)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
        except (httpx.HTTPError, RuntimeError) as exc:
            backend.failures += 1
            reason = str(exc) or type(exc).__name__
            if backend.failures >= self.unhealthy_after:
                self.mark_down(backend, reason)
            else:
                backend.last_error = reason
            return
        with contextlib.suppress(httpx.HTTPError, ValueError):
            metrics = await self.client.get(backend.url + "/metrics", timeout=PROBE_TIMEOUT_S)
            if metrics.status_code == 200:
                backend.read_metrics(metrics.text)
        backend.failures = 0
        if not backend.healthy:
            logger.info("backend %s is in", backend.url)
            backend.healthy = True
            if self.on_recovered is not None:
                self.on_recovered(backend.url)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(backend) for backend in self.backends))

    async def wait_healthy(self, timeout_s: float,
                           abort: Callable[[], str | None] = lambda: None) -> list[Backend]:
        """Probe until every backend answers or ``timeout_s`` passes; the ones
        still not answering. OSError when ``abort`` gives a reason to stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            reason = abort()
            if reason is not None:
                raise OSError(reason)
            await self.probe_all()
            down = [backend for backend in self.backends if not backend.healthy]
            if not down or loop.time() >= deadline:
                return down
            await asyncio.sleep(min(0.5, max(deadline - loop.time(), 0.0)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe_all()
