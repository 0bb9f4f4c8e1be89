"""``import cutefa.api`` loads what a dense ``flash_attn_func`` call needs and nothing more: the
feature, fp8, kv-cache, MLA and mods modules, and the SDPA provider's kernels, load on their first
use (each check runs in a fresh interpreter, since this process has imported them all long ago)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Modules a dense call never needs; each must be absent after ``import cutefa.api``.
LAZY_MODULES = (
    "cutefa.api.varlen",
    "cutefa.api.fp8",
    "cutefa.api.descales",
    "cutefa.api.features",
    "cutefa.api.feature_ops",
    "cutefa.api.feature_bwd",
    "cutefa.api.validate_features",
    "cutefa.api.kvcache",
    "cutefa.api.kvcache_e4m3",
    "cutefa.api.mla",
    "cutefa.api.padding",
    "cutefa.mods",
    "cutefa.paged",
    "cutefa.model.feature_sets",
    "cutefa.model.policy_sm80",
    "cutefa.model.policy_sm90",
    "cutefa.model.policy_sm100",
    "cutefa.templating",
    "cutefa.codegen",
    "cutefa.tune",
    "cutefa.cli",
    "cutefa.sdpa_serve",
)


def _modules_after(code: str) -> set[str]:
    """The cutefa modules loaded by running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('cutefa'))))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def after_api() -> set[str]:
    return _modules_after("import cutefa.api")


def test_import_api_loads_the_dense_path_only(after_api):
    assert {"cutefa.api.attention", "cutefa.api.dense", "cutefa.api.backward", "cutefa.dispatch"} <= after_api
    loaded = sorted(
        m for m in after_api if any(m == lazy or m.startswith(lazy + ".") for lazy in LAZY_MODULES)
    )
    assert loaded == []


def test_the_lazy_names_of_the_api_load_their_module_on_first_access():
    found = _modules_after(
        "import cutefa.api as api\n"
        "from cutefa.api.varlen import flash_attn_varlen_func\n"
        "from cutefa.api.descales import fp8_block_sizes\n"
        "assert api.flash_attn_varlen_func is flash_attn_varlen_func\n"
        "assert api.fp8_block_sizes is fp8_block_sizes\n"
        "assert 'flash_attn_varlen_func' in vars(api)  # looked up once\n"
        "import cutefa\n"
        "assert cutefa.flash_attn_varlen_func is flash_attn_varlen_func\n"
        "assert cutefa.fp8_block_sizes is fp8_block_sizes\n"
        "from cutefa.api import fp8  # a submodule not loaded yet still imports by name\n"
        "assert fp8.__name__ == 'cutefa.api.fp8'\n"
        "try:\n"
        "    api.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    assert {"cutefa.api.varlen", "cutefa.api.feature_ops", "cutefa.api.descales", "cutefa.api.fp8"} <= found


def test_the_lazy_ops_register_when_their_module_loads():
    found = _modules_after(
        "import torch\n"
        "import cutefa.api\n"
        "assert hasattr(torch.ops.cutefa, 'flash_fwd') and hasattr(torch.ops.cutefa, 'flash_bwd')\n"
        "import cutefa.api.fp8, cutefa.api.feature_ops\n"
        "assert hasattr(torch.ops.cutefa, 'flash_fwd_fp8')\n"
        "assert hasattr(torch.ops.cutefa, 'attn_fwd') and hasattr(torch.ops.cutefa, 'attn_bwd')\n"
    )
    assert "cutefa.api.feature_ops" in found


def test_a_feature_call_loads_its_modules_on_first_use():
    """A call with a window reaches the feature path (here it stops at the CPU tensors' device
    check, after the feature modules are loaded)."""
    found = _modules_after(
        "import torch, cutefa\n"
        "q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)\n"
        "try:\n"
        "    cutefa.flash_attn_func(q, q, q, window_size=(2, 0))\n"
        "except (ValueError, TypeError, NotImplementedError, RuntimeError):\n"
        "    pass\n"
    )
    assert {"cutefa.api.varlen", "cutefa.api.feature_ops", "cutefa.api.validate_features"} <= found
