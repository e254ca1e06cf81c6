"""``EngineClient``: how asynchronous callers (the HTTP server, a chat loop)
drive the engine. ``ThreadedEngineClient`` runs the ``LLMEngine`` loop in a
background thread and streams each request's outputs into an asyncio queue;
an engine in its own process will implement the same interface.

Validation happens in the caller, before anything is queued, so a bad
request fails at once with a ValueError and never reaches the loop. A step
that raises kills the loop: every in-flight request gets an
``EngineDeadError`` and ``health()`` reports it. With ``watchdog_s`` set, a
watchdog thread does the same when one step runs longer than that (a hung
forward): the stuck thread cannot be stopped, but every caller is released
with an error and ``health()`` says the engine is dead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine, Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; no request can proceed."""


class EngineHungError(RuntimeError):
    """One engine step ran longer than the watchdog allows."""


@dataclass
class EngineHealth:
    alive: bool
    # seconds since the loop last made progress (a step, or an idle turn)
    since_progress_s: float
    num_steps: int
    error: str | None = None


class EngineClient(Protocol):
    """The engine as an asynchronous service."""

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine's own thread between two steps (adding or
        removing an adapter); its exception is raised here."""
        ...

    def health(self) -> EngineHealth: ...

    def stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class ThreadedEngineClient:
    """Runs ``LLMEngine`` in a daemon thread; safe to call from one event loop."""

    def __init__(
        self, engine: LLMEngine, idle_wait_s: float = 0.05, watchdog_s: float | None = None,
        log_requests: bool = False,
    ) -> None:
        """``watchdog_s``: declare the engine dead when one step takes longer
        (None: never); ``log_requests``: log each request as it is accepted."""
        self.engine = engine
        self.log_requests = log_requests
        self.idle_wait_s = idle_wait_s
        self.watchdog_s = watchdog_s
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_progress_s = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()
        if watchdog_s is not None:
            threading.Thread(target=self._watch, name="kvserve-engine-watchdog",
                             daemon=True).start()

    # ------------------------------------------------------------ caller side

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; aborts it if the
        consumer stops early (client disconnect, cancellation)."""
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        _, token_ids = self.engine.tokenize_prompt(prompt)
        self.engine.resolve_params(len(token_ids), params)
        if lora_request is not None:
            self.engine.add_lora(lora_request)
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s%s", request_id, len(token_ids), params,
                        f", adapter {lora_request.lora_name}" if lora_request else "")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._sinks[request_id] = (loop, sink)
        finished = False
        try:
            # checked again now that the sink is registered: a loop that dies
            # from here on delivers the error to it
            self._raise_if_dead()
            self._commands.put(("add", (prompt, params, request_id, priority, lora_request)))
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        self._raise_if_dead()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        return await future

    def health(self) -> EngineHealth:
        return EngineHealth(
            alive=self._thread.is_alive() and self._error is None,
            since_progress_s=time.monotonic() - self._last_progress_s,
            num_steps=self.engine.core.num_steps,
            error=repr(self._error) if self._error is not None else None,
        )

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout_s)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}")

    # ------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if self._error is not None:  # the watchdog gave up on this step
                        return
                    for output in outputs:
                        self._deliver(output.request_id, output)
                self._last_progress_s = time.monotonic()
        except BaseException as exc:
            logger.exception("engine loop died")
            self._fail(exc)

    def _watch(self) -> None:
        assert self.watchdog_s is not None
        poll_s = min(1.0, self.watchdog_s / 4)
        while not self._stop.wait(poll_s) and self._error is None:
            stalled_s = time.monotonic() - self._last_progress_s
            if stalled_s > self.watchdog_s:
                logger.error("engine step has run for %.1f s (watchdog %.1f s): declaring "
                             "the engine dead", stalled_s, self.watchdog_s)
                self._fail(EngineHungError(
                    f"an engine step ran longer than the {self.watchdog_s:g} s watchdog"))
                return

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine dead and release every waiting caller with an error."""
        self._error = exc
        self._stop.set()
        dead = EngineDeadError(f"the engine loop stopped: {exc!r}")
        for request_id in list(self._sinks):
            self._deliver(request_id, dead)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = (self._commands.get(timeout=self.idle_wait_s) if block
                       else self._commands.get_nowait())
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, kind: str, payload: Any) -> None:
        if kind == "add":
            prompt, params, request_id, priority, lora_request = payload
            if request_id not in self._sinks:
                return  # the caller left before the request was queued
            try:
                self.engine.add_request(prompt, params, request_id, priority, lora_request)
            except ValueError as exc:
                self._deliver(request_id, exc)
        elif kind == "call":
            fn, future = payload
            try:
                settle = functools.partial(_resolve, future, fn(), None)
            except Exception as exc:  # handed to the caller
                settle = functools.partial(_resolve, future, None, exc)
            future.get_loop().call_soon_threadsafe(settle)
        elif kind == "abort":
            output = self.engine.abort_request(payload)
            if output is not None:
                self._deliver(payload, output)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        loop, target = sink
        try:
            loop.call_soon_threadsafe(target.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            self._sinks.pop(request_id, None)


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Settle ``future`` on its loop, unless its caller left meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
