#!/usr/bin/env python3
"""Issue 28's targets for a bundled-model directory, measured through kvserve; JSON out.

Owns the evaluation of what a user sees from the bundled model: on the held-out stdlib files
of scripts/train_default_model.py's split rule (this interpreter's stdlib, so a 3.11 run
scores other versions of the same never-trained-on paths), greedy through kvserve's offline
API (or, --url, through a running server with the model's defaults; or, --engine
transformers, the training run's own greedy loop):
- signature completions (`def name(...):` + newline, max_tokens 256): share that stop on
  their own (finish_reason "stop") and share of those that parse with their signature;
- chat requests made from held-out docstring summaries (LLM.chat, the tokenizer's chat
  template, max_tokens 256): share of replies holding a parsable def and share that stop;
  the same requests as second turns (after another request and its function): share that
  define a function other than the one already in the conversation, and share that stop;
and with transformers: held-out bits per byte of the target (and draft), greedy acceptance α
of the draft. Scoring and data come from scripts/default_model_*.py (the training run's own
evaluation uses the same functions). Must not train or write model files.

    python benchmarks/bundled_model_quality.py --out results.json          # bundled model
    python benchmarks/bundled_model_quality.py --model runs/dm/kvserve-code-14m \\
        --draft runs/dm/kvserve-code-draft-2m --device cuda --out new.json
"""

from __future__ import annotations

import argparse
import dataclasses
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

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "kvserve" / "assets" / "models"


def load_script(name: str) -> ModuleType:
    """A module of scripts/ by path (scripts/ is not a package)."""
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def heldout_files(tdm: ModuleType) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = tdm.collect_corpus(root, 0, 0, [], 0)
    return list(corpus.splits["heldout"])


def kvserve_generator(args: argparse.Namespace) -> Any:
    """(prompts, conversations) -> [(text, stopped, num tokens)] through kvserve, greedy."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(args.model), device=args.device, seed=0)
    if args.model_defaults:  # what a request that sets nothing gets, greedy
        params = dataclasses.replace(llm.get_default_sampling_params(), temperature=0.0,
                                     max_tokens=args.max_tokens, **args.sampling)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                repetition_penalty=args.repetition_penalty, **args.sampling)

    def run(prompts: list[str] | None, chats: list[list[dict[str, str]]] | None) -> list[Any]:
        outs = (llm.generate(prompts, params, use_tqdm=False) if prompts is not None
                else llm.chat(chats or [], params, use_tqdm=False))
        return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop",
                 len(o.outputs[0].token_ids)) for o in outs]

    return run


def transformers_generator(args: argparse.Namespace) -> Any:
    """The same through transformers (default_model_sft.generate_until, the training run's
    evaluation): stops on the config's eos_token_id, as kvserve does; repetition penalty only."""
    if args.sampling or args.model_defaults:
        raise SystemExit("--sampling and --model-defaults need --engine kvserve")
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    sft = sys.modules["default_model_sft"]
    tdm = sys.modules["train_default_model"]
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    model: Any = LlamaForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model = model.to(torch.device(args.device))
    eos = model.config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos])
    render = tdm.chat_renderer(tok)

    def run(prompts: list[str] | None, chats: list[list[dict[str, str]]] | None) -> list[Any]:
        ids = ([tok.encode(p).ids for p in prompts] if prompts is not None
               else [render(c, True) for c in chats or []])
        outs = sft.generate_until(model, ids, args.max_tokens, stop_ids,
                                  args.repetition_penalty, tok.token_to_id(tdm.PAD))
        return [(tok.decode(new), stopped, len(new) + stopped) for new, stopped in outs]

    return run


def server_generator(args: argparse.Namespace) -> Any:
    """The same through a running `kvserve serve` (--url): each request sends only its prompt
    or messages and max_tokens, so the server's defaults (the model's generation_config)
    decide the rest, as for a client that sets nothing."""
    from concurrent.futures import ThreadPoolExecutor
    from urllib.request import Request, urlopen

    def post(path: str, body: dict[str, Any]) -> tuple[str, bool, int]:
        request = Request(args.url.rstrip("/") + path, data=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        with urlopen(request, timeout=600) as response:
            result = json.loads(response.read())
        choice = result["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, choice["finish_reason"] == "stop", result["usage"]["completion_tokens"]

    def run(prompts: list[str] | None, chats: list[list[dict[str, str]]] | None) -> list[Any]:
        jobs = ([("/v1/completions", {"prompt": p, "max_tokens": args.max_tokens})
                 for p in prompts] if prompts is not None else
                [("/v1/chat/completions", {"messages": c, "max_tokens": args.max_tokens})
                 for c in chats or []])
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda job: post(*job), jobs))

    return run


def generation_scores(args: argparse.Namespace, files: list[tuple[str, str]]) -> dict[str, Any]:
    """Signature completions and chat replies, greedy, through --engine."""
    tdm, sft, tasks = (sys.modules[n] for n in ("train_default_model", "default_model_sft",
                                                 "default_model_tasks"))
    run = (server_generator(args) if args.url else kvserve_generator(args)
           if args.engine == "kvserve" else transformers_generator(args))
    sigs = tdm.heldout_signatures(files, args.num_signatures)
    t0 = time.monotonic()
    outs = run([s + "\n" for s in sigs], None)
    comps = [(text, stopped) for text, stopped, _ in outs]
    gen_s = time.monotonic() - t0
    good = [
        sft.completion_stops_and_parses(s, c, st) for s, (c, st) in zip(sigs, comps, strict=True)
    ]
    stopped = [st for _, st in comps]
    pairs = tasks.instruction_pairs(files, max_chars=1 << 30)
    if len(pairs) > args.num_chats:
        picks = np.linspace(0, len(pairs) - 1, args.num_chats).round().astype(int)
        pairs = [pairs[i] for i in picks]
    t0 = time.monotonic()
    chats = run(None, [tasks.conversation(p) for p in pairs])
    replies = [(text, stopped) for text, stopped, _ in chats]
    turns = tasks.second_turns(pairs)
    turn_replies = run(None, [tasks.conversation(p, earlier) for p, earlier in turns])
    chat_s = time.monotonic() - t0
    return {
        "signatures": len(sigs),
        "signature_stop_share": sft.share(stopped),
        "signature_parse_share_of_stopped": sum(good) / max(sum(stopped), 1),
        "signature_stop_and_parse_share": sft.share(good),
        "signature_mean_tokens": float(np.mean([n for _, _, n in outs])),
        "signature_seconds": gen_s,
        "chat_prompts": len(pairs),
        "chat_function_share": sft.share([sft.reply_has_function(r) for r, _ in replies]),
        "chat_stop_share": sft.share([st for _, st in replies]),
        "chat_mean_tokens": float(np.mean([n for _, _, n in chats])),
        # the same requests after another pair's request and function: a new function?
        "second_turn_answer_share": sft.share([
            sft.answers_second_turn(r, earlier.name)
            for (r, _, _), (_, earlier) in zip(turn_replies, turns, strict=True)]),
        "second_turn_stop_share": sft.share([st for _, st, _ in turn_replies]),
        "chat_seconds": chat_s,
        "examples": [{"signature": s, "completion": c, "stopped": st}
                     for s, (c, st) in zip(sigs[:3], comps[:3], strict=True)],
        "chat_examples": [{"user": p.user, "reply": r, "stopped": st}
                          for p, (r, st) in zip(pairs[:3], replies[:3], strict=True)],
    }


def torch_scores(args: argparse.Namespace, files: list[tuple[str, str]]) -> dict[str, Any]:
    """Held-out bits per byte (target, draft) and the draft's greedy α, with transformers."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tdm = sys.modules["train_default_model"]
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    device = torch.device(args.device)
    stream = torch.from_numpy(
        tdm.encode_stream(tok, [t for _, t in files]).astype(np.int64)
    ).to(device)
    bos_id = tok.token_to_id(tdm.BOS)
    byte_lens = torch.from_numpy(tdm.token_byte_lengths(tok)).to(device)
    res: dict[str, Any] = {"heldout_tokens": int(stream.numel())}
    models = {}
    for key, path in (("target", args.model), ("draft", args.draft)):
        if path is None:
            continue
        model: Any = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model = model.to(device)
        models[key] = model
        t0 = time.monotonic()
        nats, count, num_bytes = tdm.eval_sums(
            model, stream, 512, 16, args.heldout_windows, bos_id, byte_lens
        )
        res[f"{key}_heldout_loss"] = nats / max(count, 1)
        res[f"{key}_heldout_bits_per_byte"] = nats / math.log(2) / max(num_bytes, 1)
        res[f"{key}_heldout_seconds"] = time.monotonic() - t0
    if "draft" in models:
        acc = tdm.acceptance_rate(models["target"], models["draft"], stream, args.alpha_windows,
                                  64, 64)
        res["draft_alpha"] = acc["alpha"]
        res["tokens_per_target_step"] = acc["tokens_per_target_step"]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODELS / "kvserve-code-14m")
    p.add_argument("--draft", default=str(MODELS / "kvserve-code-draft-2m"),
                   help="draft directory for α ('' to skip)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engine", choices=("kvserve", "transformers"), default="kvserve",
                   help="what generates the completions and chat replies (transformers: the "
                   "training run's own greedy loop, much faster on a CPU)")
    p.add_argument("--num-signatures", type=int, default=100)
    p.add_argument("--num-chats", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling", type=json.loads, default={},
                   help="more SamplingParams fields, JSON (kvserve engine), e.g. "
                   "'{\"dry_multiplier\": 0.8, \"dry_allowed_length\": 8, "
                   "\"dry_sequence_breakers\": []}'")
    p.add_argument("--url", default=None,
                   help="a running `kvserve serve` of --model (e.g. http://127.0.0.1:8000): "
                   "completions and chat replies come from it, each request sending only its "
                   "prompt or messages and max_tokens")
    p.add_argument("--model-defaults", action="store_true",
                   help="start from the model's generation_config.json (its repetition "
                   "penalty and DRY settings) instead of --repetition-penalty; still greedy")
    p.add_argument("--heldout-windows", type=int, default=0,
                   help="512-token windows scored for bits per byte (0: all)")
    p.add_argument("--alpha-windows", type=int, default=100)
    p.add_argument("--out", type=Path, default=None, help="JSON file (also printed)")
    args = p.parse_args(argv)
    args.draft = Path(args.draft) if args.draft else None
    for name in ("default_model_tasks", "default_model_sft", "train_default_model"):
        load_script(name)
    files = heldout_files(sys.modules["train_default_model"])
    result: dict[str, Any] = {
        "model": str(args.model),
        "draft": None if args.draft is None else str(args.draft),
        "device": args.device,
        "python": sys.version.split()[0],
        "heldout_files": len(files),
        "engine": args.engine if args.url is None else f"server {args.url}",
        "max_tokens": args.max_tokens,
        "repetition_penalty": (None if args.model_defaults or args.url
                               else args.repetition_penalty),
        "sampling": args.sampling,
        "model_defaults": args.model_defaults,
    }
    result.update(generation_scores(args, files))
    result.update(torch_scores(args, files))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
