"""Frozen configuration dataclasses, validated in ``__post_init__``.

``ModelConfig`` is the architecture of a checkpoint read from a Hugging Face
``config.json`` dict (never from the model's name); the others hold the
engine's knobs. No I/O happens here: reading files is the loader's job.
Nothing in this module imports torch, so ``core/`` and ``plan/`` may use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.quant.config import QuantConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def _require(hf_config: dict[str, Any], key: str, source: str) -> Any:
    if key not in hf_config or hf_config[key] is None:
        raise ValueError(f"{source}: field '{key}' is missing; it is needed to build the model")
    return hf_config[key]


def _rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Normalise rope settings: transformers 5 writes ``rope_parameters``,
    older checkpoints ``rope_theta`` plus an optional ``rope_scaling``."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling")
    if scaling:
        params = {**dict(scaling), **params}
    if "rope_theta" not in params:
        params["rope_theta"] = float(hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # one entry per layer: None for full attention, else the window in tokens
    sliding_windows: tuple[int | None, ...] = ()
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    # how the linears are stored (weight-only INT8 / INT4); None: 16-bit
    quantization: QuantConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architecture '{self.architecture}' is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.json: {name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows must have one entry per layer")

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def max_sliding_window(self) -> int | None:
        """The window if every layer slides, else None (some layer sees all)."""
        if any(w is None for w in self.sliding_windows):
            return None
        return max(w for w in self.sliding_windows if w is not None)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a ``config.json`` dict; ``source`` names it in errors."""
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{source}: field 'architectures' is missing or empty")
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture '{architecture}' is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(_require(hf_config, "num_attention_heads", source))
        hidden_size = int(_require(hf_config, "hidden_size", source))
        num_layers = int(_require(hf_config, "num_hidden_layers", source))
        num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        head_dim = int(hf_config.get("head_dim") or hidden_size // num_heads)
        model_type = hf_config.get("model_type", "")
        eos = hf_config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            vocab_size=int(_require(hf_config, "vocab_size", source)),
            hidden_size=hidden_size,
            intermediate_size=int(_require(hf_config, "intermediate_size", source)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_parameters(hf_config),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2" or architecture == "Qwen2ForCausalLM"
                      or bool(hf_config.get("attention_bias", False))),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(hf_config, architecture, num_layers),
            dtype=str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=int(
                hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0
            ),
            hf_config=dict(hf_config),
        )


def _sliding_windows(
    hf_config: dict[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    window = hf_config.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return tuple([int(window) if window else None] * num_layers)
    if architecture == "LlamaForCausalLM" or not window:
        return tuple([None] * num_layers)
    layer_types = hf_config.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if not hf_config.get("use_sliding_window", False):
        return tuple([None] * num_layers)
    max_window_layers = int(hf_config.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= max_window_layers else None for i in range(num_layers))


# the KV cache's element type: "auto" (the model's dtype) or quantised (with
# scales: fp8 per layer and KV head, int8 per token and KV head); vLLM's names
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # share of free device memory the KV pool may take when num_kv_blocks is unset
    gpu_memory_utilization: float = 0.9
    # KV budget on CPU when num_kv_blocks is unset; None: sized for the model
    # (kvserve/worker/kv_cache.py)
    cpu_kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES or an alias ("fp8")
    # host-memory KV tier (GB in all ranks together; 0: off): blocks the prefix
    # cache evicts are copied there and come back on a hit (worker/kv_offload.py)
    kv_offload_gb: float = 0.0
    # what preemption does with the victim's KV: "recompute" frees it (its full
    # blocks may still come back through the prefix cache); "swap" first copies
    # every computed block, the partly filled last one too, to the host tier
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype='{self.kv_cache_dtype}' is invalid: must be one of "
                f"{', '.join((*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES))}"
            )
        object.__setattr__(self, "kv_cache_dtype", dtype)
        if self.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb} must be >= 0")
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_offload_gb={self.kv_offload_gb} needs enable_prefix_caching: the host "
                "tier holds blocks by their prefix-cache hash")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode='{self.preemption_mode}' must be one of "
                             f"{PREEMPTION_MODES}")
        if self.preemption_mode == "swap" and not self.kv_offload_gb:
            raise ValueError("preemption_mode='swap' needs kv_offload_gb > 0: swapped blocks "
                             "go to the host KV tier")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching budgets."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    # plan step N+1 while step N runs on the device (see engine_core)
    async_scheduling: bool = False
    # pipeline stages: with more than one, this many steps are kept in flight,
    # each with requests of its own (none runs in two steps at once)
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when chunked prefill is off"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy='{self.policy}' must be 'fcfs' or 'priority'")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} must be >= 1")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: adapters resident on the device at once, adapters kept
    in host memory (None: ``max_loras``), and their largest rank."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                             f"{self.max_loras} (or None: max_loras)")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


ALL_REDUCE_BACKENDS = ("nccl", "one-shot")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes, and where they run.

    ``tensor_parallel_size`` x ``pipeline_parallel_size`` worker processes,
    one per device, spread evenly over ``nnodes`` nodes; this process is
    node ``node_rank``. ``master_addr:master_port`` is where node 0 (the one
    running the engine) serves the rendezvous store (port 0: any free port,
    one node only). Every collective gives up after ``distributed_timeout_s``.
    ``all_reduce`` picks the small all-reduce of a TP group on CUDA: NCCL, or
    a one-shot all-reduce over peer-to-peer symmetric memory (one node).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    distributed_timeout_s: float = 300.0
    all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is invalid: must be in "
                             f"[0, nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} processes "
                f"do not spread evenly over nnodes={self.nnodes}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is invalid: must be in "
                             "[0, 65535]")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError(f"nnodes={self.nnodes} needs an explicit master_port "
                             "(--master-port, or MASTER_PORT) that every node can reach")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s={self.distributed_timeout_s} is "
                             "invalid: must be > 0")
        if self.all_reduce not in ALL_REDUCE_BACKENDS:
            raise ValueError(f"all_reduce='{self.all_reduce}' is invalid: must be one of "
                             f"{ALL_REDUCE_BACKENDS}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes
SPEC_METHODS = ("ngram", "draft_model", "eagle", "oracle")
# the most tokens one speculative step may propose per request
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys), resolved.

    ``method`` names the proposer; ``model`` is the draft model's or EAGLE
    head's directory (resolved by ``engine/speculative.py``, which also
    checks that it fits the target). ``ngram`` matches the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens against the
    request's own tokens. ``oracle`` (benchmarks) replays the target's
    greedy continuation recorded from earlier requests with the same
    prompt, each proposal kept with probability ``acceptance_rate`` and
    corrupted otherwise; with ``forced_acceptance`` the oracle's coin alone
    decides which greedy proposals are kept (timing only: outputs are not
    the target's). Speculation switches itself off in a step whose
    decode batch makes it cost more than it gains (``core/spec_policy.py``)
    unless ``auto_disable`` is False; ``disable_by_batch_size`` replaces that
    rule with a fixed batch size. ``plan_ahead`` (a kvserve key) lets
    async scheduling plan a step before the one in flight is read, when
    proposals stay on the device (``plans_ahead``).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    acceptance_rate: float = 1.0
    forced_acceptance: bool = False
    disable_by_batch_size: int | None = None
    auto_disable: bool = True
    seed: int = 0
    plan_ahead: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} is invalid: must be one of "
                f"{', '.join(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k!r} is invalid: must be an "
                f"integer in [1, {MAX_SPEC_TOKENS}]"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} and "
                f"prompt_lookup_max={self.prompt_lookup_max} are invalid: need "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(
                f"speculative_config.acceptance_rate={self.acceptance_rate} is invalid: "
                "must be in [0, 1]"
            )
        if self.forced_acceptance and self.method != "oracle":
            raise ValueError(
                f"speculative_config.forced_acceptance is only for method='oracle', not "
                f"{self.method!r}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"speculative_config.disable_by_batch_size={self.disable_by_batch_size} is "
                "invalid: must be >= 1 (or unset: the measured-cost rule)"
            )
        if not isinstance(self.plan_ahead, bool):
            raise ValueError(f"speculative_config.plan_ahead={self.plan_ahead!r} is invalid: "
                             "must be true or false")
        if self.method in ("draft_model", "eagle") and not self.model:
            raise ValueError(
                f"speculative_config.model is required for method={self.method!r}: the "
                "draft model's or EAGLE head's directory"
            )

    @property
    def proposes_on_device(self) -> bool:
        """Whether the proposals are made on the device (a draft model, an
        EAGLE head; the oracle's placeholders in ``forced_acceptance`` mode),
        so a step can take them as inputs before the host has read them."""
        return self.method in ("draft_model", "eagle") or self.forced_acceptance

    @property
    def uses_lookahead_slots(self) -> bool:
        """Whether the proposer writes KV past the verified tokens while it
        drafts (a draft model or head runs its own forward on its proposals),
        so each proposing request needs that many more slots for the step."""
        return self.method in ("draft_model", "eagle")


def plans_ahead(scheduler_config: SchedulerConfig,
                speculative_config: SpeculativeConfig | None) -> bool:
    """Whether the engine plans each speculative step before the one in flight
    is read (async scheduling, one pipeline stage, proposals on the device,
    ``plan_ahead`` on): the scheduler counts the proposals in flight as
    accepted and the runner takes the accepted tokens and the proposals on
    the device (``core/scheduler.py``, ``worker/model_runner.py``)."""
    return (speculative_config is not None and speculative_config.plan_ahead
            and speculative_config.proposes_on_device and scheduler_config.async_scheduling
            and scheduler_config.pipeline_parallel_size == 1)


KV_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill / decode (``kv_role``): a prefill engine keeps a
    finished prompt's KV blocks for a decode engine to pull; a decode engine
    pulls them from the prefill engine a request names. A prefill engine
    listens for pulls on ``kv_transfer_host:kv_transfer_port`` (control) and
    serves the transfer group's rendezvous store on the port after it; held
    blocks are freed after ``kv_transfer_timeout_s`` if nobody pulls them,
    and a decode engine gives up on a pull after as long (and recomputes)."""

    kv_role: str = "both"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 14579
    kv_transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role='{self.kv_role}' is invalid: must be one of {KV_ROLES}")
        if not 0 < self.kv_transfer_port < 65535:
            raise ValueError(f"kv_transfer_port={self.kv_transfer_port} is invalid: must be "
                             "in [1, 65534] (the rendezvous store takes the port after it)")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s} is "
                             "invalid: must be > 0")

    @property
    def disaggregated(self) -> bool:
        return self.kv_role != "both"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved and validated."""

    model: str
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    # None: LoRA off (keyword-only, so it may sit here with a default)
    lora_config: LoRAConfig | None = field(default=None, kw_only=True)
    # one process unless it says more (keyword-only, as lora_config)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig, kw_only=True)
    # None: no speculative decoding
    speculative_config: SpeculativeConfig | None = field(default=None, kw_only=True)
    model_path: str | None
    tokenizer_path: str | None
    load_format: str
    dtype: str
    device: str
    seed: int
    attention_backend: str
    # CUDA graphs for decode steps of these batch sizes (padded up to the next
    # one); empty when the engine runs eagerly (CPU, reference backend,
    # enforce_eager)
    cuda_graph_sizes: tuple[int, ...] = ()
    # CUDA graphs for prefill and mixed steps of these token counts (padded up
    # to the next one; the scheduler aims its steps at them)
    cuda_graph_token_sizes: tuple[int, ...] = ()
    # replaces the tokenizer's chat template (the template's text); None: keep it
    chat_template: str | None = None
    # the most top logprobs one request may ask for; -1: no limit
    max_logprobs: int = 20
    # torch threads of an engine on the CPU; None: chosen at start-up
    num_cpu_threads: int | None = None
    # SamplingParams fields -> the model's recommended values (its
    # generation_config.json, --generation-config): what a request leaves unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # disaggregated prefill / decode; the default (role "both") is one engine doing all
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig, kw_only=True)

    def __post_init__(self) -> None:
        role = self.kv_transfer_config.kv_role
        if role == "both":
            return
        if self.parallel_config.world_size > 1:
            raise ValueError(
                f"kv_role='{role}' needs tensor_parallel_size=1 and pipeline_parallel_size=1 "
                f"(got {self.parallel_config.tensor_parallel_size} and "
                f"{self.parallel_config.pipeline_parallel_size}): KV transfer between "
                "parallel engines is not supported yet")
        if self.speculative_config is not None:
            raise ValueError(f"kv_role='{role}' does not support speculative decoding yet "
                             "(the proposer's KV would have to travel too)")
