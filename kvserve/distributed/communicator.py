"""The collectives of tensor parallelism and the point-to-point hand-off of
pipeline parallelism, over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

``Communicator`` is one TP group: ``all_reduce`` (after the attention and
MLP outputs, the embedding lookup) and ``all_gather`` along the last dim
(the LM head's logits). Of size one it returns its input and never touches
``torch.distributed``, so one process runs exactly as before. Every call is
capturable in a CUDA graph (the runner warms up on a side stream first);
their timeout is the process group's. With ``one_shot`` (CUDA, one node)
small all-reduces go through ``OneShotAllReduce`` instead of NCCL.

``PipelineChannel`` sends a stage's ``[num_tokens, 2, hidden_size]`` hidden
states and residual to the next stage and receives the previous stage's,
outside any CUDA graph: sends are asynchronous, each keeping its tensor
alive until it completes.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

from kvserve.distributed.sharding import RankLayout

logger = logging.getLogger(__name__)

# all_gather_single replaces all_gather_into_tensor from torch 2.13 on
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# inputs up to this size take the one-shot all-reduce; larger ones NCCL
ONE_SHOT_MAX_BYTES = 1 << 20


class OneShotAllReduce:
    """A sum over the TP ranks of one node in one kernel: every rank writes its
    input into its own symmetric-memory buffer, then reads every peer's
    buffer over peer-to-peer links and adds (torch's
    ``symm_mem.one_shot_all_reduce``). NVLink multicast stays off
    (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set in every worker): this
    needs only peer-to-peer access. Built collectively, at start-up."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.13, a deprecated no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.buffer.zero_()
        torch.cuda.synchronize(device)
        symm_mem.rendezvous(self.buffer, self.group_name).barrier(channel=0)
        self._copy_op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy", None)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.buffer[: x.numel()]
        if self._copy_op is not None:  # the copy into the buffer inside the same kernel
            out = self._copy_op(buffer, x.reshape(-1), "sum", self.group_name)
        else:
            buffer.copy_(x.reshape(-1))
            out = torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", self.group_name)
        return out.view(x.shape)


class Communicator:
    """Collectives over one TP group; the identity when the group has one rank."""

    def __init__(self, group: Any = None, size: int = 1, rank: int = 0) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.one_shot: OneShotAllReduce | None = None

    def enable_one_shot(self, device: torch.device, dtype: torch.dtype) -> None:
        """Route small all-reduces of ``dtype`` through ``OneShotAllReduce`` (collective)."""
        if self.size > 1:
            self.one_shot = OneShotAllReduce(self.group, device, dtype)
            logger.info("TP all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
                        ONE_SHOT_MAX_BYTES // 1024)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group (in place when NCCL or gloo runs it)."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``: the ranks' slices side
        by side along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        # the ranks' tensors one after another along dim 0 (gloo takes no other form)
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_into(out, x, group=self.group)
        stacked = out.view(self.size, *x.shape)
        return stacked.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])


class PipelineChannel:
    """Hidden states to the next stage and from the previous one (same TP rank)."""

    def __init__(self, layout: RankLayout) -> None:
        self.prev_rank = None if layout.is_first_stage else layout.prev_stage_rank
        self.next_rank = None if layout.is_last_stage else layout.next_stage_rank
        # sends in flight, with the tensors they read
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (a copy: the caller may overwrite it) to the next stage."""
        assert self.next_rank is not None, "the last stage sends nothing"
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        copy = tensor.clone()
        self._sends.append((dist.isend(copy, self.next_rank), copy))

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (contiguous) with what the previous stage sent next; returns it."""
        assert self.prev_rank is not None, "the first stage receives nothing"
        dist.recv(out, self.prev_rank)
        return out

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
