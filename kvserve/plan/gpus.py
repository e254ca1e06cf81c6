"""The GPU table of ``kvserve plan``: spec sheets and measured rates.

Owns the spec-sheet numbers of a few common GPUs (dense rates, never the
2:4-sparsity figures vendors print beside them), the rates measured on the
cards kvserve has run on (the device-to-device copy and the dense matmul
rates that every MBU / MFU figure and the step model are taken against),
and their lookup by name. Pure data: no torch, no device queries — ``plan``
runs on any machine; a benchmark that queried its card's name looks the
card up here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as its datasheet describes it.

    ``memory_gb`` and ``bandwidth_gb_s`` are decimal (1 GB = 1e9 bytes);
    rates are dense tensor-core peaks in TFLOP/s (TOP/s for INT8). A chip
    without FP8 or INT8 tensor support has ``None`` there.
    """

    name: str
    description: str
    memory_gb: float
    bandwidth_gb_s: float
    bf16_tflops: float
    fp8_tflops: float | None = None
    int8_tops: float | None = None

    def tflops_for(self, weights: str) -> float:
        """The peak rate that matmuls with ``weights`` run at.

        FP8 weights use the FP8 rate and INT8 weights the INT8 rate where
        the chip has one; everything else (bf16, fp16, weight-only int4,
        which is dequantised to 16 bits) runs at the bf16 rate.
        """
        if weights == "fp8" and self.fp8_tflops is not None:
            return self.fp8_tflops
        if weights == "int8" and self.int8_tops is not None:
            return self.int8_tops
        return self.bf16_tflops


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("h100-sxm", "NVIDIA H100 SXM5 80GB", 80, 3350, 989, 1979, 1979),
        GpuSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, 2000, 756, 1513, 1513),
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", 141, 4800, 989, 1979, 1979),
        GpuSpec("b200", "NVIDIA B200 (HGX, 1000 W)", 180, 8000, 2250, 4500, 4500),
        GpuSpec("a100-80gb", "NVIDIA A100 SXM4 80GB", 80, 2039, 312, None, 624),
        GpuSpec("a100-40gb", "NVIDIA A100 SXM4 40GB", 40, 1555, 312, None, 624),
        GpuSpec("l40s", "NVIDIA L40S 48GB", 48, 864, 362, 733, 733),
        # GeForce: FP16/BF16 with FP32 accumulation runs at half the FP16-accumulate rate
        GpuSpec("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24, 1008, 165.2, 330.3, 660.6),
        # datasheet "Tensor Performance" 327.6 is sparse FP8: dense FP8 163.8, bf16 81.9
        GpuSpec("rtx-4000-ada", "NVIDIA RTX 4000 Ada Generation 20GB", 20, 432, 81.9, 163.8,
                163.8),
        GpuSpec("rtx-3080", "NVIDIA GeForce RTX 3080 10GB", 10, 760, 59.5, None, 238),
    )
}

ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "a100": "a100-80gb",
    "4090": "rtx-4090",
    "3080": "rtx-3080",
}


@dataclass(frozen=True)
class CardRates:
    """What a card sustains in practice, measured: the device-to-device copy
    (bytes read + written per second, decimal GB/s) and dense square matmul
    rates in TFLOP/s (8192³; FP8 through ``torch._scaled_mm``). ``source``
    says which run measured them."""

    copy_gb_s: float
    bf16_tflop_s: float
    fp8_tflop_s: float | None
    source: str

    def tflops_for(self, weights: str, spec: GpuSpec | None) -> float:
        """The measured matmul rate for ``weights``. An FP8 or INT8 rate that
        was not measured is the bf16 one scaled by the spec sheet's ratio."""
        if weights == "fp8" and self.fp8_tflop_s is not None:
            return self.fp8_tflop_s
        if spec is None:
            return self.bf16_tflop_s
        return self.bf16_tflop_s * spec.tflops_for(weights) / spec.bf16_tflops


# measured / spec-sheet shares on the two measured cards (H100 3,006 / 3,350 and
# H200 4,257 / 4,800 GB/s; 785 and 779 / 989 TFLOP/s), used for cards not measured
COPY_SHARE_OF_SPEC = 0.89
MATMUL_SHARE_OF_SPEC = 0.79

MEASURED_RATES: dict[str, CardRates] = {
    "h100-sxm": CardRates(
        3006, 785, 1395,
        "NVIDIA H100 80GB HBM3, 2026-11-26 (../shared/BENCHMARKS.md: peers/gpu_peers.py; "
        "FP8 torch._scaled_mm 8192³ in a later call)"),
    "h200": CardRates(
        4257, 779, None,
        "NVIDIA H200, 2026-11-26 (../shared/BENCHMARKS.md: peers/gpu_peers.py; FP8 not "
        "measured: bf16 x the spec sheet's FP8/bf16 ratio)"),
}


def rates_for(gpu: GpuSpec) -> CardRates:
    """The measured rates of ``gpu``, or estimates from its spec sheet."""
    if gpu.name in MEASURED_RATES:
        return MEASURED_RATES[gpu.name]
    return CardRates(
        gpu.bandwidth_gb_s * COPY_SHARE_OF_SPEC, gpu.bf16_tflops * MATMUL_SHARE_OF_SPEC, None,
        f"not measured: {COPY_SHARE_OF_SPEC:.0%} of the spec sheet's bandwidth and "
        f"{MATMUL_SHARE_OF_SPEC:.0%} of its bf16 rate (the shares measured on H100 and H200)")


def get_gpu(name: str) -> GpuSpec:
    """Look a GPU up by table name or alias, case-insensitively."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU '{name}'; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


# the words of the name CUDA reports (``torch.cuda.get_device_name``) -> table name;
# cards whose bandwidth differs from every row (H100 NVL, A100 PCIe, GH200) match none
_DEVICE_NAME_WORDS: tuple[tuple[frozenset[str], str], ...] = tuple(
    (frozenset(words.split()), name) for words, name in (
        ("h200", "h200"),
        ("h100 hbm3", "h100-sxm"),
        ("h100 sxm5", "h100-sxm"),
        ("h100 pcie", "h100-pcie"),
        ("b200", "b200"),
        ("a100 sxm4 80gb", "a100-80gb"),
        ("a100 sxm4 40gb", "a100-40gb"),
        ("l40s", "l40s"),
        ("rtx 4090", "rtx-4090"),
        ("rtx 4000 ada", "rtx-4000-ada"),
        ("rtx 3080", "rtx-3080"),
    )
)


def gpu_for_device_name(device_name: str) -> GpuSpec | None:
    """The table's entry for a card by the name CUDA reports ("NVIDIA H100 80GB
    HBM3", "NVIDIA H200"), or None when no entry matches it exactly."""
    words = set(device_name.lower().replace("-", " ").split())
    for required, name in _DEVICE_NAME_WORDS:
        if required <= words:
            return GPUS[name]
    return None
