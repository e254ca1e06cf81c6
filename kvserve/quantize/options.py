"""What one ``kvserve quantize`` run does (``QuantizeOptions``), and every check
that can fail before the model is loaded: the options themselves, the
checkpoint's ``config.json`` (architecture, already quantised, sizes the
group size must divide) and the output directory. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.quant.config import GROUP_SIZES, WEIGHT_BITS, QuantConfig

METHODS = ("rtn", "gptq", "awq", "smoothquant")
# the weights and the default group size of each method; smoothquant writes INT8 W8A8
DEFAULT_BITS = {"rtn": 4, "gptq": 4, "awq": 4, "smoothquant": 8}
DEFAULT_GROUP_SIZE = {"rtn": 128, "gptq": 128, "awq": 128, "smoothquant": -1}
CHECKPOINT_FORMAT = "compressed-tensors"


@dataclass(frozen=True)
class QuantizeOptions:
    """The settings of one run (the CLI flags; see ``cli.py`` for their help)."""

    model: Path
    output: Path
    method: str
    bits: int = 4
    group_size: int = 128  # -1: one scale per output channel
    symmetric: bool | None = None  # None: the method's default (AWQ asymmetric, else symmetric)
    act_order: bool = False  # GPTQ only
    calib: Path | None = None
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    device: str = "cpu"
    dampening: float = 0.01  # GPTQ: fraction of the Hessian's mean diagonal added to it
    awq_clip: bool = True  # AWQ: search a clipping range per group after the scales
    batch_size: int = 8  # calibration windows per forward
    alpha: float = 0.5  # smoothquant: migration strength, s = max|X|^a / max|W|^(1-a)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method '{self.method}' is not supported; "
                             f"allowed: {', '.join(METHODS)}")
        if self.method == "smoothquant" and (self.bits, self.group_size) != (8, -1):
            raise ValueError(f"--method smoothquant writes INT8 W8A8 (8 bits, one scale per "
                             f"output channel); got --bits {self.bits} --group-size "
                             f"{self.group_size}")
        if self.method == "smoothquant" and self.symmetric is False:
            raise ValueError("--method smoothquant writes symmetric int8; --asym is not allowed")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"--alpha {self.alpha} must lie in [0, 1]")
        if self.alpha != 0.5 and self.method != "smoothquant":
            raise ValueError(f"--alpha applies to --method smoothquant only; got --method "
                             f"{self.method}")
        if self.bits not in WEIGHT_BITS:
            raise ValueError(f"--bits {self.bits} is not supported; allowed: {WEIGHT_BITS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size {self.group_size} is not supported; "
                             f"allowed: {GROUP_SIZES} (-1: per output channel)")
        if self.act_order and self.method != "gptq":
            raise ValueError(f"--act-order applies to --method gptq only; got --method "
                             f"{self.method}")
        if self.method != "rtn" and self.calib is None:
            raise ValueError(f"--method {self.method} needs calibration text: pass --calib "
                             "FILE (a text file, a .jsonl with a 'text' field, or a directory "
                             "of .py / .txt files)")
        for name in ("num_samples", "seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not 0.0 < self.dampening < 1.0:
            raise ValueError(f"--dampening {self.dampening} must lie in (0, 1)")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device '{self.device}' is not supported; allowed: cpu, cuda, "
                             "cuda:N")

    @property
    def is_symmetric(self) -> bool:
        return self.symmetric if self.symmetric is not None else self.method != "awq"

    @property
    def uses_calibration(self) -> bool:
        return self.method != "rtn"

    @property
    def quant_config(self) -> QuantConfig:
        """How the written checkpoint's linears are stored (lm_head stays 16-bit).
        Act-order is GPTQ's processing order only: the groups stay in column
        order, so the checkpoint has no ``g_idx`` (see ``gptq.py``)."""
        return QuantConfig(bits=self.bits, group_size=self.group_size,
                           symmetric=self.is_symmetric, checkpoint_format=CHECKPOINT_FORMAT,
                           weight_type="w8a8-int8" if self.method == "smoothquant" else "int")


def read_model_config(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    """``config.json`` of the checkpoint at ``path`` (raw, and parsed), with the
    checks that need only it: a supported dense architecture, not quantised already."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise ValueError(f"model: {path} is not a checkpoint directory with a config.json")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {config_file} is not valid JSON ({e})") from e
    if not isinstance(hf_config, dict):
        raise ValueError(f"model: {config_file} must hold a JSON object")
    existing = hf_config.get("quantization_config")
    if existing:
        method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else "?"
        raise ValueError(f"model: {path} is already quantised (config.json has a "
                         f"quantization_config, quant_method '{method}'); quantize a 16-bit "
                         "checkpoint")
    config = ModelConfig.from_hf_config(hf_config, source=str(config_file))
    if config.num_experts:
        raise ValueError(f"model: {config.architecture} with num_experts={config.num_experts} "
                         "(mixture of experts) cannot be calibrated; dense models only")
    if not (path / "model.safetensors").is_file() and not (
            path / "model.safetensors.index.json").is_file():
        raise ValueError(f"model: {path} has no model.safetensors nor "
                         "model.safetensors.index.json")
    return hf_config, config


def linear_input_sizes(config: ModelConfig) -> dict[str, int]:
    """The input size of each quantised linear of a decoder layer, by HF name."""
    return {"q_proj / k_proj / v_proj": config.hidden_size,
            "o_proj": config.num_heads * config.head_dim,
            "gate_proj / up_proj": config.hidden_size,
            "down_proj": config.intermediate_size}


def check_against_model(options: QuantizeOptions, config: ModelConfig) -> None:
    """The group size divides every linear's input size; int4 needs even sizes;
    calibration windows fit the model's context."""
    for name, size in linear_input_sizes(config).items():
        if options.group_size != -1 and size % options.group_size:
            raise ValueError(f"--group-size {options.group_size} does not divide the input size "
                             f"{size} of {name} in {config.architecture}; pick one of "
                             f"{[g for g in GROUP_SIZES if g == -1 or size % g == 0]}")
        if options.bits == 4 and size % 2:
            raise ValueError(f"--bits 4 needs even input sizes; {name} has {size}")
    if options.uses_calibration and options.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {options.seq_len} exceeds the model's "
                         f"max_position_embeddings {config.max_position_embeddings}")


def check_output(output: Path) -> None:
    """The output must not exist, or be an empty directory."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"--output {output} exists and is not an empty directory; "
                         "pass a new path")
