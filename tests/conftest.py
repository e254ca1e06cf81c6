"""Shared test helpers: tiny random Hugging Face checkpoints, LoRA adapters, attention metadata.

``make_tiny_checkpoint(variant, path)`` writes a seeded, few-layer checkpoint
with ``transformers`` (float32 safetensors) for each architecture we serve;
the ``tiny_checkpoint`` fixture caches one per variant for the session.
``make_attention_metadata`` builds the per-step metadata for hand-made
batches. Weights are re-drawn larger than HF's init (and biases and norm
scales are randomised too) so attention is peaked and a wrong rope, mask or
bias changes the logits visibly. ``make_lora_adapter`` writes a random PEFT
LoRA adapter for a checkpoint, ``merge_lora`` the checkpoint with an adapter
merged into its weights (the oracle of LoRA serving). ``load_file_module``
imports a script of scripts/ or benchmarks/ (not packages) by path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata

# Without CUDA, Triton kernels run in its interpreter; the switch is read when
# a kernel is decorated, so it must be set before any test imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test reaches the Hugging Face hub: model names that look like hub ids
# resolve from the (test's own) cache only. Read when huggingface_hub is
# imported, which nothing above does.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_BASE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# variant -> (transformers config class name, overrides of _BASE, save_pretrained kwargs)
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}, {}),
    "llama_mha": ("LlamaConfig", {"num_key_value_heads": 4}, {}),
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1, "num_hidden_layers": 3}, {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}, {}),
    "llama31": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }}, {}),
    "llama_sharded": ("LlamaConfig", {"num_hidden_layers": 3}, {"max_shard_size": "200KB"}),
    # 8 query heads (head_dim 16), 2 KV heads, 4 layers: splits 8 ways, 4 stages
    "llama_wide": ("LlamaConfig", {"hidden_size": 128, "intermediate_size": 256,
                                   "num_attention_heads": 8, "num_hidden_layers": 4}, {}),
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 16}, {}),
    "qwen2": ("Qwen2Config", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0,
    }}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "num_hidden_layers": 3}, {}),
}

WEIGHT_STD = 0.15


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def make_tiny_checkpoint(
    variant: str, path: Path, *, seed: int = 0, with_tokenizer: bool = False
) -> Path:
    """Write a tiny random float32 checkpoint of ``variant`` into ``path``; return ``path``."""
    import transformers

    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny variant '{variant}'; known: {', '.join(TINY_VARIANTS)}")
    config_cls_name, overrides, save_kwargs = TINY_VARIANTS[variant]
    config = getattr(transformers, config_cls_name)(**{**_BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    if with_tokenizer:
        write_tiny_tokenizer(path, int(config.vocab_size))
    return path


def write_tiny_tokenizer(path: Path, max_vocab_size: int) -> None:
    """A byte-level BPE ``tokenizer.json`` + ``tokenizer_config.json`` with ``<pad> <s> </s>``
    at ids 0, 1, 2 (matching the tiny configs), trained on a few lines of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(max_vocab_size, 320),
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld 👋",
              "a paged kv cache serves many requests at once"] * 8
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 128,
        "chat_template": (
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}"
        ),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory fixture: ``tiny_checkpoint("llama", with_tokenizer=False)`` -> a cached
    checkpoint directory. Treat it as read-only; copy it before editing.
    """
    cache: dict[tuple[str, bool], Path] = {}

    def get(variant: str, with_tokenizer: bool = False) -> Path:
        key = (variant, with_tokenizer)
        if key not in cache:
            cache[key] = make_tiny_checkpoint(
                variant, tmp_path_factory.mktemp(variant), with_tokenizer=with_tokenizer
            )
        return cache[key]

    return get


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for requests whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are new.

    Returns ``(metadata, positions)``; ``positions`` is ``[num_tokens]`` int64.
    """
    starts = [0]
    positions: list[int] = []
    slots: list[int] = []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(starts[-1] + query_len)
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(b) for b in block_tables)
    table = [list(b) + [0] * (max_blocks - len(b)) for b in block_tables]
    metadata = AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=starts[-1],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64, device=device)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _module_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of one decoder layer."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv = (hf_config.get("num_key_value_heads") or heads) * head_dim
    inter = hf_config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def lora_tensor_name(layer: int, module: str, kind: str) -> str:
    parent = _LORA_PARENT.get(module, "self_attn")
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{kind}.weight"


def make_lora_adapter(
    base: Path, path: Path, *, rank: int = 8, alpha: float = 16.0,
    target_modules: Sequence[str] = LORA_TARGETS, seed: int = 0, std: float = 0.1,
    **config_overrides: Any,
) -> Path:
    """Write a random PEFT LoRA adapter for the checkpoint ``base`` into ``path``.

    Both A and B are random (PEFT initialises B to zero), so the adapter
    changes the model's outputs visibly; ``config_overrides`` replace fields of
    ``adapter_config.json``.
    """
    from safetensors.torch import save_file

    hf_config = json.loads((base / "config.json").read_text())
    shapes = _module_shapes(hf_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for module in target_modules:
            in_features, out_features = shapes[module]
            tensors[lora_tensor_name(layer, module, "A")] = std * torch.randn(
                rank, in_features, generator=generator)
            tensors[lora_tensor_name(layer, module, "B")] = std * torch.randn(
                out_features, rank, generator=generator)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": str(base), "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False, **config_overrides,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def merge_lora(base: Path, adapter: Path, path: Path) -> Path:
    """Write ``base`` with ``W + (lora_alpha / r) * B @ A`` in every adapted
    weight into ``path`` (float32, with the base's tokenizer files)."""
    import transformers
    from safetensors import safe_open

    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f, torch.no_grad():
        for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if ".lora_A." not in name:
                continue
            lora_a = f.get_tensor(name).double()
            lora_b = f.get_tensor(name.replace(".lora_A.", ".lora_B.")).double()
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weight = model.get_parameter(target)
            weight.copy_(weight.double() + scaling * (lora_b @ lora_a))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            shutil.copy(base / name, path / name)
    return path


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tensors from ``torch.empty`` (kernel launchers' outputs and scratch)
    start as NaN (floating) or their dtype's maximum (integer), so an element a
    kernel never writes shows."""
    real_empty = torch.empty
    # `with torch.device(...)` caches the constructors it redirects the first
    # time it redirects one in the process. Fill that cache with the real
    # torch.empty now, or it would hold the wrapper below, and every later
    # block would leave torch.empty on the CPU (an engine built on "cuda" in
    # a later test would get CPU parameters).
    with torch.device("cpu"):
        real_empty(0)

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        # the blocks' cache holds torch.empty, not this wrapper: name the device
        kwargs.setdefault("device", torch.get_default_device())
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            return tensor.fill_(float("nan"))
        if tensor.dtype != torch.bool and not tensor.is_complex():
            return tensor.fill_(torch.iinfo(tensor.dtype).max)
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    yield


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def load_file_module(path: Path, name: str) -> ModuleType:
    """The Python file at ``path`` imported as module ``name`` (registered in
    sys.modules first: dataclasses resolve their module by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
