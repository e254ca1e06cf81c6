#!/usr/bin/env python
"""Train an EAGLE head (``kvserve/spec/eagle.py``) for a target model, then
measure it in kvserve's engine.

The head reads the target's final hidden state ``f_t`` fused with the
streams entering some of the target's layers (``--aux-layers``, by default
vLLM's EAGLE-3 choice; ``none``: ``f_t`` alone) and the embedding of
the next token ``x_{t+1}`` and predicts ``f_{t+1}``; the target's LM head
turns that into a distribution over ``x_{t+2}``. Training data is code (by
default the bundled family's corpus and split, ``FAMILY_PACKAGES`` of
``scripts/train_default_model.py``: the stdlib's held-out files are never
trained on), the targets come from the frozen target run on the fly
(transformers), and the loss of each of
``--unroll`` chained steps is ``smooth_l1(head, f) + --ce-weight * CE(the
target's next-token distribution, the head's)``: step 2 reads step 1's
output instead of the target's feature, as proposing does. The head is
kvserve's own module with dense causal attention while training, so the
saved tensors load into the engine as they are; its decoder layer starts
from the target's last layer.

At the end the head is written (``config.json``, ``model.safetensors``,
``train_log.json``, ``README.md``) and measured by the engine on held-out
prompts: greedy speculative decoding with ``k = --eval-k``, acceptance rate,
acceptance per position, mean accepted length, beside the bundled draft
model when the target is the bundled model.

    python scripts/train_eagle_head.py                      # bundled target, GPU, minutes
    python scripts/train_eagle_head.py --target DIR --out DIR --minutes 30
    python scripts/train_eagle_head.py --toy --target DIR --corpus-dir DIR --out DIR  # CPU test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from anywhere: the repository's kvserve
    sys.path.insert(0, str(REPO))

from kvserve.assets import DEFAULT_MODEL, MODELS_DIR  # noqa: E402
from kvserve.engine.speculative import EAGLE_HEAD  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402
from kvserve.spec.eagle import (  # noqa: E402
    DRAFT_VOCAB_KEY,
    EagleHead,
    aux_layer_ids,
    eagle_head_config,
    head_model_config,
    restrict_draft_vocab,
    save_eagle_head,
)


def log(message: str) -> None:
    print(f"[train_eagle_head] {message}", flush=True)


# --------------------------------------------------------------------------- the head


class DenseCausalAttention(nn.Module):
    """What ``kvserve.layers.attention.Attention`` computes, over whole
    ``[batch, seq]`` windows with no KV cache: rope, then causal attention
    (GQA by repeating K/V heads). ``shape`` is set before each forward."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.shape = (1, 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any,
                positions: torch.Tensor, rotary_emb: RotaryEmbedding) -> torch.Tensor:
        q, k = rotary_emb(positions, q, k)
        batch, seq = self.shape

        def heads(x: torch.Tensor, num: int) -> torch.Tensor:
            return x.reshape(batch, seq, num, self.head_dim).transpose(1, 2)

        group = self.num_heads // self.num_kv_heads
        keys = heads(k, self.num_kv_heads).repeat_interleave(group, dim=1)
        values = heads(v, self.num_kv_heads).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(heads(q, self.num_heads), keys, values,
                                             is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(batch * seq, self.num_heads * self.head_dim)


def make_trainable_head(head_config: dict[str, Any], target: nn.Module,
                        aux_layer_ids: tuple[int, ...] = ()) -> EagleHead:
    """kvserve's head with dense attention, its decoder layer copied from the
    target's last layer (packed as kvserve packs it), ``fc`` passing the
    feature through and ``fuse`` (with aux layers) passing the final hidden
    state through, so training starts from the one-feature head."""
    head = EagleHead(head_model_config(head_config, "head config"), aux_layer_ids)
    attn = head.layer.self_attn
    attn.attn = DenseCausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     attn.head_dim ** -0.5)
    last = target.model.layers[-1]
    hidden = head.config.hidden_size
    with torch.no_grad():
        attn.qkv_proj.weight.copy_(torch.cat([last.self_attn.q_proj.weight,
                                              last.self_attn.k_proj.weight,
                                              last.self_attn.v_proj.weight]))
        attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        head.layer.mlp.gate_up_proj.weight.copy_(torch.cat([last.mlp.gate_proj.weight,
                                                            last.mlp.up_proj.weight]))
        head.layer.mlp.down_proj.weight.copy_(last.mlp.down_proj.weight)
        head.layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        head.layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.model.norm.weight)
        head.fc.weight.normal_(0.0, 0.02)
        head.fc.weight[:, hidden:] += torch.eye(hidden)
        if head.fuse is not None:
            head.fuse.weight.zero_()
            head.fuse.weight[:, -hidden:] = torch.eye(hidden)
    for param in head.parameters():
        param.requires_grad_(True)
    return head


def head_forward(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor,
                 start: int) -> torch.Tensor:
    """``[B, L, H]`` windows through the head at positions ``start ..``."""
    batch, seq, hidden = embeds.shape
    head.layer.self_attn.attn.shape = (batch, seq)  # type: ignore[union-attr]
    positions = (torch.arange(seq, device=embeds.device) + start).repeat(batch)
    out = head(embeds.reshape(-1, hidden), features.reshape(-1, hidden), positions, None)
    return out.reshape(batch, seq, hidden)


# --------------------------------------------------------------------------- data


def load_corpus_module() -> ModuleType:
    """``scripts/train_default_model.py``, for its corpus and split rules."""
    path = REPO / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_splits(args: argparse.Namespace) -> dict[str, list[str]]:
    """Train and held-out texts: the target's corpus and split."""
    tdm = load_corpus_module()
    root = Path(args.corpus_dir) if args.corpus_dir else Path(sysconfig.get_paths()["stdlib"])
    if args.packages is None:  # the family's (resolved here, so train_log.json says which)
        args.packages = tdm.FAMILY_PACKAGES
    if args.packages_max_mb is None:
        args.packages_max_mb = tdm.FULL_PRESET["packages_max_mb"]
    packages = [p for p in args.packages.split(",") if p] if not args.corpus_dir else []
    corpus = tdm.collect_corpus(root, args.max_files, 0, packages, int(args.packages_max_mb * 1e6))
    return {"train": corpus.texts("train"), "heldout": corpus.texts("heldout")}


def encode(tokenizer: Any, texts: list[str], bos_id: int) -> np.ndarray:
    ids: list[int] = []
    for text in texts:
        ids += [bos_id, *tokenizer.encode(text).ids]
    return np.asarray(ids, dtype=np.int64)


def windows(stream: np.ndarray, seq_len: int, batch: int, rng: np.random.Generator
            ) -> torch.Tensor:
    starts = rng.integers(0, max(len(stream) - seq_len, 1), size=batch)
    return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]))


# --------------------------------------------------------------------------- training


@torch.no_grad()
def target_outputs(target: nn.Module, ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The target's final hidden states, next-token log-probabilities and the
    streams entering ``aux_layer_ids`` (``[B, L, n, H]``; transformers'
    ``hidden_states[i]``), or None."""
    out = target.model(input_ids=ids, output_hidden_states=bool(aux_layer_ids))
    hidden = out.last_hidden_state
    aux = (torch.stack([out.hidden_states[i] for i in aux_layer_ids], dim=2)
           if aux_layer_ids else None)
    return hidden, torch.log_softmax(target.lm_head(hidden).float(), dim=-1), aux


def unrolled_loss(head: EagleHead, target: nn.Module, ids: torch.Tensor, unroll: int,
                  ce_weight: float) -> tuple[torch.Tensor, list[float]]:
    """The chained steps' losses and each step's top-1 agreement with the target."""
    features, logprobs, aux = target_outputs(target, ids, head.aux_layer_ids)
    embed = target.model.embed_tokens
    total = torch.zeros((), device=ids.device)
    agreement = []
    batch, seq_len, hidden = features.shape
    inputs = head.target_features(
        features.reshape(-1, hidden),
        None if aux is None else aux.reshape(batch * seq_len, -1, hidden),
    ).reshape(batch, seq_len, hidden)
    for step in range(1, unroll + 1):
        seq = ids.shape[1] - step
        if seq < 1:
            break
        # row t of step s: token x_{t+s}, the feature for position t + s - 1
        out = head_forward(head, embed(ids[:, step:]), inputs[:, :seq], step - 1)
        wanted = features[:, step:]
        regression = F.smooth_l1_loss(out.float(), wanted.float())
        head_logprobs = torch.log_softmax(target.lm_head(out).float(), dim=-1)
        target_probs = logprobs[:, step:].exp()
        ce = -(target_probs * head_logprobs).sum(-1).mean()
        total = total + 0.8 ** (step - 1) * (regression + ce_weight * ce)
        agreement.append(float((head_logprobs.argmax(-1) == logprobs[:, step:].argmax(-1))
                               .float().mean()))
        inputs = out
    return total, agreement


def mixed_precision(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA (the target runs in bf16, the head trains in float32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def train(args: argparse.Namespace, head: EagleHead, target: nn.Module,
          streams: dict[str, np.ndarray], device: torch.device) -> dict[str, Any]:
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    start, step, history = time.monotonic(), 0, []
    budget_s = args.minutes * 60
    while step < args.max_steps and time.monotonic() - start < budget_s:
        progress = max(step / max(args.max_steps, 1), (time.monotonic() - start) / budget_s)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi
                                                                               * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = windows(streams["train"], args.seq_len, args.batch_size, rng).to(device)
        with mixed_precision(device):
            loss, agreement = unrolled_loss(head, target, ids, args.unroll, args.ce_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            history.append({"step": step, "loss": float(loss.detach()), "agreement": agreement,
                            "lr": lr, "elapsed_s": time.monotonic() - start})
            log(f"step {step} loss {float(loss.detach()):.4f} top-1 agreement "
                f"{[round(a, 3) for a in agreement]} ({time.monotonic() - start:.0f}s)")
    return {"steps": step, "train_s": time.monotonic() - start, "history": history}


@torch.no_grad()
def heldout_agreement(args: argparse.Namespace, head: EagleHead, target: nn.Module,
                      stream: np.ndarray, device: torch.device) -> list[float]:
    """Teacher-forced top-1 agreement with the target per chained step, held out."""
    rng = np.random.default_rng(args.seed + 1)
    sums = np.zeros(args.unroll)
    for _ in range(args.eval_batches):
        ids = windows(stream, args.seq_len, args.batch_size, rng).to(device)
        with mixed_precision(device):
            _, agreement = unrolled_loss(head, target, ids, args.unroll, args.ce_weight)
        sums[:len(agreement)] += agreement
    return (sums / args.eval_batches).tolist()


# --------------------------------------------------------------------------- evaluation


def engine_eval(args: argparse.Namespace, heldout: list[str], tokenizer: Any
                ) -> dict[str, Any]:
    """Greedy speculative decoding in kvserve on held-out prompts: the head,
    and the bundled draft beside it when the target is the bundled model."""
    from kvserve import LLM, SamplingParams

    prompts = [tokenizer.encode(text).ids[:args.eval_prompt_len] for text in heldout]
    prompts = [[args.bos_id, *p] for p in prompts if len(p) >= 8][:args.eval_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.eval_new_tokens, ignore_eos=True)
    methods = {"eagle": {"method": "eagle", "model": args.out}}
    if Path(args.target).resolve() == (MODELS_DIR / DEFAULT_MODEL).resolve():
        methods["draft_model"] = {"method": "draft_model"}
    results: dict[str, Any] = {"num_prompts": len(prompts), "k": args.eval_k}
    for name, config in methods.items():
        llm = LLM(model=args.target, seed=args.seed, speculative_config={
            **config, "num_speculative_tokens": args.eval_k, "auto_disable": False})
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        per_position = [a / max(d, 1) for a, d in zip(
            stats["spec_decode_num_accepted_tokens_per_pos"],
            stats["spec_decode_num_drafted_tokens_per_pos"], strict=True)]
        results[name] = {
            "acceptance_rate": stats["spec_decode_acceptance_rate"],
            "alpha_first": per_position[0],
            "accepted_per_position": per_position,
            "mean_accepted_length": stats["spec_decode_mean_accepted_length"],
            "seconds": time.perf_counter() - start,
        }
        log(f"engine, {name}: {results[name]}")
        del llm
    return results


def write_card(out: Path, result: dict[str, Any]) -> None:
    evaluation = result.get("engine", {})
    aux = result["args"].get("aux_layers", ())
    lines = [f"# {out.name}", "",
             f"EAGLE head for `{Path(result['target']).name}` (kvserve/spec/eagle.py), trained "
             "by scripts/train_eagle_head.py: one decoder layer over the target's final hidden "
             "states" + (f" (fused with the streams entering layers {list(aux)})" if aux else "")
             + " and token embeddings; " + (
                 "the target's LM head." if not (vocab := result.get("draft_vocab")) else
                 f"the target's LM-head rows of the {vocab['size']:,} most frequent training "
                 f"tokens ({vocab['train_token_share']:.1%} of the training text) as its "
                 "draft vocabulary."), "",
             (f"Trained {result['train']['steps']} steps in {result['train']['train_s']:.0f} s"
              if "from_head" not in result["train"] else
              f"Taken from {result['train']['from_head']} without training")
             + f" on {result['device']} ({result['num_params']:,} parameters, "
             f"{result['dtype']}).",
             "", "| held-out | value |", "|---|---:|",
             f"| teacher-forced top-1 agreement per chained step | "
             f"{', '.join(f'{a:.3f}' for a in result['heldout_agreement'])} |"]
    for name in ("eagle", "draft_model"):
        if name in evaluation:
            e = evaluation[name]
            lines += [f"| {name}: acceptance α (first proposal) / rate, k={evaluation['k']} | "
                      f"{e['alpha_first']:.3f} / {e['acceptance_rate']:.3f} |",
                      f"| {name}: mean accepted length (tokens per verification) | "
                      f"{e['mean_accepted_length']:.2f} |"]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def aux_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """``--aux-layers``: ids, 'none', or 'auto' (vLLM's EAGLE-3 default for the target's
    depth)."""
    if text == "none":
        return ()
    if text == "auto":  # a shallow target keeps those of its layers that exist
        return tuple(sorted({2, num_layers // 2, num_layers - 3} & set(range(num_layers))))
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(MODELS_DIR / DEFAULT_MODEL))
    p.add_argument("--out", default=str(MODELS_DIR / EAGLE_HEAD))
    p.add_argument("--corpus-dir", default=None,
                   help="a directory of .py files instead of the stdlib (+ --packages)")
    p.add_argument("--packages", default=None,
                   help="packages whose .py files join the stdlib's train split (default: "
                   "the bundled family's, scripts/train_default_model.py FAMILY_PACKAGES)")
    p.add_argument("--packages-max-mb", type=float, default=None,
                   help="cap on the packages' bytes (default: the family's, "
                   "train_default_model.py FULL_PRESET)")
    p.add_argument("--max-files", type=int, default=0)
    p.add_argument("--minutes", type=float, default=6.0)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--unroll", type=int, default=3, help="chained steps trained on")
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--aux-layers", default="auto",
                   help="comma-separated target layers whose input streams the head also "
                   "reads (EAGLE-3 style); 'auto' (default): vLLM's choice 2, L // 2, L - 3 "
                   "of an L-layer target; 'none': the final hidden state only")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="propose from the N most frequent tokens of the training text only "
                   "(EAGLE-3's draft vocabulary: the head gets those rows of the target's LM "
                   "head, so each proposal reads N of its vocab_size rows); 0: all")
    p.add_argument("--from-head", default=None,
                   help="a trained head directory to start from instead of training (with "
                   "--draft-vocab: give an existing head a draft vocabulary)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-prompt-len", type=int, default=64)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--toy", action="store_true",
                   help="a few steps on small windows (CPU tests)")
    args = p.parse_args(argv)
    if args.toy:
        args.batch_size, args.seq_len, args.max_steps, args.warmup = 2, 24, 3, 1
        args.eval_batches, args.eval_prompts, args.eval_new_tokens = 1, 2, 8
        args.log_every, args.unroll = 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    import transformers
    from tokenizers import Tokenizer

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    target_dir, out = Path(args.target), Path(args.out)
    target_config = json.loads((target_dir / "config.json").read_text())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    target = target.to(device).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    args.bos_id = int(target_config.get("bos_token_id") or 0)
    splits = load_splits(args)
    streams = {name: encode(tokenizer, texts, args.bos_id) for name, texts in splits.items()}
    log(f"corpus: {len(splits['train'])} train / {len(splits['heldout'])} held-out files, "
        f"{streams['train'].size:,} / {streams['heldout'].size:,} tokens; device {device}")
    if args.from_head is not None:
        head_config = json.loads((Path(args.from_head) / "config.json").read_text())
        if head_config.get(DRAFT_VOCAB_KEY) is not None:
            raise SystemExit(f"--from-head {args.from_head}: the head already has a draft "
                             "vocabulary; start from one without")
        args.aux_layers = aux_layer_ids(head_config, f"--from-head {args.from_head}",
                                        int(target_config["num_hidden_layers"]))
    else:
        args.aux_layers = aux_layers(args.aux_layers, int(target_config["num_hidden_layers"]))
        head_config = eagle_head_config(target_config, args.aux_layers)
    head = make_trainable_head(head_config, target.float(), args.aux_layers).to(device)
    target = target.to(dtype)
    result: dict[str, Any] = {"target": str(target_dir), "device": str(device),
                              "args": {k: v for k, v in vars(args).items()},
                              "num_params": sum(p.numel() for p in head.parameters())}
    if args.from_head is not None:
        from safetensors.torch import load_file

        head.load_state_dict({k: v.float() for k, v in load_file(
            str(Path(args.from_head) / "model.safetensors"), device=str(device)).items()})
        result["train"] = {"from_head": args.from_head, "steps": 0, "train_s": 0.0}
    else:
        result["train"] = train(args, head, target, streams, device)
    head.eval()
    result["heldout_agreement"] = heldout_agreement(args, head, target, streams["heldout"], device)
    log(f"held-out top-1 agreement per chained step: {result['heldout_agreement']}")
    if args.draft_vocab:
        counts = np.bincount(streams["train"], minlength=int(target_config["vocab_size"]))
        top = np.argsort(-counts, kind="stable")[:args.draft_vocab]
        head, head_config = restrict_draft_vocab(
            head, head_config, target.get_output_embeddings().weight.float(), torch.from_numpy(top))
        result["num_params"] = sum(p.numel() for p in head.parameters())
        result["draft_vocab"] = {"size": len(top),
                                 "train_token_share": float(counts[top].sum() / counts.sum())}
        log(f"draft vocabulary: {result['draft_vocab']}")
    saved_dtype = torch.bfloat16 if target_config.get("torch_dtype") == "bfloat16" else None
    if saved_dtype is not None:
        head = head.to(saved_dtype)
    result["dtype"] = str(saved_dtype or torch.float32)
    save_eagle_head(head, head_config, out)
    result["engine"] = engine_eval(args, splits["heldout"], tokenizer)
    (out / "train_log.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_card(out, result)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
