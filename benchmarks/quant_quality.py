"""Held-out quality of the bundled model quantised by ``kvserve quantize``.

    PYTHONPATH=. python benchmarks/quant_quality.py --output-json quant_quality.json \\
        [--stdlib /root/.pyenv/versions/3.12.1/lib/python3.12] [--device cpu|cuda] \\
        [--configs bf16 int8-rtn int4-g128-rtn ...] [--keep-dir runs/quant_quality] \
        [--kv-cache-dtypes auto bfloat16 fp8_e4m3 int8]

The held-out files are those of ``scripts/train_default_model.py``'s split
(``classify``: sha256 of the path relative to the stdlib, held out below 50 of
1000), taken from the stdlib named by ``--stdlib`` with the script's own
functions (reading, skip rules, duplicates), tokenised ``<|bos|> text
<|eos|>`` per file, and scored as the model card scores them: every
non-overlapping 512-token window, next-token loss with ``<|bos|>`` targets
ignored, bits per byte over the UTF-8 bytes the scored tokens spell.
Calibration text (GPTQ, AWQ) is the train split's files of the same stdlib
only, the same windows for every method (``--num-samples`` x ``--seq-len``,
``--seed``).

Every configuration but ``bf16``, ``fp8`` and ``w8a8-int8`` (FP8 / INT8 W8A8
rounded at load, as ``--quantization fp8|w8a8-int8``: the torch reference's
arithmetic, activations quantised per token) is a checkpoint written by
``kvserve quantize`` (compressed-tensors); the SmoothQuant rows
(``w8a8-int8-smoothquant-aA``, alpha A) are loaded from their written
checkpoint as ``kvserve serve`` loads it. Every row, ``bf16`` included, is scored by
kvserve's own model: its linears hold the run's ``QuantizedWeight``s
(kvserve's packed layout, the layer seam's weight-only method, torch
reference on the CPU) and its other tensors are read from the written
checkpoint (AWQ's folded norms). With ``--kv-cache-dtypes`` each weight
configuration is scored once per KV cache dtype (``auto``: the model's
float32; ``bfloat16``; ``fp8_e4m3`` with scales 1.0 and ``int8`` with
per-token scales, as ``--kv-cache-dtype`` stores them): the windows are
prefilled through the cache, so every attention reads the stored K and V,
and each row also gives the share of positions whose greedy (argmax) next
token equals the same weights' ``auto`` row. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvserve.assets import default_model_path
from kvserve.attention.backend import get_attention_backend
from kvserve.attention.kv_quant import KV_CACHE_DTYPES
from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.layers.attention import bind_kv_cache
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM, get_model_class
from kvserve.models.source import resolve_model_config
from kvserve.quant.config import QuantConfig, quantize_at_load
from kvserve.quant.formats import parse_quantization_config
from kvserve.quant.methods import LinearMethod
from kvserve.quantize.options import QuantizeOptions
from kvserve.quantize.pipeline import QuantizeResult, quantize_checkpoint
from kvserve.worker.kv_cache import KVCacheSpec, allocate_kv_scales

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STDLIB = Path("/root/.pyenv/versions/3.12.1/lib/python3.12")
BLOCK_SIZE = 16
# name -> (method, bits, group_size, symmetric, act_order); "bf16" is the checkpoint as is
CONFIGS: dict[str, tuple[str, int, int, bool, bool]] = {
    "int8-rtn": ("rtn", 8, -1, True, False),
    "int4-g128-rtn": ("rtn", 4, 128, True, False),
    "int4-g128-asym-rtn": ("rtn", 4, 128, False, False),
    "int4-g128-gptq": ("gptq", 4, 128, True, False),
    "int4-g128-gptq-act-order": ("gptq", 4, 128, True, True),
    "int4-g128-asym-awq": ("awq", 4, 128, False, False),
    "int4-g64-rtn": ("rtn", 4, 64, True, False),
    "int4-g64-gptq": ("gptq", 4, 64, True, False),
    "int4-g64-asym-rtn": ("rtn", 4, 64, False, False),
    "int4-g64-asym-awq": ("awq", 4, 64, False, False),
    "int4-g32-rtn": ("rtn", 4, 32, True, False),
    "int4-g32-gptq": ("gptq", 4, 32, True, False),
    "int4-g32-asym-rtn": ("rtn", 4, 32, False, False),
    "int4-g32-asym-awq": ("awq", 4, 32, False, False),
}
# INT8 W8A8 checkpoints written by ``kvserve quantize --method smoothquant``: name -> alpha
SMOOTHQUANT_CONFIGS = {"w8a8-int8-smoothquant-a0.5": 0.5, "w8a8-int8-smoothquant-a0.8": 0.8}
QUANTIZED_AT_LOAD = ("fp8", "w8a8-int8")
# --kv-cache-dtypes name -> the cache's dtype (None: the model's, float32 here)
KV_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16,
                                            **KV_CACHE_DTYPES}
DEFAULT_CONFIGS = ["bf16", "int8-rtn", "int4-g128-rtn", "int4-g128-asym-rtn", "int4-g128-gptq",
                   "int4-g128-gptq-act-order", "int4-g128-asym-awq"]


def training_script() -> Any:
    """``scripts/train_default_model.py`` as a module (its split and scoring rules)."""
    spec = importlib.util.spec_from_file_location("train_default_model",
                                                  ROOT / "scripts" / "train_default_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def corpus_splits(train: Any, stdlib: Path) -> dict[str, list[tuple[str, str]]]:
    """The stdlib's train and held-out files (relative path, text), split as in training."""
    preset = train.FULL_PRESET
    corpus = train.collect_corpus(stdlib, max_files=0,
                                  lora_max_bytes=int(preset["lora_max_mb"] * 1e6),
                                  packages=[], packages_max_bytes=0)
    return {"train": corpus.splits["train"], "heldout": corpus.splits["heldout"]}


def heldout_as_in_training(heldout: list[tuple[str, str]]) -> bool:
    """Whether these are the held-out files the model card's run scored (by path)."""
    corpus = json.loads((ROOT / "docs" / "default_model" / "corpus.json").read_text())
    return sorted(rel for rel, _ in heldout) == sorted(corpus["splits"]["heldout"]["files"])


def prefill_metadata(num_reqs: int, seq_len: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """``num_reqs`` fresh requests of ``seq_len`` tokens each, contiguous blocks."""
    blocks = -(-seq_len // BLOCK_SIZE)
    starts = [i * seq_len for i in range(num_reqs + 1)]
    table = torch.arange(num_reqs * blocks, dtype=torch.int32).view(num_reqs, blocks)
    positions = torch.arange(seq_len).repeat(num_reqs)
    slots = (table[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(num_reqs, -1)
    metadata = AttentionMetadata(
        num_reqs=num_reqs, num_tokens=num_reqs * seq_len, max_query_len=seq_len,
        max_seq_len=seq_len, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32), block_table=table,
        slot_mapping=slots[:, :seq_len].reshape(-1).long(), query_start_loc_cpu=starts,
        seq_lens_cpu=[seq_len] * num_reqs)
    return metadata, positions


@torch.no_grad()
def score(model: CausalLM, config: ModelConfig, stream: torch.Tensor, byte_lens: torch.Tensor,
          bos_id: int, seq_len: int, batch_size: int, max_windows: int,
          kv_dtype: torch.dtype | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Held-out loss, perplexity and bits per byte over every non-overlapping window
    (``max_windows`` > 0: that many, evenly spaced over the stream), with a KV
    cache of ``kv_dtype`` (None: the model's); and the argmax next token at
    every scored position."""
    total = (stream.numel() - 1) // seq_len
    chosen = torch.arange(total)
    if 0 < max_windows < total:
        chosen = torch.linspace(0, total - 1, max_windows).round().long()
    offsets = torch.arange(seq_len + 1)
    num_blocks = batch_size * -(-seq_len // BLOCK_SIZE)
    dtype = kv_dtype or next(model.parameters()).dtype
    caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
                          dtype=dtype) for _ in range(config.num_layers)]
    scales = allocate_kv_scales(KVCacheSpec.of(model), model, dtype, num_blocks, BLOCK_SIZE,
                                torch.device("cpu"))
    bind_kv_cache(model, caches, get_attention_backend("torch"), scales)
    nats, count, num_bytes = 0.0, 0, 0
    greedy = []
    for starts in chosen.split(batch_size):
        window = stream[starts[:, None] * seq_len + offsets[None, :]]
        metadata, positions = prefill_metadata(len(starts), seq_len)
        hidden = model(window[:, :-1].reshape(-1), positions, metadata)
        logits = model.compute_logits(hidden).float()
        labels = window[:, 1:].reshape(-1)
        keep = labels != bos_id
        nats += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep],
                                                        reduction="sum"))
        greedy.append(logits[keep].argmax(dim=-1))
        count += int(keep.sum())
        num_bytes += int(byte_lens[labels].sum())
    return ({"heldout_loss": nats / count, "heldout_ppl": math.exp(nats / count),
             "heldout_bits_per_byte": nats / math.log(2) / num_bytes, "scored_tokens": count},
            torch.cat(greedy))


def quantized_model(result: QuantizeResult, config: ModelConfig) -> CausalLM:
    """kvserve's model holding the run's ``QuantizedWeight``s (kvserve's packed
    layout) and the written checkpoint's other tensors."""
    options = result.options
    quant = QuantConfig(bits=options.bits, group_size=options.group_size,
                        symmetric=options.is_symmetric)
    config = dataclasses.replace(config, quantization=quant)
    model = get_model_class(config.architecture)(config)
    tensors = load_file(options.output / "model.safetensors")
    weights = {name: t for name, t in tensors.items()
               if name.rsplit(".", 1)[0] not in result.quantized}
    for module, qw in result.quantized.items():
        weights[f"{module}.qweight"] = qw.qweight
        weights[f"{module}.scales"] = qw.scales
        if qw.zeros is not None:
            weights[f"{module}.zeros"] = qw.zeros
    model.load_weights(weights.items())
    for module in model.modules():
        method: LinearMethod | None = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def write_calibration(files: list[tuple[str, str]], path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _, text in files))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--stdlib", type=Path, default=DEFAULT_STDLIB)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        choices=["bf16", *QUANTIZED_AT_LOAD, *CONFIGS, *SMOOTHQUANT_CONFIGS])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_DTYPES),
                        help="score each configuration with each KV cache dtype")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="calibration device")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--max-windows", type=int, default=0,
                        help="score N evenly spaced held-out windows (0: all, as the model card)")
    parser.add_argument("--keep-dir", type=Path, default=None,
                        help="keep the written checkpoints here (default: a temporary dir)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train = training_script()
    splits = corpus_splits(train, args.stdlib)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    stream = torch.from_numpy(train.encode_stream(tok, [t for _, t in splits["heldout"]])
                              .astype("int64"))
    byte_lens = torch.from_numpy(train.token_byte_lengths(tok))
    bos_id = tok.token_to_id(train.BOS)
    config, _ = resolve_model_config(str(args.model))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        calib = write_calibration(splits["train"], Path(tmp) / "calib.jsonl")
        for name in args.configs:
            start = time.perf_counter()
            row: dict[str, Any] = {"config": name}
            if name == "bf16" or name in QUANTIZED_AT_LOAD:  # W8A8 as --quantization NAME
                quant = quantize_at_load(name) if name in QUANTIZED_AT_LOAD else None
                model = load_model(dataclasses.replace(config, quantization=quant), args.model,
                                   "auto", torch.float32, "cpu")
                row["checkpoint_bytes"] = (args.model / "model.safetensors").stat().st_size
            elif name in SMOOTHQUANT_CONFIGS:
                result = quantize_checkpoint(QuantizeOptions(
                    model=args.model, output=work / name, method="smoothquant", bits=8,
                    group_size=-1, alpha=SMOOTHQUANT_CONFIGS[name], calib=calib,
                    num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed,
                    device=args.device))
                row |= {"method": "smoothquant", "calibration_s": round(result.seconds, 1),
                        "checkpoint_bytes": (work / name / "model.safetensors").stat().st_size}
                written, _ = resolve_model_config(str(work / name))
                quant = parse_quantization_config(written.hf_config)
                model = load_model(dataclasses.replace(written, quantization=quant), work / name,
                                   "auto", torch.float32, "cpu")
            else:
                method, bits, group_size, symmetric, act_order = CONFIGS[name]
                result = quantize_checkpoint(QuantizeOptions(
                    model=args.model, output=work / name, method=method, bits=bits,
                    group_size=group_size, symmetric=symmetric, act_order=act_order,
                    calib=None if method == "rtn" else calib, num_samples=args.num_samples,
                    seq_len=args.seq_len, seed=args.seed, device=args.device))
                row |= {"method": method, "calibration_s": round(result.seconds, 1),
                        "checkpoint_bytes": (work / name / "model.safetensors").stat().st_size}
                model = quantized_model(result, config)
            base_greedy: torch.Tensor | None = None
            for kv_name in args.kv_cache_dtypes:
                kv_row = dict(row, config=name if kv_name == "auto" else f"{name} kv={kv_name}",
                              kv_cache_dtype=kv_name)
                figures, greedy = score(model, config, stream, byte_lens, bos_id, args.seq_len,
                                        args.eval_batch_size, args.max_windows,
                                        KV_DTYPES[kv_name])
                kv_row |= figures
                if kv_name == "auto":
                    base_greedy = greedy
                elif base_greedy is not None:
                    kv_row["greedy_agreement_vs_auto_kv"] = float(
                        (greedy == base_greedy).float().mean())
                kv_row["seconds"] = round(time.perf_counter() - start, 1)
                rows.append(kv_row)
                print(json.dumps(kv_row), flush=True)
    base = next((r for r in rows if r["config"] == "bf16"), None)
    print(f"\n{'config':28s} {'ppl':>8s} {'vs bf16':>8s} {'bits/byte':>9s} {'MB':>6s}")
    for row in rows:
        delta = f"{row['heldout_ppl'] / base['heldout_ppl'] - 1:+.2%}" if base else "-"
        print(f"{row['config']:28s} {row['heldout_ppl']:8.3f} {delta:>8s} "
              f"{row['heldout_bits_per_byte']:9.4f} {row['checkpoint_bytes'] / 1e6:6.1f}")
    if args.output_json:
        args.output_json.write_text(json.dumps({
            "model": str(args.model), "stdlib": str(args.stdlib),
            "heldout_files": len(splits["heldout"]), "train_files": len(splits["train"]),
            "heldout_files_as_in_training": heldout_as_in_training(splits["heldout"]),
            "heldout_tokens": int(stream.numel()), "num_samples": args.num_samples,
            "seq_len": args.seq_len, "seed": args.seed, "max_windows": args.max_windows,
            "torch": torch.__version__,
            "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
