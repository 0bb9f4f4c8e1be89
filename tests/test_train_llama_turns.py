"""examples/train_llama.py's --turns on the CPU, with fake training steps and a fake clock (no GPU, no
transformers): the timed steps are cut into even chunks, the backends' order rotates each chunk,
every backend runs every chunk once under a fresh context, its ms/step is the median of its chunks,
its losses stay in step order, its garbage collections are summed over its chunks, and one chunk
(--turns 1) gives the single block's timing and report line."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys
from pathlib import Path

import pytest


def _load_example():
    key = "cutefa_examples_train_llama"
    if key not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # its dataclasses resolve their annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[key]


train_llama = _load_example()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_trainer(name: str, durations: list[float], clock: FakeClock, warmup: int, log: list | None = None):
    """A Trainer whose step i takes durations[i] seconds of the fake clock and returns the loss i, and
    whose context records when it is entered and left (a generator context: single-use)."""

    def step(batch):
        index, seconds = batch
        clock.now += seconds
        if log is not None:
            log.append((name, "step", index))
        return float(index)

    @contextlib.contextmanager
    def context():
        if log is not None:
            log.append((name, "enter", None))
        yield
        if log is not None:
            log.append((name, "exit", None))

    data = list(enumerate(durations))
    run = train_llama.Run(name, tokens_per_step=1000)
    trainer = train_llama.Trainer(run, step, data, warmup, context)
    trainer.clock = clock
    return trainer


def test_chunks_cut_the_timed_steps_evenly_and_in_order():
    chunks = train_llama.chunks_of(10, 300, 10)
    assert [len(c) for c in chunks] == [29] * 10
    assert [i for c in chunks for i in c] == list(range(10, 300))
    chunks = train_llama.chunks_of(0, 7, 3)
    assert chunks == [range(3), range(3, 5), range(5, 7)]
    assert train_llama.chunks_of(3, 30, 1) == [range(3, 30)]
    assert train_llama.chunks_of(3, 30, 27) == [range(i, i + 1) for i in range(3, 30)]
    for turns in (0, 28):
        with pytest.raises(ValueError, match="turns"):
            train_llama.chunks_of(3, 30, turns)


def test_turn_order_rotates():
    orders = [train_llama.turn_order(3, r) for r in range(6)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert train_llama.turn_order(0, 4) == []
    assert train_llama.turn_order(1, 7) == [0]


def test_time_chunk_syncs_around_the_steps():
    events = []
    clock = FakeClock()

    def step(i):
        events.append(("step", i))
        clock.now += 0.5

    def sync():
        events.append(("sync", clock.now))

    seconds = train_llama.time_chunk(step, range(4, 7), sync, clock)
    assert seconds == 1.5
    assert events == [("sync", 0.0), ("step", 4), ("step", 5), ("step", 6), ("sync", 1.5)]


def test_every_backend_runs_every_chunk_once_in_rotating_order_under_fresh_contexts():
    clock, log = FakeClock(), []
    names = ["a", "b", "c"]
    trainers = [fake_trainer(n, [0.01] * 20, clock, warmup=2, log=log) for n in names]
    chunks = train_llama.chunks_of(2, 20, 6)
    train_llama.run_in_turns(trainers, chunks)

    # each chunk: every backend's enter, its steps of that chunk, exit; the chunks in order
    runs = []  # (chunk index, backend) in the order they ran
    position = 0
    for r, chunk in enumerate(chunks):
        for _ in names:
            name = log[position][0]
            expected = [(name, "enter", None)] + [(name, "step", i) for i in chunk] + [(name, "exit", None)]
            assert log[position : position + len(expected)] == expected
            position += len(expected)
            runs.append((r, name))
    assert position == len(log)
    for r in range(len(chunks)):
        order = [name for chunk, name in runs if chunk == r]
        assert order == [names[i] for i in train_llama.turn_order(3, r)]
    assert sorted(runs) == sorted((r, n) for r in range(len(chunks)) for n in names)
    for trainer in trainers:
        assert trainer.run.chunks == [(len(c), pytest.approx(0.01 * len(c))) for c in chunks]


def test_ms_per_step_is_the_median_of_the_chunks_and_the_losses_stay_in_order():
    clock = FakeClock()
    warmup = 3
    # backend a: chunks of 10, 20, 40, 30 ms/step; b: a steady 15 ms/step with one slow chunk of 90
    slow_a = [0.001] * warmup + [0.010] * 4 + [0.020] * 4 + [0.040] * 4 + [0.030] * 4
    slow_b = [0.001] * warmup + [0.015] * 8 + [0.090] * 4 + [0.015] * 4
    a = fake_trainer("a", slow_a, clock, warmup)
    b = fake_trainer("b", slow_b, clock, warmup)
    for trainer in (a, b):
        trainer.warm_up()
    train_llama.run_in_turns([a, b], train_llama.chunks_of(warmup, len(slow_a), 4))
    run_a, run_b = a.finish(), b.finish()

    assert run_a.chunk_ms == pytest.approx([10, 20, 40, 30])
    assert run_a.ms_per_step == pytest.approx(25.0)  # the median of 10, 20, 30, 40
    assert run_a.spread == pytest.approx((10, 40))
    assert run_b.ms_per_step == pytest.approx(15.0)  # the slow chunk does not move the median
    assert run_b.spread == pytest.approx((15, 90))
    assert run_b.tokens_per_second == pytest.approx(1000 / 0.015)
    assert run_a.timed_steps == run_b.timed_steps == 16
    assert run_a.losses == [float(i) for i in range(len(slow_a))]  # warm-up, then every chunk, in order
    assert a.step is None  # finish lets the model go

    line = train_llama.run_lines(run_a, turns=4)[0]
    assert "25.00 ms/step (median of 4 turns, 10.00-40.00)" in line
    assert "loss 0.000 -> 18.000" in line


def test_one_turn_is_the_single_block_timing():
    clock = FakeClock()
    durations = [0.002] * 3 + [0.004, 0.006, 0.011, 0.003, 0.005]
    trainer = fake_trainer("cutefa", durations, clock, warmup=3)
    trainer.warm_up()
    start = clock.now
    (chunk,) = train_llama.chunks_of(3, len(durations), 1)
    train_llama.run_in_turns([trainer], [chunk])
    run = trainer.finish()
    run.peak_bytes = 3 * 2**30

    seconds = clock.now - start  # the one timed block, as the single run measures it
    steps = len(durations) - 3
    assert run.chunks == [(steps, pytest.approx(seconds))]
    assert run.ms_per_step == pytest.approx(1e3 * seconds / steps)
    assert run.tokens_per_second == pytest.approx(steps * 1000 / seconds)
    old = (
        f"{'cutefa':12s}  {steps * 1000 / seconds:10.0f} tokens/s  {1e3 * seconds / steps:7.2f} ms/step"
        f"  peak {3.0:6.2f} GiB  loss {0.0:.3f} -> {7.0:.3f}"
    )
    lines = train_llama.run_lines(run)
    assert lines[0] == old
    assert lines[1].strip().startswith("gc ")  # the garbage collector's line follows


def test_garbage_collections_are_summed_over_the_chunks():
    clock = FakeClock()
    durations = [0.001] * 12

    trainer = fake_trainer("a", durations, clock, warmup=2)
    step = trainer.step

    def collecting_step(batch):
        gc.collect()  # one generation-2 collection per step
        return step(batch)

    trainer.step = collecting_step
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection besides the steps' own
    try:
        trainer.warm_up()
        train_llama.run_in_turns([trainer], train_llama.chunks_of(2, 12, 5))
    finally:
        if enabled:
            gc.enable()
    run = trainer.finish()
    assert run.gc.counts[2] == 10  # the 10 timed steps, not the 2 warm-up ones
    assert trainer.gc._callback not in gc.callbacks
    assert "/10 collections of generations 0/1/2" in run.gc.line(run.timed_steps)


def test_unavailable_backend_is_not_ready():
    run = train_llama.Run("fa4", note="not installed")
    trainer = train_llama.Trainer(run, None, [], 3)
    assert not trainer.ready
    assert train_llama.run_lines(trainer.finish()) == [f"{'fa4':12s}  skipped: not installed"]


def test_backend_contexts_are_made_fresh():
    _, make, _ = train_llama.attention_setup("sdpa_cudnn")
    first, second = make(), make()
    assert first is not second
    for context in (first, second):
        with context:
            pass


@pytest.mark.parametrize("turns", ["0", "28"])
def test_turns_out_of_range_are_refused(turns, capsys):
    with pytest.raises(SystemExit):
        train_llama.main(["--preset", "tiny", "--device", "cpu", "--turns", turns])
    assert "--turns must be from 1 to the 27 timed steps" in capsys.readouterr().err
