"""The compiled two-pass argmax (``kvserve/kernels/argmax.py``) on a CUDA
device (skipped without one), equal to ``torch.argmax`` exactly: vocabularies
of Llama-3 (128,256), Qwen2 (152,064), Llama-2 (32,000) and a small one, 1 to
256 rows, float32 / bfloat16 / float16, on random rows and on tie-heavy ones
(a few distinct values, so the first maximum sits anywhere; rows of all
``-inf``; NaN, which wins at its first column), at the default and other
chunk sizes; then captured in a CUDA graph and replayed on new data; then the
sampler with the kernel against the sampler with torch's argmax, token for
token, on greedy, random and mixed batches. Every ``torch.empty`` starts
poisoned (integers at their maximum, floats NaN), so an unwritten scratch
slot or output shows.

The kernel module is imported inside the tests, so collecting this file on
a CPU machine never decorates it before the CPU interpreter tests switch the
interpreter on.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.sampling.sampler import Sampler, SamplingBatch, make_generator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCABS = [128256, 152064, 32000, 1000]
ROWS = [1, 2, 64, 256]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
CHUNKS = [1024, 2048, 4096, 8192]


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees poisoned ``torch.empty`` outputs and scratch."""


def assert_argmax(x: torch.Tensor, chunk: int | None = None) -> None:
    from kvserve.kernels.argmax import CHUNK, argmax_rows

    out = argmax_rows(x, CHUNK if chunk is None else chunk)
    ref = x.argmax(dim=-1)
    assert out.dtype == torch.int64 and out.shape == ref.shape
    rows = (out != ref).nonzero().flatten()[:5].tolist()
    assert not rows, f"rows {rows}: kernel {out[rows].tolist()}, torch {ref[rows].tolist()}"


def tie_heavy(num_rows: int, num_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Values in {-2, ..., 2} with the top value rare and anywhere; a row of
    all -inf, one with NaN beside +inf, one all equal."""
    x = torch.randn(num_rows, num_cols, device="cuda").mul(0.7).round().clamp(-2, 2)
    x[0, torch.randint(num_cols, (3,), device="cuda")] = 3.0
    if num_rows > 1:
        x[1] = float("-inf")
    if num_rows > 3:
        x[2, num_cols // 3] = float("inf")
        x[2, num_cols - 1] = float("nan")
        x[3] = 1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("num_cols", VOCABS)
def test_random_rows(num_cols: int, num_rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_rows * 7 + num_cols)
    assert_argmax((3 * torch.randn(num_rows, num_cols, device="cuda")).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("num_cols", VOCABS)
def test_tie_heavy_rows(num_cols: int, num_rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_rows * 11 + num_cols)
    assert_argmax(tie_heavy(num_rows, num_cols, dtype))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_other_chunk_sizes(chunk: int) -> None:
    torch.manual_seed(chunk)
    for num_cols in VOCABS:
        assert_argmax(tie_heavy(64, num_cols, torch.float32), chunk)
        assert_argmax(torch.randn(64, num_cols, device="cuda"), chunk)


def test_strided_rows() -> None:
    wide = torch.randn(8, 128256 + 256, device="cuda")
    assert_argmax(wide[:, 100 : 100 + 128256])


@pytest.mark.parametrize("num_rows", [1, 64])
def test_cuda_graph_replay_on_new_data(num_rows: int) -> None:
    from kvserve.kernels.argmax import argmax_rows

    static = torch.randn(num_rows, 128256, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        argmax_rows(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(static)
    for seed in range(3):
        torch.manual_seed(seed)
        fresh = tie_heavy(num_rows, 128256, torch.float32) if seed else torch.randn_like(static)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, fresh.argmax(dim=-1))


def _sample(use_triton: bool, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """One sampler call with fresh generators (seeded rows and the default)."""
    torch.manual_seed(0)
    generators = [make_generator(p.seed, "cuda") if p.seed is not None else None for p in params]
    num_rows, vocab_size = logits.shape
    batch = SamplingBatch.build(params, [[1, 2, 3]] * num_rows, [[]] * num_rows, generators,
                                vocab_size, "cuda")
    return Sampler(use_triton=use_triton)(logits, batch).sampled_token_ids


@pytest.mark.parametrize("kind", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("num_rows", [1, 8, 64])
def test_sampler_tokens_unchanged(kind: str, num_rows: int) -> None:
    torch.manual_seed(num_rows)
    logits = 4 * torch.randn(num_rows, 128256, device="cuda", dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0)
    params = {
        "greedy": [greedy] * num_rows,
        "random": [SamplingParams(temperature=0.8, seed=i if i % 2 else None)
                   for i in range(num_rows)],
        "mixed": [greedy if i % 2 else SamplingParams(temperature=1.0, top_p=0.9, seed=i)
                  for i in range(num_rows)],
    }[kind]
    with_kernel = _sample(True, logits, params)
    assert torch.equal(with_kernel, _sample(False, logits, params))
    if kind == "greedy":
        assert torch.equal(with_kernel, logits.float().argmax(dim=-1))
