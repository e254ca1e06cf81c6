"""scripts/train_default_model.py end to end on its --tiny config (CPU, a few steps).

One subprocess run writes the three directories; the tests check that transformers loads
the target and draft with the shared tokenizer and chat template, that the LoRA adapter is
in PEFT's layout, and that the JSON logs and model card say what the issue asks for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_default_model.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default_model")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return out


def model_dirs(out: Path) -> dict[str, Path]:
    metrics = json.loads((out / "metrics.json").read_text())
    return {key: out / name for key, name in metrics["names"].items()}


def test_writes_the_three_directories_and_logs(run_dir: Path) -> None:
    dirs = model_dirs(run_dir)
    assert dirs["target"].name.startswith("kvserve-code-")
    assert dirs["draft"].name.startswith("kvserve-code-draft-")
    assert dirs["lora"].name == "kvserve-code-lora-tests"
    for key in ("target", "draft"):
        for name in (
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "README.md",
        ):
            assert (dirs[key] / name).is_file(), f"{key}: {name} missing"
    for name in ("corpus.json", "metrics.json", "train_log.json"):
        assert (run_dir / name).is_file()
    corpus = json.loads((run_dir / "corpus.json").read_text())
    assert corpus["python_version"]
    for split in ("train", "val", "heldout", "lora_train", "lora_heldout"):
        assert corpus["splits"][split]["num_files"] > 0
        assert corpus["splits"][split]["num_tokens"] > 0
    train = set(corpus["splits"]["train"]["files"])
    assert not train & set(corpus["splits"]["heldout"]["files"])
    assert not any("test" in f.split("/")[0] for f in train)


def test_models_load_in_transformers_and_generate(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    dirs = model_dirs(run_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(dirs["target"]))
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|eos|>"
    assert tokenizer.pad_token == "<|pad|>"
    ids = tokenizer("def f(x):\n    return x\n").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat == "<|bos|><|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"
    for key in ("target", "draft"):
        config = json.loads((dirs[key] / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
        with safe_open(str(dirs[key] / "model.safetensors"), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # noqa: SIM118
        model = AutoModelForCausalLM.from_pretrained(str(dirs[key]), dtype=torch.float32)
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, len(ids) + 4)
        assert (dirs[key] / "tokenizer.json").read_text() == (
            dirs["target"] / "tokenizer.json"
        ).read_text()


def test_lora_adapter_is_in_peft_layout(run_dir: Path) -> None:
    dirs = model_dirs(run_dir)
    config = json.loads((dirs["lora"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["bias"] == "none" and config["fan_in_fan_out"] is False
    assert config["base_model_name_or_path"] == dirs["target"].name
    base = json.loads((dirs["target"] / "config.json").read_text())
    hidden, head_dim = base["hidden_size"], base["head_dim"]
    out_features = {
        "q_proj": base["num_attention_heads"] * head_dim,
        "k_proj": base["num_key_value_heads"] * head_dim,
        "v_proj": base["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    with safe_open(str(dirs["lora"] / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        expected = {
            f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
            for i in range(base["num_hidden_layers"])
            for m in config["target_modules"]
            for ab in "AB"
        }
        assert keys == expected
        prefix = "base_model.model.model.layers.0.self_attn"
        for m, out_dim in out_features.items():
            assert tuple(f.get_tensor(f"{prefix}.{m}.lora_A.weight").shape) == (8, hidden)
            assert tuple(f.get_tensor(f"{prefix}.{m}.lora_B.weight").shape) == (out_dim, 8)
    assert (dirs["lora"] / "tokenizer.json").is_file()


def test_metrics_and_model_card(run_dir: Path) -> None:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["errors"] == {}
    for key in ("target", "draft"):
        assert metrics[key]["heldout_loss"] > 0 and metrics[key]["num_params"] > 0
        assert metrics[key]["steps"] > 0
    assert metrics["lora"]["heldout_loss_base"] > 0 and metrics["lora"]["heldout_loss_lora"] > 0
    assert 0.0 <= metrics["signature_validity"]["valid_share"] <= 1.0
    assert metrics["signature_validity"]["num_prompts"] > 0
    assert 0.0 <= metrics["acceptance"]["alpha"] <= 1.0
    assert len(metrics["samples"]) == 3
    card = (model_dirs(run_dir)["target"] / "README.md").read_text()
    for needle in ("## Corpus", "perplexity", "acceptance", "def fibonacci(n):", "class Stack:"):
        assert needle in card
