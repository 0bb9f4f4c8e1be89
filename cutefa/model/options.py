"""Per-family kernel options: one frozen record per (family, direction, dtype class), enums for
exclusive choices.

A :class:`~cutefa.model.spec.VariantSpec` carries exactly one of these records, the one of its
family: an sm80 forward cannot even hold an sm90 schedule. Each field adds its name token(s) to the
variant name in field order (:func:`option_tokens`), and :func:`parse_option_tokens` reads them
back, so the name stays the identity.

Where a choice is exclusive (the consumer schedule, the tile scheduler, the dQ path, the V
transpose) it is one enum; independent refinements stay booleans. The rules that relate fields of
one record (lazy rescale needs the overlap schedule, ...) live in :mod:`cutefa.model.rules`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Choice(enum.Enum):
    """An exclusive choice. Its value is the name token(s) it adds ("" adds none). Members order
    by declaration, so specs sort."""

    def __lt__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        members = list(type(self))
        return members.index(self) < members.index(other)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(t for t in self.value.split("_") if t)


class Mask(Choice):
    """Which keys a query row attends (a compile-time choice; window sizes are kernel arguments)."""

    NONE = ""
    CAUSAL = "causal"  # bottom-right aligned when seqlen_q != seqlen_k
    LOCAL = "local"  # a sliding window (left, right) around the diagonal


class Schedule(Choice):
    """sm90 forward: how the consumer warpgroups order their GEMMs and softmax."""

    SERIAL = ""  # S = Q K^T, softmax, O += P V, one after the other
    OVERLAP = "ov"  # the next S = Q K^T issued before this block's softmax (intra-warpgroup overlap)
    PINGPONG = "pp"  # consumer warpgroups take turns issuing their GEMMs
    OVERLAP_PINGPONG = "ov_pp"  # both

    @property
    def overlap(self) -> bool:
        return self in (Schedule.OVERLAP, Schedule.OVERLAP_PINGPONG)

    @property
    def pingpong(self) -> bool:
        return self in (Schedule.PINGPONG, Schedule.OVERLAP_PINGPONG)


class Scheduler(Choice):
    """sm90 forward: how query tiles are mapped to CTAs."""

    GRID = ""  # one CTA per tile, the hardware's launch order
    PERSISTENT = "persist"  # one CTA per SM walking the tiles longest-first
    LPT = "lpt"  # one CTA per tile in a 1-D grid, longest-first in L2-sized sections (16-bit only)
    # Packed batches (16-bit only): LPT's 1-D order over ceil(max_seqlen_q / tile_m) query tiles of
    # every (head, sequence), the last (heaviest when causal) first; a CTA past its sequence's tiles
    # exits before it sets anything up.
    HEAVY_FIRST = "hfirst"


class Quant(Choice):
    """e4m3 forward: the granularity of the descales."""

    TENSOR = ""  # one descale per (batch, kv head) (or per tensor)
    BLOCK = "blockq"  # one per tile of rows (FlashAttention-3's block quantization)


class CacheDtype(Choice):
    """sm80 decode (split-KV) forward: the element type of the KV cache."""

    SAME = ""  # the cache in q's dtype (fp16/bf16)
    E4M3 = "kve4m3"  # an e4m3 cache with descales per (batch, kv head), converted to q's dtype on chip


class VTranspose(Choice):
    """sm90 e4m3 forward: how the producer warpgroup transposes V in shared memory."""

    INDEXED = ""  # 32-bit views of the swizzled tiles indexed per word
    HOISTED = "hvt"  # per-thread byte bases computed once, compile-time offsets
    WIDE = "hvt_wvt"  # hoisted, with 64-bit shared-memory accesses (8 keys x 8 head dims a unit)


class RowSum(Choice):
    """sm90 e4m3 forward: how the row sums of P are taken."""

    FADD = ""  # a floating-point add per probability
    MMA = "smma"  # one more WGMMA per key block, P times a block of ones


class OAccum(Choice):
    """sm90 e4m3 forward: where O accumulates."""

    ONE_LEVEL = ""  # in the WGMMA accumulator across all keys
    TWO_LEVEL = "tlacc"  # promoted into an fp32 copy every few key blocks (accuracy on long rows)


class DqPath(Choice):
    """sm90 backward: how dQ = dS K reaches the fp32 dQ accumulator in global memory."""

    RED = ""  # per-thread 8-byte reductions
    BULK = "dqbulk"  # staged in shared memory, one bulk reduce-add per consumer and query block
    BULK_WARP = "dqbulk_dqw"  # BULK issued by a dedicated dQ-writer warp
    BULK_STAGED = "dqbulk_dqs"  # BULK through a dQ staging buffer of its own (the swapped partition)


class DqLayout(Choice):
    """sm80 backward: the layout of the fp32 dQ accumulator."""

    ROWS = ""  # row-major, element-wise reductions
    QUAD = "dqquad"  # columns permuted so four values of a row add in one 16-byte reduction
    TILE = "dqtile"  # tiled by query blocks in the MMA's fragment order (FlashAttention-2's)


def _flag(token: str) -> dict:
    """Field metadata of a boolean option: the name token it adds when true."""
    return {"token": token}


@dataclass(frozen=True, order=True)
class Options:
    """Base of the option records. ``exp_emu`` fields are the percent of the softmax's exp2
    evaluated by a polynomial on the FMA units (name token ``emu<N>``)."""

    def replace(self, **changes: object) -> Options:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, order=True)
class Sm80FwdOptions(Options):
    """The sm80 forward (FlashAttention-2). ``cache_dtype``: the decode variants' (split_kv) KV-cache
    element type. ``line_copy``: the decode variants' K/V rows copied a 128-byte line per 8 threads
    (cutefa.model.policy_decode.copy_threads_per_row) instead of a 32-byte sector per 2.
    ``page_chunks``: a paged decode variant with line copies reads the page table once per aligned
    chunk of 16 keys a thread, not once per row (pages of at least 16 keys only;
    cutefa.model.policy_decode.DecodePages)."""

    cache_dtype: CacheDtype = CacheDtype.SAME
    line_copy: bool = dataclasses.field(default=False, metadata=_flag("lcp"))
    page_chunks: bool = dataclasses.field(default=False, metadata=_flag("pch"))

    @property
    def kv_e4m3(self) -> bool:
        """The template's switch: an e4m3 KV cache."""
        return self.cache_dtype is CacheDtype.E4M3


@dataclass(frozen=True, order=True)
class Sm80BwdOptions(Options):
    dq_layout: DqLayout = DqLayout.ROWS
    # With DqLayout.TILE and one Q buffer: dQ computed by column chunks, each chunk's reductions
    # issued between the next chunk's MMAs (they leave while MMAs run).
    dq_pipe: bool = dataclasses.field(default=False, metadata=_flag("dqpipe"))


@dataclass(frozen=True, order=True)
class Sm90FwdOptions(Options):
    """The sm90 16-bit forward (FlashAttention-3)."""

    schedule: Schedule = Schedule.SERIAL
    scheduler: Scheduler = Scheduler.GRID
    # O rescaled right after S = Q K^T is issued, under that WGMMA (FA3/4's RescaleOBeforeGemm).
    early_rescale: bool = dataclasses.field(default=False, metadata=_flag("erescale"))
    # P converted from fp32 two scores per instruction.
    pair_cvt: bool = dataclasses.field(default=False, metadata=_flag("pcvt"))
    # A warp rescales O only when one of its rows' maxes rises by more than a threshold.
    lazy_rescale: bool = dataclasses.field(default=False, metadata=_flag("lres"))
    exp_emu: int = 0


@dataclass(frozen=True, order=True)
class Sm90Fp8FwdOptions(Options):
    """The sm90 e4m3 forward (FlashAttention-3's fp8 path)."""

    schedule: Schedule = Schedule.SERIAL
    scheduler: Scheduler = Scheduler.GRID
    quant: Quant = Quant.TENSOR
    v_transpose: VTranspose = VTranspose.INDEXED
    lazy_rescale: bool = dataclasses.field(default=False, metadata=_flag("lres"))
    row_sum: RowSum = RowSum.FADD
    o_accum: OAccum = OAccum.ONE_LEVEL
    # The kernel takes v's column means (centered v) and adds them in the epilogue.
    v_mean: bool = dataclasses.field(default=False, metadata=_flag("vmean"))
    exp_emu: int = 0


@dataclass(frozen=True, order=True)
class Sm90BwdOptions(Options):
    """The sm90 backward (FlashAttention-3)."""

    # Software-pipelined dQ (main partition) / dV, dK issued before the per-block barrier (head-dim split).
    overlap: bool = dataclasses.field(default=False, metadata=_flag("ov"))
    dq_path: DqPath = DqPath.RED
    # LSE2 and D read from shared memory ahead of the WGMMA waits they follow.
    row_prefetch: bool = dataclasses.field(default=False, metadata=_flag("rpf"))


@dataclass(frozen=True, order=True)
class Sm100FwdOptions(Options):
    """The sm100 forward (FlashAttention-4), 16-bit and e4m3."""

    # A pair of CTAs shares each UMMA (tcgen05 cta_group::2).
    cta_pair: bool = dataclasses.field(default=False, metadata=_flag("pair"))
    exp_emu: int = 0


@dataclass(frozen=True, order=True)
class Sm100BwdOptions(Options):
    """The sm100 backward has no options beyond its tile."""


def options_class(arch: str, direction: str, dtype: str) -> type[Options]:
    """The option record of a (family, direction, dtype)."""
    if arch == "sm80":
        return Sm80FwdOptions if direction == "fwd" else Sm80BwdOptions
    if arch == "sm90":
        if direction == "bwd":
            return Sm90BwdOptions
        return Sm90Fp8FwdOptions if dtype == "e4m3" else Sm90FwdOptions
    if arch == "sm100":
        return Sm100FwdOptions if direction == "fwd" else Sm100BwdOptions
    raise ValueError(f"no option record for family {arch!r}")


def option_tokens(options: Options) -> list[str]:
    """The name tokens of ``options``, in field order."""
    tokens: list[str] = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, Choice):
            tokens += value.tokens
        elif field.name == "exp_emu":
            if value:
                tokens.append(f"emu{value}")
        elif value:
            tokens.append(field.metadata["token"])
    return tokens


def parse_option_tokens(cls: type[Options], tokens: list[str]) -> tuple[Options, list[str]]:
    """Read ``cls``'s fields from the front of ``tokens`` (in field order, as
    :func:`option_tokens` writes them); returns the record and the tokens left over."""
    values: dict[str, object] = {}
    rest = list(tokens)
    for field in dataclasses.fields(cls):
        kind = field.type if not isinstance(field.type, str) else _CHOICES.get(field.type)
        if kind is not None and isinstance(kind, type) and issubclass(kind, Choice):
            # the longest member whose tokens start the rest (e.g. hvt_wvt before hvt)
            for member in sorted(kind, key=lambda m: -len(m.tokens)):
                n = len(member.tokens)
                if n and rest[:n] == list(member.tokens):
                    values[field.name] = member
                    rest = rest[n:]
                    break
        elif field.name == "exp_emu":
            if rest and rest[0].startswith("emu") and rest[0][3:].isdigit():
                values[field.name] = int(rest[0][3:])
                rest = rest[1:]
        elif rest and rest[0] == field.metadata["token"]:
            values[field.name] = True
            rest = rest[1:]
    return cls(**values), rest


_CHOICES: dict[str, type[Choice]] = {
    cls.__name__: cls
    for cls in (Mask, Schedule, Scheduler, Quant, CacheDtype, VTranspose, RowSum, OAccum, DqPath, DqLayout)
}
