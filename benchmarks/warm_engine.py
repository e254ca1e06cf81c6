"""Shared by the profiling scripts (profile_decode.py, step_host_time.py): an engine from
``EngineArgs``' command-line flags, warmed on one greedy request of random prompt tokens."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs


def warm_engine(args: argparse.Namespace) -> tuple[LLM, list[int], SamplingParams]:
    """The engine of ``args`` (EngineArgs' flags plus ``input_len`` and ``output_len``),
    the request it ran (``input_len`` random prompt tokens, ``output_len`` greedy new ones,
    ``ignore_eos``) and its params; the run compiled and captured what the engine needs."""
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    vocab_size = llm.engine.config.model_config.vocab_size  # type: ignore[attr-defined]
    prompt = torch.randint(3, vocab_size, (args.input_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    return llm, prompt, params
