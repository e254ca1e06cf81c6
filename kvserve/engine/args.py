"""Engine arguments: the user-facing knobs (as keyword arguments of ``LLM``
or flags of the CLI) and their resolution into one frozen ``EngineConfig``.

Resolving reads the model's ``config.json`` (or a preset) to learn the
architecture and the context length; weights are loaded later, by the
worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvserve.assets import default_model_path
from kvserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.engine.tokenizer import has_tokenizer
from kvserve.models.source import resolve_model_config
from kvserve.quant.config import QUANTIZE_AT_LOAD
from kvserve.quant.formats import QUANTIZATION_CHOICES, read_quantize_config, resolve_quantization

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")
# CUDA graphs are captured for decode batches up to this size at most
MAX_CUDA_GRAPH_SIZE = 512


def default_cuda_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (capped at 512),
    which is always included so every batch the scheduler can form is covered."""
    top = min(max_num_seqs, MAX_CUDA_GRAPH_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def default_cuda_graph_token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Step sizes in tokens for graphs of prefill and mixed steps: 16, 32, 64,
    128, 256, every multiple of 128 up to 2,048, then of 256, up to
    ``max_num_batched_tokens`` (always included). Finer steps pad less (a
    padded token costs a token's matmuls); the scheduler trims a step's last
    prefill chunk to end on one of them where it can."""
    top = max_num_batched_tokens
    sizes = {s for s in (16, 32, 64, 128, 256) if s <= top}
    sizes |= set(range(384, min(top, 2048) + 1, 128)) | set(range(2304, top + 1, 256)) | {top}
    return tuple(sorted(sizes))


def resolve_attention_backend(name: str, device: str) -> str:
    """``"auto"`` is ``"triton"`` when the engine runs on CUDA and Triton is
    installed, else ``"torch"``; other names pass through (the registry checks
    them when the worker starts)."""
    if name != "auto":
        return name
    if device == "cpu" or importlib.util.find_spec("triton") is None:
        return "torch"
    import torch

    return "triton" if torch.cuda.is_available() else "torch"


def resolve_async_scheduling(flag: bool | None, device: str) -> bool:
    """Unset means on when the engine runs on CUDA, where the device works
    while the host prepares the next step; on the CPU the forward runs in the
    calling thread, so there is nothing to overlap."""
    if flag is not None:
        return flag
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


@dataclass
class EngineArgs:
    """User-facing engine knobs, with vLLM's names."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    device: str = "auto"
    attention_backend: str = "auto"
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    cuda_graph_token_sizes: list[int] | None = None
    async_scheduling: bool | None = None
    quantization: str | None = None
    quantize_lm_head: bool = False

    def create_engine_config(self) -> EngineConfig:
        model = self.model or str(default_model_path())
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format='{self.load_format}' is invalid: must be one of {LOAD_FORMATS}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device='{self.device}' is invalid: must be one of {DEVICES}")
        model_config, path = resolve_model_config(model)
        model_config = self._quantization(model_config, path)
        if path is None and self.load_format != "dummy":
            raise ValueError(
                f"model='{model}' is a preset with no weights: pass load_format='dummy' "
                "(--load-format dummy) to run it with random weights"
            )
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}"
            )
        max_batched = self.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS
            if self.enable_chunked_prefill
            else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        )
        attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        cuda_graph_sizes: tuple[int, ...] = ()
        cuda_graph_token_sizes: tuple[int, ...] = ()
        if not self.enforce_eager and attention_backend == "triton" and self.device != "cpu":
            cuda_graph_sizes = self._cuda_graph_sizes()
            cuda_graph_token_sizes = self._cuda_graph_token_sizes(max_batched)
        # without tokenizer files the engine falls back to the byte tokenizer
        tokenizer = self.tokenizer or (str(path) if path is not None and has_tokenizer(path)
                                       else None)
        return EngineConfig(
            model=model,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                async_scheduling=resolve_async_scheduling(self.async_scheduling, self.device),
            ),
            lora_config=(LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)
                         if self.enable_lora else None),
            model_path=str(path) if path is not None else None,
            tokenizer_path=str(Path(tokenizer)) if tokenizer else None,
            load_format=self.load_format,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            attention_backend=attention_backend,
            cuda_graph_sizes=cuda_graph_sizes,
            cuda_graph_token_sizes=cuda_graph_token_sizes,
        )

    def _quantization(self, model_config: ModelConfig, path: Path | None) -> ModelConfig:
        """``model_config`` with the weight quantisation to serve it with: the
        checkpoint's own, or what ``quantization`` asks for (checked against it)."""
        if self.quantize_lm_head and self.quantization not in QUANTIZE_AT_LOAD:
            raise ValueError(
                f"quantize_lm_head=True needs a quantization that rounds at load "
                f"({', '.join(QUANTIZE_AT_LOAD)}); got quantization={self.quantization!r}"
            )
        source = str(path / "config.json") if path is not None else "the preset"
        quantize_config = read_quantize_config(path) if path is not None else None
        quantization = resolve_quantization(model_config.hf_config, self.quantization, source,
                                            quantize_config, self.quantize_lm_head)
        return dataclasses.replace(model_config, quantization=quantization)

    def _cuda_graph_sizes(self) -> tuple[int, ...]:
        if self.cuda_graph_sizes is None:
            return default_cuda_graph_sizes(self.max_num_seqs)
        bad = [s for s in self.cuda_graph_sizes if not 1 <= s <= self.max_num_seqs]
        if bad:
            raise ValueError(
                f"cuda_graph_sizes={self.cuda_graph_sizes} is invalid: every size must be in "
                f"[1, max_num_seqs={self.max_num_seqs}]; got {bad}"
            )
        return tuple(sorted(set(self.cuda_graph_sizes)))

    def _cuda_graph_token_sizes(self, max_batched: int) -> tuple[int, ...]:
        if self.cuda_graph_token_sizes is None:
            return default_cuda_graph_token_sizes(max_batched)
        bad = [s for s in self.cuda_graph_token_sizes if not 2 <= s <= max_batched]
        if bad:
            raise ValueError(
                f"cuda_graph_token_sizes={self.cuda_graph_token_sizes} is invalid: every size "
                f"must be in [2, max_num_batched_tokens={max_batched}]; got {bad}"
            )
        return tuple(sorted(set(self.cuda_graph_token_sizes)))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per field (underscores become dashes)."""
        defaults = EngineArgs()
        group = parser.add_argument_group("engine")
        group.add_argument("--model", default=None,
                           help="local Hugging Face directory or preset name "
                                "(default: the bundled model)")
        group.add_argument("--tokenizer", default=None)
        group.add_argument("--dtype", default=defaults.dtype,
                           help="auto | float32 | float16 | bfloat16")
        group.add_argument("--load-format", default=defaults.load_format, choices=LOAD_FORMATS)
        group.add_argument("--seed", type=int, default=defaults.seed)
        group.add_argument("--device", default=defaults.device, choices=DEVICES)
        group.add_argument("--attention-backend", default=defaults.attention_backend)
        group.add_argument("--enable-lora", action="store_true",
                           help="serve LoRA adapters (LoRARequest, --lora-modules)")
        group.add_argument("--max-loras", type=int, default=defaults.max_loras,
                           help="adapters resident on the device at once")
        group.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank)
        group.add_argument("--block-size", type=int, default=defaults.block_size)
        group.add_argument("--num-kv-blocks", type=int, default=None)
        group.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype,
                           help="auto (the model's dtype) | fp8_e4m3 (alias fp8: scales from "
                                "the checkpoint, else 1.0) | int8 (a scale per token and KV "
                                "head): about twice the tokens in the same memory")
        group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                           action="store_false")
        group.add_argument("--gpu-memory-utilization", type=float,
                           default=defaults.gpu_memory_utilization)
        group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
        group.add_argument("--max-num-batched-tokens", type=int, default=None)
        group.add_argument("--max-model-len", type=int, default=None)
        group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                           action="store_false")
        group.add_argument("--scheduling-policy", default=defaults.scheduling_policy,
                           choices=("fcfs", "priority"))
        group.add_argument("--enforce-eager", action="store_true",
                           help="no CUDA graphs: run every step eagerly")
        group.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                           help="decode batch sizes to capture as CUDA graphs "
                                "(default: 1 2 4 8 16 24 ... up to max_num_seqs, at most 512)")
        group.add_argument("--cuda-graph-token-sizes", type=int, nargs="*", default=None,
                           help="step sizes in tokens to capture prefill and mixed steps at "
                                "(default: 16 32 64 128 256, then every 128 up to 2048 and "
                                "every 256 up to max_num_batched_tokens; none: such steps "
                                "run eagerly)")
        group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                           default=None,
                           help="schedule the next step while the current one runs "
                                "(default: on with CUDA, off on the CPU)")
        group.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                           help="weight quantisation: gptq | awq | compressed-tensors check "
                                "the checkpoint's own (detected when unset); int8 (per "
                                "channel) or int4 (groups of 128, or -g32 / -g64) round a "
                                "16-bit checkpoint's linears as it loads")
        group.add_argument("--quantize-lm-head", action="store_true",
                           help="with --quantization, quantise the LM head too "
                                "(untied heads only)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})
