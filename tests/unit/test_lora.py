"""LoRA serving on CPU. The oracle is the base model with the adapter merged
into its weights (``W + alpha / r * B @ A``), run in transformers and in
kvserve: the unmerged adapter must give the same float32 logits and the
same 32 greedy tokens, for the bundled adapter (q/k/v/o) and for random
adapters on every supported projection. Then: mixed batches (two adapters
and none) equal their solo runs, the prefix cache keeps adapters apart,
``max_loras=1`` makes the second adapter wait, bad adapters fail naming the
field, and the server lists adapters and selects one by ``model``."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.assets import DEFAULT_MODEL, LORA_ADAPTER, MODELS_DIR, bundled_model_path
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.cli import main as cli_main
from kvserve.config import LoRAConfig
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import ThreadedEngineClient
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.tokenizer import load_tokenizer
from kvserve.layers.attention import bind_kv_cache
from kvserve.lora import LoRARequest
from kvserve.lora.manager import LoRAManager
from kvserve.models.loader import load_model
from kvserve.models.source import resolve_model_config
from kvserve.server.api import build_app
from kvserve.server.state import ServerConfig, ServerState
from tests.conftest import lora_tensor_name, make_attention_metadata, make_lora_adapter, merge_lora

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
RTOL = 1e-4
BLOCK_SIZE = 4
BUNDLED_ADAPTER = MODELS_DIR / LORA_ADAPTER
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5],
    [11, 12],
    list(range(20, 45)),
]


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


def kvserve_logits(
    path: Path, batch: list[tuple[list[int], LoRARequest | None]],
) -> list[torch.Tensor]:
    """Float32 logits of one flattened prefill of several prompts, each with its
    adapter (or none), through ``LoRAManager`` and the paged reference attention."""
    config, _ = resolve_model_config(str(path))
    model = load_model(config, path, "auto", torch.float32, "cpu")
    loras = {lora.lora_int_id: lora for _, lora in batch if lora is not None}
    lens = [len(prompt) for prompt, _ in batch]
    if loras:
        manager = LoRAManager(model, LoRAConfig(max_loras=len(loras)), torch.device("cpu"))
        for lora in loras.values():
            manager.add_lora(lora)
        manager.set_batch([lora.lora_int_id if lora else 0 for _, lora in batch], lens)
    tables, next_block = [], 1
    for length in lens:
        num_blocks = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    caches = [torch.zeros(2, next_block, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
              for _ in range(config.num_layers)]
    bind_kv_cache(model, caches, TorchRefAttentionBackend())
    metadata, positions = make_attention_metadata(lens, lens, tables, BLOCK_SIZE)
    token_ids = torch.tensor([t for prompt, _ in batch for t in prompt])
    with torch.inference_mode():
        logits = model.compute_logits(model(token_ids, positions, metadata))
    return list(logits.split(lens))


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([prompt])).logits[0]


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int = 32) -> list[int]:
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            repetition_penalty=1.0,  # not generation_config.json's default: GREEDY_32 has none
        )
    return out[0, len(prompt):].tolist()


def token_ids(llm: LLM, prompts: list[list[int]], lora: Any = None,
              params: SamplingParams = GREEDY_32) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outputs]


def check_equals_merged(base: Path, lora: LoRARequest, merged: Path, prompt: list[int]) -> None:
    """Logits and 32 greedy tokens with the adapter unmerged = the merged checkpoint's."""
    expected = hf_logits(merged, prompt)
    [with_lora, without] = kvserve_logits(base, [(prompt, lora), (prompt, None)])
    [merged_ours] = kvserve_logits(merged, [(prompt, None)])
    assert rel_err(with_lora, expected) < RTOL
    assert rel_err(merged_ours, expected) < RTOL
    assert rel_err(without, expected) > 100 * RTOL  # the adapter does change the logits

    llm = LLM(model=str(base), enable_lora=True, num_kv_blocks=64, block_size=BLOCK_SIZE)
    [ours] = token_ids(llm, [prompt], lora)
    assert ours == hf_greedy(merged, prompt)
    assert [ours] == token_ids(LLM(model=str(merged), num_kv_blocks=64), [prompt])
    assert [ours] != token_ids(llm, [prompt])  # the base model's own continuation differs


# ------------------------------------------------------------ oracles


def test_bundled_adapter_equals_merged_weights(tmp_path: Path) -> None:
    base = bundled_model_path(DEFAULT_MODEL)
    merged = merge_lora(base, BUNDLED_ADAPTER, tmp_path / "merged")
    prompt = load_tokenizer(base).encode("import os\n\ndef list_files(path):\n")
    check_equals_merged(base, LoRARequest("code-tests", 1, str(BUNDLED_ADAPTER)), merged, prompt)


@dataclass
class Tiny:
    """A tiny random Llama, two random adapters and the checkpoints with each merged."""

    base: Path
    lora_a: LoRARequest  # every supported projection, r=8
    lora_b: LoRARequest  # q and v only, r=4
    merged_a: Path
    merged_b: Path


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora")
    path_a = make_lora_adapter(base, root / "a", rank=8, alpha=16.0, seed=1)
    path_b = make_lora_adapter(base, root / "b", rank=4, alpha=8.0, seed=2, std=0.2,
                               target_modules=["q_proj", "v_proj"])
    return Tiny(base, LoRARequest("a", 1, str(path_a)), LoRARequest("b", 2, str(path_b)),
                merge_lora(base, path_a, root / "merged-a"),
                merge_lora(base, path_b, root / "merged-b"))


def test_random_adapters_on_every_projection_equal_merged_weights(tiny: Tiny) -> None:
    check_equals_merged(tiny.base, tiny.lora_a, tiny.merged_a, PROMPTS[1])
    check_equals_merged(tiny.base, tiny.lora_b, tiny.merged_b, PROMPTS[3])


@pytest.mark.parametrize("variant", ["llama_tied", "mistral", "qwen2", "qwen3"])
def test_other_architectures_equal_merged_weights(
    variant: str, tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
) -> None:
    base = tiny_checkpoint(variant)
    adapter = make_lora_adapter(base, tmp_path / "adapter", seed=4)
    merged = merge_lora(base, adapter, tmp_path / "merged")
    lora = LoRARequest("x", 1, str(adapter))
    [with_lora, without] = kvserve_logits(base, [(PROMPTS[1], lora), (PROMPTS[1], None)])
    expected = hf_logits(merged, PROMPTS[1])
    assert rel_err(with_lora, expected) < RTOL
    assert rel_err(without, hf_logits(base, PROMPTS[1])) < RTOL
    assert rel_err(without, expected) > 100 * RTOL


def test_mixed_batch_logits_equal_merged_weights(tiny: Tiny) -> None:
    batch = [(PROMPTS[0], tiny.lora_a), (PROMPTS[1], None), (PROMPTS[2], tiny.lora_b),
             (PROMPTS[3], tiny.lora_a)]
    references = [tiny.merged_a, tiny.base, tiny.merged_b, tiny.merged_a]
    for (prompt, _), logits, reference in zip(batch, kvserve_logits(tiny.base, batch),
                                              references, strict=True):
        assert rel_err(logits, hf_logits(reference, prompt)) < RTOL


# ------------------------------------------------------------ engine behaviour


def test_mixed_batch_tokens_equal_solo_runs(tiny: Tiny) -> None:
    llm = LLM(model=str(tiny.base), enable_lora=True, block_size=BLOCK_SIZE, num_kv_blocks=256,
              max_num_batched_tokens=24)
    jobs = [(prompt, lora) for prompt in PROMPTS for lora in (tiny.lora_a, None, tiny.lora_b)]
    solo = [token_ids(llm, [prompt], lora)[0] for prompt, lora in jobs]
    assert len({tuple(tokens) for tokens in solo}) == len(solo)  # every adapter matters
    together = token_ids(llm, [p for p, _ in jobs], [lora for _, lora in jobs])
    assert together == solo


def test_prefix_cache_keeps_adapters_apart(tiny: Tiny) -> None:
    prompt = PROMPTS[3]  # 25 tokens: 6 full blocks
    uncached = LLM(model=str(tiny.base), enable_lora=True, block_size=BLOCK_SIZE,
                   num_kv_blocks=64, enable_prefix_caching=False)
    [base_alone] = token_ids(uncached, [prompt])
    [lora_alone] = token_ids(uncached, [prompt], tiny.lora_a)
    llm = LLM(model=str(tiny.base), enable_lora=True, block_size=BLOCK_SIZE, num_kv_blocks=64)
    assert token_ids(llm, [prompt]) == [base_alone]
    hits = llm.stats()["prefix_cache_hits"]
    assert token_ids(llm, [prompt], tiny.lora_a) == [lora_alone]
    assert llm.stats()["prefix_cache_hits"] == hits  # the base model's blocks are not reused
    assert token_ids(llm, [prompt], tiny.lora_a) == [lora_alone]
    assert llm.stats()["prefix_cache_hits"] > hits  # the adapter's own blocks are
    hits = llm.stats()["prefix_cache_hits"]
    assert token_ids(llm, [prompt]) == [base_alone]
    assert llm.stats()["prefix_cache_hits"] > hits


def test_max_loras_1_makes_the_second_adapter_wait(tiny: Tiny) -> None:
    llm = LLM(model=str(tiny.base), enable_lora=True, max_loras=1, block_size=BLOCK_SIZE,
              num_kv_blocks=128)
    jobs = [(PROMPTS[0], tiny.lora_a), (PROMPTS[1], tiny.lora_b), (PROMPTS[2], tiny.lora_a),
            (PROMPTS[3], None)]
    solo = [token_ids(llm, [prompt], lora)[0] for prompt, lora in jobs]
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    request_ids = [engine.add_request(p, GREEDY_32, lora_request=lora) for p, lora in jobs]
    finished: dict[str, list[int]] = {}
    b_waited = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        running = {r.lora_int_id for r in scheduler.running} - {0}
        assert len(running) <= 1
        b_waited |= running == {1} and any(r.lora_int_id == 2 for r in scheduler.waiting)
    assert b_waited
    assert [finished[r] for r in request_ids] == solo


# ------------------------------------------------------------ bad input


def _config(**fields: Any) -> Callable[[Path], None]:
    """An edit replacing fields of ``adapter_config.json``."""
    def edit(path: Path) -> None:
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))

    return edit


def _no_weights(path: Path) -> None:
    (path / "adapter_model.safetensors").unlink()


def _only_a(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "adapter_model.safetensors")
    del tensors[lora_tensor_name(0, "q_proj", "B")]
    save_file(tensors, str(path / "adapter_model.safetensors"))


# (case, make_lora_adapter overrides, edit of the written directory, expected message)
BAD_ADAPTERS: list[tuple[str, dict[str, Any], Callable[[Path], None] | None, str]] = [
    ("rank-too-large", {"rank": 16}, None, r"r=16 exceeds max_lora_rank=8"),
    ("target-embed", {}, _config(target_modules=["q_proj", "embed_tokens"]),
     r"target_modules contains \['embed_tokens'\].*allowed: q_proj"),
    ("target-regex", {}, _config(target_modules=".*proj"), r"target_modules='\.\*proj'"),
    ("dora", {"use_dora": True}, None, r"use_dora=True is not supported"),
    ("rslora", {"use_rslora": True}, None, r"use_rslora=True is not supported"),
    ("bias", {"bias": "all"}, None, r"bias='all' is not supported; allowed: 'none'"),
    ("modules-to-save", {"modules_to_save": ["lm_head"]}, None, r"modules_to_save="),
    ("prefix-tuning", {"peft_type": "PREFIX_TUNING"}, None, r"peft_type='PREFIX_TUNING'"),
    ("no-weights", {}, _no_weights, r"adapter_model.safetensors not found"),
    ("no-config", {}, lambda p: (p / "adapter_config.json").unlink(),
     r"adapter_config.json not found"),
    ("unpaired", {}, _only_a, r"q_proj.lora_A.weight' has no lora_A/lora_B partner"),
]


@pytest.mark.parametrize("case,overrides,edit,message", BAD_ADAPTERS,
                         ids=[case[0] for case in BAD_ADAPTERS])
def test_bad_adapters_fail_naming_the_field(
    tiny: Tiny, tmp_path: Path, case: str, overrides: dict[str, Any],
    edit: Callable[[Path], None] | None, message: str,
) -> None:
    path = make_lora_adapter(tiny.base, tmp_path / case, **overrides)
    if edit is not None:
        edit(path)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny.base), enable_lora=True,
                                                   max_lora_rank=8, num_kv_blocks=16))
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6, 7], GREEDY_32, lora_request=LoRARequest(case, 1, str(path)))
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def lora_llm(tiny: Tiny) -> LLM:
    return LLM(model=str(tiny.base), enable_lora=True, num_kv_blocks=64)


def test_adapters_for_another_model_fail_naming_the_tensor(
    lora_llm: LLM, tiny_checkpoint: Callable[[str], Path], tmp_path: Path,
) -> None:
    # 4 KV heads instead of 2: k_proj and v_proj are wider
    other = make_lora_adapter(tiny_checkpoint("llama_mha"), tmp_path / "mha")
    with pytest.raises(ValueError, match=r"k_proj.lora_B.weight' has shape \(64, 8\); the "
                                         r"base model needs \(32, 8\)"):
        lora_llm.generate([[5, 6]], GREEDY_32, lora_request=LoRARequest("mha", 7, str(other)))
    # a hidden size of 96 instead of 64
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    other = make_lora_adapter(wide, tmp_path / "wide-lora")
    with pytest.raises(ValueError, match=r"down_proj.lora_B.weight' has shape \(96, 8\); the "
                                         r"base model needs \(64, 8\)"):
        lora_llm.generate([[5, 6]], GREEDY_32, lora_request=LoRARequest("wide", 8, str(other)))
    # the bundled adapter is for the 8-layer bundled model
    with pytest.raises(ValueError, match=r"targets layer 2 but the base model has 2 layers"):
        lora_llm.generate([[5, 6]], GREEDY_32,
                          lora_request=LoRARequest("code", 9, str(BUNDLED_ADAPTER)))


def test_bad_lora_requests_queue_nothing(tiny: Tiny, lora_llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lora_path='.*missing' is not a directory"):
        lora_llm.generate([[5, 6]], GREEDY_32,
                          lora_request=LoRARequest("x", 3, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"lora_int_id=0 is invalid"):
        LoRARequest("x", 0, str(tmp_path))
    with pytest.raises(ValueError, match=r"lora_request: 1 given for 2 prompts"):
        lora_llm.generate([[5, 6], [7, 8]], GREEDY_32, lora_request=[tiny.lora_a])
    token_ids(lora_llm, [[5, 6]], tiny.lora_a)
    renamed = LoRARequest("a", tiny.lora_a.lora_int_id, str(tiny.merged_b))
    with pytest.raises(ValueError, match=r"lora_int_id=1 is already used by 'a'"):
        lora_llm.generate([[5, 6], [7, 8]], GREEDY_32, lora_request=[None, renamed])
    assert not lora_llm.engine.has_unfinished_requests()
    assert token_ids(lora_llm, [[5, 6]], tiny.lora_b)  # still serving


def test_lora_request_without_enable_lora_names_the_field(tiny: Tiny) -> None:
    llm = LLM(model=str(tiny.base), num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"lora_request: .*enable_lora=True \(--enable-lora\)"):
        llm.generate([[5, 6]], GREEDY_32, lora_request=tiny.lora_a)
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------ server


@dataclass
class Served:
    state: ServerState
    lora: LoRARequest
    base_text: str
    lora_text: str


PROMPT = [5, 17, 99, 3, 250, 7, 42]
COMPLETION: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
                              "ignore_eos": True}


def _offline_text(engine: LLMEngine, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    request_id = engine.add_request(PROMPT, params, lora_request=lora)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                text = output.outputs[0].text
    return text


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served]:
    base = tiny_checkpoint("llama", with_tokenizer=True)
    adapter = make_lora_adapter(base, tmp_path_factory.mktemp("served") / "adapter", seed=3)
    lora = LoRARequest("tiny-lora", 1, str(adapter))
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(base), enable_lora=True,
                                                   max_num_seqs=4, num_kv_blocks=64))
    engine.add_lora(lora)
    base_text, lora_text = _offline_text(engine, None), _offline_text(engine, lora)
    assert base_text != lora_text
    client = ThreadedEngineClient(engine)
    state = ServerState(ServerConfig(["tiny"], lora_requests=[lora]), client=client)
    yield Served(state, lora, base_text, lora_text)
    client.shutdown()


def call(state: ServerState, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
            return await client.request(method, path, timeout=30, **kwargs)

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_server_lists_adapters_with_their_parent(served: Served) -> None:
    cards = call(served.state, "GET", "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-lora"]
    assert cards[0]["parent"] is None
    assert cards[1]["parent"] == "tiny" and cards[1]["root"] == served.lora.lora_path
    card = call(served.state, "GET", "/v1/models/tiny-lora").json()
    assert card["id"] == "tiny-lora" and card["parent"] == "tiny"


def test_server_selects_the_adapter_by_model_name(served: Served) -> None:
    for model, expected in (("tiny-lora", served.lora_text), ("tiny", served.base_text)):
        result = call(served.state, "POST", "/v1/completions",
                      json={**COMPLETION, "model": model}).json()
        assert result["model"] == model
        assert result["choices"][0]["text"] == expected
    chat = call(served.state, "POST", "/v1/chat/completions", json={
        "model": "tiny-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "tiny-lora"
    unknown = call(served.state, "POST", "/v1/completions", json={**COMPLETION, "model": "x"})
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["param"] == "model" and "tiny-lora" in error["message"]


@pytest.mark.parametrize("flags,message", [
    (["--lora-modules", "a=/nowhere"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "'a' is invalid: write NAME=PATH"),
    (["--enable-lora", "--lora-modules", "tiny=/nowhere"], "the name 'tiny' is already used"),
    (["--enable-lora", "--lora-modules", "a=/nowhere"], "--lora-modules a: lora_path="),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
])
def test_serve_rejects_bad_lora_modules_before_starting(
    tiny: Tiny, capsys: pytest.CaptureFixture[str], flags: list[str], message: str,
) -> None:
    argv = ["serve", "--model", str(tiny.base), "--served-model-name", "tiny", *flags]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
