"""The rotary-embedding kernel ``apply_rotary``: neox-style (``rotate_half``)
rotation of q and k by their tokens' positions, IN PLACE.

Each head's first ``rotary_dim / 2`` dims pair with the next ``rotary_dim / 2``;
dims past ``rotary_dim`` (partial rotary) are neither read nor written.
cos and sin come from the float32 ``[max_position, rotary_dim]`` cache of
``kvserve/layers/rotary.py`` (cos in the first half, sin in the second),
the products are computed in float32 and each output rounded once to the
dtype. (The torch oracle casts cos and sin to the dtype first and rounds
every product, so 16-bit results differ from it by a few units in the last
place of the inputs' magnitude; this kernel is the more accurate of the two.)

In place because q and k are views into the step's packed qkv projection,
which nothing reads un-rotated: no allocation and no extra copy, and a
CUDA graph replays into the same buffers. Grid ``(num_tokens,)``: a program
loads its position's cos/sin once and rotates every q and k head of its
token. A position outside ``[0, max_position)`` leaves its token unrotated
instead of reading past the cache, so padded rows of a CUDA-graph batch may
carry any position. Nothing is read back to the host.

The Triton attention backend does not launch this kernel: it rotates in
``rope_store_kv.py``, fused with its KV write, or in a decode step inside
the decode attention kernel (``paged_attention.py``), through the same
``rotate_pair``. This one serves ``RotaryEmbedding`` with ``use_triton``
under a backend that does not fuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """The rotated halves ``(x1 cos - x2 sin, x2 cos + x1 sin)``, in float32: the one
    expression of the rotation, shared with ``rope_store_kv.py`` and
    ``paged_attention.py`` so that the kernels compile it alike and round alike."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def rotate_heads(
    x_ptr,  # first element of one token's [num_heads, head_dim] heads
    stride_head,
    cos,  # [1, HALF_PAD] float32
    sin,  # [1, HALF_PAD] float32
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate ``NUM_HEADS`` heads of one token in place, each output rounded once."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    first = x_ptr + heads[:, None] * stride_head + dims[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    rotated1, rotated2 = rotate_pair(x1, x2, cos, sin)
    tl.store(first, rotated1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, rotated2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    positions_ptr,  # [num_tokens] int32 or int64
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_ptr,  # [max_position, 2 * HALF] float32: cos | sin
    max_position,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache_pos,
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    if (pos < 0) | (pos >= max_position):
        return
    dims = tl.arange(0, HALF_PAD)
    cache_row = cos_sin_ptr + pos * stride_cache_pos
    cos = tl.load(cache_row + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(cache_row + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    rotate_heads(q_ptr + token * stride_q_token, stride_q_head, cos, sin,
                 NUM_HEADS, NUM_HEADS_PAD, HALF, HALF_PAD)
    rotate_heads(k_ptr + token * stride_k_token, stride_k_head, cos, sin,
                 NUM_KV_HEADS, NUM_KV_HEADS_PAD, HALF, HALF_PAD)


def heads_view(name: str, x: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """``x`` as ``[num_tokens, heads, head_dim]`` (a view), after checking it."""
    if x.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype}; allowed: {DTYPES}")
    if x.dim() == 2 and x.shape[0] == num_tokens and x.shape[1] % head_dim == 0:
        x = x.view(num_tokens, x.shape[1] // head_dim, head_dim)  # a unit last stride suffices
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim:
        raise ValueError(
            f"{name}: shape {tuple(x.shape)}; expected [num_tokens={num_tokens}, heads * "
            f"{head_dim}] or [num_tokens, heads, {head_dim}]"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: last-dimension stride {x.stride(-1)}; must be 1")
    return x


def check_rotary_inputs(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int, rotary_dim: int
) -> None:
    """Raise ValueError unless ``rotary_dim``, ``positions`` and ``cos_sin_cache`` suit a
    rotation of heads of ``head_dim`` (devices are the caller's to check)."""
    if rotary_dim <= 0 or rotary_dim % 2 != 0 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim={rotary_dim}; must be even and in [2, head_dim={head_dim}]"
        )
    if (positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64)
            or not positions.is_contiguous()):
        raise ValueError(
            f"positions: {positions.dtype} of shape {tuple(positions.shape)}; expected a "
            "contiguous [num_tokens] int32 or int64 tensor"
        )
    if (cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim
            or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1):
        raise ValueError(
            f"cos_sin_cache: {cos_sin_cache.dtype} of shape {tuple(cos_sin_cache.shape)}; "
            f"expected float32 [max_position, rotary_dim={rotary_dim}] with unit last stride"
        )


def apply_rotary(
    positions: torch.Tensor,  # [num_tokens] int64 or int32
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim] or [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] or [.., num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32
    head_dim: int,
    rotary_dim: int,
) -> None:
    """Rotate ``q`` and ``k`` in place by ``positions`` (neox style, partial rotary allowed).

    ``q`` and ``k`` need only a unit last stride: views split from a packed
    qkv tensor are rotated where they lie.
    """
    check_rotary_inputs(positions, cos_sin_cache, head_dim, rotary_dim)
    num_tokens = positions.shape[0]
    q3 = heads_view("q", q, num_tokens, head_dim)
    k3 = heads_view("k", k, num_tokens, head_dim)
    if k.dtype != q.dtype:
        raise ValueError(f"k: dtype {k.dtype}; expected q's {q.dtype}")
    for name, tensor in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if tensor.device != positions.device:
            raise ValueError(
                f"{name}: on {tensor.device}; expected {positions.device} (positions' device)"
            )
    if num_tokens == 0:
        return
    num_heads, num_kv_heads = q3.shape[1], k3.shape[1]
    half = rotary_dim // 2
    heads_pad = triton.next_power_of_2(max(num_heads, num_kv_heads))
    rotary_kernel[(num_tokens,)](
        positions, q3, k3, cos_sin_cache, cos_sin_cache.shape[0],
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_HEADS_PAD=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=8 if heads_pad * triton.next_power_of_2(half) >= 4096 else 4,
    )
