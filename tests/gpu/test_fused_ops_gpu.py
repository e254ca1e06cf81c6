"""The compiled fused small-op kernels (RMSNorm with and without the residual
add, per-head q/k norm, SiluAndMul, rotary) on a CUDA device (skipped
without one), against the layers' torch code on Llama-3-8B shapes: hidden
4096, intermediate 14336, 32 query / 8 KV heads of 128, 1 to 4096 tokens,
bfloat16 and float16. Each output must be NaN-free (fresh outputs are
allocated NaN-poisoned) with relative error under 1e-2, and at least 99 %
of its elements bit-equal to torch with the same rounding sequence (the
compiled kernels round to nearest even, so this checks the rounding
semantics). The skinny GEMM, which sums in another order than cuBLAS, is
held to the relative error alone, against ``F.linear`` in float32, for 1 to
16 rows on Llama-3-8B's five projection shapes and odd ones, with its
default and alternative configurations. Then the kernels captured in a CUDA
graph and replayed on new inputs, and a tiny Qwen3's hidden states and
logits with ``set_triton_ops`` on and off over a 10-token step and a
one-row decode (float32: within 1e-4; bfloat16, where every linear of
both steps takes the skinny GEMM: no farther from float32 than torch's).

Kernel modules are imported inside the tests, so collecting this file on a
CPU machine never decorates them before the CPU interpreter tests switch the
interpreter on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import get_attention_backend
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import bind_kv_cache
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.loader import load_model
from kvserve.models.source import resolve_model_config
from tests.conftest import make_attention_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_ERROR = 1e-2
MIN_BIT_EQUAL = 0.99
DTYPES = [torch.bfloat16, torch.float16]
NUM_TOKENS = [1, 7, 256, 4096]
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MAX_POSITION = 32768
# (N, K): qkv, o, gate_up, down, lm_head of Llama-3-8B, then sizes no block divides
LINEAR_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                 (1000, 4000), (333, 1027)]
SKINNY_ROWS = [1, 2, 5, 8, 16]


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees NaN-poisoned ``torch.empty`` outputs."""


def check(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor | None = None) -> None:
    """``out`` close to ``ref``; mostly bit-equal to ``exact`` (default ``ref``)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < MAX_ERROR, f"relative error {error:.2e}"
    equal = (out == (ref if exact is None else exact)).float().mean().item()
    assert equal >= MIN_BIT_EQUAL, f"only {equal:.2%} of elements bit-equal"


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device="cuda")).to(dtype)


def make_norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).cuda()
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden, device="cuda"))
    return norm.to(dtype)


def run_both(module: torch.nn.Module, *args: torch.Tensor) -> tuple[Any, Any]:
    """The module's Triton forward, then its torch forward, on the same inputs."""
    set_triton_ops(module, True)
    out = module(*args)
    set_triton_ops(module, False)
    return out, module(*args)


def packed_qkv(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A packed qkv projection and its q, k, v views (row stride = qkv width)."""
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, scale=2.0)
    return (qkv, *qkv.split([q_size, kv_size, kv_size], dim=-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    norm = make_norm(HIDDEN, dtype)
    x = randn(num_tokens, HIDDEN, dtype=dtype, scale=3.0)
    residual = randn(num_tokens, HIDDEN, dtype=dtype, scale=10.0)
    out, ref = run_both(norm, x)
    check(out, ref)
    (out, summed), (ref, ref_summed) = run_both(norm, x, residual)
    assert torch.equal(summed, ref_summed)
    check(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_per_head_norm_on_qkv_views(dtype: torch.dtype, num_tokens: int) -> None:
    _, q, k, _ = packed_qkv(num_tokens, dtype)
    for flat, heads in ((q, NUM_HEADS), (k, NUM_KV_HEADS)):
        out, ref = run_both(make_norm(HEAD_DIM, dtype), flat.view(num_tokens, heads, HEAD_DIM))
        check(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(dtype: torch.dtype, num_tokens: int) -> None:
    x = randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, scale=3.0)
    out, ref = run_both(SiluAndMul(), x)
    check(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, num_tokens: int, partial: float) -> None:
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION,
                           {**LLAMA3_ROPE, "partial_rotary_factor": partial}).cuda()
    qkv, q, k, _ = packed_qkv(num_tokens, dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device="cuda")
    positions[0] = MAX_POSITION - 1
    before = qkv.clone()
    ref_q, ref_k = rope(positions, q, k)  # torch: cos/sin and every product rounded
    exact_q, exact_k = (t.to(dtype) for t in rope(positions, q.float(), k.float()))
    set_triton_ops(rope, True)
    rope(positions, q, k)
    check(q, ref_q, exact_q)
    check(k, ref_k, exact_k)
    v_start = q.shape[1] + k.shape[1]
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched


def check_linear(out: torch.Tensor, x: torch.Tensor, weight32: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    """``out`` close to ``F.linear`` in float32 on the upcast inputs."""
    ref = F.linear(x.float(), weight32, None if bias is None else bias.float())
    assert out.shape == ref.shape and out.dtype == x.dtype and out.is_contiguous()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < MAX_ERROR, f"{tuple(x.shape)} x {tuple(weight32.shape)}: rel error {error:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", LINEAR_SHAPES, ids=[f"{n}x{k}" for n, k in LINEAR_SHAPES])
def test_skinny_matmul(dtype: torch.dtype, n: int, k: int) -> None:
    from kvserve.kernels.skinny_gemm import skinny_matmul

    weight = randn(n, k, dtype=dtype, scale=0.02)
    weight32 = weight.float()
    bias = randn(n, dtype=dtype)
    for m in SKINNY_ROWS:
        x = randn(m, k, dtype=dtype)
        check_linear(skinny_matmul(x, weight), x, weight32, None)
        check_linear(skinny_matmul(x, weight, bias), x, weight32, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_gated_skinny_matmul_is_silu_and_mul_then_matmul(dtype: torch.dtype) -> None:
    from kvserve.kernels.activation import silu_and_mul
    from kvserve.kernels.skinny_gemm import skinny_matmul

    gate_up = randn(1, 2 * INTERMEDIATE, dtype=dtype, scale=2.0)
    weight = randn(HIDDEN, INTERMEDIATE, dtype=dtype, scale=0.02)
    fused = skinny_matmul(gate_up, weight, gated=True)
    assert torch.equal(fused, skinny_matmul(silu_and_mul(gate_up), weight))
    check_linear(fused, SiluAndMul()(gate_up), weight.float(), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 4000)], ids=["4096x4096", "1000x4000"])
def test_skinny_matmul_configs(dtype: torch.dtype, n: int, k: int) -> None:
    from kvserve.kernels.skinny_gemm import SkinnyConfig, skinny_matmul

    configs = [  # FMA (any rows), mma.sync (block_n 16, 32), wgmma (block_n 64, 4 warps)
        SkinnyConfig(8, 1024, 4, 3, use_dot=False), SkinnyConfig(32, 128, 8, 1, use_dot=False),
        SkinnyConfig(16, 256, 1, 4, use_dot=True), SkinnyConfig(32, 128, 2, 4, use_dot=True),
        SkinnyConfig(64, 64, 4, 4, use_dot=True), SkinnyConfig(64, 128, 8, 3, use_dot=True),
    ]
    weight = randn(n, k, dtype=dtype, scale=0.02)
    weight32 = weight.float()
    for m in (1, 2, 5, 16):
        x = randn(m, k, dtype=dtype)
        for config in configs:
            if config.use_dot or m <= 2:  # FMA's accumulator grows with the rows
                check_linear(skinny_matmul(x, weight, None, config), x, weight32, None)


def test_kernels_replay_in_a_cuda_graph() -> None:
    from kvserve.kernels.activation import silu_and_mul
    from kvserve.kernels.rms_norm import add_rms_norm
    from kvserve.kernels.rotary import apply_rotary
    from kvserve.kernels.skinny_gemm import skinny_matmul

    dtype, num_tokens = torch.bfloat16, 64
    weight = make_norm(HIDDEN, dtype).weight
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, LLAMA3_ROPE).cuda()
    x, residual = randn(num_tokens, HIDDEN, dtype=dtype), randn(num_tokens, HIDDEN, dtype=dtype)
    gate_up = randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype)
    qkv, q, k, _ = packed_qkv(num_tokens, dtype)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device="cuda")
    o_proj = randn(HIDDEN, HIDDEN, dtype=dtype, scale=0.02)

    def step() -> tuple[torch.Tensor, ...]:
        apply_rotary(positions, q, k, rope.cos_sin_cache, HEAD_DIM, HEAD_DIM)
        return (*add_rms_norm(x, residual, weight, 1e-5), silu_and_mul(gate_up),
                skinny_matmul(x[:1], o_proj), skinny_matmul(x[:16], o_proj))

    qkv_input = qkv.clone()
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outputs = step()
    for tensor in (x, residual, gate_up, qkv_input):
        tensor.copy_(torch.randn_like(tensor, dtype=torch.float32))
    positions.random_(0, MAX_POSITION)
    qkv.copy_(qkv_input)
    graph.replay()
    graph_qkv = qkv.clone()
    qkv.copy_(qkv_input)
    for graph_out, eager_out in zip(graph_outputs, step(), strict=True):
        assert torch.equal(graph_out, eager_out)
    assert torch.equal(graph_qkv, qkv)


def tiny_model_outputs(path: Path, dtype: torch.dtype, triton_ops: bool) -> list[torch.Tensor]:
    """Hidden states and logits of two forwards of a tiny model: a 9-token
    prefill with a decode at position 20, then that decode alone (one row)."""
    config, model_path = resolve_model_config(str(path))
    model = load_model(config, model_path, "auto", dtype, torch.device("cuda"))
    set_triton_ops(model, triton_ops)
    caches = [torch.zeros(2, 10, 4, config.num_kv_heads, config.head_dim, dtype=dtype,
                          device="cuda") for _ in range(config.num_layers)]
    bind_kv_cache(model, caches, get_attention_backend("torch"))
    input_ids = torch.arange(3, 13, device="cuda")
    outputs = []
    with torch.inference_mode():
        for query_lens, seq_lens, tables in (([9, 1], [9, 21], [[3, 1, 7], [2, 5, 4, 6, 9, 8]]),
                                             ([1], [21], [[2, 5, 4, 6, 9, 8]])):
            metadata, positions = make_attention_metadata(query_lens, seq_lens, tables,
                                                          block_size=4, device="cuda")
            hidden = model(input_ids[:len(positions)], positions, metadata)
            outputs += [hidden.float(), model.compute_logits(hidden)]
    return outputs


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_tiny_model_hidden_states_match(tiny_checkpoint: Callable[[str], Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.kernels import skinny_gemm

    calls: list[int] = []
    skinny_matmul = skinny_gemm.skinny_matmul

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return skinny_matmul(x, *args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_matmul", counted)
    # qwen3: per-head q/k norm on qkv views, rope on [num_tokens, heads, head_dim]
    path = tiny_checkpoint("qwen3")
    num_layers = resolve_model_config(str(path))[0].num_layers
    oracle = tiny_model_outputs(path, torch.float32, triton_ops=False)
    fp32 = tiny_model_outputs(path, torch.float32, triton_ops=True)
    assert calls == []  # float32 keeps F.linear
    for out, ref in zip(fp32, oracle, strict=True):
        assert rel_error(out, ref) < 1e-4
    # the tiny models' attention is peaked, so bfloat16 drifts from float32 on
    # either path: the Triton path must drift no more than the torch one (its
    # rope rounds once where torch rounds four times)
    bf16 = tiny_model_outputs(path, torch.bfloat16, triton_ops=True)
    # both steps (10 rows, then one): qkv, o, gate_up and down of every layer,
    # and the head, take the skinny GEMM (the 10-row down after the SiLU kernel)
    assert calls == [10] * (4 * num_layers + 1) + [1] * (4 * num_layers + 1)
    bf16_torch = tiny_model_outputs(path, torch.bfloat16, triton_ops=False)
    for out, out_torch, ref in zip(bf16, bf16_torch, oracle, strict=True):
        assert not out.isnan().any()
        assert rel_error(out, ref) < max(MAX_ERROR, 1.5 * rel_error(out_torch, ref))
