"""The model family shipped in the wheel: target and draft load in kvserve and
in transformers with equal logits and equal greedy tokens, the LoRA adapter
matches its base model's modules, and ``kvserve generate`` with no
``--model`` completes code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvserve import LLM, SamplingParams
from kvserve.assets import DEFAULT_MODEL, DRAFT_MODEL, LORA_ADAPTER, bundled_model_path
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.layers.attention import bind_kv_cache
from kvserve.models.loader import load_model
from kvserve.models.source import resolve_model_config
from tests.conftest import make_attention_metadata

PROMPT = "import os\n\ndef list_files(path):\n"


def hf_model(path: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.mark.parametrize("name", [DEFAULT_MODEL, DRAFT_MODEL])
def test_logits_match_transformers(name: str) -> None:
    path = bundled_model_path(name)
    config, _ = resolve_model_config(str(path))
    ours = load_model(config, path, "auto", torch.float32, "cpu")
    block_size, num_blocks = 16, 8
    caches = [torch.zeros(2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
              for _ in range(config.num_layers)]
    bind_kv_cache(ours, caches, TorchRefAttentionBackend())
    from kvserve.engine.tokenizer import load_tokenizer

    token_ids = load_tokenizer(path).encode(PROMPT)
    n = len(token_ids)
    metadata, positions = make_attention_metadata([n], [n], [list(range(1, num_blocks))],
                                                  block_size)
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.tensor(token_ids), positions, metadata))
        expected = hf_model(path)(torch.tensor([token_ids])).logits[0]
    error = (logits - expected).norm() / expected.norm()
    assert error < 1e-4


@pytest.mark.parametrize("name", [DEFAULT_MODEL, DRAFT_MODEL])
def test_greedy_32_tokens_match_transformers(name: str) -> None:
    path = bundled_model_path(name)
    llm = LLM(model=str(path))
    # no repetition penalty on either side: generation_config.json's default (1.3) is not
    # what this compares
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                            repetition_penalty=1.0)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    prompt_ids = out.prompt_token_ids
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                            repetition_penalty=1.0,
                            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    assert out.outputs[0].token_ids == hf[0, len(prompt_ids):].tolist()


def test_lora_adapter_fits_the_default_model() -> None:
    adapter = bundled_model_path(DEFAULT_MODEL).parent / LORA_ADAPTER
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == DEFAULT_MODEL
    base, _ = resolve_model_config(str(bundled_model_path(DEFAULT_MODEL)))
    out_features = {"q_proj": base.num_heads * base.head_dim,
                    "k_proj": base.num_kv_heads * base.head_dim,
                    "v_proj": base.num_kv_heads * base.head_dim,
                    "o_proj": base.hidden_size}
    in_features = {**dict.fromkeys(("q_proj", "k_proj", "v_proj"), base.hidden_size),
                   "o_proj": base.num_heads * base.head_dim}
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in range(base.num_layers):
            for module in config["target_modules"]:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                lora_a = f.get_tensor(f"{prefix}.lora_A.weight")
                lora_b = f.get_tensor(f"{prefix}.lora_B.weight")
                assert lora_a.shape == (config["r"], in_features[module])
                assert lora_b.shape == (out_features[module], config["r"])
                names -= {f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"}
    assert not names, f"unexpected adapter tensors: {sorted(names)[:4]}"


def test_generate_without_model_completes_requested_length() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "def fibonacci(n):",
         "--max-tokens", "24", "--ignore-eos"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("def fibonacci(n):")
    assert "24 tokens" in proc.stderr
    assert DEFAULT_MODEL in proc.stderr


def test_chat_cli_answers_through_the_chat_template() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "chat", "--max-tokens", "8", "--ignore-eos"],
        input="write a function\n/exit\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("assistant> ") == 1
    reply = proc.stdout.split("assistant> ", 1)[1].split("you> ", 1)[0]
    assert reply.strip()
