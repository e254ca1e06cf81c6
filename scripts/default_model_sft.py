"""Supervised chat stage and the stop / answer evaluations of the bundled model (issue 28).

Owns the short instruction-tuning stage that follows pre-training (loss on the assistant's
tokens only, mixed with a pre-training batch so completion quality holds), greedy
generation with an optional repetition penalty and stop tokens, and the scores of issue 28:
do signature completions stop with <|eos|> and parse, do chat replies hold a parsable
function and stop on their own. Used by scripts/train_default_model.py (HF models, torch
only) and scored the same way by benchmarks/bundled_model_quality.py through kvserve. Must
not import kvserve.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
CODE_FENCE_RE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


# --------------------------------------------------------------------------- scoring


def parses(source: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ast.parse(source)
        except Exception:  # SyntaxError, ValueError, RecursionError, MemoryError
            return False
    return True


def completion_stops_and_parses(signature: str, completion: str, stopped: bool) -> bool:
    """A signature's completion counts when it stopped by itself and signature + completion
    is valid Python with a non-empty body."""
    return stopped and bool(completion.strip()) and parses(signature + "\n" + completion)


def reply_functions(reply: str) -> list[str]:
    """The top-level functions a chat reply defines, by name, from the first of these that
    parses and defines one: the whole reply, a fenced block, or the text from its first
    top-level `def`/`async def`/decorator line on ([] if none)."""
    candidates = [reply, *CODE_FENCE_RE.findall(reply)]
    lines = reply.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(("def ", "async def ", "@")):
            candidates.append("\n".join(lines[i:]))
            break
    for text in candidates:
        if parses(text):
            names = [n.name for n in ast.parse(text).body
                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            if names:
                return names
    return []


def reply_has_function(reply: str) -> bool:
    """Does a chat reply hold a `def` that parses (``reply_functions``)?"""
    return bool(reply_functions(reply))


def answers_second_turn(reply: str, earlier_name: str) -> bool:
    """A second-turn reply that defines a function other than the earlier turn's (not a
    copy of the answer already in the conversation)."""
    names = reply_functions(reply)
    return bool(names) and earlier_name not in names


def share(flags: list[bool]) -> float:
    return sum(flags) / max(len(flags), 1)


def choose_penalty(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The penalty whose held-out score (mean of stop-and-parse, chat function and chat stop
    shares) is highest; a tie keeps the smaller penalty (1.0: none)."""
    def score(r: dict[str, Any]) -> float:
        return (r["stop_and_parse_share"] + r["chat_function_share"] + r["chat_stop_share"]) / 3

    best = max(sorted(results, key=lambda r: r["repetition_penalty"]), key=score)
    return {
        "chosen": best["repetition_penalty"],
        "scores": {str(r["repetition_penalty"]): score(r) for r in results},
        "rule": "max mean(stop_and_parse, chat_function, chat_stop) on held-out files; ties: "
        "smaller penalty",
    }


# --------------------------------------------------------------------------- generation


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float
) -> torch.Tensor:
    """The CTRL / HF / vLLM rule: logits of tokens already in the sequence (`seen`, a bool
    [batch, vocab] mask) are divided by penalty when positive, multiplied when negative."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


@torch.no_grad()
def generate_until(
    model: nn.Module,
    prompts: list[list[int]],
    max_new: int,
    stop_ids: set[int],
    penalty: float = 1.0,
    pad_id: int = 0,
    batch_size: int = 128,
) -> list[tuple[list[int], bool]]:
    """Greedy generation of each prompt until a stop id (not returned) or max_new tokens;
    returns (new ids, stopped). Prompts are left-padded into batches (attention mask and
    position ids skip the padding), decoded with transformers' KV cache."""
    model.eval()
    device = next(model.parameters()).device
    config: Any = model.config  # a transformers causal LM
    vocab = int(config.vocab_size)
    stops = torch.tensor(sorted(stop_ids), device=device)
    results: list[tuple[list[int], bool]] = []
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        width = max(len(p) for p in chunk)
        seq = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(chunk):
            seq[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        seq, mask = seq.to(device), mask.to(device)
        seen = torch.zeros(len(chunk), vocab, dtype=torch.bool, device=device)
        seen.scatter_(1, seq, mask.bool())
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        new: list[torch.Tensor] = []
        # transformers renamed `past_key_values` to `cache` in 5.2x; accept either
        params = inspect.signature(model.forward).parameters
        cache_kwarg = "cache" if "cache" in params else "past_key_values"
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=seq, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(max_new):
            logits = apply_repetition_penalty(out.logits[:, -1].float(), seen, penalty)
            nxt = logits.argmax(-1).masked_fill(done, pad_id)
            done |= torch.isin(nxt, stops)
            new.append(nxt)
            seen[torch.arange(len(chunk), device=device), nxt] = True
            if bool(done.all()) or len(new) == max_new:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                use_cache=True, **{cache_kwarg: getattr(out, "cache", None) or out.past_key_values},
            )
        for ids in torch.stack(new, dim=1).tolist():
            cut = next((j for j, t in enumerate(ids) if t in stop_ids), None)
            results.append((ids, False) if cut is None else (ids[:cut], True))
    return results


# --------------------------------------------------------------------------- SFT stage


def sft_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


@torch.no_grad()
def sft_val_loss(
    model: nn.Module, examples: list[tuple[list[int], list[int]]], pad_id: int, batch: int
) -> float:
    """Mean assistant-token loss over all examples (deterministic, in order)."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for first in range(0, len(examples), batch):
        chunk = examples[first : first + batch]
        width = max(len(f) for f, _ in chunk) - 1
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for row, (full, lab) in enumerate(chunk):
            ids[row, : len(full) - 1] = torch.tensor(full[:-1])
            labels[row, : len(full) - 1] = torch.tensor(lab[1:])
        n = int((labels != IGNORE_INDEX).sum())
        total += float(sft_loss(model, ids.to(device), labels.to(device))) * n
        count += n
    return total / max(count, 1)


def sft_stage(
    model: nn.Module,
    draw: Callable[[], tuple[np.ndarray, np.ndarray]],
    lm_batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None,
    lm_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    val_examples: list[tuple[list[int], list[int]]],
    settings: dict[str, Any],
    log: Callable[[str], None],
    autocast: Callable[[], Any],
) -> dict[str, Any]:
    """AdamW on the chat examples (assistant tokens only) plus lm_weight x the pre-training
    loss of one lm batch per step, warmup then cosine over max_steps or budget_s, whichever
    ends first; keeps the weights with the best held-apart chat loss. `settings`: lr,
    max_steps, budget_s, warmup_steps, lm_weight, eval_every, pad_id, batch_size."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    best: dict[str, Any] = {"val": math.inf, "step": 0, "state": None}
    history: list[dict[str, float]] = []
    start, step = time.monotonic(), 0

    def evaluate() -> None:
        with autocast():
            val = sft_val_loss(model, val_examples, settings["pad_id"], settings["batch_size"])
        history.append({"step": step, "chat_val_loss": val})
        if val < best["val"]:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best.update(val=val, step=step, state=state)

    evaluate()
    while step < settings["max_steps"] and time.monotonic() - start < settings["budget_s"]:
        elapsed = time.monotonic() - start
        progress = max(step / settings["max_steps"], elapsed / settings["budget_s"])
        warm = min(1.0, (step + 1) / max(settings["warmup_steps"], 1))
        for group in opt.param_groups:
            group["lr"] = settings["lr"] * warm * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        model.train()
        ids, labels = (torch.from_numpy(a).to(device) for a in draw())
        with autocast():
            loss = sft_loss(model, ids, labels)
            if lm_batches is not None and settings["lm_weight"] > 0:
                x, y = next(lm_batches)
                loss = loss + settings["lm_weight"] * lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % settings["eval_every"] == 0:
            evaluate()
    if history[-1]["step"] != step:
        evaluate()
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    train_s = time.monotonic() - start
    log(f"sft done: {step} steps in {train_s:.0f}s, best chat val loss {best['val']:.3f} "
        f"at step {best['step']} (before: {history[0]['chat_val_loss']:.3f})")
    return {"steps": step, "train_s": train_s, "best_chat_val_loss": best["val"],
            "best_step": best["step"], "chat_val_loss_before": history[0]["chat_val_loss"],
            "history": history}
