"""Start-up phases (``CUTEFA_PROFILE=1``): recorded in order on the first call from a pack, in a
fresh process that never imports the DSL; nothing recorded, and no per-call cost, when off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import timeit
from pathlib import Path

import pytest

from cutefa import profile

TESTS = Path(__file__).parent

# Phases of the first call from a pack, in the order they happen.
FIRST_CALL_PHASES = [
    "import cutefa.api",
    "device query",
    "dispatch (tuned tables)",
    "kernel source fingerprint",
    "pack manifest",
    "pack checks (target, DSL version)",
    "pack kernel sha256",
    "DSL runtime library (find, dlopen)",
    "kernel library (dlopen libtvm_ffi and the kernel)",
    "first kernel call (module load, launch)",
]


def run(code: str, **env: str) -> dict:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTEFA_", "CUTE_DSL"))}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env | env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# A fresh process: a pack of dummy kernel files (true checksums and fingerprints) holding the
# variant an H200 picks, the public API called on CPU tensors. cutefa.ffi's loader is replaced (the
# dummy files are no shared objects); the kernel it hands back counts its calls. The DSL runtime
# library is loaded for real.
CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from cutefa import ffi
calls = []
ffi.load = lambda path, name: lambda *args: calls.append(len(args))
import torch
import cutefa
fn = cutefa.flash_attn_func  # imports cutefa.api
from cutefa import dispatch, profile
from cutefa.api import launch, validate
from pack_support import write_pack
dispatch.device_target = lambda device=None: ("sm_90a", "NVIDIA H200")
validate.DEVICE_TYPES = ("cuda", "cpu")
torch.cuda.current_device = lambda: None
q = torch.zeros(1, 128, 16, 128, dtype=torch.bfloat16)
write_pack(Path({pack!r}), [launch.choose(q, q, True).spec])
for _ in range(3):
    fn(q, q, q, causal=True)
print(json.dumps({{"phases": profile.phases(), "totals": profile.totals(), "report": profile.report(),
                  "calls": len(calls), "enabled": profile.ENABLED,
                  "dsl": sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "iket"))}}))
"""


def test_first_call_reports_its_phases_in_order_without_the_dsl(tmp_path):
    pack = tmp_path / "pack"
    got = run(
        CHILD.format(tests=str(TESTS), pack=str(pack)),
        CUTEFA_PROFILE="1",
        CUTEFA_KERNEL_PATH=str(pack),
        CUTEFA_JIT="0",
        CUTEFA_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert got["enabled"] and got["calls"] == 3 and got["dsl"] == []
    names = [name for name, _ in got["phases"]]
    # the device query and dispatch ran once already while the test wrote the pack
    first = names.index("kernel source fingerprint") - 2
    assert names[0] == "import cutefa.api"
    assert names[first:] == FIRST_CALL_PHASES[1:], names  # later calls take the plan: no phases
    assert all(ms >= 0 for _, ms in got["phases"])
    assert list(got["totals"]) == FIRST_CALL_PHASES
    assert "kernel library (dlopen libtvm_ffi and the kernel)" in got["report"] and got[
        "report"
    ].splitlines()[-1].startswith("total")


def test_nothing_is_recorded_when_off(tmp_path):
    pack = tmp_path / "pack"
    got = run(
        CHILD.format(tests=str(TESTS), pack=str(pack)),
        CUTEFA_KERNEL_PATH=str(pack),
        CUTEFA_JIT="0",
        CUTEFA_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert not got["enabled"] and got["phases"] == [] and got["calls"] == 3
    assert "no start-up phases recorded" in got["report"]


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)]
)
def test_switch_values(value, on):
    got = run(
        "import json, cutefa.profile as p; print(json.dumps({'on': p.ENABLED}))",
        CUTEFA_PROFILE=value,
    )
    assert got["on"] is on


def test_records_are_bounded_and_summed(monkeypatch):
    monkeypatch.setattr(profile, "_RECORDS", [])
    monkeypatch.setattr(profile, "MAX_RECORDS", 3)
    monkeypatch.setattr(profile, "ENABLED", False)
    profile.enable(True)
    for name in ("a", "b", "a", "c"):
        with profile.phase(name):
            pass
    profile.record("b", 0.002)
    profile.enable(False)
    assert [name for name, _ in profile.phases()] == ["a", "b", "a"]
    assert list(profile.totals()) == ["a", "b"]
    with profile.phase("off"):
        pass
    assert len(profile.phases()) == 3


def test_a_disabled_phase_costs_next_to_nothing(monkeypatch):
    monkeypatch.setattr(profile, "ENABLED", False)
    n = 20000
    seconds = min(timeit.repeat(lambda: profile.phase("x").__enter__(), number=n, repeat=3)) / n
    assert seconds < 2e-6
