"""The engine core's side of disaggregated prefill / decode: it ties the
scheduler's books (pinned and receiving requests) to the transfer thread
(``distributed/kv_transfer.py``, imported lazily like the worker layer).

Prefill role: a request with ``kv_transfer_params={"do_remote_decode": true}``
runs as usual; when it finishes, the scheduler keeps its blocks, its final
output carries where to pull them from (vLLM's ``do_remote_prefill``,
``remote_host``, ``remote_port``, ``remote_request_id``,
``remote_block_ids``), and the blocks are offered to the sender until a
decode engine pulls them or they expire; then they are freed.

Decode role: a request carrying such params is queued and given blocks for
all its prompt tokens but the last (the ones beyond its local prefix hits are
pulled); it is not scheduled until they land, then it computes the last
prompt token (producing its first token, as one engine would) and decodes.
A pull that fails leaves the request to compute its prompt itself.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvserve import envs
from kvserve.config import KVTransferConfig
from kvserve.core.outputs import EngineCoreOutput
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler

if TYPE_CHECKING:
    from kvserve.distributed.kv_transfer import KVReceiver, KVSender

logger = logging.getLogger(__name__)

# how long an idle engine core waits for a transfer to end before looking again
IDLE_WAIT_S = 0.005
_REMOTE_KEYS = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids")


def check_kv_transfer_params(params: dict[str, Any] | None, role: str) -> None:
    """ValueError when a request's ``kv_transfer_params`` do not fit this
    engine's role or lack a field a decode engine needs."""
    if not params:
        return
    if params.get("do_remote_decode") and role != "prefill":
        raise ValueError("kv_transfer_params.do_remote_decode needs an engine started with "
                         f"--kv-role prefill; this one is '{role}'")
    if params.get("do_remote_prefill"):
        if role != "decode":
            raise ValueError("kv_transfer_params.do_remote_prefill needs an engine started "
                             f"with --kv-role decode; this one is '{role}'")
        missing = [key for key in _REMOTE_KEYS if key not in params]
        if missing:
            raise ValueError(f"kv_transfer_params: missing {missing} (pass on what the "
                             "prefill engine answered)")
        ids = params["remote_block_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"kv_transfer_params.remote_block_ids={ids!r} is invalid: must be "
                             "a list of integers")


class KVConnector:
    """Drives pins, offers and pulls around each engine step."""

    def __init__(self, config: KVTransferConfig, scheduler: Scheduler, executor: Any) -> None:
        from kvserve.distributed.kv_transfer import KVReceiver, KVSender

        self.config = config
        self.role = config.kv_role
        self.scheduler = scheduler
        tensors = executor.kv_pool_tensors()
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        if self.role == "prefill":
            self.sender = KVSender(tensors, config.kv_transfer_host, config.kv_transfer_port,
                                   config.kv_transfer_timeout_s,
                                   envs.fault_injection().kv_send_delay_s)
        else:
            self.receiver = KVReceiver(tensors, config.kv_transfer_timeout_s)
        self.num_pulled = self.num_recomputed = 0

    def add_request(self, request: Request) -> None:
        """Queue a request in the scheduler, starting its pull when it has one."""
        params = request.sampling_params.kv_transfer_params
        check_kv_transfer_params(params, self.role)
        self.scheduler.add_request(request)
        if not params or not params.get("do_remote_prefill"):
            return
        num_tokens = request.num_prompt_tokens - 1  # the last one is computed here
        started = self.scheduler.start_kv_receive(request.request_id, num_tokens) \
            if num_tokens > 0 else None
        block_ids, num_local = started if started is not None else ([], 0)
        remote_ids = list(params["remote_block_ids"][num_local:num_local + len(block_ids)])
        if started is None or len(remote_ids) != len(block_ids):
            if started is not None:
                logger.warning("KV transfer: %s names %d blocks, %d needed; recomputing",
                               request.request_id, len(params["remote_block_ids"]),
                               num_local + len(block_ids))
                self.scheduler.finish_kv_receive(request.request_id, False)
            self.num_recomputed += 1
            block_ids, remote_ids = [], []
        from kvserve.distributed.kv_transfer import PullJob

        assert self.receiver is not None
        # a pull of no blocks (all in the local prefix cache, or none taken) lets the
        # prefill engine free them now rather than at its timeout
        self.receiver.pull(PullJob(request.request_id, str(params["remote_host"]),
                                   int(params["remote_port"]), str(params["remote_request_id"]),
                                   remote_ids, block_ids))

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        """Offer finished prefills' blocks and say where they are; free the
        blocks of offers that ended; let landed (or failed) pulls run."""
        scheduler = self.scheduler
        if self.sender is not None:
            for output in outputs:
                if output.finished and output.request_id in scheduler.kv_pinned:
                    block_ids = scheduler.kv_manager.get_block_ids(output.request_id)
                    self.sender.offer(output.request_id, block_ids)
                    output.kv_transfer_params = {
                        "do_remote_prefill": True, "remote_host": self.config.kv_transfer_host,
                        "remote_port": self.config.kv_transfer_port,
                        "remote_request_id": output.request_id,
                        "remote_block_ids": block_ids}
            for request_id in self.sender.take_released():
                scheduler.release_kv(request_id)
        if self.receiver is not None:
            for request_id, ok in self.receiver.take_finished():
                if request_id in scheduler.kv_receiving:
                    scheduler.finish_kv_receive(request_id, ok)
                    self.num_pulled += ok
                    self.num_recomputed += not ok

    def busy(self) -> bool:
        """Whether blocks are pinned or being received (the core must keep stepping)."""
        return bool(self.scheduler.kv_pinned or self.scheduler.kv_receiving)

    def wait(self) -> None:
        """Nothing to run: wait a little for a transfer to end."""
        if self.receiver is not None:
            self.receiver.done.wait(IDLE_WAIT_S)
        else:
            time.sleep(IDLE_WAIT_S)

    def stats(self) -> dict[str, Any]:
        if self.sender is not None:
            return {"kv_transfer_bytes_sent": self.sender.bytes_sent,
                    "kv_transfer_send_s": self.sender.send_s}
        assert self.receiver is not None
        return {"kv_transfer_bytes_received": self.receiver.bytes_received,
                "kv_transfer_receive_s": self.receiver.receive_s,
                "kv_transfer_pulled_requests": self.num_pulled,
                "kv_transfer_recomputed_requests": self.num_recomputed}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
