"""An EAGLE-style head (registered as ``"eagle"``): one decoder layer over the
target's last hidden states and token embeddings, chained to propose.

At a position ``t`` the head reads the target's final hidden state ``f_t``
and the embedding of the next token ``x_{t+1}``, ``fc([e(x_{t+1}); f_t])``,
runs one Llama decoder layer (its own attention, its KV in the target's
paged pool: ``proposer.py``) and a final norm, and predicts ``f_{t+1}``,
which the target's LM head turns into a distribution over ``x_{t+2}``.
Every step it catches up over the target's rows (the target's
hidden states, the next tokens: the step's inputs shifted by one, the
token the step added after each sampling request's last kept one); the
row of that last kept token already predicts the first proposal. Each
further proposal is a one-token step on the previous proposal and the
head's own output feature (a chain; no tree). Proposals are the argmax.

A head may also read the target's earlier layers, as EAGLE-3 does: with
``eagle_aux_hidden_state_layer_ids`` in its config, the target keeps the
residual streams entering those layers on every forward, and the head's
``fuse`` maps ``[aux_1; ...; aux_n; f_t]`` to the feature it reads for the
target's rows (its own chained rows still read its output).

A head may propose from a draft vocabulary, as EAGLE-3 does: with
``draft_vocab_size`` in its config it carries its own ``lm_head`` over that
many tokens and ``d2t`` (draft id -> target id offsets, vLLM's layout:
target id = draft id + ``d2t[draft id]``), so each proposal reads a fraction
of the target's LM head; ``restrict_draft_vocab`` makes one from a head by
keeping the target's LM-head rows of the most frequent tokens. Verification
is untouched: a proposal outside the vocabulary is simply never made.

A head is a directory with ``config.json`` (``architectures:
["EagleHead"]``, the layer's shape, the target's ``hidden_size`` and
``vocab_size``) and ``model.safetensors`` in this module's parameter names;
``scripts/train_eagle_head.py`` trains one for any target we serve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.host_copy import to_device
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer
from kvserve.models.registry import CausalLM
from kvserve.spec.proposer import ChainProposer, ProposerSetting, ProposerStep

# a head config's target layers whose input streams it fuses (vLLM's EAGLE-3 key)
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
# a head config's draft vocabulary size (EAGLE-3's key)
DRAFT_VOCAB_KEY = "draft_vocab_size"


def head_model_config(config: dict[str, Any], source: str) -> ModelConfig:
    """The head's layer shape (``config.json`` of a head) as a one-layer Llama config."""
    return ModelConfig.from_hf_config(
        {**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
        source=source)


class EagleHead(nn.Module):
    """``fc`` over ``[embedding; feature]``, one decoder layer, a final norm;
    with ``aux_layer_ids``, ``fuse`` first makes the target's feature from the
    residual streams entering those layers and the final hidden state."""

    def __init__(self, config: ModelConfig, aux_layer_ids: tuple[int, ...] = (),
                 draft_vocab_size: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.aux_layer_ids = aux_layer_ids
        hidden = config.hidden_size
        # a draft vocabulary: its own LM head and the draft -> target id offsets
        self.lm_head = (Linear(hidden, draft_vocab_size, bias=False)
                        if draft_vocab_size is not None else None)
        self.d2t: torch.Tensor | None
        if draft_vocab_size is None:
            self.d2t = None
        else:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.fuse = (Linear((len(aux_layer_ids) + 1) * hidden, hidden, bias=False)
                     if aux_layer_ids else None)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_parameters)
        self.layer = LlamaDecoderLayer(config, 0, rotary, LlamaAttention)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: the next tokens' embeddings
        features: torch.Tensor,  # [num_tokens, hidden]: the target's (or head's) features
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the predicted next features
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        hidden, residual = self.layer(positions, x, None, metadata)
        out, _ = self.norm(hidden, residual)
        return out

    def propose(self, features: torch.Tensor, target: CausalLM) -> torch.Tensor:
        """The argmax token (a target id) of each row of the head's output
        features: over the draft vocabulary when the head has one, else over
        the target's LM head."""
        if self.lm_head is None or self.d2t is None:
            return target.compute_logits(features).argmax(dim=-1)
        draft_ids = self.lm_head(features).argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The feature the head reads for the target's rows: the final hidden
        state ``[T, hidden]``, or ``fuse([aux_1; ...; aux_n; final])`` over the
        aux layers' streams ``[T, n, hidden]``."""
        if self.fuse is None:
            return hidden
        assert aux is not None, "a head with aux layers reads the target's aux hidden states"
        return self.fuse(torch.cat([aux.reshape(len(hidden), -1).to(hidden.dtype), hidden],
                                   dim=-1))


class EagleProposer(ChainProposer):
    """An EAGLE head running beside the target, with the target's embeddings
    and LM head."""

    def __init__(self, head: EagleHead, target: CausalLM, **kwargs: Any) -> None:
        super().__init__(head, hidden_size=head.config.hidden_size, **kwargs)
        self.head = head
        self.target = target

    @torch.inference_mode()
    def run(self, step: ProposerStep) -> torch.Tensor | None:
        assert step.hidden is not None, "an EAGLE head reads the target's hidden states"
        num_tokens = len(step.input_ids)
        features = self.head.target_features(step.hidden[:num_tokens],
                                             self.target.aux_hidden_states(num_tokens))
        out = self.head(self.target.embed_input_ids(self._next_ids(step)), features,
                        step.positions, step.metadata)
        rows = np.flatnonzero(step.num_draft > 0)
        if not len(rows):
            return None
        num_rows, num_draft = len(rows), int(step.num_draft[rows].max())
        rows_t, limit, last_positions = self.chain_setup(step, rows)
        features = out.index_select(0, step.last_index.index_select(0, rows_t))
        tokens = self.head.propose(features, self.target)
        drafts = torch.empty((num_rows, num_draft), dtype=torch.int64, device=self.device)
        drafts[:, 0] = tokens
        for j in range(1, num_draft):
            # proposal j - 1 sits at last + j + 1; the head's row for it is at last + j
            tokens, features = self.chain_step(num_rows, last_positions + j, j < limit, tokens,
                                               features)
            drafts[:, j] = tokens
        return drafts

    def step_forward(self, num_rows: int, metadata: AttentionMetadata
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        out = self.head(self.target.embed_input_ids(b.input_ids[:num_rows]),
                        b.features[:num_rows], b.positions[:num_rows], metadata)
        return self.head.propose(out, self.target), out

    def _next_ids(self, step: ProposerStep) -> torch.Tensor:
        """The token after each of the step's rows: the next row's input within
        a request; after a request's last row the next prompt token, or for a
        sampling request, after its last kept row, the token the step added."""
        next_ids = torch.roll(step.input_ids, -1)
        ends = step.query_end - 1
        not_sampling = np.ones(len(ends), dtype=bool)
        not_sampling[step.sample_indices] = False
        fix = np.stack([ends[not_sampling], np.maximum(step.next_token_ids[not_sampling], 0)])
        if fix.shape[1]:
            fix_t = to_device(fix, torch.int64, self.device)
            next_ids[fix_t[0]] = fix_t[1]
        if len(step.sample_indices):
            next_ids[step.last_index] = step.bonus_ids
        return next_ids


def eagle_head_config(target_config: dict[str, Any],
                      aux_layer_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """A head's ``config.json`` for a target's ``config.json``: the target's
    layer shape, one layer, and the target layers whose streams it fuses
    (``eagle_aux_hidden_state_layer_ids``, vLLM's EAGLE-3 key; none: the
    final hidden state alone)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "rope_theta", "rope_scaling", "hidden_act", "vocab_size", "attention_bias",
            "mlp_bias")
    config = {key: target_config[key] for key in keys if key in target_config}
    aux = {AUX_KEY: list(aux_layer_ids)} if aux_layer_ids else {}
    return {"architectures": ["EagleHead"], **config, "num_hidden_layers": 1, **aux}


def aux_layer_ids(config: dict[str, Any], source: str, num_target_layers: int
                  ) -> tuple[int, ...]:
    """A head config's aux layer ids, checked (distinct target layers, in order)."""
    ids = config.get(AUX_KEY) or []
    if (not isinstance(ids, list)
            or not all(type(i) is int and 0 <= i < num_target_layers for i in ids)
            or sorted(set(ids)) != ids):
        raise ValueError(f"{source}: field '{AUX_KEY}'={ids!r} is invalid: must be increasing "
                         f"distinct layer ids of the target, in [0, {num_target_layers - 1}]")
    return tuple(ids)


def draft_vocab_size(config: dict[str, Any], source: str, vocab_size: int) -> int | None:
    """A head config's draft vocabulary size, checked (None: the target's whole vocabulary)."""
    size = config.get(DRAFT_VOCAB_KEY)
    if size is None or size == vocab_size:
        return None
    if type(size) is not int or not 0 < size < vocab_size:
        raise ValueError(f"{source}: field '{DRAFT_VOCAB_KEY}'={size!r} is invalid: must be an "
                         f"integer in [1, {vocab_size}] (the target's vocab_size)")
    return size


def restrict_draft_vocab(head: EagleHead, config: dict[str, Any], target_lm_head: torch.Tensor,
                         token_ids: torch.Tensor) -> tuple[EagleHead, dict[str, Any]]:
    """A copy of ``head`` (and its config) proposing only ``token_ids`` (target ids,
    e.g. the most frequent tokens of the training text): its ``lm_head`` is
    those rows of the target's LM head weight ``[vocab, hidden]``, so on those
    tokens it ranks exactly as the target's LM head does."""
    ids = torch.sort(token_ids.to(torch.int64).unique()).values.cpu()
    if not len(ids) or int(ids[0]) < 0 or int(ids[-1]) >= target_lm_head.shape[0]:
        span = f"ids in [{int(ids[0])}, {int(ids[-1])}]" if len(ids) else "no ids"
        raise ValueError(f"restrict_draft_vocab: token ids must lie in [0, "
                         f"{target_lm_head.shape[0]}), got {span}")
    restricted = EagleHead(head.config, head.aux_layer_ids, len(ids))
    restricted.load_state_dict({**head.state_dict(),
                                "lm_head.weight": target_lm_head.detach().cpu()[ids],
                                "d2t": ids - torch.arange(len(ids))})
    return restricted, {**config, DRAFT_VOCAB_KEY: len(ids)}


def save_eagle_head(head: EagleHead, config: dict[str, Any], path: Path) -> None:
    """Write a head directory (``config.json``, ``model.safetensors``)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: tensor.detach().contiguous().cpu()
               for name, tensor in head.state_dict().items()}, str(path / "model.safetensors"))


def write_random_eagle_head(target_config: dict[str, Any], path: Path, std: float,
                            seed: int = 0, aux_layer_ids: tuple[int, ...] = ()) -> Path:
    """An untrained head for a target (normal weights of ``std``, norm scales
    1) written to ``path``: for tests and for timing on random weights."""
    config = eagle_head_config(target_config, aux_layer_ids)
    torch.manual_seed(seed)
    head = EagleHead(head_model_config(config, "random"), aux_layer_ids)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, std) if param.dim() > 1 else param.fill_(1.0)
    save_eagle_head(head, config, path)
    return path


def load_eagle_head(path: Path, device: torch.device, dtype: torch.dtype,
                    num_target_layers: int) -> EagleHead:
    """A head from its directory; ValueError naming a tensor that does not fit
    (or an aux layer the target, of ``num_target_layers``, lacks)."""
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config = head_model_config(raw, str(path / "config.json"))
    source = f"speculative_config.model={str(path)!r}: config.json"
    aux = aux_layer_ids(raw, source, num_target_layers)
    draft_vocab = draft_vocab_size(raw, source, config.vocab_size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in dtype; the rope cache stays float32
    try:
        with torch.device(device):
            head = EagleHead(config, aux, draft_vocab)
    finally:
        torch.set_default_dtype(previous)
    weights = load_file(str(path / "model.safetensors"), device=str(device))
    params = head.state_dict()
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(f"speculative_config.model={str(path)!r}: model.safetensors lacks "
                         f"{missing} / has unexpected {unexpected} tensors for an EAGLE head")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(weights[name].shape) != tuple(param.shape):
                raise ValueError(
                    f"speculative_config.model={str(path)!r}: tensor '{name}' has shape "
                    f"{tuple(weights[name].shape)}; the head's config needs {tuple(param.shape)}")
            param.copy_(weights[name])
    if head.d2t is not None:
        target_ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t
        if not bool(((target_ids >= 0) & (target_ids < config.vocab_size)).all()):
            raise ValueError(f"speculative_config.model={str(path)!r}: tensor 'd2t' maps draft "
                             f"ids outside the target's vocabulary [0, {config.vocab_size})")
    return head.eval()


def load_eagle_proposer(setting: ProposerSetting, target: CausalLM, path: Path) -> EagleProposer:
    """Load the head at ``path`` beside ``target`` (its embedding is shared);
    a head with aux layers makes the target keep their streams."""
    head = load_eagle_head(path, setting.device, setting.dtype, target.config.num_layers)
    if head.aux_layer_ids:
        target.keep_aux_hidden_states(head.aux_layer_ids, setting.max_tokens)
    if setting.use_triton:
        set_triton_ops(head, True)
    return EagleProposer(head, target, **setting.chain_kwargs())
