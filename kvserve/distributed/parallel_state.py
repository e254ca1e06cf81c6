"""This process's place among the parallel workers, and its communicators.

``ParallelState`` is what a worker knows of the split: its ``RankLayout``,
``tp`` (the ``Communicator`` of its stage's TP group), ``pp`` (the
``PipelineChannel`` to its neighbouring stages) and a CPU group over every
rank for start-up agreements (``min_over_ranks``: the KV pool size).
``init_distributed`` builds it in a worker process; ``ParallelState.single()``
is one process, which communicates with nobody.

Parallel layers size and shard themselves when they are built: a worker
builds its model inside ``building(state)``, each layer reads
``building_state()`` in its constructor and keeps what it needs. Nothing
reads it afterwards, and outside the block it is the single-process state,
so a ``ModelConfig`` alone still builds the whole model (as
``torch.device(...)`` decides where a model is built without an argument).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvserve.config import ParallelConfig
from kvserve.distributed.communicator import Communicator, PipelineChannel
from kvserve.distributed.sharding import RankLayout

logger = logging.getLogger(__name__)


@dataclass
class ParallelState:
    """One rank's layout and communicators."""

    layout: RankLayout = field(default_factory=RankLayout)
    tp: Communicator = field(default_factory=Communicator)
    pp: PipelineChannel | None = None
    # gloo over every rank (None in one process)
    cpu_group: Any = None

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    @property
    def is_single(self) -> bool:
        return self.layout.world_size == 1

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank must call it)."""
        if self.cpu_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())


_building: ParallelState | None = None


@contextmanager
def building(state: ParallelState) -> Iterator[None]:
    """Build a model for ``state``'s rank: its layers read it in their constructors."""
    global _building
    previous, _building = _building, state
    try:
        yield
    finally:
        _building = previous


def building_state() -> ParallelState:
    """The state of the model being built (one process outside ``building``)."""
    return _building if _building is not None else ParallelState.single()


def init_distributed(config: ParallelConfig, rank: int, device: torch.device,
                     store: Any) -> ParallelState:
    """Join the process group (NCCL on CUDA, gloo on CPU) through ``store`` and
    build this rank's communicators. Collective: every rank calls it."""
    timeout = timedelta(seconds=config.distributed_timeout_s)
    layout = RankLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank)
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=layout.world_size,
                                timeout=timeout, device_id=device)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world_size,
                                timeout=timeout)
        cpu_group = dist.group.WORLD
    tp = Communicator()
    if layout.tp_size > 1:
        # new_group is collective: every rank creates every stage's group, in order
        for pp_rank in range(layout.pp_size):
            ranks = layout.stage_ranks(pp_rank)
            group = dist.new_group(ranks, timeout=timeout)
            if pp_rank == layout.pp_rank:
                tp = Communicator(group, layout.tp_size, layout.tp_rank)
    pp = PipelineChannel(layout) if layout.pp_size > 1 else None
    logger.info("rank %d of %d: TP rank %d of %d, pipeline stage %d of %d, on %s", rank,
                layout.world_size, layout.tp_rank, layout.tp_size, layout.pp_rank,
                layout.pp_size, device)
    return ParallelState(layout, tp, pp, cpu_group)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
