"""Compile the decode path's Triton kernels and the KV writes beside them for
sm_90 (Hopper) with no GPU: ``python -m tests.compile_kernels_sm90`` (run by
``tests/unit/test_kernels_compile_for_hopper.py`` in a process without
``TRITON_INTERPRET``). Every variant of the launchers' constexprs that the
interpreter tests cannot reach is built: the programmatic-dependent-launch
branches, and the compiler's own rules (a jit helper must return one type
from all of its branches), which the interpreter does not enforce. The
quantised GEMMs are built with their inline PTX and with the 16-byte
alignment hints a real launch specialises on (``build_quant_matmul``); the
attention kernels and KV writes for each KV cache dtype (16-bit, fp8, int8:
``build_kv_cache_dtypes``); the FP8 per-token quantiser of the W8A8 linears."""

from __future__ import annotations

import itertools
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.kernels.fp8_quant import per_token_quant_kernel
from kvserve.kernels.int8_scale import scale_int32_kernel
from kvserve.kernels.lora import SPLIT_K, lora_expand_kernel, lora_shrink_kernel
from kvserve.kernels.paged_attention import decode_attention_kernel, prefill_attention_kernel
from kvserve.kernels.quant_matmul_kernels import (
    quant_dequant_kernel,
    quant_dot_kernel,
    quant_fma_kernel,
)
from kvserve.kernels.rms_norm import rms_norm_kernel
from kvserve.kernels.rope_store_kv import rope_store_kv_kernel
from kvserve.kernels.skinny_gemm import skinny_matmul_kernel
from kvserve.kernels.store_kv import store_kv_kernel

HOPPER = GPUTarget("cuda", 90, 32)


def build(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any], floats: tuple[str, ...],
          divisible: tuple[str, ...] = (), **options: int) -> None:
    """Compile ``fn`` to a cubin: pointer args of the given types, float args
    ``floats``, every other runtime arg an int32; args in ``divisible`` carry
    the divisible-by-16 hint a launch gives aligned pointers and sizes."""
    signature = {name: pointers.get(name, "fp32" if name in floats else "i32")
                 for name in fn.arg_names if name not in constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in divisible if name in signature}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                   options=options)


def build_quant_matmul() -> None:
    """The quantised GEMMs (``kernels/quant_matmul.py``): each path at INT4 and
    INT8, per group and per channel, symmetric and with zeros; the decode
    variants with PDL (one- and two-tile preloads) and a masked last K step;
    the fused gate; the dot kernel's wgmma, mma.sync and multi-group tiles."""
    pointers = {name: "*bf16" for name in ("x_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr")}
    pointers["qw_ptr"] = "*u8"
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "N", "K",
               "stride_xm", "stride_qn")
    common = dict(HAS_BIAS=True, ASM=True)
    for bits, per_channel, zeros in itertools.product((4, 8), (False, True), (False, True)):
        weight = dict(BITS=bits, GROUP=1 if per_channel else 32, PER_CHANNEL=per_channel,
                      HAS_ZEROS=zeros)
        build(quant_fma_kernel, pointers, dict(
            **weight, **common, BLOCK_N=16, BLOCK_K=1024 // (8 // bits), EVEN_K=False,
            NUM_STAGES=3, GATED=False, PDL=True, PRELOAD=2), (), aligned,
              num_warps=2, num_stages=3)
        build(quant_dot_kernel, pointers, dict(  # BLOCK_K 128: four groups of 32 a step
            **weight, **common, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8,
            EVEN_K=False, NUM_STAGES=4, GATED=False, PDL=True, PRELOAD=2), (), aligned,
              num_warps=4, num_stages=4)
        build(quant_dequant_kernel, pointers | {"out_ptr": "*fp16"}, dict(
            **weight, BLOCK_N=16, BLOCK_K=512, EVEN_K=False, ASM=True), (), aligned,
              num_warps=4)
    for bits in (4, 8):
        weight = dict(BITS=bits, GROUP=128, PER_CHANNEL=False, HAS_ZEROS=True)
        build(quant_fma_kernel, pointers, dict(
            **weight, **common, BLOCK_N=16, BLOCK_K=512, EVEN_K=True, NUM_STAGES=3,
            GATED=True, PDL=True, PRELOAD=1), (), aligned, num_warps=2, num_stages=3)
        build(quant_dot_kernel, pointers, dict(  # mma.sync (one warp), gated, no PDL
            **weight, **common, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, GROUP_M=8, EVEN_K=True,
            NUM_STAGES=4, GATED=True, PDL=False, PRELOAD=1), (), aligned,
              num_warps=1, num_stages=4)
        build(quant_dot_kernel, pointers, dict(  # the tile GEMM
            **weight, **common, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128 // (8 // bits),
            GROUP_M=8, EVEN_K=True, NUM_STAGES=3, GATED=False, PDL=False, PRELOAD=1), (),
              aligned, num_warps=8, num_stages=3)


# KV cache dtype -> (pointer type of its cache, kv_quant mode)
KV_CACHES = {"bf16": ("*bf16", 0), "fp8": ("*fp8e4nv", 1), "int8": ("*i8", 2)}


def build_kv_cache_dtypes() -> None:
    """The KV writes and both attention kernels reading each cache dtype with
    bfloat16 q: the decode kernel with PDL, the fused rope + KV write and a
    window; the prefill kernel with a window and skipped decodes."""
    q_pointers = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_ptr", "v_ptr", "new_k_ptr",
                                             "new_v_ptr")}
    q_pointers.update({name: "*fp32" for name in (
        "part_out_ptr", "part_max_ptr", "part_sum_ptr", "cos_sin_ptr", "k_scale_ptr",
        "v_scale_ptr")})
    q_pointers.update({name: "*i32" for name in (
        "semaphore_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr")})
    q_pointers |= {"slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}
    for cache, mode in KV_CACHES.values():
        pointers = q_pointers | {"k_cache_ptr": cache, "v_cache_ptr": cache}
        for pdl, fuse_rope in itertools.product((False, True), (False, True)):
            build(decode_attention_kernel, pointers, dict(
                BLOCK_SIZE=16, GROUP=4, ROWS=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=128,
                USE_WINDOW=True, NUM_SPLITS_IS_ONE=False, SPLITS_PAD=16, MERGE_HEADS=4,
                MIN_SPLIT=64, DOT_PRECISION="tf32", FUSE_ROPE=fuse_rope, HALF=64, PDL=pdl,
                KV_QUANT=mode), ("scale_log2",), num_warps=4, num_stages=2)
        build(prefill_attention_kernel, pointers, dict(
            BLOCK_SIZE=16, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=16,
            BLOCK_M=64, BLOCK_N=64, USE_WINDOW=True, SKIP_DECODES=True, DOT_PRECISION="tf32",
            KV_QUANT=mode), ("scale_log2",), num_warps=4, num_stages=3)
        if mode == 0:
            continue  # the 16-bit writes are built in main()
        for rotary_dim in (128, 64):
            build(rope_store_kv_kernel, pointers, dict(
                BLOCK_SIZE=16, GROUP=4, GROUP_PAD=4, HALF=rotary_dim // 2,
                HALF_PAD=rotary_dim // 2, HEAD_DIM=128, HEAD_DIM_PAD=128,
                TAIL_PAD=max(128 - rotary_dim, 1), KV_QUANT=mode), ())
        build(store_kv_kernel, pointers, dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
                                              KV_QUANT=mode), ())


def build_lora() -> None:
    """The batched LoRA shrink and expand, gathered and segmented, bf16 and
    float32 models, ranks 8 (padded to the 16 of a dot tile) and 64."""
    indices = {name: "*i32" for name in ("token_slots_ptr", "sorted_ids_ptr", "tiles_ptr",
                                          "slices_ptr")}
    for dtype, rank, segmented in itertools.product(("bf16", "fp32"), (8, 64), (False, True)):
        pointers = indices | {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "buf_ptr": "*fp32"}
        block_r = max(16, rank) if segmented else min(4, rank)
        build(lora_shrink_kernel, pointers, dict(
            RANK=rank, BLOCK_M=16, BLOCK_R=block_r,
            BLOCK_K=128 if segmented else 256, SPLIT=SPLIT_K, SEGMENTED=segmented), ())
        pointers = indices | {"b_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "buf_ptr": "*fp32"}
        build(lora_expand_kernel, pointers, dict(
            RANK=rank, BLOCK_M=16, BLOCK_N=64 if segmented else 128,
            BLOCK_R=max(16, rank), SPLIT=SPLIT_K, SEGMENTED=segmented), ())


def main() -> None:
    bf16 = {name: "*bf16" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")}
    for pdl, preload, (block_m, use_dot, gated), even_k in itertools.product(
            (False, True), (1, 2), ((1, False, False), (1, False, True), (4, False, False),
                                    (16, True, False)), (True, False)):
        build(skinny_matmul_kernel, bf16, dict(
            BLOCK_M=block_m, BLOCK_N=16 if use_dot else 4, BLOCK_K=256 if use_dot else 1024,
            EVEN_K=even_k, HAS_BIAS=True, USE_DOT=use_dot, NUM_STAGES=3, GATED=gated,
            PDL=pdl, PRELOAD=preload), (), num_warps=2, num_stages=3)
    norm_pointers = {name: "*bf16" for name in
                     ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "summed_ptr")}
    for pdl, residual in itertools.product((False, True), (False, True)):
        build(rms_norm_kernel, norm_pointers,
              dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=residual, PDL=pdl), ("eps",),
              num_warps=8)
    attention_pointers = {name: "*bf16" for name in (
        "q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "new_k_ptr", "new_v_ptr")}
    attention_pointers.update({name: "*fp32" for name in (
        "part_out_ptr", "part_max_ptr", "part_sum_ptr", "cos_sin_ptr")})
    attention_pointers.update({name: "*i32" for name in (
        "semaphore_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr")})
    attention_pointers["slot_mapping_ptr"] = "*i64"
    attention_pointers |= {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for pdl, fuse_rope, window in itertools.product((False, True), (False, True), (False, True)):
        build(decode_attention_kernel, attention_pointers, dict(
            BLOCK_SIZE=16, GROUP=4, ROWS=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=64,
            USE_WINDOW=window, NUM_SPLITS_IS_ONE=False, SPLITS_PAD=16, MERGE_HEADS=4,
            MIN_SPLIT=64, DOT_PRECISION="ieee", FUSE_ROPE=fuse_rope, HALF=64, PDL=pdl,
            KV_QUANT=0), ("scale_log2",), num_warps=4, num_stages=2)
    kv_pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "k_cache_ptr",
                                               "v_cache_ptr")}
    kv_pointers |= {"slot_mapping_ptr": "*i64", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
                    "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for rotary_dim in (128, 64):  # full and partial rotary
        build(rope_store_kv_kernel, kv_pointers, dict(
            BLOCK_SIZE=16, GROUP=4, GROUP_PAD=4, HALF=rotary_dim // 2, HALF_PAD=rotary_dim // 2,
            HEAD_DIM=128, HEAD_DIM_PAD=128, TAIL_PAD=max(128 - rotary_dim, 1), KV_QUANT=0), ())
    build(store_kv_kernel, kv_pointers, dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
                                             KV_QUANT=0), ())
    build_kv_cache_dtypes()
    for dtype, (block, one_pass), (out, qmax, quant) in itertools.product(
            ("*bf16", "*fp16", "*fp32"), ((4096, True), (4096, False)),
            (("*fp8e4nv", 448.0, 1), ("*i8", 127.0, 2))):  # FP8, INT8 W8A8
        build(per_token_quant_kernel, {"x_ptr": dtype, "out_ptr": out, "scale_ptr": "*fp32"},
              dict(QMAX=qmax, QUANT=quant, BLOCK=block, ONE_PASS=one_pass), (), num_warps=8)
    for out, has_bias in itertools.product(("*bf16", "*fp16"), (True, False)):  # INT8 epilogue
        build(scale_int32_kernel, {"acc_ptr": "*i32", "x_scale_ptr": "*fp32",
                                   "w_scale_ptr": "*fp32", "bias_ptr": out, "out_ptr": out},
              dict(HAS_BIAS=has_bias, BLOCK_M=32, BLOCK_N=128), (), num_warps=4)
    build_quant_matmul()
    build_lora()
    print("compiled for sm_90")


if __name__ == "__main__":
    main()
