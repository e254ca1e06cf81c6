"""``kvserve quantize --device cuda`` (skipped without a CUDA device): GPTQ and AWQ
calibrated on the GPU write the same checkpoint layout as on the CPU and are as
good: the written model's logits on text like the calibration text are as far
from the 16-bit model's as the CPU run's (within 25%; float arithmetic differs
between the devices, so the integers need not match one for one), and both
beat round-to-nearest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve.cli import main
from tests.unit.test_quantize_cli import TEXT, dequantised_state, logits_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("flags", [
    ["--method", "gptq"], ["--method", "gptq", "--act-order"], ["--method", "awq", "--sym"]])
def test_cuda_calibration_is_as_good_as_the_cpu(
    flags: list[str], tiny_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:
    source = tiny_checkpoint("llama", with_tokenizer=True)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT * 40)
    errors = {}
    for device in ("cpu", "cuda", "rtn"):
        output = tmp_path / device
        argv = ["quantize", str(source), "--group-size", "32", "--output", str(output)]
        if device == "rtn":
            argv += ["--method", "rtn"]
        else:
            argv += [*flags, "--calib", str(calib), "--num-samples", "4", "--seq-len", "32",
                     "--device", device]
        assert main(argv) == 0
        errors[device] = logits_error(source, dequantised_state(output, 4, 32))
    assert errors["cuda"] < 1.25 * errors["cpu"]
    assert errors["cuda"] < errors["rtn"]
