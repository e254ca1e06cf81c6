"""What ``kvserve bench latency`` and ``kvserve bench throughput`` share.

``resolve_engine`` turns the engine flags into a checked configuration
before anything heavy runs, so a bad flag fails at once. ``start`` measures
the device's copy and matmul rates in the engine's dtype (in the same process,
before the engine takes its memory; on the CPU with the engine's thread count),
then builds the engine.
``ModelFigures`` holds the planner's parameter and KV counts at the engine's
element size: the bytes one decode step must read (MBU) and the FLOPs per
token (MFU). ``OfflineBench.result`` assembles the JSON every run writes.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.bench.device_rates import DeviceRates, measure_rates
from kvserve.bench.report import environment
from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine.args import EngineArgs
from kvserve.param_count import count_params
from kvserve.plan.counts import (
    KV_DTYPE_BYTES,
    PLAN_KV_DTYPES,
    PlanInputs,
    kv_bytes_per_token,
    weight_read_bytes,
)
from kvserve.plan.utilization import mbu, mfu

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM


@dataclass(frozen=True)
class ModelFigures:
    """The planner's counts for one model, in bytes of the engine's dtype."""

    params: int
    weight_read_bytes: float  # every weight but an untied embedding table (a gather)
    kv_bytes_per_token: float  # K and V, all layers

    @classmethod
    def of(cls, model: ModelConfig, element_bytes: int,
           kv_cache_dtype: str = "auto") -> ModelFigures:
        """The planner counts 16-bit weights and KV; scale them to ``element_bytes``
        (weight-only quantised linears: to their packed bytes; a quantised KV
        cache, ``kv_cache_dtype`` fp8_e4m3 or int8: its own bytes)."""
        inputs = PlanInputs()  # bf16 weights and KV on one GPU
        scale = element_bytes / KV_DTYPE_BYTES[inputs.kv_dtype]
        params = count_params(model)
        read_bytes = weight_read_bytes(params, inputs) * scale
        quant = model.quantization
        if quant is not None:  # packed values plus their scales and zero points
            quantized = quant.num_quantized(params.linear, params.lm_head)
            read_bytes -= quantized * (
                element_bytes - quant.bytes_per_weight(model.hidden_size, element_bytes))
        kv_bytes = kv_bytes_per_token(model, inputs) * scale
        if kv_cache_dtype != "auto":
            kv_bytes = kv_bytes_per_token(model, PlanInputs(
                kv_dtype=PLAN_KV_DTYPES[kv_cache_dtype]))
        return cls(params=params.total, weight_read_bytes=read_bytes,
                   kv_bytes_per_token=kv_bytes)

    def decode_step_bytes(self, batch_size: int, mean_context: float) -> float:
        """Bytes one decode step must read: the weights once, plus the KV of
        ``batch_size`` requests of ``mean_context`` tokens."""
        return self.weight_read_bytes + self.kv_bytes_per_token * batch_size * mean_context

    def mbu(self, batch_size: int, mean_context: float, decode_tok_s: float,
            bandwidth_gb_s: float) -> float:
        """``utilization.mbu`` of decode steps at ``decode_tok_s`` / batch steps/s."""
        return mbu(self.decode_step_bytes(batch_size, mean_context),
                   batch_size / decode_tok_s, bandwidth_gb_s * 1e9)

    def mfu(self, tokens_s: float, tflop_s: float) -> float:
        """``utilization.mfu`` against a matmul rate in TFLOP/s."""
        return mfu(self.params, tokens_s, tflop_s * 1e12)


def mean_decode_context(input_len: int, output_len: int) -> float:
    """The mean context of the decode steps of a request: they attend over
    input + 1 ... input + output - 1 tokens, input + output / 2 on average."""
    return input_len + output_len / 2


def resolve_engine(args: argparse.Namespace) -> tuple[EngineArgs, EngineConfig]:
    """The engine flags, checked and resolved (reads config.json; loads nothing)."""
    engine_args = EngineArgs.from_cli_args(args)
    return engine_args, engine_args.create_engine_config()


def check_fits(config: EngineConfig, num_tokens: int, what: str) -> None:
    """ValueError naming ``what`` when a request of ``num_tokens`` cannot run."""
    max_model_len = config.scheduler_config.max_model_len
    if num_tokens > max_model_len:
        raise ValueError(f"{what} needs {num_tokens} tokens (prompt + output), more than "
                         f"max_model_len={max_model_len} (--max-model-len)")


@dataclass
class OfflineBench:
    """A built engine and what was measured before it was built."""

    llm: LLM
    engine_args: EngineArgs
    config: EngineConfig
    device: str
    dtype: str
    rates: DeviceRates
    figures: ModelFigures

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.vocab_size

    def result(self, benchmark: str, figures: dict[str, Any]) -> dict[str, Any]:
        """The JSON of one run: environment, engine, rates, model counts,
        ``figures``, and the engine's counters since it started (warm-ups too)."""
        return {"benchmark": benchmark, **environment(), "model": self.config.model,
                "device": self.device, "dtype": self.dtype, **self.rates.to_dict(),
                **dataclasses.asdict(self.figures),
                "engine_args": dataclasses.asdict(self.engine_args), **figures,
                "engine_stats": self.llm.stats()}


def start(engine_args: EngineArgs, config: EngineConfig) -> OfflineBench:
    """Measure the device's rates in the engine's dtype, then build the engine."""
    import torch

    from kvserve.engine.engine_core import freeze_startup_heap
    from kvserve.engine.llm import LLM
    from kvserve.models.loader import resolve_dtype
    from kvserve.worker.cpu_host import configure_cpu_threads
    from kvserve.worker.executor import resolve_device

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, config.model_config, device)
    if device.type == "cpu":  # the rates (and the card's name) with the engine's threads
        configure_cpu_threads(config.num_cpu_threads)
    rates = measure_rates(device, dtype)
    llm = LLM(**dataclasses.asdict(engine_args))
    freeze_startup_heap()  # the benchmark's process owns the engine
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return OfflineBench(llm=llm, engine_args=engine_args, config=config, device=str(device),
                        dtype=rates.matmul_dtype, rates=rates,
                        figures=ModelFigures.of(config.model_config, element_bytes,
                                                config.cache_config.kv_cache_dtype))
