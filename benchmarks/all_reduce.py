"""Small all-reduces of one TP group on CUDA, as a decode step makes them: NCCL
(``torch.distributed``) against kvserve's one-shot all-reduce over symmetric
memory (``kvserve/distributed/communicator.py``), eager and captured in a
CUDA graph, for bf16 tensors of 8 KiB to 1 MiB (batch 1 of an 8B Llama
all-reduces 8 KiB, 64 times a step). One method and mode per run, under
torchrun, so a run that hangs is killed by its time limit alone:

    PYTHONPATH=. timeout 300 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/all_reduce.py --method nccl --mode graph --output-json out/ar.json

``benchmarks/tensor_parallel.py`` runs every combination this way. Rank 0
writes µs per call, after checking one sum (of the ranks: exact in bf16).
NVLink multicast stays off (kvserve's workers switch it off the same way).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve import envs
from kvserve.bench.device_rates import graph_call_us
from kvserve.bench.report import environment, write_json
from kvserve.distributed.communicator import Communicator

SIZES_KIB = (8, 16, 64, 256, 1024)
EAGER_CALLS = 200


def eager_us(call: Callable[[int], object]) -> float:
    for i in range(10):
        call(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(EAGER_CALLS):
        call(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / EAGER_CALLS * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=("nccl", "one-shot"), required=True)
    parser.add_argument("--mode", choices=("eager", "graph"), required=True)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    envs.disable_nvlink_multicast()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=60))
    comm = Communicator(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    if args.method == "one-shot":
        comm.enable_one_shot(device, torch.bfloat16)
    results = {}
    for kib in SIZES_KIB:
        numel = kib * 1024 // 2
        # distinct inputs per call, as distinct layers' outputs
        inputs = [torch.randn(numel, dtype=torch.bfloat16, device=device) for _ in range(8)]

        # each rank contributes its rank: the sum is exact in bf16
        check = comm.all_reduce(torch.full((numel,), float(dist.get_rank()),
                                           dtype=torch.bfloat16, device=device))
        assert bool((check == sum(range(dist.get_world_size()))).all()), "wrong sum"

        def call(i: int, inputs: list[torch.Tensor] = inputs) -> torch.Tensor:
            # NCCL sums in place: the values grow, the time does not
            return comm.all_reduce(inputs[i % len(inputs)])

        us = eager_us(call) if args.mode == "eager" else graph_call_us(call)
        results[f"{kib}KiB"] = us
        if dist.get_rank() == 0:
            print(f"{args.method} {args.mode} {kib:5d} KiB: {us:8.1f} µs", flush=True)
    if dist.get_rank() == 0:
        write_json(args.output_json, {"benchmark": "all_reduce", **environment(),
                                      "card": torch.cuda.get_device_name(device),
                                      "world_size": dist.get_world_size(),
                                      "method": args.method, "mode": args.mode,
                                      "us_per_call": results})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
