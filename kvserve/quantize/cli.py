"""``kvserve quantize``'s flags and handler (``kvserve/cli.py`` only registers them).

Heavy imports (torch, transformers) happen in the handler, so ``kvserve --help``
stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvserve.quant.config import GROUP_SIZES, WEIGHT_BITS
from kvserve.quantize.options import (
    DEFAULT_BITS,
    DEFAULT_GROUP_SIZE,
    METHODS,
    QuantizeOptions,
)

DESCRIPTION = """\
Quantise a 16-bit checkpoint's linears to INT8 / INT4 weights (round-to-nearest, GPTQ or
AWQ on calibration text) and write it in compressed-tensors pack-quantized format, or to
INT8 W8A8 (SmoothQuant: int8 weights, int8 activations per token) in int-quantized format;
kvserve, vLLM, SGLang and transformers load both. lm_head stays 16-bit. The output is written
beside --output and renamed into place at the end: a failed run leaves nothing behind."""


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("quantize", help="calibrate a checkpoint to INT8 / INT4 weights",
                            description=DESCRIPTION)
    parser.add_argument("model", help="checkpoint directory, a bundled model's name, or a "
                                      "Hugging Face hub id (through the hub's cache: HF_HOME, "
                                      "HF_HUB_OFFLINE, HF_TOKEN)")
    parser.add_argument("--method", required=True, choices=METHODS,
                        help="rtn: round to nearest; gptq: error-correcting rounding from "
                             "calibration activations; awq: activation-aware scales, then rtn; "
                             "smoothquant: activation outliers folded into the weights, then "
                             "INT8 W8A8 (serve with int8 activations)")
    parser.add_argument("--bits", type=int, default=None, choices=WEIGHT_BITS,
                        help="bits per weight (default 4; smoothquant: 8)")
    parser.add_argument("--group-size", type=int, default=None, choices=GROUP_SIZES,
                        help="input columns per scale; -1: one scale per output channel "
                             "(default 128; smoothquant: -1)")
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="smoothquant: migration strength in [0, 1], s = max|X|^alpha / "
                             "max|W|^(1-alpha) (default 0.5)")
    symmetry = parser.add_mutually_exclusive_group()
    symmetry.add_argument("--asym", dest="symmetric", action="store_false", default=None,
                          help="zero points per group (default for awq)")
    symmetry.add_argument("--sym", dest="symmetric", action="store_true",
                          help="no zero points (default for rtn and gptq)")
    parser.add_argument("--act-order", action="store_true",
                        help="gptq: quantise the most active input columns first")
    parser.add_argument("--dampening", type=float, default=0.01,
                        help="gptq: fraction of the Hessian's mean diagonal added to it")
    parser.add_argument("--no-awq-clip", dest="awq_clip", action="store_false",
                        help="awq: skip the clipping-range search")
    calib = parser.add_argument_group("calibration (gptq, awq, smoothquant)")
    calib.add_argument("--calib", type=Path, default=None,
                       help="a text file, a .jsonl with a 'text' field, or a directory of "
                            ".py / .txt files")
    calib.add_argument("--num-samples", type=int, default=128,
                       help="calibration windows (default 128)")
    calib.add_argument("--seq-len", type=int, default=512,
                       help="tokens per calibration window (default 512)")
    calib.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    calib.add_argument("--seed", type=int, default=0,
                       help="seed of the calibration windows' sampling (default 0)")
    calib.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--output", type=Path, required=True,
                        help="a new directory (or an empty one)")
    parser.set_defaults(func=run_quantize)


def _model_path(model: str) -> Path:
    """A local path as it is, then a bundled model's name, then a hub id (its
    snapshot in the hub's cache, downloaded first if needed)."""
    from kvserve.assets import MODELS_DIR, bundled_model_path
    from kvserve.models.hub import is_hub_id
    from kvserve.models.source import resolve_model_path

    path = Path(model).expanduser()
    if path.exists():
        return path
    if (MODELS_DIR / model).is_dir():
        return bundled_model_path(model)
    if is_hub_id(model):  # a path ("./x", "/x", "~/x") never is one
        return resolve_model_path(model, weights=True)
    return path


def run_quantize(args: argparse.Namespace) -> int:
    options = QuantizeOptions(
        model=_model_path(args.model), output=args.output, method=args.method,
        bits=DEFAULT_BITS[args.method] if args.bits is None else args.bits,
        group_size=(DEFAULT_GROUP_SIZE[args.method] if args.group_size is None
                    else args.group_size),
        symmetric=args.symmetric, act_order=args.act_order, alpha=args.alpha,
        calib=args.calib, num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed,
        device=args.device, dampening=args.dampening, awq_clip=args.awq_clip,
        batch_size=args.batch_size,
    )
    from kvserve.quantize.pipeline import quantize_checkpoint

    result = quantize_checkpoint(options)
    print(f"[kvserve] {options.quant_config.name} {options.method}: wrote {options.output} "
          f"({result.checkpoint_bytes / 2**20:.1f} MiB, {len(result.quantized)} linears) in "
          f"{result.seconds:.1f} s", file=sys.stderr)
    return 0
