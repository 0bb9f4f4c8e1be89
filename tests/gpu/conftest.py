"""Fixtures for the GPU tests: per-test seeded generators and an exact float32 reference."""

from __future__ import annotations

import zlib

import pytest
import torch


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return "cuda: not available (GPU tests skip)"
    major, minor = torch.cuda.get_device_capability()
    return f"cuda: {torch.cuda.get_device_name()} (sm_{major}{minor}), torch {torch.__version__}"


@pytest.fixture(scope="session", autouse=True)
def _exact_float32_matmul():
    """The reference runs float32 matmuls on the GPU: keep TF32 off so it stays float32-exact."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CUDA generator seeded from the test's id: fresh inputs per test, the same on every run."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return torch.Generator(device="cuda").manual_seed(seed)
