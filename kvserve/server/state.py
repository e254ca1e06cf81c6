"""The server's life: loading, admission, health, draining and dying.

``ServerState`` is shared by every route. It owns:

- the engine client (loaded in a daemon thread after the port is bound, so
  probes get a 503 "loading" instead of a refused connection); the routes
  reach the engine only through it and its ``processor``;
- ``Admission``: the bound on sequences in flight (running + queued), which
  turns a burst into 503s with ``Retry-After`` instead of an ever-growing
  queue, and knows the engine request ids to abort when draining;
- the supervisor task: when the engine dies (a forward raised, the
  client's watchdog gave up on a hung one, the core process died) it lets the in-flight responses
  carry their errors out, keeps ``/health`` at 503 for a moment so probes
  see it, then asks the process to exit non-zero;
- draining on SIGTERM or Ctrl-C (``DrainingServer`` routes uvicorn's signals
  here): refuse new work (503), wait for in-flight requests up to
  ``shutdown_timeout_s``, abort the rest (``finish_reason: "abort"``), exit 0.
  A second signal aborts them at once, then exits the same way (uvicorn's
  own forced exit would cancel the tasks mid-response and log their
  tracebacks); a third ends the process on the spot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from kvserve.lora.request import LoRARequest
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import APIError

if TYPE_CHECKING:
    from kvserve.engine.client import EngineClient

logger = logging.getLogger(__name__)

SUPERVISOR_POLL_S = 0.2
# after the engine dies: the longest wait for in-flight responses to carry
# their errors out, then how long /health stays 503 before the process exits
FAILURE_FLUSH_S = 5.0
FAILURE_LINGER_S = 1.0
# after draining aborts the leftovers: the longest wait for their responses
ABORT_FLUSH_S = 5.0
# the exit status when repeated signals end the process on the spot
EXIT_SIGNALLED = 130

Loader = Callable[[], "EngineClient"]


@dataclass
class ServerConfig:
    """The server's own knobs (the engine's are in ``EngineArgs``)."""

    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_num_seqs: int = 256
    max_queued_requests: int = 1024
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 128
    health_stall_s: float = 30.0
    shutdown_timeout_s: float = 20.0
    retry_after_s: int = 1
    # LoRA adapters a request selects by naming one in "model" (--lora-modules)
    lora_requests: list[LoRARequest] = field(default_factory=list)
    # the tool-call format "auto" tool_choice parses (--tool-call-parser); None: refused
    tool_call_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating)
    allow_runtime_lora_updating: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter served under the name ``model``, if any."""
        return next((lora for lora in self.lora_requests if lora.lora_name == model), None)


@dataclass
class Ticket:
    """One admitted HTTP request: its sequences and engine request ids."""

    request_id: str
    num_seqs: int
    engine_request_ids: list[str]


class Admission:
    """Bounds the sequences in flight; all-or-nothing per HTTP request."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tickets: dict[str, Ticket] = {}
        self.num_seqs = 0

    def admit(self, ticket: Ticket) -> bool:
        if self.num_seqs + ticket.num_seqs > self.capacity:
            return False
        self.tickets[ticket.request_id] = ticket
        self.num_seqs += ticket.num_seqs
        return True

    def release(self, ticket: Ticket) -> None:
        if self.tickets.pop(ticket.request_id, None) is not None:
            self.num_seqs -= ticket.num_seqs

    async def wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.tickets and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.tickets


class ServerState:
    """Everything the routes share; see the module docstring."""

    def __init__(self, config: ServerConfig, loader: Loader | None = None,
                 client: EngineClient | None = None) -> None:
        self.config = config
        self.loader = loader
        self.client = client
        self.metrics = ServerMetrics(config.model_name, self._stats)
        # the id the next adapter loaded at run time gets (ids are never reused)
        self.next_lora_int_id = max((lora.lora_int_id for lora in config.lora_requests),
                                    default=0) + 1
        self.admission = Admission(config.max_num_seqs + config.max_queued_requests)
        self.draining = False
        self.failed = False
        self.exit_code = 0
        # set by the launcher: ask the HTTP server to stop (then exit with exit_code)
        self.request_exit: Callable[[], None] = lambda: None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.client is None and self.loader is not None:
            self._spawn(self._load())
        self._spawn(self._supervise())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.client is not None and self.client.health().alive:
            self.client.shutdown()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self) -> None:
        assert self.loader is not None and self.loop is not None
        loop, loader = self.loop, self.loader
        done: asyncio.Future[EngineClient] = loop.create_future()

        def load() -> None:
            try:
                result = loader()
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        # a daemon thread, so a SIGTERM while loading does not wait for it
        threading.Thread(target=load, name="kvserve-load", daemon=True).start()
        try:
            self.client = await done
        except Exception as exc:
            logger.debug("the traceback of the loading failure below", exc_info=exc)
            logger.error("loading the model failed: %s", " ".join(str(exc).split())
                         or type(exc).__name__)
            self._exit(1)
            return
        logger.info("model loaded; serving %s", ", ".join(self.config.served_model_names))

    async def _supervise(self) -> None:
        while not self.failed:
            await asyncio.sleep(SUPERVISOR_POLL_S)
            if self.client is not None and not self.client.health().alive:
                await self._on_engine_failure()

    async def _on_engine_failure(self) -> None:
        assert self.client is not None
        self.failed = True
        logger.error("the engine died (%s); failing in-flight requests and exiting",
                     self.client.health().error)
        await self.admission.wait_empty(FAILURE_FLUSH_S)
        await asyncio.sleep(FAILURE_LINGER_S)
        self._exit(1)

    def _exit(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)
        self.request_exit()

    def begin_drain(self) -> None:
        """SIGTERM: stop admitting, drain, abort the rest, exit (a second call
        aborts what is in flight now)."""
        if self.draining:
            self._spawn(self._abort_in_flight("a second signal"))
            return
        self.draining = True
        logger.warning("draining: %d request(s) in flight, up to %.1f s (a second Ctrl-C or "
                       "SIGTERM aborts them now)", len(self.admission.tickets),
                       self.config.shutdown_timeout_s)
        self._spawn(self._drain())

    async def _drain(self) -> None:
        if not await self.admission.wait_empty(self.config.shutdown_timeout_s):
            await self._abort_in_flight("shutdown timeout")
        self._exit(0)

    async def _abort_in_flight(self, why: str) -> None:
        """Abort every admitted request, give their responses a moment to end, exit 0."""
        if self.admission.tickets:
            logger.warning("%s: aborting %d request(s)", why, len(self.admission.tickets))
        for ticket in list(self.admission.tickets.values()):
            for request_id in ticket.engine_request_ids:
                if self.client is not None:
                    await self.client.abort(request_id)
        await self.admission.wait_empty(ABORT_FLUSH_S)
        self._exit(0)

    # ------------------------------------------------------------ checks

    def _stats(self) -> dict[str, object] | None:
        return self.client.stats() if self.client is not None else None

    def problem(self, ready: bool) -> str | None:
        """Why ``/health`` (ready=False) or ``/ready`` (ready=True) is 503, or None."""
        if self.client is None:
            return "the model is loading"
        health = self.client.health()
        if not health.alive or self.failed:
            return "the engine has stopped; see the server log"
        if health.since_progress_s > self.config.health_stall_s:
            return (f"the engine loop has made no progress for {health.since_progress_s:.1f} s "
                    f"(limit {self.config.health_stall_s:g} s)")
        if ready and self.draining:
            return "the server is shutting down"
        return None

    def require_engine(self) -> EngineClient:
        """The engine client, or a 503 (loading, draining, dead) counted as a rejection."""
        reason, message = None, ""
        if self.draining:
            reason, message = "draining", "the server is shutting down"
        elif self.client is None:
            reason, message = "loading", "the model is still loading"
        elif self.failed or not self.client.health().alive:
            reason, message = "engine_dead", "the engine is not available"
        if reason is not None or self.client is None:
            self.metrics.reject(reason or "loading")
            raise APIError(503, f"{message}; try again later or on another instance",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        return self.client

    def admit(self, ticket: Ticket) -> None:
        """Admit a request or raise 503 + Retry-After (400 if it can never fit)."""
        capacity = self.admission.capacity
        if ticket.num_seqs > capacity:
            raise APIError(400, f"the request needs {ticket.num_seqs} sequences (n x prompts) "
                           f"but the server admits at most {capacity} at once", "n")
        if not self.admission.admit(ticket):
            self.metrics.reject("queue_full")
            raise APIError(
                503, "The server is busy: the request queue is full. Try again later or on "
                "another instance.", headers={"Retry-After": str(self.config.retry_after_s)})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM / SIGINT routed to ``ServerState.begin_drain``
    (uvicorn's own handler would stop at once and re-raise the signal, making a
    clean shutdown exit with a non-zero status). The third signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.kvserve_state = state
        self._num_signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._num_signals += 1
        loop = self.kvserve_state.loop
        if self._num_signals > 2 or (self._num_signals > 1 and not self.started):
            logger.warning("exiting now, without waiting for anything")
            logging.shutdown()
            os._exit(EXIT_SIGNALLED)
        if loop is None or not self.started:
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self.kvserve_state.begin_drain)

    def request_exit(self) -> None:
        self.should_exit = True


def _settle(future: asyncio.Future[EngineClient], result: EngineClient | None,
            exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert result is not None
        future.set_result(result)
