"""What the GPU test files share: loading a sibling test module by name (its helpers and its
parametrization lists), the committed variants with the measured alternatives, and the reasons a
file skips on a GPU it does not target."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
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


def alternatives():
    """tools/alternatives.py (the measured alternatives) as a module, loaded once under the key
    tests/cpu_support.load_tool gives it."""
    key = "cutefa_tools_alternatives"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "tools" / "alternatives.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def all_variants(arch: str, direction: str | None = None) -> list:
    """The committed variants of ``arch`` (in ``direction``) and the measured alternatives beside
    them (tools/alternatives.py: not in generated/, they compile from a fresh rendering), sorted."""
    return alternatives().all_variants(arch, direction)


def _capability_skip_reason(runs_on: Callable[[tuple[int, int]], bool], needs: str) -> str | None:
    """Why a test cannot run here, or None: no CUDA GPU, or one whose compute capability
    ``runs_on`` refuses (then ``needs``, with that capability in place of its ``{}``)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    capability = torch.cuda.get_device_capability()
    if not runs_on(capability):
        return needs.format(capability)
    return None


def hopper_skip_reason() -> str | None:
    """Why a test that needs a Hopper GPU (sm_90a) cannot run here, or None."""
    return _capability_skip_reason(lambda cc: cc[0] == 9, "needs a Hopper GPU (sm_90a), this GPU is {}")


def sm80_skip_reason() -> str | None:
    """Why a test that needs an sm80-family GPU (compute capability 8.0 or newer) cannot run here,
    or None."""
    return _capability_skip_reason(lambda cc: cc >= (8, 0), "needs compute capability >= 8.0, this GPU is {}")


def sm90_kernel_skip_reason(kernel: str) -> str | None:
    """Why a test of ``kernel`` (for example "fp8 forward"), an sm90-only kernel, cannot run here
    (on anything but a compute capability 9.0 GPU), or None."""
    return _capability_skip_reason(
        lambda cc: cc == (9, 0), f"the {kernel} is an sm90 (Hopper) kernel; this GPU is {{}}"
    )
