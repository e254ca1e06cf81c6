"""``kvserve serve --data-parallel-size 2`` on two CUDA devices (skipped with
fewer): each replica sees only its own GPU, and greedy outputs through the
router (both policies that matter, streamed and not) equal one engine's.

    python -m pytest -q tests/gpu/test_router_gpu.py    # on a 2-GPU machine
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.conftest import MODEL_NAME, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n",
           "def quicksort(items):", "# parse a CSV file\n", "for i in range(10):"]


def complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    if not stream:
        return str(response.json()["choices"][0]["text"])
    return "".join(json.loads(line[6:])["choices"][0]["text"]
                   for line in response.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])


def memory_used_mib() -> list[float]:
    """Each GPU's used memory (nvidia-smi), in MiB."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [float(line) for line in out.split()]


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_data_parallel_greedy_equals_one_engine(policy: str, tmp_path: Path) -> None:
    from kvserve.assets import default_model_path

    model = default_model_path()
    single = launch(model, tmp_path / "single.log", ["--enforce-eager"],
                    env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        expected = {p: complete(single.url, p, stream=False) for p in PROMPTS}
    finally:
        single.stop()
    before = memory_used_mib()
    replicas = launch(model, tmp_path / "dp.log",
                      ["--data-parallel-size", "2", "--router-policy", policy,
                       "--enforce-eager"])
    try:
        grown = [after - start for after, start in zip(memory_used_mib(), before)]
        assert grown[0] > 1024 and grown[1] > 1024, grown  # a KV pool on each GPU
        for prompt in PROMPTS:
            assert complete(replicas.url, prompt, stream=False) == expected[prompt]
            assert complete(replicas.url, prompt, stream=True) == expected[prompt]
        metrics = httpx.get(replicas.url + "/metrics", timeout=10).text
        sent = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("kvserve:router_requests_total{")]
        assert len(sent) == 2 and sum(sent) == 2 * len(PROMPTS)
        if policy == "round_robin":
            assert sent == [len(PROMPTS), len(PROMPTS)]
    finally:
        replicas.stop()
