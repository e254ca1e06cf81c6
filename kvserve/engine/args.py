"""Engine arguments: the user-facing knobs (as keyword arguments of ``LLM``
or flags of the CLI) and their resolution into one frozen ``EngineConfig``.

Resolving reads the model's ``config.json`` (or a preset) to learn the
architecture and the context length, a hub id being fetched into the
Hugging Face cache first (``kvserve/models/hub.py``); weights are loaded
later, by the worker. Flags are checked before anything is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve import envs
from kvserve.assets import default_model_path
from kvserve.config import (
    ALL_REDUCE_BACKENDS,
    PREEMPTION_MODES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvserve.distributed.sharding import check_split
from kvserve.engine.generation_config import read_sampling_defaults
from kvserve.engine.speculative import resolve_speculative_config
from kvserve.engine.tokenizer import has_tokenizer
from kvserve.models.hub import HubOptions
from kvserve.models.source import resolve_model_config, resolve_model_path
from kvserve.quant.config import QUANTIZE_AT_LOAD
from kvserve.quant.formats import QUANTIZATION_CHOICES, read_quantize_config, resolve_quantization

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")
# CUDA graphs are captured for decode batches up to this size at most
MAX_CUDA_GRAPH_SIZE = 512
# the most top logprobs a request may ask for, unless --max-logprobs says otherwise
DEFAULT_MAX_LOGPROBS = 20
# vLLM's kv_role names -> ours
_VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# --kv-transfer-config keys -> (KVTransferConfig field, conversion)
_KV_TRANSFER_KEYS: dict[str, tuple[str, Any]] = {
    "kv_role": ("kv_role", str), "kv_ip": ("kv_transfer_host", str),
    "kv_port": ("kv_transfer_port", int), "kv_timeout": ("kv_transfer_timeout_s", float)}


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


def resolve_async_scheduling(flag: bool | None, device: str, world_size: int = 1) -> bool:
    """Unset means on when the engine runs on CUDA, where the device works
    while the host prepares the next step, or in worker processes (tensor /
    pipeline parallelism); on the CPU in one process the forward runs in the
    calling thread, so there is nothing to overlap."""
    if flag is not None:
        return flag
    if world_size > 1:
        return True
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
    max_cpu_loras: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_offload_gb: float = 0.0
    preemption_mode: str = "recompute"
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
    revision: str | None = None
    hf_token: str | None = None
    download_dir: str | None = None
    chat_template: str | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    num_cpu_threads: int | None = None
    # "auto": the model's generation_config.json; "vllm": none; else a folder holding one
    generation_config: str = "auto"
    kv_role: str = "both"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 14579
    kv_transfer_timeout: float = 30.0
    # vLLM's spelling, a JSON object; its keys override the flags above
    kv_transfer_config: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: torchrun's variables (MASTER_ADDR, ...) when set, else one node on 127.0.0.1
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    distributed_timeout_s: float = 300.0
    all_reduce: str = "nccl"
    # vLLM's keys: {"method": "ngram" | "draft_model" | "eagle" | "oracle",
    # "num_speculative_tokens": k, "model": PATH, ...} (a dict, or its JSON)
    speculative_config: dict[str, Any] | str | None = None

    def create_engine_config(self) -> EngineConfig:
        model = self.model or str(default_model_path())
        self._check_flags()
        chat_template = read_chat_template(self.chat_template)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format='{self.load_format}' is invalid: must be one of {LOAD_FORMATS}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device='{self.device}' is invalid: must be one of {DEVICES}")
        hub = HubOptions(self.revision, self.hf_token, self.download_dir)
        model_config, path = resolve_model_config(model, hub,
                                                  weights=self.load_format != "dummy")
        model_config = self._quantization(model_config, path)
        parallel_config = self._parallel_config()
        check_split(model_config, parallel_config.tensor_parallel_size,
                    parallel_config.pipeline_parallel_size)
        if self.speculative_config is not None and parallel_config.world_size > 1:
            raise ValueError(
                "speculative_config: speculative decoding runs in one process for now; got "
                f"tensor_parallel_size={parallel_config.tensor_parallel_size} x "
                f"pipeline_parallel_size={parallel_config.pipeline_parallel_size}"
            )
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
        tokenizer = self._tokenizer_path(model, path, hub)
        sampling_defaults = read_sampling_defaults(self.generation_config,
                                                   str(path) if path is not None else None)
        return EngineConfig(
            model=model,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_offload_gb=self.kv_offload_gb,
                preemption_mode=self.preemption_mode,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                async_scheduling=resolve_async_scheduling(self.async_scheduling, self.device,
                                                          parallel_config.world_size),
                pipeline_parallel_size=parallel_config.pipeline_parallel_size,
            ),
            lora_config=(LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                                    max_cpu_loras=self.max_cpu_loras)
                         if self.enable_lora else None),
            parallel_config=parallel_config,
            model_path=str(path) if path is not None else None,
            tokenizer_path=str(tokenizer) if tokenizer is not None else None,
            load_format=self.load_format,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            attention_backend=attention_backend,
            cuda_graph_sizes=cuda_graph_sizes,
            cuda_graph_token_sizes=cuda_graph_token_sizes,
            chat_template=chat_template,
            max_logprobs=self.max_logprobs,
            num_cpu_threads=self.num_cpu_threads,
            sampling_defaults=sampling_defaults,
            speculative_config=resolve_speculative_config(self.speculative_config, model_config,
                                                          path, max_model_len),
            kv_transfer_config=self._kv_transfer_config(),
        )

    def _kv_transfer_config(self) -> KVTransferConfig:
        """The role and transfer address, from the flags or from vLLM's
        ``--kv-transfer-config`` JSON (kv_role kv_producer / kv_consumer /
        kv_both, or prefill / decode / both; kv_ip, kv_port, kv_timeout)."""
        values: dict[str, Any] = {
            "kv_role": self.kv_role, "kv_transfer_host": self.kv_transfer_host,
            "kv_transfer_port": self.kv_transfer_port,
            "kv_transfer_timeout_s": float(self.kv_transfer_timeout)}
        if self.kv_transfer_config:
            try:
                given = json.loads(self.kv_transfer_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
            if not isinstance(given, dict):
                raise ValueError("kv_transfer_config must be a JSON object, e.g. "
                                 '\'{"kv_role": "kv_producer", "kv_port": 14579}\'')
            unknown = set(given) - set(_KV_TRANSFER_KEYS) - {"kv_connector"}
            if unknown:
                raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}; known: "
                                 f"{sorted(_KV_TRANSFER_KEYS)} (and kv_connector, ignored)")
            for key, value in given.items():
                if key in _KV_TRANSFER_KEYS:
                    name, convert = _KV_TRANSFER_KEYS[key]
                    values[name] = convert(value)
        values["kv_role"] = _VLLM_KV_ROLES.get(values["kv_role"], values["kv_role"])
        return KVTransferConfig(**values)

    def _parallel_config(self) -> ParallelConfig:
        """The split and the node layout; unset node flags fall back to torchrun's
        variables (MASTER_ADDR, MASTER_PORT, NODE_RANK, NNODES)."""
        torchrun = envs.torchrun_defaults()
        given = {"nnodes": self.nnodes, "node_rank": self.node_rank,
                 "master_addr": self.master_addr, "master_port": self.master_port}
        nodes = {key: value if value is not None else torchrun[key]
                 for key, value in given.items() if value is not None or key in torchrun}
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_timeout_s=float(self.distributed_timeout_s), all_reduce=self.all_reduce,
            **nodes,  # type: ignore[arg-type]
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

    def _check_flags(self) -> None:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs} is invalid: must be >= 0, or "
                             "-1 for no limit (the vocabulary)")
        if self.num_cpu_threads is not None and self.num_cpu_threads < 1:
            raise ValueError(f"num_cpu_threads={self.num_cpu_threads} is invalid: must be >= 1 "
                             "(unset: chosen at start-up)")

    def _tokenizer_path(self, model: str, path: Path | None, hub: HubOptions) -> Path | None:
        """``tokenizer`` (a directory or a hub id), else the model's own files;
        None (the byte tokenizer) when there are none."""
        if self.tokenizer is None or self.tokenizer == model:
            return path if path is not None and has_tokenizer(path) else None
        tokenizer = Path(self.tokenizer).expanduser()
        if tokenizer.is_dir():
            return tokenizer
        return resolve_model_path(self.tokenizer, HubOptions(None, hub.token, hub.cache_dir),
                                  field="tokenizer")

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
                           help="a local Hugging Face directory, a Hugging Face hub id "
                                "(org/name, fetched into the hub's cache) or a preset name "
                                "(default: the bundled model)")
        group.add_argument("--tokenizer", default=None,
                           help="a directory or hub id to take the tokenizer from "
                                "(default: the model's own)")
        group.add_argument("--dtype", default=defaults.dtype,
                           help="auto | float32 | float16 | bfloat16")
        group.add_argument("--load-format", default=defaults.load_format, choices=LOAD_FORMATS,
                           help="auto: the model's safetensors; dummy: random weights of its "
                                "shape (presets, benchmarks)")
        group.add_argument("--seed", type=int, default=defaults.seed,
                           help="seed of random weights and of sampling without a "
                                "per-request seed (default: %(default)s)")
        group.add_argument("--device", default=defaults.device, choices=DEVICES,
                           help="auto: CUDA when available, else the CPU")
        group.add_argument("--attention-backend", default=defaults.attention_backend,
                           help="auto: triton on CUDA, else torch (the reference)")
        group.add_argument("--enable-lora", action="store_true",
                           help="serve LoRA adapters (LoRARequest, --lora-modules)")
        group.add_argument("--max-loras", type=int, default=defaults.max_loras,
                           help="adapters resident on the device at once")
        group.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank,
                           help="the largest adapter rank accepted (default: %(default)s)")
        group.add_argument("--max-cpu-loras", type=int, default=None,
                           help="adapters kept in host memory, read again from their "
                                "directory when dropped (default: --max-loras)")
        group.add_argument("--block-size", type=int, default=defaults.block_size,
                           help="tokens per KV-cache block, a power of two "
                                "(default: %(default)s)")
        group.add_argument("--num-kv-blocks", type=int, default=None,
                           help="KV-cache blocks to allocate (default: sized from "
                                "--gpu-memory-utilization on CUDA, from the model on the CPU)")
        group.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype,
                           help="auto (the model's dtype) | fp8_e4m3 (alias fp8: scales from "
                                "the checkpoint, else 1.0) | int8 (a scale per token and KV "
                                "head): about twice the tokens in the same memory "
                                "(default: %(default)s)")
        group.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                           action=argparse.BooleanOptionalAction,
                           default=defaults.enable_prefix_caching,
                           help="reuse the KV of prompt prefixes seen before (default: on)")
        group.add_argument("--gpu-memory-utilization", type=float,
                           default=defaults.gpu_memory_utilization,
                           help="share of the GPU's memory the engine may use: weights, "
                                "activations and the KV cache (default: %(default)s)")
        group.add_argument("--kv-offload-gb", type=float, default=defaults.kv_offload_gb,
                           help="host memory (GB, pinned on CUDA) for a second KV tier: "
                                "blocks the prefix cache evicts are copied there and come "
                                "back on a hit (default: 0, off)")
        group.add_argument("--kv-role", default=defaults.kv_role,
                           choices=("prefill", "decode", "both"),
                           help="disaggregated serving: prefill engines compute prompts and "
                                "keep their KV for decode engines to pull; both: one engine "
                                "does all (default: %(default)s)")
        group.add_argument("--kv-transfer-host", default=defaults.kv_transfer_host,
                           help="a prefill engine's address for KV pulls (default: "
                                "%(default)s)")
        group.add_argument("--kv-transfer-port", type=int, default=defaults.kv_transfer_port,
                           help="a prefill engine's port for KV pulls; the port after it "
                                "serves the transfer group's store (default: %(default)s)")
        group.add_argument("--kv-transfer-timeout", type=float,
                           default=defaults.kv_transfer_timeout,
                           help="seconds a prefill engine keeps unpulled KV, and a decode "
                                "engine waits for a pull before recomputing "
                                "(default: %(default)s)")
        group.add_argument("--kv-transfer-config", default=None,
                           help="vLLM's spelling of the above, a JSON object: kv_role "
                                "(kv_producer | kv_consumer | kv_both), kv_ip, kv_port, "
                                "kv_timeout")
        group.add_argument("--preemption-mode", default=defaults.preemption_mode,
                           choices=PREEMPTION_MODES,
                           help="recompute: a preempted request's KV is dropped and computed "
                                "again; swap: copied to the host tier (needs --kv-offload-gb) "
                                "and back when it resumes (default: %(default)s)")
        group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                           help="the most requests in the running batch "
                                "(default: %(default)s)")
        group.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="the token budget of one step (default: "
                                f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or max_model_len without "
                                "chunked prefill)")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="the longest request, prompt and output, in tokens "
                                "(default: the model's max_position_embeddings)")
        group.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill",
                           action=argparse.BooleanOptionalAction,
                           default=defaults.enable_chunked_prefill,
                           help="split long prompts over several steps beside decodes "
                                "(default: on)")
        group.add_argument("--scheduling-policy", default=defaults.scheduling_policy,
                           choices=("fcfs", "priority"),
                           help="fcfs: first come, first served; priority: by request "
                                "priority, then arrival")
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
        group.add_argument("--revision", default=None,
                           help="the hub branch, tag or commit of --model (default: main)")
        group.add_argument("--hf-token", default=None,
                           help="a Hugging Face token for private or gated models "
                                "(default: $HF_TOKEN or the saved login)")
        group.add_argument("--download-dir", default=None,
                           help="the hub cache to use (default: $HF_HUB_CACHE, "
                                "i.e. $HF_HOME/hub)")
        group.add_argument("--chat-template", default=None,
                           help="a Jinja chat template, or a file holding one, used instead "
                                "of the tokenizer's")
        group.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                           help="the most top logprobs a request may ask for; -1: no limit "
                                "(default: %(default)s)")
        group.add_argument("--generation-config", default=defaults.generation_config,
                           help="default sampling parameters (temperature, top_p, top_k, "
                                "min_p, repetition_penalty, max_new_tokens as max_tokens): "
                                "'auto' from the model's generation_config.json, 'vllm' none, "
                                "or a folder holding one; a request's values win "
                                "(default: %(default)s)")
        group.add_argument("--num-cpu-threads", type=int, default=None,
                           help="torch threads of an engine on the CPU (default: the cores "
                                "idle at start-up, or $OMP_NUM_THREADS when set)")
        parallel = parser.add_argument_group("parallelism")
        parallel.add_argument("--tensor-parallel-size", "-tp", type=int,
                              default=defaults.tensor_parallel_size,
                              help="split every layer over this many devices (worker processes)")
        parallel.add_argument("--pipeline-parallel-size", "-pp", type=int,
                              default=defaults.pipeline_parallel_size,
                              help="split the layers into this many consecutive stages")
        parallel.add_argument("--nnodes", type=int, default=None,
                              help="nodes the worker processes spread over (default: NNODES, "
                                   "or 1)")
        parallel.add_argument("--node-rank", type=int, default=None,
                              help="this node (0 runs the engine and the server; the others "
                                   "run `kvserve serve --node-rank N` with the same flags; "
                                   "default: NODE_RANK, or 0)")
        parallel.add_argument("--master-addr", default=None,
                              help="address of node 0, reachable from every node (default: "
                                   "MASTER_ADDR, or 127.0.0.1)")
        parallel.add_argument("--master-port", type=int, default=None,
                              help="port of node 0's rendezvous store (default: MASTER_PORT, "
                                   "or any free port on one node)")
        parallel.add_argument("--distributed-timeout-s", type=float,
                              default=defaults.distributed_timeout_s,
                              help="a collective, or a worker's answer, waited for longer "
                                   "fails the engine")
        parallel.add_argument("--all-reduce", default=defaults.all_reduce,
                              choices=ALL_REDUCE_BACKENDS,
                              help="small TP all-reduces on CUDA: NCCL, or one-shot over "
                                   "peer-to-peer symmetric memory (one node)")
        group.add_argument("--speculative-config", default=None,
                           help="speculative decoding as JSON, vLLM's keys: "
                                '\'{"method": "ngram", "num_speculative_tokens": 4}\' '
                                "(methods: ngram, draft_model, eagle, oracle; \"model\": "
                                "the draft or head directory)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of a file, or a Jinja template given
    inline; checked for Jinja syntax now. None: the tokenizer's own."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: cannot read {path} ({exc})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template='{value}' is invalid: not a file, nor a Jinja template "
                         "(one with {{ ... }} or {% ... %})")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: not a valid Jinja template: {exc.message} "
                         f"(line {exc.lineno})") from None
    return text
