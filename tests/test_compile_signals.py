"""A JIT compile and the kernel load in the user's process leave Ctrl-C working: the SIGINT handler
(Python's and the C-level one under it) and the signal mask are the same before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compile

PROBE = r"""
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)

class Sigaction(ctypes.Structure):  # glibc x86-64 / aarch64 struct sigaction
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]

def state():
    old = Sigaction()
    assert libc.sigaction(signal.SIGINT, None, ctypes.byref(old)) == 0
    return {"python": repr(signal.getsignal(signal.SIGINT)), "c": [old.handler, old.flags],
            "blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}

# the state a Python program starts with (a child inherits an ignored or blocked SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
before = state()
from cutefa import compile as cc, loader
from cutefa.model import policy_decode
entry = cc._entry(policy_decode.decode_spec("bf16", 64, 4), "sm_90a")
cc._build(entry)
loader._load(entry, entry.read_meta())
print(json.dumps({"before": before, "after": state()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's struct sigaction")
def test_a_compile_and_load_in_process_leave_sigint_alone(tmp_path):
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTEFA_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    states = json.loads(done.stdout.strip().splitlines()[-1])
    assert states["before"]["python"] == "<built-in function default_int_handler>", states
    assert states["after"] == states["before"], states
