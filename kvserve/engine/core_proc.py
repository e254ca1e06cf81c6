"""The engine core in its own process (``run_engine_core``) and the client
that drives it from the front end (``MPCoreClient``, a ``CoreClient``).

Transport: two ZeroMQ sockets over IPC in Linux's abstract namespace
(``ipc://@kvserve-core-<id>-in|out``: no file to leave behind), bound by the
front end, connected by the core; messages are msgpack (msgspec), one
multipart message each: ``[kind, request id, payload]``. In: ``add``
(an ``EngineCoreRequest``, its compiled grammar as xgrammar JSON), ``abort``,
``stop`` (samples a stop string ended), ``shutdown``. Out: ``ready`` /
``failed`` once at start, then ``outputs`` (a step's ``EngineCoreOutput``\\ s,
with the core's stats at most every ``STATS_EVERY_S``), ``reject`` (a request
the core refused: a ``ValueError`` is bad input, anything else, a message it
could not decode included, is internal) and ``stats``.

Life: the core runs until the front end sends ``shutdown`` (it then stops
its executor's worker processes and exits 0) or goes away (a lifeline pipe
closes: it exits at once; tensor-parallel workers watch the core the same
way). It ignores SIGINT and SIGTERM, which a terminal or ``kill -- -PGID``
sends the whole group: the front end drains first, then stops it. A step
running longer than ``watchdog_s`` makes it exit with ``EXIT_HUNG``. The
front end notices a dead core within ``POLL_S`` (its ``step``, or
``check_alive`` while idle) and raises ``EngineDeadError``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput
from kvserve.core.request import Request
from kvserve.engine.core_client import EngineCoreRequest, EngineDeadError, Rejection
from kvserve.engine.engine_core import EngineCore, Executor, create_executor
from kvserve.engine.structured_output import StructuredOutputCompiler
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# how long the front end waits for outputs before checking the core is alive
POLL_S = 0.1
# the longest the core waits for input while idle before checking its watch
IDLE_POLL_S = 0.5
STATS_EVERY_S = 0.25
READY_TIMEOUT_S = 3600.0  # loading a large checkpoint from a slow disk
SHUTDOWN_TIMEOUT_S = 10.0
EXIT_HUNG = 75  # a step ran past the watchdog

ADD, ABORT, STOP, SHUTDOWN = b"add", b"abort", b"stop", b"shutdown"
READY, FAILED, OUTPUTS, REJECT, STATS = b"ready", b"failed", b"outputs", b"reject", b"stats"

_encoder = msgspec.msgpack.Encoder()
_output_decoder = msgspec.msgpack.Decoder(tuple[list[EngineCoreOutput], dict[str, Any] | None])
_request_decoder = msgspec.msgpack.Decoder(tuple[EngineCoreRequest, str | None])
_ids_decoder = msgspec.msgpack.Decoder(list[str])
_rejection_decoder = msgspec.msgpack.Decoder(Rejection)
_stats_decoder = msgspec.msgpack.Decoder(dict[str, Any])

Setup = Callable[[Executor], None]


def _addresses() -> tuple[str, str]:
    name = f"ipc://@kvserve-core-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return name + "-in", name + "-out"


# ------------------------------------------------------------------ core side


class _CoreLoop:
    """The core process's loop: read input, step, send outputs."""

    def __init__(self, config: EngineConfig, core: EngineCore, inputs: zmq.Socket[bytes],
                 outputs: zmq.Socket[bytes]) -> None:
        self.config = config
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.step_s = 0.0
        self.last_progress_s = time.monotonic()
        self.stepping = False
        self._stats_sent_s = 0.0
        self._stats_dirty = False
        self._grammars: StructuredOutputCompiler | None = None
        self._running = True

    def run(self) -> None:
        while self._running:
            busy = self.core.has_unfinished_requests()
            if busy or self.inputs.poll(int(IDLE_POLL_S * 1000)):
                self._drain_inputs()
            if self._running and self.core.has_unfinished_requests():
                self._step()
            elif self._stats_dirty:
                self._send(STATS, b"", _encoder.encode(self.stats()))
                self._stats_dirty = False
            self.last_progress_s = time.monotonic()

    def _step(self) -> None:
        start = time.perf_counter()
        self.stepping = True
        outputs = self.core.step()
        self.stepping = False
        self.step_s += time.perf_counter() - start
        now = time.monotonic()
        stats = None
        if now - self._stats_sent_s >= STATS_EVERY_S or not self.core.has_unfinished_requests():
            stats, self._stats_sent_s, self._stats_dirty = self.stats(), now, False
        else:
            self._stats_dirty = True
        if outputs or stats is not None:
            self._send(OUTPUTS, b"", _encoder.encode((outputs, stats)))

    def stats(self) -> dict[str, Any]:
        return {**self.core.stats(), "step_s": self.step_s}

    def _send(self, kind: bytes, request_id: bytes, payload: bytes) -> None:
        self.outputs.send_multipart((kind, request_id, payload), copy=False)

    def _drain_inputs(self) -> None:
        while self._running:
            try:
                kind, request_id, payload = self.inputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(kind, payload)
            except ValueError as exc:
                self._reject(request_id, str(exc), internal=False)
            except Exception as exc:  # a message it cannot decode or apply
                logger.exception("the engine core could not process a %r message", kind)
                self._reject(request_id, f"{type(exc).__name__}: {exc}", internal=True)
            self._stats_dirty = True

    def _reject(self, request_id: bytes, message: str, internal: bool) -> None:
        rejection = Rejection(request_id.decode("utf-8", "replace"), message, internal)
        self._send(REJECT, request_id, _encoder.encode(rejection))

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ADD:
            request, grammar = _request_decoder.decode(payload)
            self._add(request, grammar)
        elif kind == ABORT:
            self.core.abort_requests(_ids_decoder.decode(payload))
        elif kind == STOP:
            self.core.finish_stopped(_ids_decoder.decode(payload))
        elif kind == SHUTDOWN:
            self._running = False
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _add(self, request: EngineCoreRequest, grammar: str | None) -> None:
        if grammar is not None:
            request = replace(request, sampling_params=request.sampling_params.with_grammar(
                self._grammar_compiler().deserialize(grammar)))
        if request.lora_request is not None:
            self.core.add_lora(request.lora_request)
        self.core.add_request(request.to_request())

    def _grammar_compiler(self) -> StructuredOutputCompiler:
        """The front end's compiler, rebuilt here (tokenizer and all) on first use."""
        if self._grammars is None:
            from kvserve.engine.input_processor import InputProcessor
            from kvserve.engine.llm_engine import load_engine_tokenizer

            processor = InputProcessor(self.config, load_engine_tokenizer(self.config))
            self._grammars = processor.grammar_compiler
        return self._grammars


def _exit_when_closed(lifeline: Connection) -> None:
    """Exit at once when the front end closes the lifeline or dies."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(1)


def _watch_steps(loop: _CoreLoop, watchdog_s: float) -> None:
    """Exit with ``EXIT_HUNG`` when one step runs longer than ``watchdog_s``."""
    while True:
        time.sleep(min(1.0, watchdog_s / 4))
        stalled_s = time.monotonic() - loop.last_progress_s
        if loop.stepping and stalled_s > watchdog_s:
            logger.error("engine step has run for %.1f s (watchdog %.1f s): the engine core "
                         "exits", stalled_s, watchdog_s)
            logging.shutdown()
            os._exit(EXIT_HUNG)


def run_engine_core(config: EngineConfig, addresses: tuple[str, str], lifeline: Connection,
                    setup: Setup | None, lora_requests: Sequence[LoRARequest],
                    watchdog_s: float | None, log_level: int) -> None:
    """The entry point of the core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True,
                     name="kvserve-lifeline").start()
    logging.basicConfig(level=log_level, format="%(levelname)s core %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(log_level)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.connect(addresses[0])
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(addresses[1])
    try:
        core = EngineCore(config, create_executor(config))
        if setup is not None:
            setup(core.executor)
        for lora_request in lora_requests:
            core.add_lora(lora_request)
    except BaseException as exc:
        logger.debug("engine core start-up failed", exc_info=exc)
        failure = (type(exc).__name__, str(exc), isinstance(exc, ValueError))
        outputs.send_multipart((FAILED, b"", _encoder.encode(failure)))
        outputs.close(linger=5000)
        os._exit(1)
    from kvserve.engine.engine_core import freeze_startup_heap

    freeze_startup_heap()
    loop = _CoreLoop(config, core, inputs, outputs)
    if watchdog_s is not None:
        threading.Thread(target=_watch_steps, args=(loop, watchdog_s), daemon=True,
                         name="kvserve-core-watchdog").start()
    outputs.send_multipart((READY, b"", _encoder.encode({"pid": os.getpid(), **loop.stats()})))
    try:
        loop.run()
    except BaseException:
        logger.exception("the engine core died")
        core.shutdown(kill=True)
        logging.shutdown()
        os._exit(1)
    core.shutdown()
    outputs.close(linger=1000)
    os._exit(0)


# ------------------------------------------------------------------ front-end side


class MPCoreClient:
    """Starts the core process and drives it (see the module docstring)."""

    def __init__(self, config: EngineConfig, setup: Setup | None = None,
                 lora_requests: Sequence[LoRARequest] = (), watchdog_s: float | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the core and wait until its model is loaded; the core's
        start-up error is raised here (a ``ValueError`` stays one)."""
        self.config = config
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.addresses = addresses = _addresses()
        # no high-water marks: a burst of requests never blocks or drops; a send
        # fails at once only when the core is not connected (it has died)
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(addresses[0])
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(addresses[1])
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self._outputs, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._rejections: list[Rejection] = []
        self._stats: dict[str, Any] = {}
        # the last message from the core, or the last check while nothing was owed
        self._heard_s = time.monotonic()
        mp = multiprocessing.get_context("spawn")
        lifeline_r, self._lifeline = mp.Pipe(duplex=False)
        self.process = mp.Process(
            target=run_engine_core, name="kvserve-engine-core",
            args=(config, addresses, lifeline_r, setup, list(lora_requests), watchdog_s,
                  logging.getLogger("kvserve").getEffectiveLevel()))
        self.process.start()
        lifeline_r.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self._lifeline,
                                           self._context, (self._wake_r, self._wake_w))
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.shutdown(kill=True)
            raise
        logger.info("engine core process started (pid %d)", self.process.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(int(POLL_S * 1000)):
                kind, _, payload = self._outputs.recv_multipart()
                if kind == READY:
                    self._stats = _stats_decoder.decode(payload)
                    return
                name, message, bad_input = msgspec.msgpack.decode(payload)
                raise (ValueError if bad_input else RuntimeError)(
                    message if bad_input else f"{name}: {message}")
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.process.exitcode} while starting; see the log")
        raise RuntimeError(f"the engine core did not start within {timeout_s:g} s")

    # ------------------------------------------------------------ CoreClient

    @property
    def num_steps(self) -> int:
        return int(self._stats.get("num_steps", 0))

    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        grammar = None
        if params.grammar is not None:
            grammar = StructuredOutputCompiler.serialize(params.grammar)
            request = replace(request, sampling_params=params.with_grammar(None))
        self._send(ADD, request.request_id, _encoder.encode((request, grammar)))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort in the core; their last outputs are not waited for (nothing
        the front end tracks is still owed)."""
        if request_ids:
            self._send(ABORT, "", _encoder.encode(request_ids))
        return []

    def finish_stopped(self, request_ids: list[str]) -> None:
        self._send(STOP, "", _encoder.encode(request_ids))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check the adapter's config here; the core loads its tensors with
        the first request that names it (a request it cannot load fails alone)."""
        from kvserve.lora.peft import read_adapter_config

        assert self.config.lora_config is not None, "the processor checks LoRA is enabled"
        read_adapter_config(Path(lora_request.lora_path), self.config.lora_config.max_lora_rank)

    def remove_lora(self, lora_int_id: int) -> bool:
        raise ValueError(f"lora_int_id={lora_int_id}: adapters cannot be removed from an "
                         "engine core process (start the server with --engine-core inproc)")

    def get_request(self, request_id: str) -> Request | None:
        return None  # its state lives in the core process

    def step(self) -> list[EngineCoreOutput]:
        """The outputs the core has sent, waiting up to ``POLL_S`` for some
        (less when ``wake`` is called); EngineDeadError once it is gone."""
        events = dict(self._poller.poll(int(POLL_S * 1000)))
        if self._wake_r in events:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        outputs = self._receive() if self._outputs in events else []
        if not outputs:
            self._raise_if_exited()
        return outputs

    def _receive(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while True:
            try:
                kind, _, payload = self._outputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            self._heard_s = time.monotonic()
            if kind == OUTPUTS:
                step_outputs, stats = _output_decoder.decode(payload)
                outputs += step_outputs
                if stats is not None:
                    self._stats = stats
            elif kind == REJECT:
                self._rejections.append(_rejection_decoder.decode(payload))
            elif kind == STATS:
                self._stats = _stats_decoder.decode(payload)

    def take_rejections(self) -> list[Rejection]:
        rejections, self._rejections = self._rejections, []
        return rejections

    def last_progress_s(self) -> float:
        return self._heard_s

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the core process has exited (called
        while nothing is in flight, it also marks the core as up to date)."""
        self._heard_s = time.monotonic()
        if self._outputs.poll(0):
            self._receive()  # stats sent while the front end was idle
        self._raise_if_exited()

    def _raise_if_exited(self) -> None:
        if not self.process.is_alive():
            raise EngineDeadError(f"the engine core process (pid {self.process.pid}) exited "
                                  f"with code {self.process.exitcode}")

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"w")

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def shutdown(self, kill: bool = False) -> None:
        """Ask the core to stop (it stops its workers), or with ``kill`` end it
        at once; then close the sockets. Idempotent."""
        if not self._finalizer.alive:
            return
        if not kill and self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                self._send(SHUTDOWN, "", b"")
            self.process.join(SHUTDOWN_TIMEOUT_S)
        self._finalizer()

    def _send(self, kind: bytes, request_id: str, payload: bytes) -> None:
        try:
            self._inputs.send_multipart((kind, request_id.encode(), payload), zmq.NOBLOCK,
                                        copy=False)
        except zmq.Again:
            self._raise_if_exited()
            raise EngineDeadError("the engine core process is not connected") from None


def _stop(process: multiprocessing.process.BaseProcess, lifeline: Connection,
          context: zmq.Context[Any], fds: tuple[int, int]) -> None:
    """Kill the core if it still runs, close everything (the finalizer)."""
    lifeline.close()  # the core exits at once if it is still there
    if process.is_alive():
        process.kill()
    process.join(SHUTDOWN_TIMEOUT_S)
    context.destroy(linger=0)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
