"""The LoRA side of ``kvserve bench throughput`` and ``latency``:
``--num-loras N --lora-rank R`` writes N random PEFT adapters of rank R for
the benchmarked model (every supported projection, or ``--lora-targets``)
into a temporary directory, turns LoRA on in the engine (``max_lora_rank``
raised to R if needed) and runs request ``i`` with adapter ``i % N``.

The adapters are random (A and B both drawn; PEFT starts B at zero), scaled
so each delta is small beside the base output: the speed does not depend on
the values, and greedy decoding stays close to the base model's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvserve.config import ModelConfig
from kvserve.lora.peft import CONFIG_FILE, SUPPORTED_TARGET_MODULES, WEIGHTS_FILE
from kvserve.lora.request import LoRARequest


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--num-loras", type=int, default=0,
                       help="random PEFT adapters made for the run, used round-robin by the "
                            "requests (turns --enable-lora on; default 0: the base model)")
    group.add_argument("--lora-rank", type=int, default=16,
                       help="their rank (default: %(default)s)")
    group.add_argument("--lora-targets", nargs="+", default=list(SUPPORTED_TARGET_MODULES),
                       choices=list(SUPPORTED_TARGET_MODULES),
                       help="the projections they adapt (default: all seven)")


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad LoRA flags; with adapters, turn LoRA on in the engine flags."""
    if args.num_loras < 0:
        raise ValueError(f"--num-loras={args.num_loras} is invalid: must be >= 0")
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank={args.lora_rank} is invalid: must be >= 1")
    if args.num_loras:
        args.enable_lora = True
        args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)


def module_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of a decoder layer."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_random_adapter(model: ModelConfig, path: Path, rank: int, targets: list[str],
                         seed: int) -> Path:
    """A random rank-``rank`` PEFT adapter (bf16 tensors) for ``model`` in ``path``."""
    import torch
    from safetensors.torch import save_file

    shapes = module_shapes(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module in targets:
            in_features, out_features = shapes[module]
            prefix = (f"base_model.model.model.layers.{layer}."
                      f"{SUPPORTED_TARGET_MODULES[module]}.{module}")
            # x @ A.T has entries of about |x| / sqrt(rank); B keeps the delta small
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(
                rank, in_features, generator=generator) / in_features ** 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (0.01 * torch.randn(
                out_features, rank, generator=generator)).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none", "task_type": "CAUSAL_LM"}))
    save_file(tensors, str(path / WEIGHTS_FILE))
    return path


@contextmanager
def random_adapters(args: argparse.Namespace, model: ModelConfig
                    ) -> Iterator[list[LoRARequest]]:
    """``--num-loras`` random adapters in a temporary directory (removed after)."""
    if not args.num_loras:
        yield []
        return
    root = Path(tempfile.mkdtemp(prefix="kvserve-bench-lora-"))
    try:
        yield [LoRARequest(f"bench-lora-{i}", i + 1, str(write_random_adapter(
            model, root / f"lora-{i}", args.lora_rank, list(args.lora_targets), seed=i)))
            for i in range(args.num_loras)]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def round_robin(loras: list[LoRARequest], num_requests: int) -> list[LoRARequest | None] | None:
    """Request ``i``'s adapter: ``loras[i % len(loras)]``; None without adapters."""
    if not loras:
        return None
    return [loras[i % len(loras)] for i in range(num_requests)]


def describe(args: argparse.Namespace) -> dict[str, object]:
    """The LoRA figures of a run's JSON."""
    return {"num_loras": args.num_loras, "lora_rank": args.lora_rank if args.num_loras else None,
            "lora_targets": list(args.lora_targets) if args.num_loras else None}
