"""The two-pass argmax kernel (``kvserve/kernels/argmax.py``) on CPU under
``TRITON_INTERPRET=1``, against ``torch.argmax`` exactly: random rows of
ragged widths around the chunk size (one column, one chunk minus one, one
chunk plus one, several chunks and a few) in float32, bfloat16 and float16;
ties inside a chunk and across chunk boundaries (the first column wins);
rows of all ``-inf``; NaN (the first NaN wins, above ``+inf``); signed zeros;
rows of a wider tensor (row stride above V); zero rows; and the launcher's
refusals. A small ``chunk`` gives many chunks on small rows. Every
``torch.empty`` starts poisoned (integers at their maximum, which an unwritten
scratch slot turns into "NaN at column 0"; an unwritten output is out of
range), so a slot or row a kernel never writes shows. The sampler on CPU
stays on torch and never imports Triton.
Skipped like ``test_triton_kernels.py``: without Triton, with CUDA (see
``tests/gpu/test_triton_argmax_gpu.py``), or when Triton was imported
without the interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_triton_argmax_gpu.py")

from kvserve.kernels.argmax import CHUNK, argmax_rows  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
WIDTHS = [1, 7, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
SMALL_CHUNK = 16
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees poisoned ``torch.empty`` outputs and scratch."""


def assert_argmax(x: torch.Tensor, chunk: int = CHUNK) -> None:
    out = argmax_rows(x, chunk)
    assert out.dtype == torch.int64 and out.shape == (x.shape[0],)
    assert torch.equal(out, x.argmax(dim=-1)), (out, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_cols", WIDTHS)
@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_random_rows(num_rows: int, num_cols: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(num_rows * 100_003 + num_cols)
    # 16-bit rounding of thousands of normals leaves ties at the maximum too
    assert_argmax(torch.randn(num_rows, num_cols, generator=generator).to(dtype))


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, CHUNK])
def test_ties_first_column_wins(chunk: int) -> None:
    num_cols = 3 * chunk + 5
    x = torch.zeros(6, num_cols)
    x[0, [chunk - 1, chunk, 2 * chunk]] = 5.0  # across chunk boundaries
    x[1, [9, 5, 11]] = 5.0  # inside the first chunk
    x[2, [num_cols - 2, num_cols - 1]] = 5.0  # inside the last, partial chunk
    x[3, [chunk + 3, 2 * chunk + 3, 3 * chunk + 3]] = 5.0  # one per chunk, none in the first
    x[4] = torch.randint(0, 3, (num_cols,), generator=torch.Generator().manual_seed(0)).float()
    # x[5] all zero: the first column
    assert_argmax(x, chunk)
    assert argmax_rows(x, chunk)[:4].tolist() == [chunk - 1, 5, num_cols - 2, chunk + 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_negative_infinity(dtype: torch.dtype) -> None:
    x = torch.full((3, 2 * SMALL_CHUNK + 1), -INF, dtype=dtype)
    x[1, -1] = -1e4  # one finite column, in the partial chunk
    assert argmax_rows(x, SMALL_CHUNK).tolist() == [0, 2 * SMALL_CHUNK, 0]
    assert_argmax(x, SMALL_CHUNK)


def test_nan_and_signed_zeros_as_torch() -> None:
    x = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    x[0, [40, 70]] = NAN
    x[1, 10], x[1, 60] = INF, NAN  # NaN above +inf
    x[2, 33] = -NAN  # a NaN with the sign bit set
    x[3] = -1.0
    x[3, [20, 50]] = torch.tensor([-0.0, 0.0])  # -0.0 ties with +0.0
    x[4] = -1.0
    x[4, 90], x[4, 30] = 0.0, -0.0
    x[5] = NAN
    x[6] = -INF
    x[6, 55] = NAN
    x[7, [17, 80]] = INF
    assert argmax_rows(x, SMALL_CHUNK).tolist() == [40, 60, 33, 20, 30, 0, 55, 17]
    assert_argmax(x, SMALL_CHUNK)


def test_strided_rows_and_empty_batch() -> None:
    wide = torch.randn(5, 3 * SMALL_CHUNK + 40, generator=torch.Generator().manual_seed(2))
    assert_argmax(wide[:, 3 : 3 * SMALL_CHUNK + 4], SMALL_CHUNK)  # row stride above V
    assert_argmax(wide[::2], SMALL_CHUNK)
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)


@pytest.mark.parametrize(
    ("x", "chunk", "message"),
    [
        (torch.zeros(10), CHUNK, r"x: shape \(10,\); expected a 2-D"),
        (torch.zeros(2, 3, 4), CHUNK, r"x: shape \(2, 3, 4\); expected a 2-D"),
        (torch.zeros(2, 4, dtype=torch.float64), CHUNK, r"x: dtype torch.float64; expected"),
        (torch.zeros(2, 4, dtype=torch.int64), CHUNK, r"x: dtype torch.int64; expected"),
        (torch.zeros(2, 0), CHUNK, r"x: shape \(2, 0\); V .* at least 1"),
        (torch.zeros(4, 3).t(), CHUNK, r"x: last-dimension stride 3; must be 1"),
        (torch.zeros(2, 8)[:, ::2], CHUNK, r"x: last-dimension stride 2; must be 1"),
        (torch.zeros(2, 4), 100, r"chunk=100; must be a power of two"),
        (torch.zeros(2, 4), 8, r"chunk=8; must be a power of two"),
        (torch.zeros(1, 4096 * 16 + 1), 16, r"x: V=65537 columns; at most 65536 with chunk=16"),
    ],
    ids=["1d", "3d", "float64", "int64", "no-columns", "transposed", "strided", "chunk-100",
         "chunk-8", "too-many-chunks"],
)
def test_rejects_bad_inputs(x: torch.Tensor, chunk: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        argmax_rows(x, chunk)


def test_sampler_on_cpu_stays_on_torch() -> None:
    """CPU logits take torch.argmax, and sampling imports no Triton."""
    code = (
        "import sys, torch\n"
        "from kvserve.core.sampling_params import SamplingParams\n"
        "from kvserve.sampling.sampler import Sampler, SamplingBatch\n"
        "logits = torch.randn(4, 300)\n"
        "params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)] * 2\n"
        "batch = SamplingBatch.build(params, [[]] * 4, [[]] * 4, [None] * 4, 300, 'cpu')\n"
        "ids = Sampler()(logits, batch).sampled_token_ids\n"
        "assert torch.equal(ids[0::2], logits.argmax(dim=-1)[0::2])\n"
        "assert 'triton' not in sys.modules, 'sampling on CPU imported triton'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
