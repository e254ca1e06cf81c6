"""The quantised checkpoint, in compressed-tensors ``pack-quantized`` format as
llm-compressor writes it, so vLLM, SGLang and transformers load it too.

Per quantised linear ``NAME`` (every decoder-layer linear; ``lm_head`` is in
``ignore`` and stays 16-bit):

- ``NAME.weight_packed`` int32 ``[N, ceil(K * bits / 32)]``: the unsigned
  values (compressed-tensors' signed value plus ``2**(bits - 1)``), column
  ``j`` in bits ``(j % per_word) * bits`` of word ``j // per_word``;
- ``NAME.weight_scale`` ``[N, K // group]`` in the checkpoint's dtype
  (``[N, 1]`` per channel);
- ``NAME.weight_zero_point`` (asymmetric only) int32, the unsigned zero
  points packed the same way along the output dimension:
  ``[ceil(N * bits / 32), K // group]``;
- ``NAME.weight_shape`` int64 ``[N, K]``.

An INT8 W8A8 run (``--method smoothquant``) writes format ``int-quantized``
instead, as llm-compressor's ``W8A8`` scheme: ``NAME.weight`` int8 ``[N, K]``
and ``NAME.weight_scale`` float32 ``[N, 1]``, activations dynamic per token
(nothing stored).

That is kvserve's ``QuantizedWeight`` repacked, with no arithmetic: the
stored integers and scales are those of ``quant/packing.py``. ``config.json``
is the source's plus ``quantization_config``; the tokenizer files and
``generation_config.json`` are copied. Everything is written into a
temporary directory beside the output and renamed into place at the end;
on any error the temporary directory is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvserve.quant.config import QuantConfig
from kvserve.quant.packing import QuantizedWeight, unpack

if TYPE_CHECKING:
    from torch import nn

    from kvserve.quantize.options import QuantizeOptions

FORMAT = "pack-quantized"
W8A8_FORMAT = "int-quantized"
# the compressed-tensors release whose format and config this follows
# (scripts/check_quantize_output.py checks a written checkpoint against it)
COMPRESSED_TENSORS_VERSION = "0.20.0"
MAX_SHARD_BYTES = 5 * 2**30
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja", "generation_config.json")


def quantization_config(quant: QuantConfig, act_order: bool) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``, every field as llm-compressor writes it."""
    w8a8 = quant.weight_type == "w8a8-int8"
    per_channel = quant.group_size == -1
    weights: dict[str, Any] = {
        "actorder": "static" if act_order else None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None if per_channel else quant.group_size,
        "num_bits": quant.bits,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "channel" if per_channel else "group",
        "symmetric": quant.symmetric,
        "type": "int",
        "zp_dtype": None if quant.symmetric else "torch.int8",
    }
    activations = None
    if w8a8:  # dynamic per-token int8, nothing stored
        activations = {**weights, "actorder": None, "dynamic": True, "observer": None,
                       "strategy": "token"}
    fmt = W8A8_FORMAT if w8a8 else FORMAT
    return {
        "config_groups": {"group_0": {
            "format": fmt, "input_activations": activations, "output_activations": None,
            "targets": ["Linear"], "weights": weights,
        }},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(quant.ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values [R, C]`` (< ``2**bits``) -> int32 ``[R, ceil(C * bits / 32)]``,
    ``32 // bits`` per word, the first in the lowest bits."""
    per_word = 32 // bits
    rows, cols = values.shape
    padded = F.pad(values.to(torch.int64), (0, -cols % per_word))
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (padded.view(rows, -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def compressed_tensors(qw: QuantizedWeight, w8a8: bool = False) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one linear, by suffix (see the module
    docstring); ``int-quantized`` ones with ``w8a8``."""
    if w8a8:
        if (qw.bits, qw.zeros, qw.scales.shape[1]) != (8, None, 1):
            raise ValueError("int-quantized needs 8-bit symmetric per-channel weights")
        return {"weight": (qw.qweight.to(torch.int16) - 128).to(torch.int8),
                "weight_scale": qw.scales.float().contiguous()}
    if qw.perm is not None:
        raise ValueError("compressed-tensors pack-quantized has no act-order permutation; "
                         "the weight must be in column order")
    n, k = qw.shape
    tensors = {
        "weight_packed": pack_int32(unpack(qw.qweight, qw.bits), qw.bits),
        "weight_scale": qw.scales.contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zeros is not None:
        zeros = qw.zeros.float().round().to(torch.uint8)
        tensors["weight_zero_point"] = pack_int32(zeros.T, qw.bits).T.contiguous()
    return tensors


def checkpoint_tensors(
    model: nn.Module, quantized: dict[str, QuantizedWeight], w8a8: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: the model's state with each quantised
    linear's ``weight`` replaced by its compressed tensors (a tied head once)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if module in quantized:
            for suffix, value in compressed_tensors(quantized[module], w8a8).items():
                tensors[f"{module}.{suffix}"] = value
        else:
            tensors[name] = tensor.detach().cpu().contiguous()
    missing = set(quantized) - {n.rpartition(".")[0] for n in tensors}
    if missing:
        raise ValueError(f"quantised linears missing from the model: {sorted(missing)}")
    return tensors


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def _save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    shards = _shards(tensors)
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _chmod_default(path: Path, mode: int) -> None:
    """``mode`` less the process's umask, as a plain ``mkdir`` / ``open`` would give
    (``mkdtemp`` and some writers create owner-only files)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


@contextmanager
def staging_directory(output: Path) -> Iterator[Path]:
    """A fresh directory beside ``output``, renamed to ``output`` when the block
    succeeds (``output`` may be absent or an empty directory), removed when it fails."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial",
                                    dir=output.parent))
    try:
        _chmod_default(staging, 0o777)
        yield staging
        if output.is_dir():
            output.rmdir()  # empty: checked before the run
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_checkpoint(
    options: QuantizeOptions, hf_config: dict[str, Any], model: nn.Module,
    quantized: dict[str, QuantizedWeight],
) -> int:
    """Write the checkpoint to ``options.output``; returns its size in bytes."""
    tensors = checkpoint_tensors(model, quantized,
                                 options.quant_config.weight_type == "w8a8-int8")
    config = {**hf_config,
              "quantization_config": quantization_config(options.quant_config, options.act_order)}
    with staging_directory(options.output) as staging:
        _save_tensors(tensors, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in COPIED_FILES:
            if (options.model / name).is_file():
                shutil.copy2(options.model / name, staging / name)
        for path in staging.iterdir():
            _chmod_default(path, 0o666)
    return sum(p.stat().st_size for p in options.output.iterdir())
