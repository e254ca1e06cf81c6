"""The model of kvserve's step on a card: what ``kvserve plan`` predicts.

A decode step of ``batch`` requests at ``context`` tokens, and the prefill
of one prompt (its time to first token), as the engine runs them: every
byte and FLOP from ``planner.py``'s counts, taken at the card's *measured*
copy and matmul rates (``gpus.MEASURED_RATES`` or ``--calibrate``) times the
engine's efficiencies on that card (``StepConstants``). docs/plan.md writes
the formulas out and names the measurement behind every constant; the
roofline (spec-sheet peaks, no efficiencies) stays in ``planner.py`` as the
bound nothing can beat.

Parts of a step, each in seconds:

- ``gemm``: the linear layers stream their weights and do 2 FLOPs per
  weight per row; the two times join as a p-norm (p = ``gemm_overlap``:
  1 adds them, large p takes the larger). One-row steps run kvserve's
  skinny GEMM, larger ones cuBLAS: each has its own bandwidth share.
- ``attention``: decode reads the batch's KV at a share of the copy rate
  that grows with the (request, KV head) streams working in parallel, plus
  a floor per layer and a cost per request and layer; prefill attention is
  FLOP-bound at its own share of the matmul rate.
- ``elementwise``: norms, RoPE, SiLU-and-mul read and write activations
  (counted per token from the architecture), and the logits of every row
  that samples are written and read once, at the GEMMs' bandwidth share.
- ``fixed``: a floor per step and per layer (graph launch, small kernels,
  the gaps between them, argmax or sampling); prefill adds one per request.
- ``host``: the host's scheduling and output processing per step. With
  async scheduling it overlaps the device, so a decode step takes the
  larger of the two (``StepTime.total_s``).

Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields

from kvserve.config import ModelConfig
from kvserve.plan.counts import (
    ACTIVATION_BYTES,
    LOGIT_BYTES,
    Hardware,
    PlanInputs,
    count_params,
    kv_bytes_per_token,
    lm_head_bytes,
    weight_read_bytes,
)

# the engine's default max_num_batched_tokens: a longer prompt is prefilled in
# chunks of this many tokens, each reading the weights again
PREFILL_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class StepConstants:
    """The engine's efficiencies on one card; docs/plan.md names the
    measurement behind each. Shares are of the card's measured copy or
    matmul rate; times in µs."""

    gemm_bandwidth_share: float  # one-row GEMM (skinny kernel): weight bytes / copy rate
    gemm_batched_bandwidth_share: float  # GEMMs of 2+ rows (cuBLAS): the same
    gemm_compute_share: float  # GEMM FLOP rate at large row counts / matmul rate
    gemm_overlap: float  # p of the p-norm joining a GEMM's memory and compute times
    attention_bandwidth_share: float  # decode attention's KV read rate, many streams
    attention_half_streams: float  # streams at which it reaches half that share
    attention_layer_us: float  # per layer call (launch, split-K reduce)
    attention_request_us: float  # per request per layer
    prefill_attention_share: float  # prefill attention FLOP rate / matmul rate
    layer_us: float  # per layer per step: small kernels' floors and the gaps between
    step_us: float  # per step: graph launch, argmax / sampling, the gap between steps
    prefill_us: float  # per prefilled request: scheduling, input copy, first token out
    host_step_us: float  # the host's work per decode step
    host_request_us: float  # ... and per running request
    source: str

    def values(self) -> dict[str, float]:
        """The numeric constants by name (``source`` left out)."""
        return {k: v for k, v in asdict(self).items() if k != "source"}


CONSTANT_NAMES: tuple[str, ...] = tuple(
    f.name for f in fields(StepConstants) if f.name != "source")

# Seeded by hand from docs/benchmarks.md's H100 rows until a GPU sweep is fitted
# (``kvserve plan --fit``): W1 (batch 1, 5.4 ms a step, GEMMs at ~97% of copy),
# the attention kernels timed in CUDA graphs (batch 1: 6.1 / 7.7 / 14.3 / 37.6 µs a
# layer at 256 / 1K / 4K / 16K positions; batch 128 reading KV at 87% / 96% of
# copy at 1K / 4K), W6 (prefill MFU 82%), the 128-token TTFT (7.7-8.5 ms) and the
# host's busy time at W2 (2.1-3.3 ms of a batch-256 step). docs/plan.md says which
# constant came from which and which still wait for the sweep.
H100_SEED = StepConstants(
    gemm_bandwidth_share=0.98,
    gemm_batched_bandwidth_share=0.90,
    gemm_compute_share=0.88,
    gemm_overlap=1.5,
    attention_bandwidth_share=0.99,
    attention_half_streams=3.0,
    attention_layer_us=5.5,
    attention_request_us=0.16,
    prefill_attention_share=0.30,
    layer_us=1.0,
    step_us=60.0,
    prefill_us=300.0,
    host_step_us=400.0,
    host_request_us=10.0,
    source="seeded from docs/benchmarks.md (H100 rows of issue 4); not yet fitted to a sweep",
)

STEP_CONSTANTS: dict[str, StepConstants] = {
    "h100-sxm": H100_SEED,
}


def constants_for(gpu_name: str) -> StepConstants:
    """The card's constants, or the H100's (labelled so) for a card not fitted yet."""
    if gpu_name in STEP_CONSTANTS:
        return STEP_CONSTANTS[gpu_name]
    return dataclasses.replace(STEP_CONSTANTS["h100-sxm"],
                               source=f"not fitted on {gpu_name}: the h100-sxm constants")


@dataclass(frozen=True)
class StepTime:
    """A predicted step (or a whole prefill) by part, in seconds."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    fixed_s: float
    host_s: float = 0.0

    @property
    def device_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.fixed_s

    @property
    def total_s(self) -> float:
        """The device's time, unless the host's (overlapping it) is longer."""
        return max(self.device_s, self.host_s)

    def breakdown_ms(self) -> dict[str, float]:
        return {"gemm": self.gemm_s * 1e3, "attention": self.attention_s * 1e3,
                "elementwise": self.elementwise_s * 1e3, "fixed": self.fixed_s * 1e3,
                "host": self.host_s * 1e3, "device": self.device_s * 1e3,
                "total": self.total_s * 1e3}


def _gemm_s(weight_bytes: float, flops: float, rows: int, hardware: Hardware,
            k: StepConstants) -> float:
    """A GEMM (or a set of them) over ``rows`` rows: its memory and compute
    times joined by the p-norm of ``gemm_overlap``."""
    share = k.gemm_bandwidth_share if rows == 1 else k.gemm_batched_bandwidth_share
    memory_s = weight_bytes / (share * hardware.copy_bytes_s)
    compute_s = flops / (k.gemm_compute_share * hardware.matmul_flops_s)
    p = k.gemm_overlap
    return float((memory_s**p + compute_s**p) ** (1.0 / p))


def elementwise_bytes_per_token(model: ModelConfig, inputs: PlanInputs) -> float:
    """Activation bytes the small kernels of one token read and write, per GPU:
    two fused add + RMSNorm (read x and the residual, write both: 4H each),
    SiLU-and-mul (read 2I, write I) and RoPE with the KV write (read and
    write q and k: 3 (heads + KV heads) d), all layers."""
    heads = model.num_heads / inputs.tp
    kv_heads = math.ceil(model.num_kv_heads / inputs.tp)
    per_layer = (8 * model.hidden_size + 3 * model.intermediate_size / inputs.tp
                 + 3 * (heads + kv_heads) * model.head_dim)
    return model.num_layers * per_layer * ACTIVATION_BYTES


def _logits_bytes(model: ModelConfig, inputs: PlanInputs, rows: int) -> float:
    """Float32 logits of ``rows`` sampling rows, written then read once."""
    return 2.0 * rows * model.vocab_size / inputs.tp * LOGIT_BYTES


def decode_step(model: ModelConfig, inputs: PlanInputs, hardware: Hardware, k: StepConstants,
                tokens_per_request: int = 1) -> StepTime:
    """One decode step of ``inputs.batch`` requests attending to ``inputs.context``
    tokens each; ``tokens_per_request`` > 1 is a speculative verify step
    (1 + k tokens per request, each sampled)."""
    params = count_params(model, inputs.tp)
    batch, rows = inputs.batch, inputs.batch * tokens_per_request
    gemm_flops = 2.0 * rows * (params.linear_active + params.vocab_matmul)
    gemm = _gemm_s(weight_read_bytes(params, inputs), gemm_flops, rows, hardware, k)
    streams = batch * math.ceil(model.num_kv_heads / inputs.tp)
    kv_share = k.attention_bandwidth_share * streams / (streams + k.attention_half_streams)
    kv_bytes = kv_bytes_per_token(model, inputs) * inputs.context * batch
    attention = (model.num_layers * (k.attention_layer_us + k.attention_request_us * batch)
                 * 1e-6 + kv_bytes / (kv_share * hardware.copy_bytes_s))
    moved = (rows * elementwise_bytes_per_token(model, inputs)
             + _logits_bytes(model, inputs, rows))
    elementwise = moved / (k.gemm_batched_bandwidth_share * hardware.copy_bytes_s)
    fixed = (k.step_us + k.layer_us * model.num_layers) * 1e-6
    host = (k.host_step_us + k.host_request_us * batch) * 1e-6
    return StepTime(gemm, attention, elementwise, fixed, host)


def prefill_time(model: ModelConfig, inputs: PlanInputs, hardware: Hardware, k: StepConstants,
                 chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> StepTime:
    """One request's ``inputs.prompt`` tokens to its first token, on an idle
    engine: chunks of ``chunk_tokens``, each streaming the decoder's weights,
    the logits matmul once at the end."""
    params = count_params(model, inputs.tp)
    head_bytes = lm_head_bytes(params, inputs)
    layer_bytes = weight_read_bytes(params, inputs) - head_bytes
    prompt = inputs.prompt
    num_chunks = -(-prompt // chunk_tokens)
    gemm = 0.0
    for index in range(num_chunks):
        rows = min(chunk_tokens, prompt - index * chunk_tokens)
        gemm += _gemm_s(layer_bytes, 2.0 * rows * params.linear_active, rows, hardware, k)
    gemm += _gemm_s(head_bytes, 2.0 * params.vocab_matmul, 1, hardware, k)
    attention_flops = (4.0 * model.num_layers * model.num_heads * model.head_dim / inputs.tp
                       * prompt * (prompt + 1) / 2)
    attention = (attention_flops / (k.prefill_attention_share * hardware.matmul_flops_s)
                 + num_chunks * model.num_layers * k.attention_layer_us * 1e-6)
    moved = prompt * elementwise_bytes_per_token(model, inputs) + _logits_bytes(model, inputs, 1)
    elementwise = moved / (k.gemm_batched_bandwidth_share * hardware.copy_bytes_s)
    fixed = (num_chunks * (k.step_us + k.layer_us * model.num_layers) + k.prefill_us) * 1e-6
    return StepTime(gemm, attention, elementwise, fixed)
