"""The inputs of ``kvserve plan`` and what they count to: bytes and FLOPs.

Owns the checked inputs (``PlanInputs``, ``Hardware``) and the counting
formulas: weight bytes, KV bytes, the FLOPs and bytes of a decode step and
of a prefill, the tensor-parallel shard check. No I/O, no torch, no
printing; ``planner.py`` turns counts into a plan, ``step_model.py`` into
predicted times. The formulas are written out in docs/plan.md.

All byte and FLOP figures are per GPU: weights and KV are split ``tp`` ways
as the engine splits them (``count_params(model, tp)``: KV heads whole, so
with fewer KV heads than ``tp`` each GPU keeps one replicated head of the
cache and of the k and v projections; norms whole on every GPU). The
matmul FLOPs follow the weights. Communication is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.param_count import ParamCount, count_params, shardable_tp, tp_problems
from kvserve.plan.gpus import GpuSpec, rates_for

WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5,
}
KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# bytes of the scale kept beside each token's head vector: kvserve's int8 KV
# cache has a float32 one per token, KV head and K/V (fp8's are per layer and head)
KV_SCALE_BYTES: dict[str, int] = {"int8": 4}
# the engine's quantised --kv-cache-dtype -> the plan's --kv-dtype
PLAN_KV_DTYPES: dict[str, str] = {"fp8_e4m3": "fp8", "int8": "int8"}
# embeddings, lm_head, norms and biases stay 16-bit when the linears are quantized
UNQUANTIZED_BYTES = 2.0
# activations between the kernels of a step are 16-bit; logits are float32
ACTIVATION_BYTES = 2
LOGIT_BYTES = 4
# the share of GPU memory weights + KV may take, like gpu_memory_utilization
DEFAULT_MEMORY_UTILIZATION = 0.9


class PlanError(ValueError):
    """A bad planner input; ``flag`` names the CLI flag that carries it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class Hardware:
    """The per-GPU numbers a plan uses, in bytes, bytes/s and FLOP/s.

    ``bandwidth_bytes_s`` and ``flops_s`` are the spec sheet's peaks (the
    roofline); ``copy_bytes_s`` and ``matmul_flops_s`` the rates the card
    sustains, measured (``rates_source`` says where), which the step model
    predicts from. ``flops_s`` and ``matmul_flops_s`` are at the rate the
    ``--weights`` dtype runs at.
    """

    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    flops_s: float
    copy_bytes_s: float
    matmul_flops_s: float
    rates_source: str

    @classmethod
    def from_gpu(
        cls,
        gpu: GpuSpec,
        weights: str = "bf16",
        bandwidth_gb_s: float | None = None,
        flops_tflop_s: float | None = None,
        memory_gb: float | None = None,
        copy_gb_s: float | None = None,
        matmul_tflop_s: float | None = None,
        rates_source: str | None = None,
    ) -> Hardware:
        """The GPU's numbers at the rate ``weights`` run at.

        ``copy_gb_s`` / ``matmul_tflop_s`` (a calibration of this card) replace
        the table's measured rates; ``bandwidth_gb_s`` / ``flops_tflop_s`` (the
        user's overrides) replace both the peak and the sustained rate.
        """
        if weights not in WEIGHT_DTYPE_BYTES:
            raise PlanError("--weights", f"'{weights}' is not one of {sorted(WEIGHT_DTYPE_BYTES)}")
        for flag, value in (("--bandwidth", bandwidth_gb_s), ("--flops", flops_tflop_s),
                            ("--memory", memory_gb)):
            if value is not None and not value > 0:
                raise PlanError(flag, f"must be > 0, got {value}")
        table = rates_for(gpu)
        copy = copy_gb_s or table.copy_gb_s
        matmul = matmul_tflop_s or table.tflops_for(weights, gpu)
        source = rates_source or table.source
        if bandwidth_gb_s or flops_tflop_s:
            copy, matmul = bandwidth_gb_s or copy, flops_tflop_s or matmul
            source = "--bandwidth / --flops as given; " + source
        return cls(
            name=gpu.name,
            memory_bytes=(memory_gb if memory_gb is not None else gpu.memory_gb) * 1e9,
            bandwidth_bytes_s=(bandwidth_gb_s or gpu.bandwidth_gb_s) * 1e9,
            flops_s=(flops_tflop_s or gpu.tflops_for(weights)) * 1e12,
            copy_bytes_s=copy * 1e9,
            matmul_flops_s=matmul * 1e12,
            rates_source=source,
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
    # the host KV tier (--kv-offload-gb), GB over all GPUs together
    kv_offload_gb: float = 0.0

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
        if self.kv_offload_gb < 0:
            raise PlanError("--kv-offload-gb", f"must be >= 0, got {self.kv_offload_gb}")
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


def check_tp(model: ModelConfig, tp: int) -> None:
    """Refuse a ``tp`` the model's shapes cannot be split over, by the engine's
    own rule (``sharding.tp_problems``): heads split whole, KV heads split
    whole or are replicated (``tp`` a multiple of them), the MLP splits evenly."""
    problems = tp_problems(model, tp)
    if problems:
        allowed = ", ".join(str(n) for n in shardable_tp(model))
        raise PlanError("--tp", f"{tp} does not split this model: {'; '.join(problems)}; "
                                f"sizes this model can use: {allowed}")


def _check_rank_params(params: ParamCount, inputs: PlanInputs) -> None:
    if params.tp != inputs.tp:
        raise ValueError(f"params counted for tp={params.tp} but the plan is for "
                         f"--tp {inputs.tp}: pass count_params(model, {inputs.tp})")


def weight_bytes(params: ParamCount, inputs: PlanInputs) -> float:
    """Bytes of all weights on one GPU (the memory footprint); ``params`` is
    one rank's count, ``count_params(model, inputs.tp)``."""
    _check_rank_params(params, inputs)
    quantized = params.linear * WEIGHT_DTYPE_BYTES[inputs.weights]
    return quantized + (params.total - params.linear) * UNQUANTIZED_BYTES


def weight_read_bytes(params: ParamCount, inputs: PlanInputs) -> float:
    """Bytes of weights one forward pass reads on one GPU (``params`` one rank's).

    The embedding lookup is a gather of a few rows, so an untied embedding
    table is not read; a tied one is read once, by the logits matmul.
    """
    skipped = params.embedding if params.lm_head else 0
    return weight_bytes(params, inputs) - skipped * UNQUANTIZED_BYTES


def lm_head_bytes(params: ParamCount, inputs: PlanInputs) -> float:
    """Bytes of the logits matmul's weights on one GPU (16-bit, tied or not;
    ``params`` one rank's)."""
    _check_rank_params(params, inputs)
    return params.vocab_matmul * UNQUANTIZED_BYTES


def kv_bytes_per_token(model: ModelConfig, inputs: PlanInputs) -> int:
    """2 (K and V) x layers x KV heads on this GPU x (head_dim x bytes, plus an
    int8 cache's per-token scale)."""
    kv_heads_per_gpu = math.ceil(model.num_kv_heads / inputs.tp)
    return (2 * model.num_layers * kv_heads_per_gpu
            * (model.head_dim * KV_DTYPE_BYTES[inputs.kv_dtype]
               + KV_SCALE_BYTES.get(inputs.kv_dtype, 0)))


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


def _attention_flops_per_key(model: ModelConfig, inputs: PlanInputs) -> float:
    """FLOPs of one query attending to one key, all layers: QK^T and PV."""
    return 4.0 * model.num_layers * model.num_heads * model.head_dim / inputs.tp


def decode_cost(model: ModelConfig, inputs: PlanInputs) -> Cost:
    """One decode step: every request adds a token attending to ``context``.
    Its bytes are what MBU is taken over (``utilization.mbu``)."""
    params = count_params(model, inputs.tp)
    matmul = 2.0 * (params.linear_active + params.vocab_matmul)
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
    params = count_params(model, inputs.tp)
    prompt = inputs.prompt
    matmul = 2.0 * (params.linear_active * prompt + params.vocab_matmul)
    attention = _attention_flops_per_key(model, inputs) * prompt * (prompt + 1) / 2
    kv_written = kv_bytes_per_token(model, inputs) * prompt
    return Cost(flops=matmul + attention, bytes=weight_read_bytes(params, inputs) + kv_written)
