"""setmaxnreg only moves registers between the warpgroups of a CTA inside the allocation the CTA got
at launch (the kernel's register count, at most 65536 / threads rounded down to 8, times its
threads). A split whose budgets add up to more than that makes the warpgroups that ask for more
(`setmaxnreg.inc`) wait forever for registers nobody frees: the kernel hangs on the GPU, and nothing
on the CPU fails unless the arithmetic is checked. These tests check it for every kernel that
redistributes registers, the committed ones and the measured alternatives (tools/alternatives.py),
from the constants its template renders."""

import functools
import re

import pytest
from cpu_support import all_variants

from cutefa import codegen

REGISTER_FILE = 65536  # 32-bit registers per SM, the most one CTA can hold
WG = 128  # threads of a warpgroup, the unit setmaxnreg acts on


@functools.cache
def _source(name: str) -> str:
    return codegen.render_source(next(s for a in ("sm90", "sm100") for s in _variants(a) if s.name == name))


@functools.cache
def _variants(arch: str) -> tuple:
    return tuple(all_variants(arch))


def _constants(name: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^([A-Z_]+) = (\d+)\b", _source(name), flags=re.MULTILINE)}


def launch_allocation(threads: int) -> int:
    """Registers per thread a CTA of ``threads`` threads can hold at launch (whole 8-register units)."""
    return min(REGISTER_FILE // threads // 8 * 8, 255 // 8 * 8)


def _sm90_names() -> list[str]:
    return [s.name for s in _variants("sm90") if "PRODUCER_REGS = " in _source(s.name)]


def _sm100_names() -> list[str]:
    return [s.name for s in _variants("sm100") if "REG_SOFTMAX = " in _source(s.name)]


def _budget_ok(value: int) -> bool:
    return 24 <= value <= 256 and value % 8 == 0  # setmaxnreg's range and granularity


def test_launch_allocation():
    assert launch_allocation(384) == 168  # one producer + two consumer warpgroups
    assert launch_allocation(512) == 128
    assert 24 * WG + 240 * 2 * WG == 168 * 384  # the 16-bit sm90 split fills it exactly
    assert 32 * WG + 240 * 2 * WG > 168 * 384  # ... and one more producer unit does not fit


def test_every_redistributing_kernel_is_checked():
    sm90 = {name.split("_")[2] for name in _sm90_names()}  # fwd / bwd
    assert sm90 == {"fwd", "bwd"}, sm90
    assert any("_e4m3_" in name for name in _sm90_names())
    assert len(_sm90_names()) == len(_variants("sm90"))  # every sm90 kernel redistributes
    assert _sm100_names()


@pytest.mark.parametrize("name", _sm90_names())
def test_sm90_split_fits_the_launch_allocation(name):
    c = _constants(name)
    threads, producer, consumer = c["THREADS"], c["PRODUCER_REGS"], c["CONSUMER_REGS"]
    assert threads % WG == 0 and threads >= 2 * WG, threads
    assert _budget_ok(producer) and _budget_ok(consumer), (producer, consumer)
    assert producer < consumer
    need = WG * producer + (threads - WG) * consumer  # one producer warpgroup, the rest consumers
    assert need <= launch_allocation(threads) * threads, (name, producer, consumer, need)


@pytest.mark.parametrize("name", _sm100_names())
def test_sm100_split_fits_the_launch_allocation(name):
    c = _constants(name)
    text = _source(name)
    assert "WARP_SOFTMAX = ((0, 1, 2, 3), (4, 5, 6, 7))" in text  # two softmax warpgroups
    assert c["WARP_CORRECTION"] == 8 and c["THREADS"] == 4 * WG  # one correction, one other
    softmax, correction, other = c["REG_SOFTMAX"], c["REG_CORRECTION"], c["REG_OTHER"]
    assert all(_budget_ok(v) for v in (softmax, correction, other)), (softmax, correction, other)
    need = WG * (2 * softmax + correction + other)
    assert need <= launch_allocation(c["THREADS"]) * c["THREADS"], (name, softmax, correction, other)
