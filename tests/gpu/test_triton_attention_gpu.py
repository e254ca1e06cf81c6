"""The compiled Triton attention kernels on a CUDA device (skipped without
one), against the torch reference: bfloat16 and float16, head_dim 64 and
128, block sizes 16 and 32, ragged batches up to 64 requests with contexts
up to 8k crossing block boundaries, GQA / MQA / MHA and a group of 7,
sliding windows, split-K decode; then whole-engine greedy tokens equal
between ``attention_backend="triton"`` and ``"torch"``.

Outputs are poisoned with NaN, and so is every cache slot no request owns;
inputs are fresh random numbers each run. Kernel modules are imported
inside the tests, so collecting this file on a CPU machine never decorates
them before the CPU interpreter tests switch the interpreter on.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.torch_ref import paged_attention_ref, write_kv
from tests.attention_cases import Case
from tests.attention_cases import make_case as make_shared_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_ERROR = 1e-2
DTYPES = [torch.bfloat16, torch.float16]


# shuffled block tables, fresh random values every time
make_case = functools.partial(make_shared_case, device="cuda", seed=None)


def check(case: Case, sliding_window: int | None = None, num_splits: int | None = None,
          decode: bool = False) -> None:
    """Run store_kv + the chosen kernel and compare with the torch reference."""
    from kvserve.kernels.paged_attention import decode_attention, prefill_attention
    from kvserve.kernels.store_kv import store_kv

    md = case.metadata
    scale = case.q.shape[-1] ** -0.5
    expected_cache = case.kv_cache.clone()
    write_kv(case.k, case.v, expected_cache, md.slot_mapping)
    cache = case.kv_cache.clone()
    store_kv(case.k, case.v, cache, md.slot_mapping)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0, equal_nan=True)
    out = torch.full_like(case.q, float("nan"))
    if decode:
        decode_attention(case.q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                         md.max_seq_len, scale, sliding_window, out=out, num_splits=num_splits)
    else:
        prefill_attention(case.q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                          md.max_query_len, scale, sliding_window, out=out)
    ref = paged_attention_ref(case.q, expected_cache, md, scale, sliding_window).float()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error < MAX_ERROR, f"relative error {error:.2e}"


def ragged_seq_lens(rng: random.Random, count: int, block_size: int, longest: int) -> list[int]:
    """Context lengths on, just before and just after block boundaries, and random ones."""
    edges = [1, block_size - 1, block_size, block_size + 1, longest]
    lens = edges + [rng.randint(1, longest) for _ in range(count - len(edges))]
    return lens[:count]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    rng = random.Random(head_dim * block_size)
    for batch, longest, splits in ((64, 8192, None), (1, 8192, None), (7, 3000, 5), (13, 900, 1)):
        seq_lens = ragged_seq_lens(rng, batch, block_size, longest)
        case = make_case([1] * batch, seq_lens, 32, 8, head_dim, block_size, dtype)
        check(case, num_splits=splits, decode=True)
    case = make_case([1] * 9, ragged_seq_lens(rng, 9, block_size, 6000), 32, 8, head_dim,
                     block_size, dtype)
    check(case, sliding_window=1000, decode=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    # fresh prefills, chunks over cached prefixes (ending mid-block and on a
    # boundary), decodes and a one-token prompt in one batch
    query_lens = [1000, 1, 300, 17, 1, 1, block_size, 129, 2048]
    seq_lens = [1000, 4000, 3300, 17, 8192, 1, 4 * block_size, 129 + 5 * block_size, 2048]
    case = make_case(query_lens, seq_lens, 32, 8, head_dim, block_size, dtype)
    check(case)
    check(case, sliding_window=777)
    # 64 requests with 3 new tokens each (speculative-decode shaped), contexts 40..6151
    check(make_case([3] * 64, list(range(40, 40 + 64 * 97, 97)), 32, 8, head_dim, block_size,
                    dtype))


@pytest.mark.parametrize("heads", [(8, 1), (8, 8), (14, 2)], ids=["mqa", "mha", "group7"])
def test_head_layouts(heads: tuple[int, int]) -> None:
    rng = random.Random(0)
    decode_lens = ragged_seq_lens(rng, 16, 16, 5000)
    check(make_case([1] * 16, decode_lens, *heads, 64, 16, torch.bfloat16), decode=True)
    check(make_case([1] * 16, decode_lens, *heads, 64, 16, torch.bfloat16), sliding_window=300,
          decode=True)
    case = make_case([700, 1, 45, 5], [700, 2000, 1045, 5], *heads, 64, 16, torch.bfloat16)
    check(case)
    check(case, sliding_window=100)


PROMPTS = [[5, 17, 99, 3, 250, 7, 42], list(range(20, 57)), [11, 12], list(range(100, 190))]


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen3"])
def test_engine_greedy_tokens_match_torch_backend(
    variant: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    # batch 1 (prefill then decode steps) and a batch with chunked prefill
    # (a 16-token budget mixes prefill chunks with decodes)
    path = str(tiny_checkpoint(variant))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for block_size, budget, prompts in ((16, None, PROMPTS[1:2]), (4, 16, PROMPTS)):
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(model=path, dtype="float32", device="cuda", block_size=block_size,
                      attention_backend=backend, max_num_batched_tokens=budget)
            tokens[backend] = [o.outputs[0].token_ids
                               for o in llm.generate(prompts, params, use_tqdm=False)]
        assert tokens["triton"] == tokens["torch"], (variant, block_size)


def test_auto_backend_is_triton_on_cuda() -> None:
    from kvserve.engine.args import resolve_attention_backend

    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"
