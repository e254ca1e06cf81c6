"""What ``kvserve plan`` reports: sizes, fit, the roofline and the prediction.

Owns ``Plan`` and ``compute_plan``: from a ``ModelConfig`` (the
architecture, never the model's name), a ``Hardware`` and ``PlanInputs``
to plain numbers. The counts come from ``counts.py``, the predicted times
from ``step_model.py`` (the engine on the card's measured rates), the
roofline bound from the spec sheet's peaks. No I/O, no torch, no printing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvserve.config import ModelConfig
from kvserve.param_count import count_params
from kvserve.plan.counts import (
    Hardware,
    PlanInputs,
    check_tp,
    decode_cost,
    kv_bytes_per_token,
    prefill_cost,
    weight_bytes,
)
from kvserve.plan.step_model import StepConstants, constants_for, decode_step, prefill_time


@dataclass(frozen=True)
class Plan:
    """What ``kvserve plan`` reports; every byte figure is per GPU.

    ``decode_ms_per_step``, ``prefill_ms`` and ``e2e_ms`` are the step
    model's predictions of kvserve on the card; ``roofline_*`` the bounds at
    the spec sheet's peaks. The speculative figures are upper bounds
    (``spec_decode``); ``*_iid`` are their i.i.d.-acceptance expectations.
    """

    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    kv_bytes_total: int
    fits: bool
    max_batch_at_context: int
    max_context_at_batch: int
    # tokens of KV the GPU's free memory and the host tier hold (prefix cache)
    kv_tokens_gpu: int
    kv_tokens_host: int
    decode_ms_per_step: float
    decode_tokens_per_s: float
    decode_tokens_per_s_per_request: float
    prefill_ms: float
    roofline_decode_ms_per_step: float
    roofline_prefill_ms: float
    decode_breakdown_ms: dict[str, float]
    prefill_breakdown_ms: dict[str, float]
    arithmetic_intensity_decode: float
    ridge_point: float
    bound: str
    e2e_ms: float
    copy_gb_s: float
    matmul_tflop_s: float
    rates_source: str
    constants_source: str
    spec_tokens_per_step: float | None = None
    spec_speedup: float | None = None
    spec_tokens_per_step_iid: float | None = None
    spec_speedup_iid: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class SpecFigures:
    """Speculative decoding's tokens per target step and speed-up: the upper
    bound k·α + 1 and the i.i.d. expectation (1 − α^(k+1)) / (1 − α)."""

    tokens_upper: float
    speedup_upper: float
    tokens_iid: float
    speedup_iid: float


def spec_decode(inputs: PlanInputs) -> SpecFigures | None:
    """Speculative decoding, the simple form: k draft tokens each accepted with
    probability alpha, a draft token costing r target steps, one verify step.

    k·alpha + 1 tokens per step is an upper bound (every draft token counted
    at alpha, as if a rejection did not end the run); acceptance that stops
    at the first rejection, i.i.d. alpha, expects (1 − alpha^(k+1)) / (1 −
    alpha). A step costs 1 + k·r target steps.
    """
    k, alpha, ratio = inputs.spec_k, inputs.spec_alpha, inputs.spec_cost_ratio
    if k is None or alpha is None or ratio is None:
        return None
    upper = k * alpha + 1
    iid = float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    cost = 1 + k * ratio
    return SpecFigures(upper, upper / cost, iid, iid / cost)


def _notes(model: ModelConfig, inputs: PlanInputs) -> list[str]:
    notes = []
    if inputs.tp > 1:
        notes.append(f"tp {inputs.tp}: communication (all-reduces) is not in the prediction")
    if inputs.weights not in ("bf16", "fp16"):
        notes.append(f"weights {inputs.weights}: the step model's constants were fitted on "
                     "16-bit weights; dequantisation cost is not in the prediction")
    if inputs.context > model.max_position_embeddings:
        notes.append(f"context {inputs.context:,} is beyond the model's "
                     f"max_position_embeddings {model.max_position_embeddings:,}")
    if inputs.has_spec:  # said here too for --json, whose keys carry no label
        notes.append("spec_tokens_per_step and spec_speedup are upper bounds; the _iid "
                     "figures are the expectation when acceptance stops at the first rejection")
    return notes


def compute_plan(model: ModelConfig, hardware: Hardware, inputs: PlanInputs,
                 constants: StepConstants | None = None) -> Plan:
    """Everything ``kvserve plan`` reports for one model, GPU and workload;
    ``constants`` default to the card's (``step_model.constants_for``).
    Raises PlanError when ``inputs.tp`` cannot split the model."""
    check_tp(model, inputs.tp)
    k = constants or constants_for(hardware.name)
    params = count_params(model)
    weights = weight_bytes(count_params(model, inputs.tp), inputs)
    per_token = kv_bytes_per_token(model, inputs)
    per_request = per_token * inputs.context
    total = per_request * inputs.batch
    usable = hardware.memory_bytes * inputs.memory_utilization
    free = usable - weights

    decode = decode_cost(model, inputs)
    step = decode_step(model, inputs, hardware, k)
    prefill = prefill_time(model, inputs, hardware, k)
    step_s = step.total_s
    spec = spec_decode(inputs)
    return Plan(
        params=params.total,
        weight_bytes=math.ceil(weights),
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        kv_bytes_total=total,
        fits=weights + total <= usable,
        max_batch_at_context=max(0, math.floor(free / per_request)),
        max_context_at_batch=max(0, math.floor(free / (per_token * inputs.batch))),
        kv_tokens_gpu=max(0, math.floor(free / per_token)),
        kv_tokens_host=math.floor(inputs.kv_offload_gb * 1e9 / inputs.tp / per_token),
        decode_ms_per_step=step_s * 1e3,
        decode_tokens_per_s=inputs.batch / step_s,
        decode_tokens_per_s_per_request=1.0 / step_s,
        prefill_ms=prefill.total_s * 1e3,
        roofline_decode_ms_per_step=decode.seconds_on(hardware) * 1e3,
        roofline_prefill_ms=prefill_cost(model, inputs).seconds_on(hardware) * 1e3,
        decode_breakdown_ms=step.breakdown_ms(),
        prefill_breakdown_ms=prefill.breakdown_ms(),
        arithmetic_intensity_decode=decode.intensity,
        ridge_point=hardware.flops_s / hardware.bandwidth_bytes_s,
        bound=decode.bound_on(hardware),
        e2e_ms=(prefill.total_s + inputs.output * step_s) * 1e3,
        copy_gb_s=hardware.copy_bytes_s / 1e9,
        matmul_tflop_s=hardware.matmul_flops_s / 1e12,
        rates_source=hardware.rates_source,
        constants_source=k.source,
        spec_tokens_per_step=spec.tokens_upper if spec else None,
        spec_speedup=spec.speedup_upper if spec else None,
        spec_tokens_per_step_iid=spec.tokens_iid if spec else None,
        spec_speedup_iid=spec.speedup_iid if spec else None,
        notes=_notes(model, inputs),
    )
