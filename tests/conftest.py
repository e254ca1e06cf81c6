"""Shared test helpers: tiny random Hugging Face checkpoints and attention metadata.

``make_tiny_checkpoint(variant, path)`` writes a seeded, few-layer checkpoint
with ``transformers`` (float32 safetensors) for each architecture we serve;
the ``tiny_checkpoint`` fixture caches one per variant for the session.
``make_attention_metadata`` builds the per-step metadata for hand-made
batches. Weights are re-drawn larger than HF's init (and biases and norm
scales are randomised too) so attention is peaked and a wrong rope, mask or
bias changes the logits visibly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.attention.metadata import AttentionMetadata

# Without CUDA, Triton kernels run in its interpreter; the switch is read when
# a kernel is decorated, so it must be set before any test imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
