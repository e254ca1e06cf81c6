"""Disaggregated prefill / decode on two CUDA devices (skipped with fewer): a
``--kv-role prefill`` server on GPU 0 and a ``--kv-role decode`` server on
GPU 1 behind ``kvserve router --prefill --decode``; the KV moves over NCCL.
Greedy outputs (streamed and not) equal one engine's, every request's KV is
pulled (none recomputed) and the prefill engine ends holding no block.

    python -m pytest -q tests/gpu/test_disagg_gpu.py    # on a 2-GPU machine
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import _wait_ready, launch
from tests.e2e.test_disagg import start_router, wait_released
from tests.gpu.test_router_gpu import complete
from tests.unit.test_disagg import _free_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# long enough to span several 16-token blocks
PROMPTS = ["def fibonacci(n):\n" * 8, "class Stack:\n    def __init__(self):\n" * 6,
           "import os\nimport sys\n" * 12, "# parse a CSV file\n" * 10]


def test_disaggregated_greedy_equals_one_engine(tmp_path: Path) -> None:
    from kvserve.assets import default_model_path

    model = default_model_path()
    single = launch(model, tmp_path / "single.log", ["--enforce-eager"],
                    env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        expected = {p: complete(single.url, p, stream=False) for p in PROMPTS}
    finally:
        single.stop()
    port = _free_pair()
    prefill = launch(model, tmp_path / "prefill.log", [
        "--enforce-eager", "--kv-role", "prefill", "--kv-transfer-port", str(port)],
        env={"CUDA_VISIBLE_DEVICES": "0"}, wait_ready=False)
    decode = launch(model, tmp_path / "decode.log", ["--enforce-eager", "--kv-role", "decode"],
                    env={"CUDA_VISIBLE_DEVICES": "1"}, wait_ready=False)
    servers = [prefill, decode]
    try:
        for server in servers:
            _wait_ready(server)
        servers.append(start_router(model, tmp_path, prefill, decode))
        router = servers[-1]
        for prompt in PROMPTS:
            assert complete(router.url, prompt, stream=False) == expected[prompt]
            assert complete(router.url, prompt, stream=True) == expected[prompt]
        assert decode.metric("kvserve:kv_transfer_pulled_requests_total") >= len(PROMPTS)
        assert decode.metric("kvserve:kv_transfer_recomputed_requests_total") == 0
        assert wait_released(prefill) == 0.0
    finally:
        for server in servers:
            server.stop()
