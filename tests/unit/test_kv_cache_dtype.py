"""``kv_cache_dtype`` (``--kv-cache-dtype``) through the whole engine on CPU
with tiny random checkpoints: for fp8_e4m3 and int8, greedy tokens identical
with batching, chunked prefill, a warm prefix cache and forced preemption
on and off, the Triton kernels (interpreter) against the torch reference
backend, and close to the 16-bit cache; the pool's bytes and the start-up
log; a checkpoint's KV-cache scales in each spelling, and a clear
ValueError naming the tensor when one is missing or corrupt."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.args import EngineArgs
from kvserve.models.source import resolve_model_config
from kvserve.worker.kv_cache import KVCacheSpec, determine_num_blocks
from kvserve.worker.kv_cache import kv_cache_dtype as kv_cache_dtype_of
from kvserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5],
    [11, 12],
    list(range(20, 57)),
]
KV_DTYPES = ["fp8_e4m3", "int8"]


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
              ) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def runner(llm: LLM) -> ModelRunner:
    executor = llm.engine.core.executor
    assert isinstance(executor, ModelRunner)
    return executor


def test_config_names_and_errors() -> None:
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert CacheConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp16' is invalid: must be one of "
                                         r"auto, fp8_e4m3, int8, fp8"):
        CacheConfig(kv_cache_dtype="fp16")
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"


def test_pool_bytes_count_the_int8_scales() -> None:
    config, _ = resolve_model_config("llama-3-8b")
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim)
    bf16 = spec.bytes_per_block(16, torch.bfloat16)
    assert spec.bytes_per_block(16, torch.float8_e4m3fn) * 2 == bf16
    # a float32 scale per token and KV head beside 128 int8 values: 2 * 128 / 132
    assert bf16 / spec.bytes_per_block(16, torch.int8) == pytest.approx(256 / 132)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_pool_holds_about_twice_the_tokens(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama")))
    scheduler = SchedulerConfig(max_num_seqs=4096, max_model_len=128)
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim)
    blocks = {
        name: determine_num_blocks(
            spec, CacheConfig(kv_cache_dtype=name, cpu_kv_cache_bytes=1 << 22), scheduler,
            torch.device("cpu"), kv_cache_dtype_of(CacheConfig(kv_cache_dtype=name),
                                                   torch.float16))
        for name in ("auto", kv_cache_dtype)
    }
    head_dim = 16  # the tiny llama's: an int8 scale costs 4 of 16 + 4 bytes
    expected = 2.0 if kv_cache_dtype == "fp8_e4m3" else 2 * head_dim / (head_dim + 4)
    assert blocks[kv_cache_dtype] / blocks["auto"] == pytest.approx(expected, rel=1e-3)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float16",
                  kv_cache_dtype=kv_cache_dtype, max_model_len=128, max_num_seqs=4)
    cache = runner(llm).kv_caches[0]
    assert cache.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    assert f"in {kv_cache_dtype}" in caplog.text
    assert f"{expected:.2f}x the tokens of float16 in the same memory" in caplog.text


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoint: Callable[[str], Path]) -> dict[str, list[list[int]]]:
    """Each KV dtype's greedy tokens, every prompt alone, one step per prompt."""
    tokens = {}
    for kv_cache_dtype in ["auto", *KV_DTYPES]:
        llm = LLM(model=str(tiny_checkpoint("llama")), kv_cache_dtype=kv_cache_dtype,
                  enable_chunked_prefill=False, enable_prefix_caching=False,
                  max_num_batched_tokens=512)
        tokens[kv_cache_dtype] = [token_ids(llm, [prompt])[0] for prompt in PROMPTS]
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_batch_chunks_prefix_cache_and_preemption_change_nothing(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path],
    reference_tokens: dict[str, list[list[int]]],
) -> None:
    path = str(tiny_checkpoint("llama"))
    expected = reference_tokens[kv_cache_dtype]
    llm = LLM(model=path, kv_cache_dtype=kv_cache_dtype, block_size=4, max_num_batched_tokens=16)
    assert token_ids(llm, PROMPTS * 3) == expected * 3  # batched, chunked, cold
    hits = llm.stats()["prefix_cache_hits"]
    assert token_ids(llm, PROMPTS) == expected  # warm: the prompts' blocks and scales reused
    assert llm.stats()["prefix_cache_hits"] > hits
    tight = LLM(model=path, kv_cache_dtype=kv_cache_dtype, block_size=4, num_kv_blocks=20)
    assert token_ids(tight, PROMPTS) == expected
    assert tight.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_speculative_decoding_verifies_on_the_quantised_cache(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path],
    reference_tokens: dict[str, list[list[int]]],
) -> None:
    """The verify step (1 + k tokens a request) reads and writes the same
    quantised cache: greedy tokens equal decoding without speculation."""
    llm = LLM(model=str(tiny_checkpoint("llama")), kv_cache_dtype=kv_cache_dtype, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "auto_disable": False})
    assert token_ids(llm, PROMPTS) == reference_tokens[kv_cache_dtype]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_quantised_caches_stay_close_to_the_16_bit_one(
    reference_tokens: dict[str, list[list[int]]],
) -> None:
    """Greedy decoding of a random model drifts apart once two candidates are
    near-tied; the first tokens of every prompt agree."""
    for kv_cache_dtype in KV_DTYPES:
        for quantised, exact in zip(reference_tokens[kv_cache_dtype], reference_tokens["auto"]):
            assert quantised[:4] == exact[:4], kv_cache_dtype


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_triton_backend_matches_torch_backend(
    kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Mistral (GQA, a window of 8), prompts chunked and mixed with decodes."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter switch is process-wide: tests/gpu covers CUDA")
    path = str(tiny_checkpoint("mistral"))
    prompts = [list(range(20, 45)), [5, 17, 99, 3, 250, 7, 42], [11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {
        backend: token_ids(LLM(model=path, device="cpu", block_size=4,
                               attention_backend=backend, max_num_batched_tokens=16,
                               kv_cache_dtype=kv_cache_dtype), prompts, params)
        for backend in ("torch", "triton")
    }
    assert tokens["triton"] == tokens["torch"]


# ---------------------------------------------------------------- checkpoint scales


def with_tensors(source: Path, target: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint at ``source`` with ``extra`` tensors added."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, **extra}, str(target / "model.safetensors"))
    return target


def scales_of(num_layers: int, k: Callable[[int], torch.Tensor],
              v: Callable[[int], torch.Tensor], k_name: str = "k_scale",
              v_name: str = "v_scale") -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(num_layers):
        tensors[f"model.layers.{layer}.self_attn.{k_name}"] = k(layer)
        tensors[f"model.layers.{layer}.self_attn.{v_name}"] = v(layer)
    return tensors


def test_checkpoint_scales_are_bound_to_an_fp8_cache(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Per tensor (compressed-tensors' names), per head (older output_scale
    names), one for K and V (``kv_scale``); q/prob scales dropped; 1.0
    without any; unused, saying so, by an int8 cache."""
    base = tiny_checkpoint("llama")  # 2 layers, 2 KV heads
    per_tensor = with_tensors(base, tmp_path / "per-tensor", {
        **scales_of(2, lambda i: torch.tensor(0.5 + i), lambda i: torch.tensor([0.25])),
        "model.layers.0.self_attn.q_scale": torch.tensor(3.0),
        "model.layers.1.self_attn.prob_scale": torch.tensor(3.0),
    })
    per_head = with_tensors(base, tmp_path / "per-head", scales_of(
        2, lambda i: torch.tensor([0.5, 0.75]), lambda i: torch.tensor([2.0, 1.5]),
        "k_proj.output_scale", "v_proj.output_scale"))
    one = with_tensors(base, tmp_path / "one", {
        f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.125, dtype=torch.bfloat16)
        for i in range(2)})
    expected = {
        per_tensor: [torch.tensor([[0.5, 0.5], [0.25, 0.25]]),
                     torch.tensor([[1.5, 1.5], [0.25, 0.25]])],
        per_head: [torch.tensor([[0.5, 0.75], [2.0, 1.5]])] * 2,
        one: [torch.full((2, 2), 0.125)] * 2,
    }
    for path, scales in expected.items():
        llm = LLM(model=str(path), kv_cache_dtype="fp8")
        bound = runner(llm).kv_scales
        assert bound is not None and all(map(torch.equal, bound, scales)), path.name
        assert len(token_ids(llm, PROMPTS[:1])[0]) == GREEDY.max_tokens
    default = runner(LLM(model=str(base), kv_cache_dtype="fp8")).kv_scales
    assert default is not None and all(torch.equal(s, torch.ones(2, 2)) for s in default)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        unused = LLM(model=str(per_tensor), kv_cache_dtype="int8")
    assert runner(unused).kv_scales is not None  # int8's own, per token
    assert "the checkpoint's k/v scales are unused" in caplog.text


@pytest.mark.parametrize("extra,message", [
    (scales_of(1, lambda i: torch.tensor(0.5), lambda i: torch.tensor(0.5)),
     r"checkpoint lacks 'model\.layers\.1\.self_attn\.k_scale' \(or another spelling of it\)"),
    ({**scales_of(2, lambda i: torch.tensor(0.5), lambda i: torch.tensor(0.5)),
      "model.layers.1.self_attn.kv_scale": torch.tensor(1.0)},
     r"'model\.layers\.1\.self_attn\.kv_scale': layer 1's K scale is also given by"),
    (scales_of(2, lambda i: torch.tensor(0.5), lambda i: torch.tensor(float("nan") if i else 1.0)),
     r"'model\.layers\.1\.self_attn\.v_scale': KV-cache scale \[nan, nan\]; every scale "
         r"must be finite and > 0"),
    (scales_of(2, lambda i: torch.tensor(-0.5), lambda i: torch.tensor(0.5)),
     r"'model\.layers\.0\.self_attn\.k_scale': KV-cache scale \[-0\.5, -0\.5\]"),
    (scales_of(2, lambda i: torch.ones(3), lambda i: torch.tensor(0.5)),
     r"'model\.layers\.0\.self_attn\.k_scale': a KV-cache scale of shape \(3,\)"),
    ({"model.layers.7.self_attn.v_scale": torch.tensor(0.5)},
     r"'model\.layers\.7\.self_attn\.v_scale': layer 7 does not exist \(the model has 2\)"),
], ids=["missing-layer", "twice", "nan", "negative", "shape", "no-such-layer"])
def test_bad_checkpoint_scales_name_the_tensor(
    extra: dict[str, torch.Tensor], message: str, tiny_checkpoint: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    path = with_tensors(tiny_checkpoint("llama"), tmp_path / "bad", extra)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), kv_cache_dtype="fp8")
