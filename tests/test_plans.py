"""The call-plan memo under threads (CPU, fake plans and kernels): concurrent calls, evictions
and clears never break a call, and the memo stays bounded."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from cpu_support import pretend_h200

import cutefa
from cutefa import dispatch
from cutefa.api import dense, plans


@pytest.fixture
def fast_switching():
    """Threads switch as often as the interpreter allows, so that races show within a fraction
    of a second."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def run_threads(targets, seconds):
    """Run each of ``targets`` (callables that loop until the event they are given is set) for
    ``seconds``, or until one raises; returns what they raised."""
    errors = []
    stop = threading.Event()

    def guarded(target):
        try:
            target(stop)
        except Exception as exc:  # noqa: BLE001  (every failure is the test's finding)
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    return errors


def test_remember_and_clear_from_several_threads(monkeypatch, fast_switching):
    """Threads adding plans past the bound (each addition drops the oldest) while another clears
    the memo: no 'dictionary changed size during iteration', no KeyError, and the bound holds."""
    monkeypatch.setattr(plans, "MAX_PLANS", 8)
    monkeypatch.setattr(plans, "_PLANS", {})
    monkeypatch.setattr(plans, "_FP8_PLANS", {})
    sizes = []

    def writer(name):
        def loop(stop):
            n = 0
            while not stop.is_set():
                plans.remember(plans._PLANS, (name, n), lambda *args: None, plans.clears())
                sizes.append(len(plans._PLANS))
                n += 1

        return loop

    def clearer(stop):
        while not stop.is_set():
            plans.clear_plans()

    errors = run_threads([writer("a"), writer("b"), clearer], seconds=0.5)
    assert errors == []
    assert sizes and max(sizes) <= 8


class NullKernel:
    """A compiled 16-bit forward that writes zeros; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, out, lse, scale):
        self.calls += 1
        out.zero_()
        lse.zero_()


def test_planned_calls_from_several_threads_while_caches_are_cleared(monkeypatch, fast_switching):
    """flash_attn_func from several threads on signatures that evict each other's plans, while
    another thread clears the dispatch caches (and with them the plans): every call returns its
    result, the memo stays bounded, and calls after the clears make plans again."""
    kernel = NullKernel()
    pretend_h200(monkeypatch)
    monkeypatch.setattr(dense, "get_kernel", lambda spec, target: kernel)
    monkeypatch.setattr(plans, "_PLANS", {})
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    inputs = [tuple(torch.randn(1, s, 2, 64, dtype=torch.bfloat16) for _ in range(3)) for s in range(1, 7)]

    def caller(offset):
        def loop(stop):
            i = offset
            while not stop.is_set():
                q, k, v = inputs[i % len(inputs)]
                out = cutefa.flash_attn_func(q, k, v, causal=True)
                assert out.shape == q.shape and not out.any()
                assert len(plans._PLANS) <= 3
                i += 1

        return loop

    def clearer(stop):
        while not stop.is_set():
            dispatch.clear_caches()
            time.sleep(1e-4)

    errors = run_threads([caller(0), caller(3), clearer], seconds=0.5)
    assert errors == []
    plans.clear_plans()
    q, k, v = inputs[0]
    for _ in range(2):
        cutefa.flash_attn_func(q, k, v, causal=True)
    assert len(plans._PLANS) == 1 and kernel.calls > 2


def test_a_plan_made_across_a_clear_is_not_kept(monkeypatch):
    """A call that a clear of the dispatch caches overtakes (here: the clear runs inside its kernel
    launch) leaves no plan: its dispatch choice predates the clear. The next call makes one."""
    kernel = NullKernel()
    cleared = []

    def clearing_kernel(*args):
        if not cleared:
            cleared.append(1)
            dispatch.clear_caches()
        kernel(*args)

    pretend_h200(monkeypatch)
    monkeypatch.setattr(dense, "get_kernel", lambda spec, target: clearing_kernel)
    monkeypatch.setattr(plans, "_PLANS", {})
    q, k, v = (torch.randn(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    cutefa.flash_attn_func(q, k, v)
    assert cleared and not plans._PLANS and kernel.calls == 1
    cutefa.flash_attn_func(q, k, v)
    assert len(plans._PLANS) == 1 and kernel.calls == 2
