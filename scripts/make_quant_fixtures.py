"""Regenerate ``tests/fixtures/quant/``: a tiny Llama quantised by the real producers.

CI has none of the producers, so their output is committed, with reference
data computed by each producer's own code. One tiny Llama (hidden 128,
intermediate 256, 2 layers, 4 heads / 2 KV heads, vocab 128, seeded random
weights) is saved with transformers, then quantised with calibration on a
few fixed short texts:

=======================================  ==================  =============================
fixture                                  producer            what
=======================================  ==================  =============================
llmc-gptq-w4a16-g128                     llm-compressor      GPTQModifier, scheme W4A16
llmc-gptq-w4a16-asym-g32-actorder        llm-compressor      GPTQ int4 asym g32, actorder
                                                             "weight" (current releases
                                                             refuse "group": no g_idx)
llmc-awq-w4a16-asym-g128                 llm-compressor      AWQModifier + W4A16_ASYM
llmc-gptq-w8a16-channel                  llm-compressor      GPTQ int8 symmetric, channel
llmc-fp8-dynamic                         llm-compressor      FP8_DYNAMIC: e4m3 weights per
                                                             channel, dynamic activations
llmc-fp8-static                          llm-compressor      FP8: per-tensor weight and
                                                             static input scales
llmc-w8a8-int8-smoothquant               llm-compressor      SmoothQuantModifier(0.5) +
                                                             GPTQModifier scheme W8A8: int8
                                                             weights per channel, dynamic
                                                             per-token int8 activations
llmc06-gptq-w4a16-g32-actorder-group     llm-compressor 0.6  GPTQ int4 symmetric g32,
                                                             actorder "group": weight_g_idx
gptqmodel-w4-g32-desc-act-asym           GPTQModel           gptq (v1), desc_act, sym=False
gptqmodel-w4-g32-sym                     GPTQModel           gptq (v1), sym, no desc_act
gptqmodel-w4-g32-asym-v2                 GPTQModel           gptq_v2, sym=False
autoawq-gemm-w4-g64                      AutoAWQ             GEMM, zero point, group 64
=======================================  ==================  =============================

Each fixture directory keeps the producer's ``config.json``,
``model.safetensors`` and (GPTQModel) ``quantize_config.json``, plus:

- ``reference.safetensors``: ``dequantized.<module>`` (float32, the first
  ``REFERENCE_ROWS`` rows of ``[N, K]``) for ``REFERENCE_MODULES``, dequantised
  by the producer's own code with its
  scales upcast to float32 (so the values are exact); ``logits.<i>``
  (float32 ``[T, vocab]``) of the fake-quant HF model on ``prompts[i]``: a
  float32 transformers Llama whose quantised linears hold the producer's
  dequantised weights and whose other tensors are the checkpoint's (W8A8
  int8: each quantised linear's input also rounded per token to int8,
  ``amax / 127``, as vLLM and kvserve serve it);
- ``reference.json``: producer and versions, the prompts, the greedy
  continuation of each prompt by that fake-quant model (``NEW_TOKENS``
  tokens, EOS not stopping), and the modules above.

Producers and their venvs (CPU torch 2.13.0 in each; never the system python):

- llm-compressor 0.14.0.1 (compressed-tensors 0.19.0, transformers 5.17):
  ``python -m venv /work/venvs/llmc && /work/venvs/llmc/bin/pip install
  torch==2.13.0 llmcompressor==0.14.0.1``. Its AWQ step pins calibration
  tensors to page-locked memory, which needs a GPU; on the CPU that pinning
  (a transfer-speed hint only) is turned off here.
- llm-compressor 0.6.0 (compressed-tensors 0.10.2, transformers 4.52.4), the
  last kind of release that wrote ``actorder: group`` with ``weight_g_idx``, as
  many hub checkpoints have it: ``python -m venv /work/venvs/llmc06 &&
  /work/venvs/llmc06/bin/pip install torch==2.13.0 && /work/venvs/llmc06/bin/pip
  install llmcompressor==0.6.0 transformers==4.52.4 torch==2.13.0``. Its own
  decompressor cannot unpack asymmetric zero points, so this fixture is
  symmetric.
- GPTQModel 7.6.0 (transformers 5.24; 7.7.0 needs torch >= 2.14.1):
  ``python -m venv /work/venvs/gptqmodel && /work/venvs/gptqmodel/bin/pip install
  torch==2.13.0 setuptools wheel packaging ninja && /work/venvs/gptqmodel/bin/pip
  install --no-build-isolation gptqmodel==7.6.0 torch==2.13.0``; it runs on the
  CPU with ``GPTQMODEL_CPU_WORKERS=2`` (its default of one worker on a 2-core
  machine fails its own pool check).
- AutoAWQ 0.2.9 (deprecated upstream; last tested with transformers 4.51.3):
  ``python -m venv /work/venvs/autoawq && /work/venvs/autoawq/bin/pip install
  torch==2.13.0 && /work/venvs/autoawq/bin/pip install autoawq==0.2.9
  transformers==4.51.3 torch==2.13.0 triton``.

Usage (from the repository root)::

    python scripts/make_quant_fixtures.py all            # the seven steps below
    python scripts/make_quant_fixtures.py base /tmp/quant-base
    /work/venvs/llmc/bin/python scripts/make_quant_fixtures.py llmcompressor \
        /tmp/quant-base tests/fixtures/quant
    /work/venvs/llmc/bin/python scripts/make_quant_fixtures.py llmcompressor-fp8 \
        /tmp/quant-base tests/fixtures/quant
    /work/venvs/llmc/bin/python scripts/make_quant_fixtures.py llmcompressor-w8a8 \
        /tmp/quant-base tests/fixtures/quant
    /work/venvs/llmc06/bin/python scripts/make_quant_fixtures.py llmcompressor-0.6 \
        /tmp/quant-base tests/fixtures/quant
    GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqmodel/bin/python \
        scripts/make_quant_fixtures.py gptqmodel /tmp/quant-base tests/fixtures/quant
    /work/venvs/autoawq/bin/python scripts/make_quant_fixtures.py autoawq \
        /tmp/quant-base tests/fixtures/quant

The script imports no kvserve code (the venvs do not have it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 128
SEED = 0
WEIGHT_STD = 0.15
CALIBRATION_TEXTS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps",
    "hello world, a paged kv cache serves many requests at once",
    "continuous batching keeps the accelerator busy between short requests",
    "weights in four bits read a quarter of the bytes of sixteen bit weights",
    "the scheduler hands each request a number of new tokens every step",
    "a prefix cache lets requests that share a system prompt skip its prefill",
    "group wise scales keep the rounding error of each block of weights small",
    "greedy decoding picks the most likely token at every position",
]
CALIBRATION_TOKENS = 64
REFERENCE_MODULES = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
REFERENCE_ROWS = 16  # of each reference module's output rows, to keep the fixtures small
NUM_PROMPTS = 3
PROMPT_LENGTHS = (6, 11, 17)
NEW_TOKENS = 8
KEEP_FILES = ("config.json", "model.safetensors", "quantize_config.json")
TRANSFORMERS_FILES = ("config.json", "model.safetensors")


# --- the base checkpoint (any python with transformers and tokenizers) --------


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the calibration texts, ``<pad> <s> </s>
    <unk>`` at ids 0..3 (the producers load one; the fixtures keep none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for text in CALIBRATION_TEXTS for w in re.findall(r"\w+|[^\w\s]+", text)})
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
              "model_max_length": 256}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_base(out: Path) -> None:
    """``out/float16`` and ``out/bfloat16``: the same seeded tiny Llama."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else WEIGHT_STD * noise)
    for dtype in (torch.float16, torch.bfloat16):
        path = out / str(dtype).removeprefix("torch.")
        path.mkdir(parents=True, exist_ok=True)
        model.to(dtype).save_pretrained(path)
        write_tokenizer(path)


def calibration_ids(base: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = CALIBRATION_TEXTS
    # sample i: the texts from the i-th on, run together and cut to CALIBRATION_TOKENS
    return [tokenizer.encode(" ".join(texts[i:] + texts[:i]))[:CALIBRATION_TOKENS]
            for i in range(len(texts))]


# --- the reference data (in each producer's venv) ------------------------------


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()
            for n in PROMPT_LENGTHS]


def fake_quant_int8_input(module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """A forward pre-hook: the linear's input rounded per token to int8
    (symmetric, scale ``amax / 127``, round half to even) and scaled back."""
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(x / safe).clamp(-127, 127) * scale,)


def fake_quant_model(
    fixture: Path, dequantized: dict[str, torch.Tensor], int8_inputs: bool = False
) -> Any:
    """A float32 transformers Llama: the checkpoint's tensors, and the
    dequantised weight for every quantised linear (whose inputs are rounded
    per token to int8 with ``int8_inputs``)."""
    import transformers
    from safetensors.torch import load_file

    hf_config = json.loads((fixture / "config.json").read_text())
    hf_config.pop("quantization_config", None)
    config = transformers.LlamaConfig.from_dict(hf_config)
    model = transformers.LlamaForCausalLM(config).float().eval()
    state: dict[str, torch.Tensor] = {f"{m}.weight": w.float() for m, w in dequantized.items()}
    for name, tensor in load_file(fixture / "model.safetensors").items():
        if name.rpartition(".")[0] not in dequantized:
            state[name] = tensor.float()
    model.load_state_dict(state, strict=True)
    if int8_inputs:
        for module in dequantized:
            model.get_submodule(module).register_forward_pre_hook(fake_quant_int8_input)
    return model


def greedy(model: Any, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def write_reference(
    fixture: Path, dequantized: dict[str, torch.Tensor], producer: str, packages: list[str],
    notes: str, int8_inputs: bool = False,
) -> None:
    """reference.safetensors / reference.json, then drop every file kvserve does not read."""
    from safetensors.torch import save_file

    model = fake_quant_model(fixture, dequantized, int8_inputs)
    tensors = {f"dequantized.{m}": dequantized[m][:REFERENCE_ROWS].float().contiguous()
               for m in REFERENCE_MODULES}
    with torch.no_grad():
        for i, prompt in enumerate(prompts()):
            tensors[f"logits.{i}"] = model(torch.tensor([prompt])).logits[0].float().contiguous()
    save_file(tensors, str(fixture / "reference.safetensors"))
    reference = {
        "producer": producer,
        "versions": {p: metadata.version(p) for p in packages},
        "notes": notes,
        "quantized_modules": sorted(dequantized),
        "reference_modules": list(REFERENCE_MODULES),
        "prompts": prompts(),
        "greedy": [greedy(model, p) for p in prompts()],
    }
    (fixture / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    for path in fixture.iterdir():
        if path.name not in (*KEEP_FILES, "reference.safetensors", "reference.json"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


# --- llm-compressor ------------------------------------------------------------


def llmcompressor_recipes() -> dict[str, tuple[Callable[[], Any], str]]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    def scheme(**weights: Any) -> dict[str, QuantizationScheme]:
        return {"group_0": QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(type="int", **weights))}

    return {
        "llmc-gptq-w4a16-g128": (
            lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            "GPTQModifier(scheme='W4A16'): int4 symmetric, groups of 128"),
        "llmc-gptq-w4a16-asym-g32-actorder": (
            lambda: GPTQModifier(ignore=["lm_head"], config_groups=scheme(
                num_bits=4, symmetric=False, strategy="group", group_size=32,
                actorder="weight")),
            "GPTQModifier int4 asymmetric, groups of 32, actorder='weight'"),
        "llmc-awq-w4a16-asym-g128": (
            lambda: [AWQModifier(), QuantizationModifier(
                targets=["Linear"], scheme="W4A16_ASYM", ignore=["lm_head"])],
            "AWQModifier + QuantizationModifier(scheme='W4A16_ASYM')"),
        "llmc-gptq-w8a16-channel": (
            lambda: GPTQModifier(ignore=["lm_head"], config_groups=scheme(
                num_bits=8, symmetric=True, strategy="channel")),
            "GPTQModifier int8 symmetric, one scale per output channel"),
    }


def run_llmcompressor(base: Path, out: Path) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():  # pinning needs a GPU; it only speeds up copies
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    source = base / "bfloat16"
    ids = calibration_ids(source)
    for name, (recipe, notes) in llmcompressor_recipes().items():
        fixture = fresh(out / name)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        oneshot(model=model, dataset=Dataset.from_dict({"input_ids": ids}), recipe=recipe(),
                max_seq_length=CALIBRATION_TOKENS, num_calibration_samples=len(ids))
        model.save_pretrained(fixture, save_compressed=True)
        qc = json.loads((fixture / "config.json").read_text())["quantization_config"]
        scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
        tensors = load_file(fixture / "model.safetensors")
        dequantized = {}
        for module in sorted({k.rpartition(".")[0] for k in tensors
                              if k.endswith(".weight_packed")}):
            state = {k.rpartition(".")[2]: t for k, t in tensors.items()
                     if k.rpartition(".")[0] == module}
            state["weight_scale"] = state["weight_scale"].float()
            dequantized[module] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        write_reference(fixture, dequantized, "llm-compressor",
                        ["llmcompressor", "compressed-tensors", "transformers", "torch"], notes)


def run_llmcompressor_fp8(base: Path, out: Path) -> None:
    """FP8 W8A8 as llm-compressor writes it (``format: float-quantized``):
    ``FP8_DYNAMIC`` (per-channel weight scales, dynamic per-token activations;
    no calibration) and ``FP8`` (per-tensor weight and static per-tensor
    input scales, calibrated). The reference weights are the e4m3 values
    times their scales in float32 (compressed-tensors' own dequantisation)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    source = base / "bfloat16"
    ids = calibration_ids(source)
    for name, scheme in (("llmc-fp8-dynamic", "FP8_DYNAMIC"), ("llmc-fp8-static", "FP8")):
        fixture = fresh(out / name)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        if scheme == "FP8_DYNAMIC":
            oneshot(model=model, recipe=recipe)
        else:
            oneshot(model=model, dataset=Dataset.from_dict({"input_ids": ids}), recipe=recipe,
                    max_seq_length=CALIBRATION_TOKENS, num_calibration_samples=len(ids))
        model.save_pretrained(fixture, save_compressed=True)
        dequantized = per_channel_dequantized(fixture, torch.float8_e4m3fn)
        write_reference(fixture, dequantized, "llm-compressor",
                        ["llmcompressor", "compressed-tensors", "transformers", "torch"],
                        f"QuantizationModifier(scheme={scheme!r}, ignore=['lm_head'])")


def per_channel_dequantized(fixture: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Module -> float32 weight of each ``dtype`` weight in the fixture's
    safetensors, times its per-channel (or per-tensor) ``weight_scale``."""
    from safetensors.torch import load_file

    tensors = load_file(fixture / "model.safetensors")
    dequantized = {}
    for key, weight in tensors.items():
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and weight.dtype == dtype:
            scale = tensors[f"{module}.weight_scale"].float()
            dequantized[module] = weight.float() * scale.reshape(-1, 1)
    return dequantized


def run_llmcompressor_w8a8(base: Path, out: Path) -> None:
    """INT8 W8A8 as llm-compressor writes it (``format: int-quantized``):
    ``SmoothQuantModifier(smoothing_strength=0.5)`` folds its scales into the
    norms and the q/k/v and gate/up columns, then ``GPTQModifier(scheme=
    'W8A8')`` writes int8 ``weight`` with float ``weight_scale [N, 1]``;
    activations are dynamic per token (nothing stored). The reference
    weights are the int8 values times their scales in float32, and the
    reference model rounds each quantised linear's input per token to int8."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    source = base / "bfloat16"
    ids = calibration_ids(source)
    fixture = fresh(out / "llmc-w8a8-int8-smoothquant")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    recipe = [SmoothQuantModifier(smoothing_strength=0.5),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    oneshot(model=model, dataset=Dataset.from_dict({"input_ids": ids}), recipe=recipe,
            max_seq_length=CALIBRATION_TOKENS, num_calibration_samples=len(ids))
    model.save_pretrained(fixture, save_compressed=True)
    dequantized = per_channel_dequantized(fixture, torch.int8)
    write_reference(fixture, dequantized, "llm-compressor",
                    ["llmcompressor", "compressed-tensors", "transformers", "torch"],
                    "SmoothQuantModifier(smoothing_strength=0.5) + GPTQModifier(scheme='W8A8', "
                    "ignore=['lm_head']); reference inputs rounded per token to int8 "
                    "(amax / 127)", int8_inputs=True)


def run_llmcompressor_06(base: Path, out: Path) -> None:
    """llm-compressor 0.6: GPTQ with ``actorder: group`` (``weight_g_idx``)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = base / "bfloat16"
    ids = calibration_ids(source)
    fixture = fresh(out / "llmc06-gptq-w4a16-g32-actorder-group")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
        actorder="group"))
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.bfloat16)
    oneshot(model=model, dataset=Dataset.from_dict({"input_ids": ids}),
            recipe=GPTQModifier(ignore=["lm_head"], config_groups={"group_0": scheme}),
            max_seq_length=CALIBRATION_TOKENS, num_calibration_samples=len(ids))
    model.save_pretrained(fixture, save_compressed=True)
    qc = json.loads((fixture / "config.json").read_text())["quantization_config"]
    compressor = PackedQuantizationCompressor(QuantizationConfig.model_validate(qc))
    args = QuantizationScheme.model_validate(qc["config_groups"]["group_0"]).weights
    tensors = load_file(fixture / "model.safetensors")
    dequantized = {}
    for module in sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".weight_packed")}):
        state = {k.rpartition(".")[2]: t for k, t in tensors.items()
                 if k.rpartition(".")[0] == module}
        state["weight_scale"] = state["weight_scale"].float()
        dequantized[module] = compressor.decompress_weight(state, args)
    write_reference(fixture, dequantized, "llm-compressor",
                    ["llmcompressor", "compressed-tensors", "transformers", "torch"],
                    "GPTQModifier int4 symmetric, groups of 32, actorder='group'")


# --- GPTQModel -----------------------------------------------------------------


def run_gptqmodel(base: Path, out: Path) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    source = base / "float16"
    ids = calibration_ids(source)
    calibration = [{"input_ids": i, "attention_mask": [1] * len(i)} for i in ids]
    variants = {
        "gptqmodel-w4-g32-desc-act-asym": dict(desc_act=True, sym=False, format="gptq"),
        "gptqmodel-w4-g32-sym": dict(desc_act=False, sym=True, format="gptq"),
        "gptqmodel-w4-g32-asym-v2": dict(desc_act=False, sym=False, format="gptq_v2"),
    }
    for name, kwargs in variants.items():
        fixture = fresh(out / name)
        config = QuantizeConfig(bits=4, group_size=32, device="cpu", **kwargs)
        model = GPTQModel.load(str(source), config, dtype=torch.float16)
        model.quantize(calibration, batch_size=1, backend=BACKEND.TORCH)
        model.save(str(fixture))
        del model
        # GPTQModel's own loader (v1 zero points converted as it does) and dequantisation
        loaded = GPTQModel.load(str(fixture), device="cpu", backend=BACKEND.TORCH,
                                dtype=torch.float16)  # its CPU default, bfloat16, rounds scales
        dequantized = {}
        for module, layer in loaded.model.named_modules():
            if hasattr(layer, "dequantize_weight") and hasattr(layer, "qweight"):
                layer.scales = layer.scales.float()
                dequantized[module] = layer.dequantize_weight().T.float().contiguous()
        del loaded
        write_reference(fixture, dequantized, "GPTQModel",
                        ["gptqmodel", "transformers", "torch"], f"QuantizeConfig({kwargs})")


# --- AutoAWQ -------------------------------------------------------------------


def run_autoawq(base: Path, out: Path) -> None:
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    source = base / "float16"
    ids = calibration_ids(source)
    group_size = 64
    fixture = fresh(out / "autoawq-gemm-w4-g64")
    model = AutoAWQForCausalLM.from_pretrained(str(source), safetensors=True, device_map="cpu",
                                               torch_dtype=torch.float16)
    model.quantize(AutoTokenizer.from_pretrained(source),
                   quant_config={"zero_point": True, "q_group_size": group_size, "w_bit": 4,
                                 "version": "GEMM"},
                   calib_data=ids, max_calib_samples=len(ids),
                   max_calib_seq_len=CALIBRATION_TOKENS, n_parallel_calib_samples=None)
    model.save_quantized(str(fixture))
    tensors = load_file(fixture / "model.safetensors")
    dequantized = {}
    for module in sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".qweight")}):
        dequantized[module] = dequantize_gemm(
            tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"],
            tensors[f"{module}.scales"].float(), 4, group_size).T.contiguous()
    write_reference(fixture, dequantized, "AutoAWQ", ["autoawq", "transformers", "torch"],
                    f"quant_config zero_point=True q_group_size={group_size} version=GEMM")


# --- all -----------------------------------------------------------------------


def run_all(venvs: Path, out: Path) -> None:
    base = Path("/tmp/quant-fixtures-base")
    script = str(Path(__file__).resolve())
    steps = [([sys.executable, script, "base", str(base)], {}),
             ([str(venvs / "llmc/bin/python"), script, "llmcompressor", str(base), str(out)], {}),
             ([str(venvs / "llmc/bin/python"), script, "llmcompressor-fp8", str(base),
               str(out)], {}),
             ([str(venvs / "llmc/bin/python"), script, "llmcompressor-w8a8", str(base),
               str(out)], {}),
             ([str(venvs / "llmc06/bin/python"), script, "llmcompressor-0.6", str(base),
               str(out)], {}),
             ([str(venvs / "gptqmodel/bin/python"), script, "gptqmodel", str(base), str(out)],
              {"GPTQMODEL_CPU_WORKERS": "2"}),
             ([str(venvs / "autoawq/bin/python"), script, "autoawq", str(base), str(out)], {})]
    for command, env in steps:
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, env={**os.environ, **env})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("base").add_argument("out", type=Path)
    for step in ("llmcompressor", "llmcompressor-fp8", "llmcompressor-w8a8", "llmcompressor-0.6",
                 "gptqmodel", "autoawq"):
        p = sub.add_parser(step)
        p.add_argument("base", type=Path)
        p.add_argument("out", type=Path)
    p = sub.add_parser("all")
    p.add_argument("--venvs", type=Path, default=Path("/work/venvs"))
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/quant"))
    args = parser.parse_args()
    torch.manual_seed(SEED)
    if args.step == "base":
        make_base(args.out)
    elif args.step == "all":
        run_all(args.venvs, args.out.resolve())
    else:
        base, out = args.base.resolve(), args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        os.chdir(tempfile.mkdtemp())  # producers drop logs into the working directory
        {"llmcompressor": run_llmcompressor, "llmcompressor-fp8": run_llmcompressor_fp8,
         "llmcompressor-w8a8": run_llmcompressor_w8a8, "llmcompressor-0.6": run_llmcompressor_06,
         "gptqmodel": run_gptqmodel, "autoawq": run_autoawq}[args.step](base, out)


if __name__ == "__main__":
    main()
