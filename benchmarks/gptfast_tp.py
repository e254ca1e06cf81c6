"""gpt-fast's own tensor parallelism as the peer of kvserve's: its ``tp.py``
(``maybe_init_dist`` from torchrun's variables, ``apply_tp`` shards the
linears and all-reduces with functional collectives) on the llama-3-8b
preset's shapes, random bf16 weights (the same seed on every rank, so the
ranks shard one model), its compiled decode step, W1 batch 1; timed as
``benchmarks/peers.py`` times gpt-fast on one GPU (``time_w1``).

    PYTHONPATH=. torchrun --standalone --nproc-per-node N benchmarks/gptfast_tp.py \\
        --output-json out/peer-gptfast-tpN.json

N is 2 (``benchmarks/tensor_parallel.py``), 4 or 8 (``benchmarks/multi_gpu.py``):
the preset's 32 query and 8 KV heads split down to one KV head a rank.

gpt-fast's files must be in ``.peers/gpt-fast/`` (git-ignored: never commit
them). Rank 0 writes the JSON, in ``peers.py``'s shape (peer ``gptfast-tpN``);
its MBU counts the whole model's bytes against one GPU's copy rate, so
``mbu_per_gpu_vs_copy`` divides it by the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import torch

from benchmarks import peers
from kvserve import envs
from kvserve.bench.device_rates import measure_rates
from kvserve.bench.offline import ModelFigures
from kvserve.bench.report import environment, print_table, write_json
from kvserve.config import ModelConfig
from kvserve.models.presets import get_preset


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(peers.GPT_FAST_DIR))
    import generate as gpt_fast  # gpt-fast's generate.py
    import tp as gpt_fast_tp  # gpt-fast's tp.py
    from model import Transformer  # gpt-fast's model.py

    rank = gpt_fast_tp.maybe_init_dist("cuda")
    if rank is None:
        raise RuntimeError("run under torchrun with --nproc-per-node 2 or more")
    config = ModelConfig.from_hf_config(get_preset(peers.MODEL))
    rates = measure_rates(peers.DEVICE, torch.bfloat16)
    run_args = peers.PeerRun(args, config, ModelFigures.of(config, element_bytes=2), rates)
    with peers._on_gpu_in_bf16():
        model = Transformer.from_name(peers.MODEL).eval()
    gpt_fast_tp.apply_tp(model)
    gpt_fast.decode_one_token = torch.compile(gpt_fast.decode_one_token, mode="reduce-overhead",
                                              fullgraph=True)
    prompt = torch.tensor(peers._w1_prompt(run_args), dtype=torch.int, device=peers.DEVICE)
    sampling = {"temperature": 0.8, "top_k": 200}  # gpt-fast's defaults

    def generate() -> object:
        return gpt_fast.generate(model, prompt, args.output_len, batch_size=1,
                                 interactive=False, draft_model=None, **sampling)

    @torch.no_grad()
    def prefill() -> object:
        positions = torch.arange(0, prompt.numel(), device=peers.DEVICE)
        return gpt_fast.prefill(model, prompt.view(1, -1), positions, **sampling)

    result = peers.time_w1(generate, prefill, run_args)
    world = torch.distributed.get_world_size()
    result["tensor_parallel_size"] = world
    result["mbu_per_gpu_vs_copy"] = result["mbu_vs_copy"] / world
    return {"rank": rank, "rates": rates, "figures": run_args.figures, "result": result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    envs.disable_nvlink_multicast()
    if not torch.cuda.is_available():
        print("gptfast_tp.py needs CUDA devices", file=sys.stderr)
        return 2
    done = run(args)
    if done["rank"] != 0:
        return 0
    result, rates = done["result"], done["rates"]
    name = f"gptfast-tp{result['tensor_parallel_size']}"
    print_table(f"gpt-fast TP={result['tensor_parallel_size']} on {rates.card}: {peers.MODEL}", [
        ("copy / matmul", f"{rates.copy_gb_s:,.0f} GB/s / {rates.matmul_tflop_s:,.0f} TFLOP/s"),
        peers._row(name, result),
        ("MBU per GPU", f"{100 * result['mbu_per_gpu_vs_copy']:.1f}% of copy"),
    ])
    write_json(args.output_json, {
        "benchmark": "peers", **environment(), "model": peers.MODEL, **rates.to_dict(),
        **dataclasses.asdict(done["figures"]), "args": vars(args), "peers": {name: result},
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
