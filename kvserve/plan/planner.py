"""The arithmetic of ``kvserve plan``: parameters, KV bytes, fit, roofline times.

Owns the formulas and nothing else: inputs are a ``ModelConfig`` (the
architecture, never the model's name), a ``Hardware`` and ``PlanInputs``;
the output is a ``Plan`` of plain numbers. No I/O, no torch, no printing —
the CLI formats, ``plot.py`` draws. The formulas are written out in
docs/plan.md.

All byte and FLOP figures are per GPU: weights and KV are split ``tp`` ways
(KV by whole heads, so with fewer KV heads than ``tp`` each GPU keeps one
replicated head, as tensor-parallel engines do). Communication is ignored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvserve.config import ModelConfig
from kvserve.plan.gpus import GpuSpec

WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5,
}
KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# embeddings, lm_head, norms and biases stay 16-bit when the linears are quantized
UNQUANTIZED_BYTES = 2.0
# the share of GPU memory weights + KV may take, like gpu_memory_utilization
DEFAULT_MEMORY_UTILIZATION = 0.9


class PlanError(ValueError):
    """A bad planner input; ``flag`` names the CLI flag that carries it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class Hardware:
    """The per-GPU numbers the roofline uses, in bytes, bytes/s and FLOP/s."""

    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    flops_s: float

    @classmethod
    def from_gpu(
        cls,
        gpu: GpuSpec,
        weights: str = "bf16",
        bandwidth_gb_s: float | None = None,
        flops_tflop_s: float | None = None,
        memory_gb: float | None = None,
    ) -> Hardware:
        """The GPU's numbers at the rate ``weights`` run at, with overrides."""
        if weights not in WEIGHT_DTYPE_BYTES:
            raise PlanError("--weights", f"'{weights}' is not one of {sorted(WEIGHT_DTYPE_BYTES)}")
        for flag, value in (("--bandwidth", bandwidth_gb_s), ("--flops", flops_tflop_s),
                            ("--memory", memory_gb)):
            if value is not None and not value > 0:
                raise PlanError(flag, f"must be > 0, got {value}")
        return cls(
            name=gpu.name,
            memory_bytes=(memory_gb if memory_gb is not None else gpu.memory_gb) * 1e9,
            bandwidth_bytes_s=(bandwidth_gb_s or gpu.bandwidth_gb_s) * 1e9,
            flops_s=(flops_tflop_s or gpu.tflops_for(weights)) * 1e12,
        )


@dataclass(frozen=True)
class PlanInputs:
    """The workload: shapes, dtypes, parallelism and speculative settings."""

    tp: int = 1
    batch: int = 1
    context: int = 4096
    prompt: int = 1024
    output: int = 256
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    spec_k: int | None = None
    spec_alpha: float | None = None
    spec_cost_ratio: float | None = None
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        for flag, value, low in (("--tp", self.tp, 1), ("--batch", self.batch, 1),
                                 ("--context", self.context, 1), ("--prompt", self.prompt, 1),
                                 ("--output", self.output, 0)):
            if value < low:
                raise PlanError(flag, f"must be >= {low}, got {value}")
        if self.weights not in WEIGHT_DTYPE_BYTES:
            raise PlanError("--weights", f"'{self.weights}' is not one of "
                                         f"{', '.join(WEIGHT_DTYPE_BYTES)}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise PlanError("--kv-dtype", f"'{self.kv_dtype}' is not one of "
                                          f"{', '.join(KV_DTYPE_BYTES)}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise PlanError("memory_utilization", f"must be in (0, 1], got "
                                                  f"{self.memory_utilization}")
        self._check_spec()

    def _check_spec(self) -> None:
        spec = {"--spec-k": self.spec_k, "--spec-alpha": self.spec_alpha,
                "--spec-cost-ratio": self.spec_cost_ratio}
        missing = [flag for flag, value in spec.items() if value is None]
        if missing and len(missing) < len(spec):
            raise PlanError(missing[0], "--spec-k, --spec-alpha and --spec-cost-ratio go "
                                        f"together; missing: {', '.join(missing)}")
        if self.spec_k is not None and self.spec_k < 1:
            raise PlanError("--spec-k", f"must be >= 1, got {self.spec_k}")
        if self.spec_alpha is not None and not 0.0 <= self.spec_alpha <= 1.0:
            raise PlanError("--spec-alpha", f"must be in [0, 1], got {self.spec_alpha}")
        if self.spec_cost_ratio is not None and self.spec_cost_ratio < 0:
            raise PlanError("--spec-cost-ratio", f"must be >= 0, got {self.spec_cost_ratio}")

    @property
    def has_spec(self) -> bool:
        return self.spec_k is not None


@dataclass(frozen=True)
class ParamCount:
    """Parameters by role; ``linear*`` are the decoder-layer projections."""

    total: int
    embedding: int  # vocab x hidden, a gather (no matmul) when untied
    lm_head: int  # 0 when tied to the embedding
    linear: int  # q, k, v, o, gate, up, down over all layers and experts
    linear_active: int  # the same with only the routed experts of an MoE token
    vocab_matmul: int  # vocab x hidden: the logits matmul, tied or not


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved of one forward pass, per GPU."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def seconds_on(self, hardware: Hardware) -> float:
        """Roofline time: the slower of moving the bytes and doing the FLOPs."""
        return max(self.flops / hardware.flops_s, self.bytes / hardware.bandwidth_bytes_s)

    def bound_on(self, hardware: Hardware) -> str:
        """"compute" or "memory": which term of ``seconds_on`` wins."""
        compute_s = self.flops / hardware.flops_s
        return "compute" if compute_s > self.bytes / hardware.bandwidth_bytes_s else "memory"


@dataclass(frozen=True)
class Plan:
    """What ``kvserve plan`` reports; every byte figure is per GPU."""

    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    kv_bytes_total: int
    fits: bool
    max_batch_at_context: int
    max_context_at_batch: int
    decode_ms_per_step: float
    decode_tokens_per_s: float
    decode_tokens_per_s_per_request: float
    prefill_ms: float
    arithmetic_intensity_decode: float
    ridge_point: float
    bound: str
    e2e_ms: float
    spec_tokens_per_step: float | None = None
    spec_speedup: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _experts(model: ModelConfig) -> tuple[int, int]:
    """(experts whose weights are stored, experts each token runs)."""
    if model.num_experts <= 0:
        return 1, 1
    active = model.hf_config.get("num_experts_per_tok")
    return model.num_experts, int(active) if active else model.num_experts


def count_params(model: ModelConfig) -> ParamCount:
    """Count parameters from the architecture, role by role."""
    hidden, q_dim = model.hidden_size, model.num_heads * model.head_dim
    kv_dim = model.num_kv_heads * model.head_dim
    num_experts, num_active = _experts(model)
    expert_size = int(model.hf_config.get("moe_intermediate_size") or model.intermediate_size)
    mlp_size = expert_size if model.num_experts > 0 else model.intermediate_size
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    mlp = 3 * hidden * mlp_size
    small = 2 * hidden  # input and post-attention RMSNorm
    small += (q_dim + 2 * kv_dim) if model.qkv_bias else 0
    small += 2 * model.head_dim if model.qk_norm else 0
    small += hidden * num_experts if model.num_experts > 0 else 0  # router
    embedding = model.vocab_size * hidden
    lm_head = 0 if model.tie_word_embeddings else embedding
    linear = model.num_layers * (attn + mlp * num_experts)
    total = embedding + lm_head + linear + model.num_layers * small + hidden
    return ParamCount(
        total=total,
        embedding=embedding,
        lm_head=lm_head,
        linear=linear,
        linear_active=model.num_layers * (attn + mlp * num_active),
        vocab_matmul=embedding,
    )


def weight_bytes(params: ParamCount, inputs: PlanInputs) -> float:
    """Bytes of all weights on one GPU (the memory footprint)."""
    quantized = params.linear * WEIGHT_DTYPE_BYTES[inputs.weights]
    return (quantized + (params.total - params.linear) * UNQUANTIZED_BYTES) / inputs.tp


def weight_read_bytes(params: ParamCount, inputs: PlanInputs) -> float:
    """Bytes of weights one forward pass reads on one GPU.

    The embedding lookup is a gather of a few rows, so an untied embedding
    table is not read; a tied one is read once, by the logits matmul.
    """
    skipped = params.embedding if params.lm_head else 0
    return weight_bytes(params, inputs) - skipped * UNQUANTIZED_BYTES / inputs.tp


def kv_bytes_per_token(model: ModelConfig, inputs: PlanInputs) -> int:
    """2 (K and V) x layers x KV heads on this GPU x head_dim x bytes."""
    kv_heads_per_gpu = math.ceil(model.num_kv_heads / inputs.tp)
    return (2 * model.num_layers * kv_heads_per_gpu * model.head_dim
            * KV_DTYPE_BYTES[inputs.kv_dtype])


def _attention_flops_per_key(model: ModelConfig, inputs: PlanInputs) -> float:
    """FLOPs of one query attending to one key, all layers: QK^T and PV."""
    return 4.0 * model.num_layers * model.num_heads * model.head_dim / inputs.tp


def decode_cost(model: ModelConfig, inputs: PlanInputs) -> Cost:
    """One decode step: every request adds a token attending to ``context``."""
    params = count_params(model)
    matmul = 2.0 * (params.linear_active + params.vocab_matmul) / inputs.tp
    attention = _attention_flops_per_key(model, inputs) * inputs.context
    kv_bytes = kv_bytes_per_token(model, inputs) * inputs.context * inputs.batch
    return Cost(
        flops=(matmul + attention) * inputs.batch,
        bytes=weight_read_bytes(params, inputs) + kv_bytes,
    )


def prefill_cost(model: ModelConfig, inputs: PlanInputs) -> Cost:
    """One request's prompt in one pass; logits only for its last token.

    Causal attention: query i sees i + 1 keys, P(P + 1)/2 pairs in all.
    """
    params = count_params(model)
    prompt = inputs.prompt
    matmul = 2.0 * (params.linear_active * prompt + params.vocab_matmul) / inputs.tp
    attention = _attention_flops_per_key(model, inputs) * prompt * (prompt + 1) / 2
    kv_written = kv_bytes_per_token(model, inputs) * prompt
    return Cost(flops=matmul + attention, bytes=weight_read_bytes(params, inputs) + kv_written)


def _spec_decode(inputs: PlanInputs) -> tuple[float | None, float | None]:
    """(tokens per step, speed-up) of speculative decoding, the simple form.

    k draft tokens each accepted with probability alpha give k·alpha + 1
    tokens per target step (an upper bound: exact i.i.d. acceptance gives
    (1 - alpha^(k+1)) / (1 - alpha)); a step costs 1 + k·r target steps.
    """
    k, alpha, ratio = inputs.spec_k, inputs.spec_alpha, inputs.spec_cost_ratio
    if k is None or alpha is None or ratio is None:
        return None, None
    tokens = k * alpha + 1
    return tokens, tokens / (1 + k * ratio)


def compute_plan(model: ModelConfig, hardware: Hardware, inputs: PlanInputs) -> Plan:
    """Everything ``kvserve plan`` reports for one model, GPU and workload."""
    params = count_params(model)
    weights = weight_bytes(params, inputs)
    per_token = kv_bytes_per_token(model, inputs)
    per_request = per_token * inputs.context
    total = per_request * inputs.batch
    free = hardware.memory_bytes * inputs.memory_utilization - weights

    decode = decode_cost(model, inputs)
    step_s = decode.seconds_on(hardware)
    prefill_s = prefill_cost(model, inputs).seconds_on(hardware)

    spec_tokens, spec_speedup = _spec_decode(inputs)
    return Plan(
        params=params.total,
        weight_bytes=math.ceil(weights),
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        kv_bytes_total=total,
        fits=weights + total <= hardware.memory_bytes * inputs.memory_utilization,
        max_batch_at_context=max(0, math.floor(free / per_request)),
        max_context_at_batch=max(0, math.floor(free / (per_token * inputs.batch))),
        decode_ms_per_step=step_s * 1e3,
        decode_tokens_per_s=inputs.batch / step_s,
        decode_tokens_per_s_per_request=1.0 / step_s,
        prefill_ms=prefill_s * 1e3,
        arithmetic_intensity_decode=decode.intensity,
        ridge_point=hardware.flops_s / hardware.bandwidth_bytes_s,
        bound=decode.bound_on(hardware),
        e2e_ms=(prefill_s + inputs.output * step_s) * 1e3,
        spec_tokens_per_step=spec_tokens,
        spec_speedup=spec_speedup,
    )
