"""``kvserve plan --measure``: run the engine on the plan's shapes and report
what it really does beside what the plan predicts.

The model is built with random weights (``load_format="dummy"``), so only
shapes matter. Measured: the TTFT of one ``--prompt``-token request, and the
steady decode step time of ``--batch`` requests whose context averages
``--context`` tokens. MBU is the plan's bytes per step over the measured step
time, against the device-to-device copy rate measured in the same run; MFU is
2 × parameters × tokens/s against the measured bf16 matmul rate.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.bench.device_rates import copy_rate_gb_s, matmul_tflop_s
from kvserve.plan.planner import Plan, PlanError, PlanInputs

DECODE_STEPS = 32
PREFILL_REPEATS = 3


@dataclass
class Measurement:
    """What one device run measured, beside the plan's predictions."""

    card: str
    copy_gb_s: float
    matmul_tflop_s: float
    decode_ms_per_step: float
    decode_tokens_per_s: float
    prefill_ms: float
    mbu: float  # of the measured copy rate
    mfu_decode: float  # of the measured matmul rate
    mfu_prefill: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_measurable(inputs: PlanInputs) -> None:
    """Raise PlanError naming the flag when this build cannot measure the plan."""
    import torch

    if not torch.cuda.is_available():
        raise PlanError("--measure", "measurement needs a CUDA GPU; none found")
    if inputs.tp != 1:
        raise PlanError("--tp", f"--measure runs on one GPU; got --tp {inputs.tp}")
    if inputs.weights not in ("bf16", "fp16") or inputs.kv_dtype not in ("bf16", "fp16"):
        raise PlanError("--weights", "--measure supports bf16/fp16 weights and KV cache only")


def measure(model: str, inputs: PlanInputs, plan: Plan) -> Measurement:
    """Run the engine on the plan's shapes (one GPU, random weights)."""
    import torch

    from kvserve import LLM, SamplingParams

    check_measurable(inputs)
    copy_gb_s, tflop_s = copy_rate_gb_s(), matmul_tflop_s()
    torch.cuda.empty_cache()
    max_len = max(inputs.context, inputs.prompt) + 2 * DECODE_STEPS + 8
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_len,
              max_num_seqs=inputs.batch, enable_prefix_caching=False,
              max_num_batched_tokens=max(inputs.prompt, inputs.batch, 2048))
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    ttfts = []
    for _ in range(PREFILL_REPEATS):
        start = time.perf_counter()
        llm.generate([prompt(inputs.prompt)], one, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    step_s = _decode_step_s(llm, [prompt(max(inputs.context - DECODE_STEPS // 2, 1))
                                  for _ in range(inputs.batch)])
    prefill_s = statistics.median(ttfts)
    tokens_s = inputs.batch / step_s
    step_bytes = plan.weight_bytes + plan.kv_bytes_total
    return Measurement(
        card=torch.cuda.get_device_name(),
        copy_gb_s=copy_gb_s,
        matmul_tflop_s=tflop_s,
        decode_ms_per_step=step_s * 1e3,
        decode_tokens_per_s=tokens_s,
        prefill_ms=prefill_s * 1e3,
        mbu=step_bytes / step_s / (copy_gb_s * 1e9),
        mfu_decode=2 * plan.params * tokens_s / (tflop_s * 1e12),
        mfu_prefill=2 * plan.params * inputs.prompt / prefill_s / (tflop_s * 1e12),
    )


def _decode_step_s(llm: Any, prompts: list[list[int]]) -> float:
    """Median wall time of a decode step once every request has its first token."""
    import torch

    from kvserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=2 * DECODE_STEPS, ignore_eos=True)
    for token_ids in prompts:
        engine.add_request(token_ids, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        for output in engine.step():
            started.add(output.request_id)
    times = []
    for _ in range(DECODE_STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request_id in list(started):
        engine.abort_request(request_id)
    return statistics.median(times)
