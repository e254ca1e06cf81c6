"""Random paged-attention batches for kernel tests, on any device.

``make_case`` lays the requests' blocks out in a chosen order (block 0 is
the null block and never used; spare blocks are left over), fills every
slot inside a request's context with random K/V and every other slot with
NaN, so a kernel that reads past a context or leaves an output unwritten
shows. ``quantise_case`` turns a case's cache into an fp8 or int8 one with
its scales, poisoned alike (NaN fp8 bytes; NaN int8 scales). Shared by the
interpreter tests (CPU) and the GPU tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import write_kv
from tests.conftest import make_attention_metadata


@dataclass
class Case:
    """One batch: the metadata, the step's q/k/v, and the cache before the step."""

    metadata: AttentionMetadata
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]


def make_case(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    layout: str = "shuffled",
    seed: int | None = 0,
) -> Case:
    """``layout`` is "shuffled", "reversed" or "contiguous"; ``seed=None``
    draws fresh values from the global generator."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    if layout == "shuffled":
        order = (torch.randperm(num_blocks - 1, generator=generator, device=device) + 1).tolist()
    elif layout == "reversed":
        order = list(range(num_blocks - 1, 0, -1))
    else:
        order = list(range(1, num_blocks))
    tables: list[list[int]] = []
    for count in blocks_per_req:
        tables.append(order[:count])
        order = order[count:]
    metadata, _ = make_attention_metadata(query_lens, seq_lens, tables, block_size, device)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    owned = torch.cat([
        torch.tensor(table, device=device)[positions // block_size] * block_size
        + positions % block_size
        for table, seq_len in zip(tables, seq_lens, strict=True)
        for positions in [torch.arange(seq_len, device=device)]
    ])
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=device)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[:, owned] = randn(2, owned.numel(), num_kv_heads, head_dim)
    num_tokens = metadata.num_tokens
    return Case(metadata, randn(num_tokens, num_heads, head_dim),
                randn(num_tokens, num_kv_heads, head_dim),
                randn(num_tokens, num_kv_heads, head_dim), kv_cache)


def quantise_case(
    case: Case, cache_dtype: torch.dtype, head_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the case's cache as ``cache_dtype`` (fp8 or int8) stores it, its scales),
    written by the torch reference: every slot a request owns quantised, every
    other one poisoned (NaN fp8 bytes; an int8 -128, which no write produces,
    with a NaN scale). fp8 scales: ``head_scales`` ([2, num_kv_heads]), else
    random ones around 0.5."""
    _, num_blocks, block_size, num_kv_heads, head_dim = case.kv_cache.shape
    device = case.kv_cache.device
    if cache_dtype == torch.int8:
        cache = torch.full(case.kv_cache.shape, -128, dtype=torch.int8, device=device)
        scales = torch.full((2, num_blocks, block_size, num_kv_heads), float("nan"),
                            device=device)
    else:
        cache = torch.full(case.kv_cache.shape, 0x7F, dtype=torch.uint8,
                           device=device).view(cache_dtype)
        if head_scales is None:
            generator = torch.Generator().manual_seed(num_kv_heads)
            head_scales = 0.25 + 0.5 * torch.rand(2, num_kv_heads, generator=generator)
        scales = head_scales.to(device=device, dtype=torch.float32).contiguous()
    flat = case.kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    owned = torch.nonzero(~flat[0, :, 0, 0].isnan()).flatten()
    write_kv(flat[0, owned], flat[1, owned], cache, owned, scales)
    return cache, scales


def verify_layout(case: Case, num_padding_rows: int = 0
                  ) -> tuple[AttentionMetadata, torch.Tensor]:
    """The case as a verify step laid out one query token per row
    (``worker/verify_layout.py``), padded by ``num_padding_rows`` rows, and
    its ``[T + padding]`` positions. The case's requests must each have all
    their new tokens at the end of their context (any step does)."""
    from kvserve.worker.verify_layout import VerifyBuffers

    md = case.metadata
    query_lens = torch.tensor(md.query_start_loc_cpu).diff()
    seq_lens = torch.tensor(md.seq_lens_cpu)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens.tolist(),
                                                                   seq_lens.tolist(),
                                                                   strict=True)])
    num_rows = md.num_tokens + num_padding_rows
    device = md.block_table.device
    buffers = VerifyBuffers(num_rows + 2, md.block_table.shape[1], device)
    host = buffers.fill(positions.numpy(), query_lens.numpy(), num_rows)
    buffers.gather(md.block_table, num_rows)
    slot_mapping = torch.cat([md.slot_mapping,
                              torch.full((num_padding_rows,), -1, dtype=md.slot_mapping.dtype,
                                         device=device)])
    metadata = buffers.metadata(num_rows, slot_mapping, md.max_seq_len,
                                host if not num_padding_rows else None)
    return metadata, torch.cat([positions, torch.zeros(num_padding_rows, dtype=torch.int64)]
                               ).to(device)
