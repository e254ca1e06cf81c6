"""Tensor- and pipeline-parallel layers and models on CPU, with gloo.

Each case runs on 2 or 4 ranks (``tests/multiprocess.py``). The oracle is
the same layer or model built for one process from the same weights: a
column-parallel linear gives its rows of the whole output, a row-parallel
one (16-bit, INT8 per channel, INT4 in groups) the whole output after its
all-reduce, the vocab-parallel embedding and head the whole lookup and
logits (a vocabulary that does not divide); whole tiny checkpoints split
by TP, PP and both give one process's logits, prefill and decode. Also the
refusals: a TP size that splits a quantisation group, an act-order
permutation that mixes the ranks' input slices.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.attention.backend import get_attention_backend
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import ParallelState, building
from kvserve.distributed.sharding import check_split
from kvserve.layers.attention import bind_kv_cache, get_attention_layers
from kvserve.layers.embedding import LMHead, VocabEmbedding
from kvserve.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear, RowLinear
from kvserve.models.loader import load_model
from kvserve.models.source import resolve_model_config
from kvserve.quant.config import QuantConfig
from kvserve.quant.methods import WeightOnlyLinearMethod
from kvserve.quant.packing import quantize_rtn
from tests.conftest import make_attention_metadata
from tests.multiprocess import run_ranks

BLOCK_SIZE = 4
NUM_BLOCKS = 16
ATOL = 1e-5


def _full_and_shard(make: Callable[[], Any], state: ParallelState) -> tuple[Any, Any]:
    full = make()
    with building(state):
        shard = make()
    return full, shard


def _load_both(full: Any, shard: Any, name: str, tensor: torch.Tensor, shard_id: Any = None
               ) -> None:
    full.weight_loader(getattr(full, name), tensor, shard_id)
    shard.weight_loader(getattr(shard, name), tensor, shard_id)


def _linears(state: ParallelState) -> dict[str, float]:
    """The largest difference from one process's result, per layer kind."""
    torch.manual_seed(0)
    rank, size = state.tp.rank, state.tp.size
    errors = {}
    x = torch.randn(5, 16)

    full, shard = _full_and_shard(lambda: ColumnLinear(16, 8, bias=True), state)
    _load_both(full, shard, "weight", torch.randn(8, 16))
    _load_both(full, shard, "bias", torch.randn(8))
    rows = 8 // size
    errors["column"] = (shard(x) - full(x)[:, rank * rows:(rank + 1) * rows]).abs().max().item()

    full, shard = _full_and_shard(lambda: RowLinear(16, 6, bias=True), state)
    _load_both(full, shard, "weight", torch.randn(6, 16))
    _load_both(full, shard, "bias", torch.randn(6))
    cols = 16 // size
    errors["row"] = (shard(x[:, rank * cols:(rank + 1) * cols]) - full(x)).abs().max().item()

    # 4 query heads, 1 KV head: the KV head is replicated on every rank
    full, shard = _full_and_shard(lambda: QKVLinear(16, 2, 4, 1, bias=True), state)
    parts = {"q": torch.randn(8, 16), "k": torch.randn(2, 16), "v": torch.randn(2, 16)}
    for shard_id, tensor in parts.items():
        _load_both(full, shard, "weight", tensor, shard_id)
        _load_both(full, shard, "bias", torch.randn(tensor.shape[0]), shard_id)
    q, k, v = full(x).split([8, 2, 2], dim=-1)
    heads = 4 // size
    expected = torch.cat([q[:, rank * heads * 2:(rank + 1) * heads * 2], k, v], dim=-1)
    errors["qkv"] = (shard(x) - expected).abs().max().item()

    full, shard = _full_and_shard(lambda: MergedColumnLinear(16, [8, 8]), state)
    _load_both(full, shard, "weight", torch.randn(8, 16), 0)
    _load_both(full, shard, "weight", torch.randn(8, 16), 1)
    gate, up = full(x).split([8, 8], dim=-1)
    rows = 8 // size
    expected = torch.cat([gate[:, rank * rows:(rank + 1) * rows],
                          up[:, rank * rows:(rank + 1) * rows]], dim=-1)
    errors["gate_up"] = (shard(x) - expected).abs().max().item()

    # 37 ids do not divide over the ranks: the last rank's table is padded
    full, shard = _full_and_shard(lambda: VocabEmbedding(37, 16), state)
    _load_both(full, shard, "weight", torch.randn(37, 16))
    ids = torch.tensor([0, 5, 18, 19, 20, 36, 36, 9])
    errors["embedding"] = (shard(ids) - full(ids)).abs().max().item()
    full_head, shard_head = _full_and_shard(lambda: LMHead(37, 16), state)
    _load_both(full_head, shard_head, "weight", torch.randn(37, 16))
    errors["lm_head"] = (shard_head(x) - full_head(x)).abs().max().item()
    return errors


def _quantised_row(state: ParallelState, bits: int, group_size: int) -> float:
    """A row-parallel quantised linear against the whole one, same packed tensors."""
    torch.manual_seed(1)
    config = QuantConfig(bits=bits, group_size=group_size)

    def make() -> RowLinear:
        return RowLinear(128, 12, quant_method=WeightOnlyLinearMethod(config))

    full, shard = _full_and_shard(make, state)
    qw = quantize_rtn(torch.randn(12, 128), bits, group_size)
    for name in ("qweight", "scales"):
        _load_both(full, shard, name, getattr(qw, name))
    x = torch.randn(3, 128)
    cols = 128 // state.tp.size
    local = x[:, state.tp.rank * cols:(state.tp.rank + 1) * cols]
    return (shard(local) - full(x)).abs().max().item()


def _act_order_row(state: ParallelState, perm: torch.Tensor) -> float:
    """A row-parallel act-order linear with ``perm`` against the whole one."""
    torch.manual_seed(2)
    config = QuantConfig(bits=8, group_size=32, act_order=True)

    def make() -> RowLinear:
        return RowLinear(64, 12, quant_method=WeightOnlyLinearMethod(config))

    full, shard = _full_and_shard(make, state)
    qw = quantize_rtn(torch.randn(12, 64)[:, perm], 8, 32)
    for name, tensor in (("qweight", qw.qweight), ("scales", qw.scales), ("perm", perm)):
        _load_both(full, shard, name, tensor)
    x = torch.randn(3, 64)
    cols = 64 // state.tp.size
    local = x[:, state.tp.rank * cols:(state.tp.rank + 1) * cols]
    return (shard(local) - full(x)).abs().max().item()


def test_parallel_linears_embedding_and_head_match_one_process() -> None:
    for errors in run_ranks(_linears, 2, 1):
        assert max(errors.values()) < ATOL, errors


@pytest.mark.parametrize(("bits", "group_size"), [(8, -1), (4, 32), (4, -1)])
def test_quantised_row_parallel_matches_one_process(bits: int, group_size: int) -> None:
    assert max(run_ranks(_quantised_row, 2, 1, bits, group_size)) < 1e-4


def test_act_order_row_parallel_within_slices_runs_and_across_is_refused() -> None:
    generator = torch.Generator().manual_seed(0)
    # each rank's half permuted within itself: row-parallel works
    local = torch.cat([torch.randperm(32, generator=generator),
                       32 + torch.randperm(32, generator=generator)])
    assert max(run_ranks(_act_order_row, 2, 1, local)) < 1e-4
    mixed = torch.randperm(64, generator=generator)
    with pytest.raises(RuntimeError, match="mixes input columns across the 2 tensor-parallel"):
        run_ranks(_act_order_row, 2, 1, mixed)


def test_sizes_that_do_not_split_the_model_are_refused(
    tiny_checkpoint: Callable[[str], Path]
) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama")))  # 4 heads, 2 KV heads
    check_split(config, 4, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4.*"
                                         r"Sizes that do: 1, 2, 4\b"):
        check_split(config, 3, 1)
    with pytest.raises(ValueError, match="at most 2 stages"):
        check_split(config, 1, 3)
    odd_kv = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48,
                         intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=3,
                         head_dim=8, max_position_embeddings=64, sliding_windows=(None, None))
    check_split(odd_kv, 3, 1)
    with pytest.raises(ValueError, match="num_key_value_heads=3 neither divides"):
        check_split(odd_kv, 2, 1)
    grouped = ModelConfig(**{**odd_kv.__dict__, "num_heads": 4, "num_kv_heads": 2,
                             "head_dim": 16, "intermediate_size": 64,
                             "quantization": QuantConfig(bits=4, group_size=32)})
    check_split(grouped, 2, 1)
    with pytest.raises(ValueError, match="down_proj's input of 64 columns gives each rank 16, "
                                         "which splits a group of 32"):
        check_split(grouped, 4, 1)


# ---------------------------------------------------------------- whole models


def _step(model: Any, state: ParallelState, token_ids: list[int], metadata: Any,
          positions: torch.Tensor) -> torch.Tensor | None:
    """One forward of this rank's stage: receive, run, send; logits on the last stage."""
    intermediate = None
    if state.pp is not None and state.pp.prev_rank is not None:
        intermediate = state.pp.recv(torch.empty(len(token_ids), 2, model.config.hidden_size))
    with torch.inference_mode():
        out = model(torch.tensor(token_ids), positions, metadata, intermediate)
        if state.pp is not None and state.pp.next_rank is not None:
            state.pp.send(out)
            return None
        return model.compute_logits(out)


def _model_logits(state: ParallelState, path: str, prompt: list[int],
                  num_decode: int) -> torch.Tensor | None:
    """The logits of a prefill of ``prompt`` then ``num_decode`` greedy decode
    steps, on the last stage (None elsewhere)."""
    config, model_path = resolve_model_config(path)
    with building(state):
        model = load_model(config, model_path, "auto", torch.float32, torch.device("cpu"))
    layers = get_attention_layers(model)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
              for layer in layers]
    bind_kv_cache(model, caches, get_attention_backend("torch"))
    table = list(range(NUM_BLOCKS - 1, 0, -1))
    metadata, positions = make_attention_metadata([len(prompt)], [len(prompt)], [table],
                                                  BLOCK_SIZE)
    logits = _step(model, state, prompt, metadata, positions)
    rows = [] if logits is None else [logits]
    tokens = list(prompt)
    for _ in range(num_decode):
        # the next token: greedy on the last stage, shared with the others
        next_id = torch.tensor([int(rows[-1][-1].argmax()) if rows else 0])
        if state.layout.pp_size > 1:
            torch.distributed.broadcast(next_id, src=state.layout.output_rank)
        tokens.append(int(next_id))
        metadata, positions = make_attention_metadata([1], [len(tokens)], [table], BLOCK_SIZE)
        logits = _step(model, state, tokens[-1:], metadata, positions)
        if logits is not None:
            rows.append(logits)
    if state.pp is not None:
        state.pp.wait_sends()
    return torch.cat(rows) if rows else None


def _one_process_logits(path: Path, prompt: list[int], num_decode: int) -> torch.Tensor:
    logits = _model_logits(ParallelState.single(), str(path), prompt, num_decode)
    assert logits is not None
    return logits


PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 8, 13, 200]


@pytest.mark.parametrize(("variant", "tp", "pp"), [
    ("llama", 2, 1), ("llama", 1, 2),
    pytest.param("llama_mqa", 2, 1, marks=pytest.mark.slow),  # 1 KV head, replicated
    pytest.param("llama_tied", 2, 2, marks=pytest.mark.slow),  # the head copies the table
    pytest.param("mistral", 2, 2, marks=pytest.mark.slow),  # sliding window
    pytest.param("qwen2", 2, 1, marks=pytest.mark.slow),  # q/k/v bias
    pytest.param("qwen3", 1, 2, marks=pytest.mark.slow),  # q/k norm, 3 layers over 2 stages
    pytest.param("llama", 4, 1, marks=pytest.mark.slow),  # 2 KV heads over 4 ranks
])
def test_split_model_logits_match_one_process(
    variant: str, tp: int, pp: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(variant)
    expected = _one_process_logits(path, PROMPT, 4)
    results = run_ranks(_model_logits, tp, pp, str(path), PROMPT, 4)
    last_stage = results[(pp - 1) * tp:]
    assert all(r is None for r in results[:(pp - 1) * tp])
    for logits in last_stage:
        assert (logits - expected).abs().max().item() < 1e-4
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
