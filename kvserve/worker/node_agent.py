"""A node other than the engine's, in a parallel engine spread over several nodes.

Node 0 runs the engine (and the server); every other node runs ``kvserve
serve`` with the same model and engine flags plus ``--nnodes N --node-rank R
--master-addr A --master-port P`` (or torchrun's ``NNODES``, ``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), which comes here instead of serving HTTP:
wait for node 0's rendezvous store, start this node's workers (ranks
``R * ranks_per_node ...``, one per local device) and keep them until they
stop. Workers talk to the engine directly; this process only supervises:
when a worker exits (the engine stops them at shutdown) the others get
``STOP_TIMEOUT_S`` to follow, and when node 0's store disappears (the engine
died) they are killed. The exit status is 0 when every worker stopped cleanly.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.worker.worker import CONTROL_KEY, start_workers, stop_processes

logger = logging.getLogger(__name__)

POLL_S = 1.0
STOP_TIMEOUT_S = 10.0


def run_node_agent(config: EngineConfig) -> int:
    """Run this node's workers until the engine on node 0 stops; the exit status."""
    parallel = config.parallel_config
    per_node = parallel.ranks_per_node
    ranks = range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)
    logger.info("node %d of %d: waiting for node 0 at %s:%d, then starting ranks %d..%d",
                parallel.node_rank, parallel.nnodes, parallel.master_addr, parallel.master_port,
                ranks[0], ranks[-1])
    store = dist.TCPStore(parallel.master_addr, parallel.master_port, is_master=False,
                          timeout=timedelta(seconds=parallel.distributed_timeout_s))
    store.wait([CONTROL_KEY])
    workers = start_workers(config, ranks, parallel.master_addr, parallel.master_port)
    engine_gone = False
    try:
        while not wait([w.process.sentinel for w in workers], timeout=POLL_S):
            try:
                store.check([CONTROL_KEY])
            except Exception:  # the store went away with node 0's engine
                logger.error("node 0's engine is gone: stopping this node's workers")
                engine_gone = True
                break
    finally:
        stop_processes(workers, 0.0 if engine_gone else STOP_TIMEOUT_S)
    failed = engine_gone or any(w.process.exitcode for w in workers)
    return 1 if failed else 0
