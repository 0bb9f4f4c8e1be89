"""Runs tests/gpu/cp_two_gpu.py (PyTorch's context_parallel on two GPUs, cutefa as SDPA's flash
provider) under torchrun, NCCL: causal and not, forward and backward, GQA through enable_gqa and
through repeated heads, against the unsharded cutefa call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("cp_two_gpu.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason=f"needs 2 GPUs; {torch.cuda.device_count()} visible"
    ),
    pytest.mark.skipif(
        not hasattr(torch.nn.attention, "register_flash_attention_impl"),
        reason=f"torch {torch.__version__} has no flash-attention provider registry (torch 2.10 and later)",
    ),
]


@pytest.mark.parametrize(
    "options",
    [["--seqlens", "32768", "131072", "--gqa", "enable_gqa"], ["--seqlens", "32768", "--gqa", "repeat"]],
    ids=["enable_gqa", "repeat"],
)
def test_context_parallel_on_two_gpus(options):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), *options]
    run = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=1800)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "cp: all passed" in run.stdout, output[-6000:]
