"""setmaxnreg only moves registers between the warpgroups of a CTA inside the allocation the CTA got
at launch (the kernel's register count, at most 65536 / threads rounded down to 8, times its
threads). A split whose budgets add up to more than that makes the warpgroups that ask for more
(`setmaxnreg.inc`) wait forever for registers nobody frees: the kernel hangs on the GPU, and nothing
on the CPU fails unless the arithmetic is checked. These tests check it for every generated kernel
that redistributes registers, from the constants its template rendered."""

import re
from pathlib import Path

import pytest

GENERATED = Path(__file__).resolve().parent.parent / "generated"
REGISTER_FILE = 65536  # 32-bit registers per SM, the most one CTA can hold
WG = 128  # threads of a warpgroup, the unit setmaxnreg acts on


def _constants(path: Path) -> dict[str, int]:
    text = path.read_text()
    return {k: int(v) for k, v in re.findall(r"^([A-Z_]+) = (\d+)\b", text, flags=re.MULTILINE)}


def launch_allocation(threads: int) -> int:
    """Registers per thread a CTA of ``threads`` threads can hold at launch (whole 8-register units)."""
    return min(REGISTER_FILE // threads // 8 * 8, 255 // 8 * 8)


def _sm90_files() -> list[Path]:
    return sorted(p for p in (GENERATED / "sm90").glob("cutefa_*.py") if "PRODUCER_REGS = " in p.read_text())


def _sm100_files() -> list[Path]:
    return sorted(p for p in (GENERATED / "sm100").glob("cutefa_*.py") if "REG_SOFTMAX = " in p.read_text())


def _budget_ok(value: int) -> bool:
    return 24 <= value <= 256 and value % 8 == 0  # setmaxnreg's range and granularity


def test_launch_allocation():
    assert launch_allocation(384) == 168  # one producer + two consumer warpgroups
    assert launch_allocation(512) == 128
    assert 24 * WG + 240 * 2 * WG == 168 * 384  # the 16-bit sm90 split fills it exactly
    assert 32 * WG + 240 * 2 * WG > 168 * 384  # ... and one more producer unit does not fit


def test_every_redistributing_kernel_is_checked():
    sm90 = {p.name.split("_")[2] for p in _sm90_files()}  # fwd / bwd
    assert sm90 == {"fwd", "bwd"}, sm90
    assert any("_e4m3_" in p.name for p in _sm90_files())
    assert _sm100_files()


@pytest.mark.parametrize("path", _sm90_files(), ids=lambda p: p.stem)
def test_sm90_split_fits_the_launch_allocation(path):
    c = _constants(path)
    threads, producer, consumer = c["THREADS"], c["PRODUCER_REGS"], c["CONSUMER_REGS"]
    assert threads % WG == 0 and threads >= 2 * WG, threads
    assert _budget_ok(producer) and _budget_ok(consumer), (producer, consumer)
    assert producer < consumer
    need = WG * producer + (threads - WG) * consumer  # one producer warpgroup, the rest consumers
    assert need <= launch_allocation(threads) * threads, (path.stem, producer, consumer, need)


@pytest.mark.parametrize("path", _sm100_files(), ids=lambda p: p.stem)
def test_sm100_split_fits_the_launch_allocation(path):
    c = _constants(path)
    text = path.read_text()
    assert "WARP_SOFTMAX = ((0, 1, 2, 3), (4, 5, 6, 7))" in text  # two softmax warpgroups
    assert c["WARP_CORRECTION"] == 8 and c["THREADS"] == 4 * WG  # one correction, one other
    softmax, correction, other = c["REG_SOFTMAX"], c["REG_CORRECTION"], c["REG_OTHER"]
    assert all(_budget_ok(v) for v in (softmax, correction, other)), (softmax, correction, other)
    need = WG * (2 * softmax + correction + other)
    assert need <= launch_allocation(c["THREADS"]) * c["THREADS"], (path.stem, softmax, correction, other)
