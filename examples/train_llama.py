"""Train a Llama-style model with transformers on cutefa's attention, beside PyTorch's SDPA backends.

    python examples/train_llama.py                            # ~100M parameters, 300 steps, cutefa and sdpa
    python examples/train_llama.py --attn cutefa,sdpa_flash,sdpa_cudnn,fa4 --steps 500
    python examples/train_llama.py --preset small4            # 4 layers, hidden 1024, 8/2 heads, head dim 128,
                                                              # batch 2 x 2048 tokens, bf16
    python examples/train_llama.py --preset small4 --attn sdpa_cudnn,cutefa,cutefa_sdpa --turns 10

Each backend trains the same model from the same random initialization on the same synthetic
text, one after the other in this process, and gets one line: tokens/s and ms per step (after the
warm-up steps, which include compiling kernels), peak GPU memory and the last loss. The loss curves
of all of them go into one PNG (``--plot``). The text is a fixed-seed Markov chain over the
vocabulary (each token has a few likely successors), so the loss falls from ln(vocab) towards the
chain's entropy within a few hundred steps, the same way for every backend.

A small model's step is host-bound and its time drifts during a run, so one backend's block of
steps against another's measures the drift too. ``--turns R`` (R > 1) builds and warms up every
backend first (all stay alive), cuts the timed steps into R chunks and runs them in turns: chunk by
chunk, each backend runs its next chunk, in an order that rotates each chunk. A backend's ms per
step is then the median over its chunks, shown with their spread (min-max); its peak memory is that
of its warm-up steps less what the backends built before it hold.

Backends (``--attn``, comma-separated):

- ``cutefa``: ``attn_implementation="cutefa"`` (:mod:`cutefa.integrations.transformers`);
- ``cutefa_sdpa``: ``attn_implementation="sdpa"`` with cutefa as SDPA's flash provider
  (:mod:`cutefa.torch_sdpa`);
- ``sdpa``: ``attn_implementation="sdpa"``, PyTorch's own choice of kernel;
- ``sdpa_flash`` / ``sdpa_cudnn``: SDPA held to its flash / cuDNN backend (``sdpa_kernel``);
- ``fa4``: ``attn_implementation="flash_attention_4"`` where FlashAttention-4 (``flash_attn.cute``)
  is installed (skipped with a note elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BACKENDS = ("cutefa", "cutefa_sdpa", "sdpa", "sdpa_flash", "sdpa_cudnn", "fa4")


@dataclass
class Run:
    backend: str
    losses: list[float] = field(default_factory=list)
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (steps, seconds) of each timed chunk
    tokens_per_step: int = 0
    peak_bytes: int = 0
    note: str = ""
    profile: str = ""  # --profile's table
    gc: GcTimer | None = None  # Python's garbage collections during the timed steps

    @property
    def timed_steps(self) -> int:
        return sum(steps for steps, _ in self.chunks)

    @property
    def chunk_ms(self) -> list[float]:
        """Each timed chunk's milliseconds per step, in order."""
        return [1e3 * seconds / steps for steps, seconds in self.chunks]

    @property
    def ms_per_step(self) -> float:
        """The median over the chunks of their ms per step (one chunk: its seconds over its steps)."""
        return statistics.median(self.chunk_ms) if self.chunks else math.nan

    @property
    def spread(self) -> tuple[float, float]:
        """The least and the most ms per step of a chunk."""
        ms = self.chunk_ms
        return (min(ms), max(ms)) if ms else (math.nan, math.nan)

    @property
    def tokens_per_second(self) -> float:
        return 1e3 * self.tokens_per_step / self.ms_per_step if self.chunks else math.nan


class GcTimer:
    """The time Python's garbage collector took between ``start`` and ``stop`` (``gc.callbacks``), by generation:
    a full (generation 2) collection walks every tracked object, so its cost grows with what the
    process holds (a compiler's objects, for one), and the host-bound steps of a small model feel it."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0
        self.objects = 0  # tracked objects when the timing ended
        self.dsl_loaded = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._start
            self.counts[generation] += 1

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)
        self.objects = len(gc.get_objects())
        self.dsl_loaded = "cutlass" in sys.modules  # a JIT compile in this process loads the CuTe DSL

    def line(self, steps: int) -> str:
        total = sum(self.seconds)
        return (
            f"gc {1e3 * total / max(steps, 1):.2f} ms/step ({self.counts[0]}/{self.counts[1]}/{self.counts[2]} "
            f"collections of generations 0/1/2, {1e3 * self.seconds[2]:.0f} ms in generation 2; "
            f"{self.objects / 1e6:.2f}M objects tracked{', the CuTe DSL loaded' if self.dsl_loaded else ''})"
        )


@dataclass(frozen=True)
class Settings:
    """A model shape (LlamaConfig fields) and how to train it."""

    shape: dict
    batch: int
    seqlen: int
    steps: int
    warmup: int  # steps before the timing starts (kernels compile, allocator warms up)
    lr: float


PRESETS = {
    # ~103M parameters: 12 layers, hidden 768, 12 heads of 64 over 4 kv heads, vocab 8192
    "100m": Settings(
        {
            "hidden_size": 768,
            "intermediate_size": 2560,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 8192,
        },
        batch=8,
        seqlen=1024,
        steps=300,
        warmup=10,
        lr=6e-4,
    ),
    # the 4-layer Llama of the benchmark: hidden 1024, 8 query / 2 kv heads of 128, 2 x 2048 tokens
    "small4": Settings(
        {
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 8192,
        },
        batch=2,
        seqlen=2048,
        steps=300,
        warmup=10,
        lr=1e-3,
    ),
    # a few seconds anywhere, for trying the script out
    "tiny": Settings(
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
        batch=2,
        seqlen=256,
        steps=30,
        warmup=3,
        lr=3e-3,
    ),
}


def settings_of(args: argparse.Namespace) -> Settings:
    """The preset, with the command line's batch, seqlen and steps where given."""
    preset = PRESETS[args.preset]
    return dataclasses.replace(
        preset,
        batch=args.batch or preset.batch,
        seqlen=args.seqlen or preset.seqlen,
        steps=args.steps or preset.steps,
    )


def markov_text(steps: int, batch: int, seqlen: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    """(steps, batch, seqlen) token ids from a fixed random Markov chain: each token is followed
    by one of 4 successors with probabilities 0.55/0.25/0.15/0.05. Chains run in parallel."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    chains = steps * batch
    tokens = torch.empty(chains, seqlen, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (chains,), generator=g)
    for t in range(1, seqlen):
        pick = torch.multinomial(probs, chains, replacement=True, generator=g)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens.view(steps, batch, seqlen).to(device)


def attention_setup(backend: str) -> tuple[str | None, Callable[[], contextlib.AbstractContextManager], str]:
    """(attn_implementation, what makes a fresh context for the steps to run in, a note); None: not
    available here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "cutefa":
        from cutefa.integrations import transformers as integration

        integration.register()
        return "cutefa", contextlib.nullcontext, ""
    if backend == "cutefa_sdpa":
        from cutefa import torch_sdpa

        return "sdpa", functools.partial(_provider, torch_sdpa), ""
    if backend == "sdpa":
        return "sdpa", contextlib.nullcontext, ""
    if backend == "sdpa_flash":
        return "sdpa", functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION), ""
    if backend == "sdpa_cudnn":
        return "sdpa", functools.partial(sdpa_kernel, SDPBackend.CUDNN_ATTENTION), ""
    if backend == "fa4":
        if (
            importlib.util.find_spec("flash_attn") is None
            or importlib.util.find_spec("flash_attn.cute") is None
        ):
            return None, contextlib.nullcontext, "FlashAttention-4 (flash_attn.cute) is not installed"
        return "flash_attention_4", contextlib.nullcontext, ""
    raise ValueError(f"--attn {backend!r} is not one of {BACKENDS}")


@contextlib.contextmanager
def _provider(torch_sdpa):
    torch_sdpa.activate()
    try:
        yield
    finally:
        torch_sdpa.deactivate()


# ---------------------------------------------------------------------------------------------
# the turns: plain functions of steps and clocks


def chunks_of(first: int, stop: int, turns: int) -> list[range]:
    """The steps first .. stop - 1 cut into ``turns`` consecutive chunks, as even as they come (the
    first ones one step longer)."""
    count = stop - first
    if turns < 1 or turns > count:
        raise ValueError(f"turns {turns}: cannot cut {count} steps into that many chunks")
    size, longer = divmod(count, turns)
    starts = [first + r * size + min(r, longer) for r in range(turns + 1)]
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def turn_order(count: int, turn: int) -> list[int]:
    """The backends' order in turn ``turn``: a rotation that starts at turn mod count, so that no
    backend always runs first (or always after the same one's chunk)."""
    if count == 0:
        return []
    start = turn % count
    return list(range(start, count)) + list(range(start))


def time_chunk(
    step: Callable[[int], object], steps: range, sync: Callable[[], None], clock=time.perf_counter
) -> float:
    """The seconds that ``step(i)`` for every i of ``steps`` take, a device sync before and after."""
    sync()
    start = clock()
    for i in steps:
        step(i)
    sync()
    return clock() - start


def run_in_turns(trainers: Sequence[Any], chunks: Sequence[range]) -> None:
    """Chunk by chunk, every trainer runs that chunk (``run_chunk``) under a fresh ``context()``, in
    the order :func:`turn_order` gives the chunk."""
    for turn, steps in enumerate(chunks):
        for i in turn_order(len(trainers), turn):
            with trainers[i].context():
                trainers[i].run_chunk(steps)


# ---------------------------------------------------------------------------------------------
# one backend's training


class Trainer:
    """One backend's training: ``step(tokens)`` (one optimizer step, returning the loss) over
    ``data``, and the :class:`Run` it fills. ``warm_up`` runs the first ``warmup`` steps,
    ``run_chunk`` times a chunk of the others, ``profile`` runs --profile / --host-profile,
    ``finish`` turns the losses into floats and lets the model go. The caller enters ``context()``
    (a fresh one each time: the attention backend's settings) around each of them."""

    def __init__(
        self, run: Run, step: Callable[[Any], Any] | None, data: Any, warmup: int,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        args: argparse.Namespace | None = None,
    ) -> None:  # fmt: skip
        self.run, self.step, self.data, self.warmup, self.context = run, step, data, warmup, context
        self.args = args or argparse.Namespace(device="cpu", profile=0, host_profile=0)
        self.gc = GcTimer()
        self.clock = time.perf_counter  # what times the chunks

    @property
    def ready(self) -> bool:
        """Whether the backend runs here (else its run has a note)."""
        return self.step is not None

    def _step_at(self, i: int) -> None:
        self.run.losses.append(self.step(self.data[i]))

    def warm_up(self) -> None:
        for i in range(self.warmup):
            self._step_at(i)

    def run_chunk(self, steps: range) -> None:
        """Run and time the steps ``steps`` (indices into the data, in order) and the garbage
        collections during them."""
        self.gc.start()
        seconds = time_chunk(self._step_at, steps, functools.partial(_sync, self.args.device), self.clock)
        self.gc.stop()
        self.run.chunks.append((len(steps), seconds))
        self.run.gc = self.gc

    def profile(self) -> None:
        device = self.args.device
        if self.args.profile:
            self.run.profile = profile_steps(self.step, self.data[-self.args.profile :], device)
        if self.args.host_profile:
            self.run.profile += host_profile(self.step, self.data[-self.args.host_profile :], device)

    def finish(self) -> Run:
        self.run.losses = [float(x) for x in self.run.losses]
        self.step = None  # free the GPU memory (weights, optimizer state) that the step holds
        return self.run


def build_trainer(backend: str, args: argparse.Namespace, settings: Settings, data: torch.Tensor) -> Trainer:
    """The backend's model (seeded with --seed: the same initialization for every backend), AdamW and
    learning-rate warm-up, as a :class:`Trainer`; one with a note and no step where the backend is not
    available here. Resets the GPU's peak memory statistics once the model is built."""
    from transformers import LlamaConfig, LlamaForCausalLM

    warmup = settings.warmup
    run = Run(backend, tokens_per_step=data.shape[1] * data.shape[2])
    impl, context, note = attention_setup(backend)
    if impl is None:
        run.note = note
        return Trainer(run, None, data, warmup, context, args)
    config = LlamaConfig(
        **settings.shape, max_position_embeddings=settings.seqlen, attention_dropout=0.0, use_cache=False
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device=args.device, dtype=torch.bfloat16)
    model.set_attn_implementation(impl)
    model.train()
    fused = {"fused": True} if args.device == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (2 * warmup)))
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Trainer(run, step, data, warmup, context, args)


def train(backend: str, args: argparse.Namespace, settings: Settings, data: torch.Tensor) -> Run:
    """One backend alone: built, warmed up, its timed steps in one chunk, profiled, and let go."""
    trainer = build_trainer(backend, args, settings, data)
    if trainer.ready:
        with trainer.context():
            trainer.warm_up()
            trainer.run_chunk(range(settings.warmup, len(data)))
            trainer.profile()
        trainer.run.peak_bytes = _peak_bytes(args.device)
    return trainer.finish()


def train_in_turns(
    backends: list[str], args: argparse.Namespace, settings: Settings, data: torch.Tensor
) -> list[Run]:
    """--turns R > 1: every backend built and warmed up, one after the other (all stay alive), then
    the timed steps in R chunks run in turns (:func:`run_in_turns`), then the profiles. A backend's
    peak memory is that of its warm-up less what the backends built before it hold."""
    base = _allocated_bytes(args.device)
    trainers = []
    for backend in backends:
        held = _allocated_bytes(args.device) - base  # the models and optimizers built before this one
        trainer = build_trainer(backend, args, settings, data)
        trainers.append(trainer)
        if trainer.ready:
            with trainer.context():
                trainer.warm_up()
            trainer.run.peak_bytes = _peak_bytes(args.device) - held
    ready = [t for t in trainers if t.ready]
    run_in_turns(ready, chunks_of(settings.warmup, len(data), args.turns))
    for trainer in ready:
        with trainer.context():
            trainer.profile()
    return [t.finish() for t in trainers]


def profile_steps(step: Any, batches: torch.Tensor, device: str, rows: int = 12) -> str:
    """The table of where ``len(batches)`` more steps spent their time (torch.profiler: the ops and
    kernels of the most device time), headed by the wall and device milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for tokens in batches:
            step(tokens)
        _sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e3  # us -> ms
    n = len(batches)
    head = (
        f"profiled {n} steps: wall {1e3 * wall / n:.2f} ms/step (with the profiler's own cost), "
        f"device {kernels / n:.2f} ms/step of kernels"
    )
    return head + "\n" + events.table(sort_by="self_device_time_total", row_limit=rows)


def host_profile(step: Any, batches: torch.Tensor, device: str, rows: int = 30) -> str:
    """Where the host (Python) time of ``len(batches)`` more steps went (cProfile: the functions of
    the most own time, then of the most time with their callees), for a host-bound step."""
    import cProfile
    import io
    import pstats

    _sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for tokens in batches:
        step(tokens)
    profiler.disable()
    _sync(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return f"\nhost profile of {len(batches)} steps (cProfile):\n" + text.getvalue()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _peak_bytes(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def plot(runs: list[Run], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        if run.losses:
            label = f"{run.backend} ({run.tokens_per_second / 1e3:.1f}k tok/s)"
            ax.plot(range(1, len(run.losses) + 1), run.losses, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run_lines(run: Run, turns: int = 1) -> list[str]:
    """The report of one backend: its speed, memory and losses (with --turns R > 1 also the spread
    of its chunks), then its garbage collection and its profiles where there are."""
    if run.note:
        return [f"{run.backend:12s}  skipped: {run.note}"]
    ms = f"{run.ms_per_step:7.2f} ms/step"
    if turns > 1:
        low, high = run.spread
        ms += f" (median of {len(run.chunks)} turns, {low:.2f}-{high:.2f})"
    speed = f"{run.backend:12s}  {run.tokens_per_second:10.0f} tokens/s  {ms}"
    lines = [
        f"{speed}  peak {run.peak_bytes / 2**30:6.2f} GiB  loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}"
    ]
    if run.gc is not None:
        lines.append(f"{'':12s}  {run.gc.line(run.timed_steps)}")
    if run.profile:
        lines.append(run.profile)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attn", default="cutefa,sdpa", help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the preset's)")
    parser.add_argument("--seqlen", type=int, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="(cuda; cpu only for trying sdpa out)")
    parser.add_argument("--plot", type=Path, default=Path("train_llama_loss.png"), help="loss-curve PNG")
    parser.add_argument(
        "--turns", type=int, default=1, metavar="R",
        help="R > 1: build every backend first, then time the steps in R chunks run in turns, "
        "each backend's ms/step the median over its chunks (default 1: one backend after the other)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="after the timed steps, profile N more of each backend and print where the time went",
    )  # fmt: skip
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N",
        help="after the timed steps, profile the host (Python) time of N more steps of each backend (cProfile)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.attn.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"--attn {','.join(unknown)}: not one of {', '.join(BACKENDS)}")
    settings = settings_of(args)
    if settings.steps <= settings.warmup:
        parser.error(f"--steps must exceed the {settings.warmup} warm-up steps")
    if not 1 <= args.turns <= settings.steps - settings.warmup:
        parser.error(f"--turns must be from 1 to the {settings.steps - settings.warmup} timed steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here (--device cpu runs the sdpa backends on the CPU, slowly)")
    vocab = settings.shape["vocab_size"]
    data = markov_text(settings.steps, settings.batch, settings.seqlen, vocab, args.seed, args.device)

    if args.turns == 1:
        runs = []
        for backend in backends:
            runs.append(train(backend, args, settings, data))
            print("\n".join(run_lines(runs[-1])), flush=True)
    else:
        runs = train_in_turns(backends, args, settings, data)
        for run in runs:
            print("\n".join(run_lines(run, args.turns)), flush=True)
    done = [r for r in runs if r.losses]
    if len(done) > 1:
        base = max((r for r in done if r.backend.startswith(("sdpa", "fa4"))), key=lambda r: r.tokens_per_second,
                   default=None)  # fmt: skip
        if base is not None:
            for run in done:
                print(
                    f"{run.backend:12s}  {run.tokens_per_second / base.tokens_per_second:.3f}x {base.backend}"
                )
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    layers = settings.shape["num_hidden_layers"]
    title = f"{args.preset}: {layers} layers, batch {settings.batch} x {settings.seqlen}, {device}"
    plot(done, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
