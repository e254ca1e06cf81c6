"""``EngineClient``: how asynchronous callers (the HTTP server, a chat loop)
drive the engine. ``ThreadedEngineClient`` runs the ``LLMEngine`` front end
(detokenizing, stop strings) in a background thread and streams each
request's outputs into an asyncio queue; the engine core it drives runs in
that thread or in its own process (``core_proc``), behind the same
interface.

Requests arrive processed (``client.processor.process``: the one place a
prompt is tokenized and validated), so a bad request fails at once with a
ValueError and never reaches the loop; one the core refuses later (a core
process) fails alone with that ValueError. A step that raises, or a core
process that dies, kills the loop: every in-flight request, and every
call queued for the loop (``add_lora``, ``remove_lora``), gets an
``EngineDeadError`` and ``health()`` reports it. With ``watchdog_s`` set, a
watchdog thread does the same when one step runs longer than that (a hung
forward): the stuck thread cannot be stopped, but every caller is released
with an error and ``health()`` says the engine is dead (a core process
watches its own steps and exits, which the loop sees).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvserve.config import EngineConfig
from kvserve.engine.core_client import EngineDeadError
from kvserve.engine.input_processor import EngineRequest, InputProcessor
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)
T = TypeVar("T")


__all__ = ["EngineClient", "EngineDeadError", "EngineHealth", "ThreadedEngineClient"]


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

    config: EngineConfig
    processor: InputProcessor  # builds the requests ``generate`` takes

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter between two steps; ValueError naming the problem."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter between two steps (False if it was never added);
        ValueError while requests use it."""
        ...

    def health(self) -> EngineHealth: ...

    def stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...

    def kill(self) -> None: ...


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
        self.config = engine.config
        self.processor = engine.processor
        self.log_requests = log_requests
        self.idle_wait_s = idle_wait_s
        self.watchdog_s = watchdog_s
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        # futures of ``_call``s not yet settled: a dying loop fails them
        self._calls: set[asyncio.Future[Any]] = set()
        self._calls_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_progress_s = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()
        if watchdog_s is not None:
            threading.Thread(target=self._watch, name="kvserve-engine-watchdog",
                             daemon=True).start()

    # ------------------------------------------------------------ caller side

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a processed request's outputs until it finishes; aborts it if
        the consumer stops early (client disconnect, cancellation)."""
        self._raise_if_dead()
        request_id = request.request_id
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s%s", request_id,
                        len(request.prompt_token_ids), request.params,
                        f", adapter {request.lora_request.lora_name}"
                        if request.lora_request else "")
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._sinks[request_id] = (loop, sink)
        finished = False
        try:
            # checked again now that the sink is registered: a loop that dies
            # from here on delivers the error to it
            self._raise_if_dead()
            self._put(("add", request))
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
                self._put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    def _put(self, command: tuple[str, Any]) -> None:
        self._commands.put(command)
        self.engine.core.wake()  # a core process's step may be waiting for outputs

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self._call(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_int_id))

    async def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine's own thread between two steps; its
        exception is raised here, and ``EngineDeadError`` as soon as the loop
        dies (or the watchdog gives up on it) before it ran."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._calls_lock:
            self._calls.add(future)
        try:
            # checked once the future is registered: a loop that dies from here on fails it
            self._raise_if_dead()
            self._put(("call", (fn, future)))
            return await future
        finally:
            with self._calls_lock:
                self._calls.discard(future)

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
        """Stop the loop, then the core (its process, its workers)."""
        self._stop.set()
        self._put(("wake", None))
        self._thread.join(timeout_s)
        self.engine.core.shutdown(kill=self._thread.is_alive())

    def kill(self) -> None:
        """End the core now (its process and workers), without waiting for the loop."""
        self.engine.core.shutdown(kill=True)

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
                    for request_id, error in self.engine.take_rejections():
                        self._deliver(request_id, error)
                else:
                    self.engine.core.check_alive()
                # a core process's step may hang while this loop keeps turning
                self._last_progress_s = self.engine.core.last_progress_s()
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
        with self._calls_lock:
            calls = list(self._calls)
        for future in calls:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                future.get_loop().call_soon_threadsafe(_resolve, future, None, dead)

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
            request_id = payload.request_id
            if request_id not in self._sinks:
                return  # the caller left before the request was queued
            try:
                self.engine.add_engine_request(payload)
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
