"""KV blocks between a prefill engine and a decode engine: the transfer group
(torch.distributed point to point, NCCL on CUDA, gloo on the CPU) and the
control channel that says which blocks (ZeroMQ, one message each way per
pull).

The prefill side (``KVSender``) serves pulls on its own thread: it binds a
ZeroMQ ROUTER at ``host:port`` and hosts the group's rendezvous store at
``port + 1``. The engine offers it the blocks of each finished prompt
(``offer``) with a deadline; a pull names the offered request and the
blocks wanted, is answered yes or no, and on yes the blocks follow over the
group, gathered a chunk at a time into one buffer (every pool tensor's part
of each block, as bytes: dtypes do not matter). An offer ends when it is
pulled, refused because its deadline passed, or expires unpulled; either
way it is reported (``take_released``) and the engine frees the blocks.

The decode side (``KVReceiver``) runs pulls one after another on its own
thread: it connects to the prefill engine a pull names (a new group, a new
rendezvous key, whenever the last one failed or the address changed),
receives the chunks and scatters them into the blocks the scheduler gave
the request, then reports the request done or failed (``take_finished``).
A failure of any kind (no answer, a refusal, a group that times out or a
peer that died) is reported as failed and the engine recomputes the prompt.

World size 2, rank 0 the prefill side: a prefill engine is connected to one
decode engine at a time (each pull names its connection; a pull from another
decode engine makes that one reconnect, so several work, at a reconnection
each time they alternate). Pool layouts must match (same model,
dtype and block size): each pull carries the sender's bytes per block and
the receiver refuses a mismatch. It moves bytes and decides nothing about
blocks: that is the scheduler's.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

logger = logging.getLogger(__name__)

# blocks gathered into one message of the group (bounded by CHUNK_MAX_BYTES)
CHUNK_MAX_BLOCKS = 64
CHUNK_MAX_BYTES = 64 << 20
POLL_MS = 20


@dataclass
class PullJob:
    """One request's pull, as the decode engine queues it."""

    request_id: str  # the decode engine's id
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]  # where they go here, one for one


class BlockBytes:
    """Every pool tensor's part of a block, as rows of bytes: gathers blocks
    into one [num_blocks, block_bytes] buffer and scatters such a buffer back."""

    def __init__(self, tensors: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.views: list[torch.Tensor] = []
        self.sizes: list[int] = []
        for tensor, block_dim in tensors:
            view = tensor.view(torch.uint8).movedim(block_dim, 0)  # [num_blocks, ...] bytes
            self.views.append(view)
            self.sizes.append(view[0].numel())
        self.block_bytes = sum(self.sizes)
        self.device = tensors[0][0].device if tensors else torch.device("cpu")
        self.chunk_blocks = max(1, min(CHUNK_MAX_BLOCKS,
                                       CHUNK_MAX_BYTES // max(1, self.block_bytes)))

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, device=self.device)
        # [n, block_bytes]
        return torch.cat([view.index_select(0, index).reshape(len(block_ids), -1)
                          for view in self.views], dim=1)

    def scatter(self, block_ids: list[int], buffer: torch.Tensor) -> None:
        index = torch.tensor(block_ids, device=self.device)
        offset = 0
        for view, size in zip(self.views, self.sizes, strict=True):
            part = buffer[:, offset:offset + size].reshape(len(block_ids), *view.shape[1:])
            view.index_copy_(0, index, part)
            offset += size

    def chunks(self, block_ids: list[int]) -> list[list[int]]:
        step = self.chunk_blocks
        return [block_ids[i:i + step] for i in range(0, len(block_ids), step)]


def _new_group(host: str, store_port: int, key: str, rank: int, device: torch.device,
               timeout_s: float, store: Any | None = None) -> Any:
    """The world-size-2 transfer group under rendezvous ``key`` (blocks until
    both sides join, or raises after ``timeout_s``)."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, store_port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"kv_transfer/{key}", store)
    if device.type == "cuda":
        # a peer that dies must fail the transfer, not take this process down
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def _side_stream(device: torch.device) -> Any:
    """A stream of the transfer thread's own on CUDA, so its copies and
    messages do not queue behind the engine's steps (nothing on the CPU)."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()


def _run(work: Any, device: torch.device) -> None:
    work.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class KVSender:
    """The prefill side: offers, and a thread that serves pulls."""

    def __init__(self, tensors: Sequence[tuple[torch.Tensor, int]], host: str, port: int,
                 timeout_s: float, send_delay_s: float = 0.0) -> None:
        self.blocks = BlockBytes(tensors)
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.send_delay_s = send_delay_s  # fault injection: a slow sender
        self._store = dist.TCPStore(host, port + 1, None, True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")
        self._lock = threading.Lock()
        self._offers: dict[str, tuple[list[int], float]] = {}  # request id -> (blocks, deadline)
        self._released: list[str] = []
        self._group: Any = None
        self._group_key: str | None = None  # the connected decode engine's rendezvous key
        self._stop = threading.Event()
        self.bytes_sent = 0
        self.send_s = 0.0
        self._thread = threading.Thread(target=self._serve, name="kv-sender", daemon=True)
        self._thread.start()

    def offer(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._offers[request_id] = (block_ids, time.monotonic() + self.timeout_s)

    def take_released(self) -> list[str]:
        """Offers ended since the last call (pulled, refused or expired)."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
        self._context.term()

    def _serve(self) -> None:
        with _side_stream(self.blocks.device):
            self._serve_pulls()

    def _serve_pulls(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(POLL_MS):
                identity, payload = self._socket.recv_multipart()
                try:
                    self._handle(identity, msgspec.msgpack.decode(payload))
                except Exception as exc:  # a failed pull must not stop the server
                    logger.warning("KV transfer: a pull failed (%s); the decode engine "
                                   "recomputes, the group is rebuilt on its next pull", exc)
                    self._group = None
            self._expire()

    def _reply(self, identity: bytes, message: dict[str, Any]) -> None:
        self._socket.send_multipart([identity, msgspec.msgpack.encode(message)])

    def _handle(self, identity: bytes, message: dict[str, Any]) -> None:
        if message.get("op") == "connect":
            self._reply(identity, {"ok": True, "block_bytes": self.blocks.block_bytes})
            self._group, self._group_key = None, None
            self._group = _new_group(self.host, self.port + 1, message["key"], 0,
                                     self.blocks.device, self.timeout_s, self._store)
            self._group_key = message["key"]
            return
        if self._group is None or message.get("key") != self._group_key:
            # another decode engine connected since (the group has one peer): reconnect
            self._reply(identity, {"ok": False, "error": "not connected", "reconnect": True})
            return
        request_id = message["remote_request_id"]
        with self._lock:
            offer = self._offers.pop(request_id, None)
        if offer is None:
            self._reply(identity, {"ok": False, "error": f"no KV offered for {request_id!r} "
                                   "(expired or unknown)"})
            return
        wanted = message["block_ids"]
        if not set(wanted) <= set(offer[0]):
            self._reply(identity, {"ok": False, "error": "blocks not offered"})
            self._release(request_id, True)
            return
        self._reply(identity, {"ok": True})
        try:
            self._send(wanted)
        finally:
            self._release(request_id, True)

    def _send(self, block_ids: list[int]) -> None:
        if self.send_delay_s:
            time.sleep(self.send_delay_s)
        start = time.perf_counter()
        for chunk in self.blocks.chunks(block_ids):
            buffer = self.blocks.gather(chunk)
            _run(self._group.send([buffer], 1, 0), self.blocks.device)
            self.bytes_sent += buffer.numel()
        self.send_s += time.perf_counter() - start

    def _release(self, request_id: str, offered: bool) -> None:
        if offered:
            with self._lock:
                self._released.append(request_id)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, (_, deadline) in self._offers.items() if deadline < now]
            for rid in expired:
                del self._offers[rid]
            self._released += expired
        for rid in expired:
            logger.warning("KV transfer: nobody pulled the KV of %s in %.0f s; freed",
                           rid, self.timeout_s)


class KVReceiver:
    """The decode side: a thread that runs pulls one at a time."""

    def __init__(self, tensors: Sequence[tuple[torch.Tensor, int]], timeout_s: float) -> None:
        self.blocks = BlockBytes(tensors)
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket: Any = None
        self._peer: tuple[str, int] | None = None
        self._group: Any = None
        self._key = ""  # the rendezvous key of the current group
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finished: list[tuple[str, bool]] = []
        self.done = threading.Event()  # set whenever a pull ends
        self.bytes_received = 0
        self.receive_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def pull(self, job: PullJob) -> None:
        self._jobs.put(job)

    def take_finished(self) -> list[tuple[str, bool]]:
        """(request id, whether its KV landed) of pulls ended since the last call."""
        with self._lock:
            finished, self._finished = self._finished, []
        self.done.clear()
        return finished

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=2)
        self._disconnect()
        self._context.term()

    def _run(self) -> None:
        with _side_stream(self.blocks.device):
            self._run_pulls()

    def _run_pulls(self) -> None:
        while (job := self._jobs.get()) is not None:
            ok = False
            try:
                ok = self._pull(job)
            except Exception as exc:  # any failure: the engine recomputes the prompt
                logger.warning("KV transfer: pull of %s from %s:%d failed (%s); the prompt "
                               "is recomputed", job.request_id, job.host, job.port, exc)
                self._disconnect()
            with self._lock:
                self._finished.append((job.request_id, ok))
            self.done.set()

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self._socket.send(msgspec.msgpack.encode(message))
        if not self._socket.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"no answer in {self.timeout_s} s")
        reply: dict[str, Any] = msgspec.msgpack.decode(self._socket.recv())
        return reply

    def _connect(self, host: str, port: int) -> None:
        if self._peer == (host, port) and self._group is not None:
            return
        self._disconnect()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{host}:{port}")
        key = uuid.uuid4().hex
        reply = self._ask({"op": "connect", "key": key})
        self._key = key
        if reply["block_bytes"] != self.blocks.block_bytes:
            raise ValueError(f"the prefill engine's KV blocks are {reply['block_bytes']} bytes, "
                             f"this engine's {self.blocks.block_bytes}: same model, dtype, "
                             "KV cache dtype and block size needed")
        self._group = _new_group(host, port + 1, key, 1, self.blocks.device, self.timeout_s)
        self._peer = (host, port)

    def _disconnect(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._socket, self._group, self._peer = None, None, None

    def _pull(self, job: PullJob) -> bool:
        pull = {"op": "pull", "remote_request_id": job.remote_request_id,
                "block_ids": job.remote_block_ids}
        self._connect(job.host, job.port)
        reply = self._ask({**pull, "key": self._key})
        if reply.get("reconnect"):  # another decode engine took the prefill engine's group
            self._disconnect()
            self._connect(job.host, job.port)
            reply = self._ask({**pull, "key": self._key})
        if not reply["ok"]:
            logger.warning("KV transfer: %s refused (%s); the prompt is recomputed",
                           job.request_id, reply.get("error"))
            return False
        start = time.perf_counter()
        blocks = self.blocks
        remote_chunks = blocks.chunks(job.remote_block_ids)
        local_chunks = blocks.chunks(job.block_ids)
        for remote, local in zip(remote_chunks, local_chunks, strict=True):
            buffer = torch.empty((len(remote), blocks.block_bytes), dtype=torch.uint8,
                                 device=blocks.device)
            _run(self._group.recv([buffer], 0, 0), blocks.device)
            blocks.scatter(local, buffer)
            self.bytes_received += buffer.numel()
        if blocks.device.type == "cuda":
            torch.cuda.current_stream(blocks.device).synchronize()
        self.receive_s += time.perf_counter() - start
        return True
