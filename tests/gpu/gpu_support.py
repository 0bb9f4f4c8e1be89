"""What the GPU test files share: loading a sibling test module by name (its helpers and its
parametrization lists), and the reason a Hopper-only file skips."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch


def load_sibling(name: str):
    """The module tests/gpu/<name>.py, loaded once under its own key in sys.modules."""
    key = f"cutefa_tests_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def hopper_skip_reason() -> str | None:
    """Why a test that needs a Hopper GPU (sm_90a) cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability()[0] != 9:
        return f"needs a Hopper GPU (sm_90a), this GPU is {torch.cuda.get_device_capability()}"
    return None
