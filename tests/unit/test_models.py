"""Model parity: our float32 logits vs Hugging Face's on tiny random checkpoints.

Every supported architecture and head layout (MHA, GQA, MQA, tied head,
Llama 3.1 rope scaling, Mistral sliding window, Qwen2 bias, Qwen3 q/k norm,
sharded safetensors) runs through the paged torch reference backend with
block_size 4 and descending block ids, as one prefill, as a flattened batch
of two requests, as prefill-then-decode, and as chunked prefill mixed with
decodes; each must match HF's full-sequence logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.attention.backend import get_attention_backend
from kvserve.config import ModelConfig
from kvserve.layers.attention import Attention, bind_kv_cache
from kvserve.layers.linear import MergedColumnLinear, QKVLinear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import compute_inv_freq
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM, get_model_class
from kvserve.models.source import resolve_model_config
from tests.conftest import TINY_VARIANTS, make_attention_metadata

BLOCK_SIZE = 4
NUM_BLOCKS = 32
RTOL = 1e-4

VARIANTS = list(TINY_VARIANTS)


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


class PagedRunner:
    """A minimal model runner: per-request block tables handed out from the top
    block id downwards (so tables are non-contiguous and descending)."""

    def __init__(self, model: CausalLM, config: ModelConfig) -> None:
        self.model = model
        caches = [
            torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
            for _ in range(config.num_layers)
        ]
        bind_kv_cache(model, caches, get_attention_backend("torch"))
        self.free_blocks = list(range(NUM_BLOCKS))
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run new tokens for several requests in one flattened batch; logits per request."""
        query_lens, seq_lens, tables, token_ids = [], [], [], []
        for req_id, tokens in chunks.items():
            seq_len = self.num_computed.get(req_id, 0) + len(tokens)
            table = self.block_tables.setdefault(req_id, [])
            while len(table) * BLOCK_SIZE < seq_len:
                table.append(self.free_blocks.pop())
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
            token_ids.extend(tokens)
            self.num_computed[req_id] = seq_len
        metadata, positions = make_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(token_ids), positions, metadata)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for req_id, query_len in zip(chunks, query_lens, strict=True):
            out[req_id] = logits[start : start + query_len]
            start += query_len
        return out


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], tuple]:
    """variant -> (our model, its config, HF model), built once per module."""
    import transformers

    cache: dict[str, tuple] = {}

    def get(variant: str) -> tuple:
        if variant not in cache:
            path = tiny_checkpoint(variant)
            config, model_path = resolve_model_config(str(path))
            ours = load_model(config, model_path, "auto", torch.float32, torch.device("cpu"))
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            cache[variant] = (ours, config, hf)
        return cache[variant]

    return get


def hf_logits(hf: nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [seq_len, vocab_size]


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_matches_hf(variant: str, loaded: Callable[[str], tuple]) -> None:
    ours, config, hf = loaded(variant)
    tokens = prompt(20, seed=1, vocab_size=config.vocab_size)
    logits = PagedRunner(ours, config).step({0: tokens})[0]
    assert logits.dtype == torch.float32
    assert logits.shape == (20, config.vocab_size)
    assert rel_err(logits, hf_logits(hf, tokens)) < RTOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_request_batch_matches_hf(variant: str, loaded: Callable[[str], tuple]) -> None:
    ours, config, hf = loaded(variant)
    tokens_a = prompt(20, seed=2, vocab_size=config.vocab_size)
    tokens_b = prompt(13, seed=3, vocab_size=config.vocab_size)
    out = PagedRunner(ours, config).step({0: tokens_a, 1: tokens_b})
    assert rel_err(out[0], hf_logits(hf, tokens_a)) < RTOL
    assert rel_err(out[1], hf_logits(hf, tokens_b)) < RTOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_matches_hf(variant: str, loaded: Callable[[str], tuple]) -> None:
    ours, config, hf = loaded(variant)
    tokens = prompt(20, seed=4, vocab_size=config.vocab_size)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours, config)
    prefill = runner.step({0: tokens[:12]})[0]
    assert rel_err(prefill, expected[:12]) < RTOL
    for pos in range(12, 20):
        step_logits = runner.step({0: [tokens[pos]]})[0]
        assert rel_err(step_logits[0], expected[pos]) < RTOL, f"position {pos}"
    assert runner.block_tables[0] == [31, 30, 29, 28, 27]


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3"])
def test_chunked_prefill_mixed_with_decode(variant: str, loaded: Callable[[str], tuple]) -> None:
    ours, config, hf = loaded(variant)
    tokens_a = prompt(18, seed=5, vocab_size=config.vocab_size)
    tokens_b = prompt(19, seed=6, vocab_size=config.vocab_size)
    expected_a, expected_b = hf_logits(hf, tokens_a), hf_logits(hf, tokens_b)
    runner = PagedRunner(ours, config)
    got_a = [runner.step({0: tokens_a[:10]})[0]]
    got_b = []
    # request 0 decodes one token per step while request 1 prefills in chunks of 7, 7, 5
    for step, (lo, hi) in enumerate([(0, 7), (7, 14), (14, 19)]):
        out = runner.step({0: [tokens_a[10 + step]], 1: tokens_b[lo:hi]})
        got_a.append(out[0])
        got_b.append(out[1])
    assert rel_err(torch.cat(got_a), expected_a[:13]) < RTOL
    assert rel_err(torch.cat(got_b), expected_b) < RTOL


def test_sliding_window_changes_logits(loaded: Callable[[str], tuple]) -> None:
    """The mistral variant's window (8) is shorter than the prompt, so it must matter."""
    ours, config, _ = loaded("mistral")
    assert config.sliding_windows == (8,) * config.num_layers
    tokens = prompt(20, seed=1, vocab_size=config.vocab_size)
    windowed = PagedRunner(ours, config).step({0: tokens})[0]
    for layer in ours.modules():
        if isinstance(layer, Attention):
            layer.sliding_window = None
    try:
        full = PagedRunner(ours, config).step({0: tokens})[0]
    finally:
        for layer in ours.modules():
            if isinstance(layer, Attention):
                layer.sliding_window = 8
    assert rel_err(windowed[:8], full[:8]) < RTOL
    assert rel_err(windowed[8:], full[8:]) > 1e-2


def test_llama3_inv_freq_matches_hf(tiny_checkpoint: Callable[[str], Path]) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.AutoConfig.from_pretrained(tiny_checkpoint("llama31"))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    config, _ = resolve_model_config(str(tiny_checkpoint("llama31")))
    ours = compute_inv_freq(config.head_dim, config.rope_parameters)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    plain = compute_inv_freq(config.head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    assert not torch.allclose(ours, plain)


def test_unsupported_rope_type_names_it() -> None:
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        compute_inv_freq(16, {"rope_type": "yarn", "rope_theta": 10000.0})


def test_tied_head_shares_embedding(loaded: Callable[[str], tuple]) -> None:
    ours, _, _ = loaded("llama_tied")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    untied, _, _ = loaded("llama")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_rms_norm_fused_residual_matches_unfused() -> None:
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.allclose(normed, norm(x + residual))


def test_packed_weight_loaders_place_shards() -> None:
    qkv = QKVLinear(hidden_size=4, head_dim=2, num_heads=2, num_kv_heads=1, bias=True)
    for shard_id, rows, fill in (("q", 4, 1.0), ("k", 2, 2.0), ("v", 2, 3.0)):
        qkv.weight_loader(qkv.weight, torch.full((rows, 4), fill), shard_id)
        assert qkv.bias is not None
        qkv.weight_loader(qkv.bias, torch.full((rows,), fill), shard_id)
    assert qkv.weight[:, 0].tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    assert qkv.bias is not None and qkv.bias.tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(3, 4), "k")
    gate_up = MergedColumnLinear(4, [3, 3])
    gate_up.weight_loader(gate_up.weight, torch.ones(3, 4), 1)
    gate_up.weight_loader(gate_up.weight, torch.zeros(3, 4), 0)
    assert gate_up.weight[:, 0].tolist() == [0, 0, 0, 1, 1, 1]


def test_attention_without_cache_raises(loaded: Callable[[str], tuple]) -> None:
    layer = Attention(num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5)
    metadata, _ = make_attention_metadata([1], [1], [[0]], BLOCK_SIZE)
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        layer(torch.zeros(1, 8), torch.zeros(1, 4), torch.zeros(1, 4), metadata)


def test_bind_kv_cache_checks_count_and_shape(loaded: Callable[[str], tuple]) -> None:
    ours, config, _ = loaded("llama")
    backend = get_attention_backend("torch")
    good = torch.zeros(2, 4, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    with pytest.raises(ValueError, match="attention layers"):
        bind_kv_cache(ours, [good], backend)
    bad = torch.zeros(2, 4, BLOCK_SIZE, config.num_kv_heads + 1, config.head_dim)
    with pytest.raises(ValueError, match="layer 1"):
        bind_kv_cache(ours, [good, bad], backend)


def test_get_model_class_lists_supported() -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
