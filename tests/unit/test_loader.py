"""Loader: presets with dummy weights, checkpoint errors that name the file or
field, the dtype rules, and the weight-name checks of ``load_weights``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.attention.backend import get_attention_backend
from kvserve.config import ModelConfig
from kvserve.layers.attention import bind_kv_cache
from kvserve.models.loader import load_model, resolve_dtype
from kvserve.models.presets import PRESETS
from kvserve.models.registry import CausalLM
from kvserve.models.source import resolve_model_config
from tests.conftest import make_attention_metadata

CPU = torch.device("cpu")


def shrink(config: ModelConfig) -> ModelConfig:
    """The preset's architecture at toy size (keeps rope type, bias, windows, tying)."""
    windows = tuple(None if w is None else 8 for w in config.sliding_windows[:2])
    return dataclasses.replace(
        config, vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2 if config.num_kv_heads < config.num_heads else 4,
        head_dim=16 if config.qk_norm else 8, max_position_embeddings=64,
        sliding_windows=windows,
    )


def run_prefill(model: CausalLM, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    caches = [torch.zeros(2, 8, 4, config.num_kv_heads, config.head_dim, dtype=dtype)
              for _ in range(config.num_layers)]
    bind_kv_cache(model, caches, get_attention_backend("torch"))
    metadata, positions = make_attention_metadata([10], [10], [[5, 2, 7]], block_size=4)
    with torch.inference_mode():
        hidden = model(torch.arange(3, 13), positions, metadata)
        return model.compute_logits(hidden)


def copy_checkpoint(tiny_checkpoint: Callable[[str], Path], variant: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(variant), tmp_path / variant))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_with_dummy_weights(name: str) -> None:
    config, path = resolve_model_config(name)
    assert path is None
    small = shrink(config)
    model = load_model(small, None, "dummy", torch.float32, CPU, seed=0)
    assert type(model).__name__ == config.architecture
    logits = run_prefill(model, small, torch.float32)
    assert logits.shape == (10, small.vocab_size)
    assert torch.isfinite(logits).all()


def test_llama3_8b_preset_config() -> None:
    config, _ = resolve_model_config("llama-3-8b")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        32, 32, 8, 128)
    assert config.dtype == "bfloat16"


def test_dummy_weights_are_seeded_and_norms_one() -> None:
    small = shrink(resolve_model_config("qwen3-8b")[0])
    a = load_model(small, None, "dummy", torch.float32, CPU, seed=3)
    b = load_model(small, None, "dummy", torch.float32, CPU, seed=3)
    c = load_model(small, None, "dummy", torch.float32, CPU, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.01 < float(pa.std()) < 0.04, name


def test_dummy_bfloat16_build_restores_default_dtype() -> None:
    small = shrink(resolve_model_config("llama-3.1-8b")[0])
    model = load_model(small, None, "dummy", torch.bfloat16, CPU)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = run_prefill(model, small, torch.bfloat16)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_auto_load_casts_sharded_checkpoint(tiny_checkpoint: Callable[[str], Path]) -> None:
    config, path = resolve_model_config(str(tiny_checkpoint("llama_sharded")))
    assert path is not None and config.architecture == "LlamaForCausalLM"
    model = load_model(config, path, "auto", torch.bfloat16, CPU)
    expected = load_file(next(path.glob("*.safetensors")))
    name, tensor = next(iter(expected.items()))
    assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16))


def test_auto_format_without_path_says_use_dummy() -> None:
    config, path = resolve_model_config("llama-3-8b")
    with pytest.raises(ValueError, match="dummy"):
        load_model(config, path, "auto", torch.float32, CPU)
    with pytest.raises(ValueError, match="load_format='pt'"):
        load_model(config, path, "pt", torch.float32, CPU)


def test_missing_directory_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=str(missing)):
        resolve_model_config(str(missing))


def test_missing_config_names_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_config(str(tmp_path))


def test_unparsable_config_names_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        resolve_model_config(str(tmp_path))


def test_unsupported_architecture_names_it(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    hf_config = json.loads((path / "config.json").read_text())
    hf_config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        resolve_model_config(str(path))


def test_missing_shard_names_file(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama_sharded", tmp_path)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    config, _ = resolve_model_config(str(path))
    with pytest.raises(ValueError, match=shards[1].name):
        load_model(config, path, "auto", torch.float32, CPU)


def test_no_weights_names_directory(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    (path / "model.safetensors").unlink()
    config, _ = resolve_model_config(str(path))
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(config, path, "auto", torch.float32, CPU)


def test_corrupt_safetensors_names_file(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    config, _ = resolve_model_config(str(path))
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(config, path, "auto", torch.float32, CPU)


def _rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
         "model.layers.0.self_attn.extra.weight"),
        (lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"),
         "model.layers.1.self_attn.v_proj.weight"),
        (lambda t: t.pop("model.norm.weight"), "model.norm.weight"),
        (lambda t: t.pop("lm_head.weight"), "lm_head.weight"),
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}),
         r"model.layers.0.mlp.up_proj.weight.*\(3, 64\)"),
        (lambda t: t.update({"model.rotary_emb.inv_freq": torch.zeros(8)}), None),
    ],
    ids=["unexpected", "missing_packed", "missing_norm", "missing_head", "bad_shape", "ignored"],
)
def test_weight_name_checks(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
    edit: Callable[[dict[str, torch.Tensor]], None], message: str | None,
) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    _rewrite_weights(path, edit)
    config, _ = resolve_model_config(str(path))
    if message is None:
        load_model(config, path, "auto", torch.float32, CPU)
        return
    with pytest.raises(ValueError, match=message):
        load_model(config, path, "auto", torch.float32, CPU)


def test_tied_checkpoint_tolerates_lm_head(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = copy_checkpoint(tiny_checkpoint, "llama_tied", tmp_path)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    _rewrite_weights(
        path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    config, _ = resolve_model_config(str(path))
    load_model(config, path, "auto", torch.float32, CPU)


def test_resolve_dtype_rules() -> None:
    config, _ = resolve_model_config("llama-3-8b")  # checkpoint dtype bfloat16
    assert resolve_dtype("auto", config, CPU) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", resolve_model_config("llama-2-7b")[0], "cuda") == torch.float16
    float32_checkpoint = dataclasses.replace(config, dtype="float32")
    assert resolve_dtype("auto", float32_checkpoint, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", float32_checkpoint, CPU) == torch.float32
    for name, dtype in [("float32", torch.float32), ("fp32", torch.float32),
                        ("float16", torch.float16), ("fp16", torch.float16),
                        ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16)]:
        assert resolve_dtype(name, config, CPU) == dtype
    with pytest.raises(ValueError, match=r"dtype='int8'.*bfloat16"):
        resolve_dtype("int8", config, CPU)
