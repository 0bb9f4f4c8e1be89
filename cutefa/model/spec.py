"""Kernel variant specifications: the spec is the identity, its name is the key.

A :class:`VariantSpec` is (family, direction, dtype, head dims, tile, mask kind, feature axes,
options), where options is the frozen record of its family (:mod:`cutefa.model.options`). Every
field changes the generated code, so every field is in the name: :attr:`VariantSpec.name` builds it
procedurally and :func:`parse_name` reads it back. The name is the generated file name, the
compile-cache key, the CLI filter target and the log tag.

Name layout::

    cutefa_<arch>_<fwd|bwd>_<dtype>_hd<d>[v<d_v>]_<tile_m>x<tile_n>_s<stages>_w<warps>
        [_causal|_local] [_<feature>...] [_<option token>...]
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from cutefa.model.options import Mask, Options, option_tokens, options_class, parse_option_tokens

# Kernel families (the design a kernel uses). A family runs on any compile target at or above it.
ARCHS = ("sm80", "sm90", "sm100")
DIRECTIONS = ("fwd", "bwd")
DTYPES = ("fp16", "bf16", "e4m3")
# The standard head dims: every family has a kernel of each, and the committed set a default of each.
HEAD_DIMS = (64, 96, 128, 192, 256)
# Head dims with a committed variant of their own besides the standard ones (sm80 family, tuned
# for the models that use them widely: 80 in Phi-2 and StableLM, 112); every other accepted head
# dim renders from its family's nearest default on demand.
TUNED_HEAD_DIMS = (80, 112)
COMMITTED_HEAD_DIMS = tuple(sorted(HEAD_DIMS + TUNED_HEAD_DIMS))
# The head dims a variant may have: a multiple of HEAD_DIM_STEP from HEAD_DIM_STEP to MAX_HEAD_DIM
# (whole 16-byte rows of 16-bit elements); a kernel family pads it to its own tile head dim.
HEAD_DIM_STEP = 8
MAX_HEAD_DIM = 256
ACCEPTED_HEAD_DIMS = f"a multiple of {HEAD_DIM_STEP} from {HEAD_DIM_STEP} to {MAX_HEAD_DIM}"
# (head_dim, head_dim_v) pairs with a V head dim apart from the Q/K one (DeepSeek's prefill).
HEAD_DIM_V_PAIRS = ((192, 128),)

# Compile targets (the GPU a cubin is built for) and the family each one can run.
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a")
DEFAULT_TARGET = {"sm80": "sm_80", "sm90": "sm_90a", "sm100": "sm_100a"}
_TARGET_CC = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90a": 90, "sm_100a": 100, "sm_103a": 103}
_FAMILY_CC = {"sm80": 80, "sm90": 90, "sm100": 100}
# Arch-specific families run only on the targets listed (an 'a' target's code loads only on its own
# compute capability, so each GPU needs its own compile): tcgen05 is the same on B200 (10.0) and
# B300 (10.3).
_FAMILY_TARGET_CCS = {"sm90": (90,), "sm100": (100, 103)}

# torch dtype name <-> spec dtype token
TORCH_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}


def accepted_head_dim(head_dim: object) -> bool:
    """Whether ``head_dim`` is one a variant may have (:data:`ACCEPTED_HEAD_DIMS`)."""
    return (
        isinstance(head_dim, int) and not isinstance(head_dim, bool)
        and 0 < head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0
    )  # fmt: skip


def why_not_head_dims(head_dim: int, head_dim_v: int) -> str | None:
    """Why (``head_dim``, ``head_dim_v``) is no pair a variant may have, naming what is, or None."""
    if not accepted_head_dim(head_dim):
        return f"head_dim={head_dim} is not {ACCEPTED_HEAD_DIMS}"
    if head_dim_v != head_dim and (head_dim, head_dim_v) not in HEAD_DIM_V_PAIRS:
        pairs = ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIM_V_PAIRS)
        return (
            f"head_dim_v={head_dim_v} with head_dim={head_dim}: a V head dim apart from the Q/K one is "
            f"supported for (head_dim, head_dim_v) in {pairs} only; otherwise head_dim_v must equal head_dim"
        )
    return None


def _feature(token: str) -> dict:
    return {"token": token}


@dataclass(frozen=True, order=True)
class Features:
    """Compile-time feature axes shared by every family (their runtime values, such as window
    sizes, caps, page sizes and lengths, are kernel arguments). A spec whose template does not
    implement a feature has no kernel (:func:`cutefa.model.rules.why_no_kernel` says which)."""

    varlen: bool = dataclasses.field(default=False, metadata=_feature("varlen"))  # cu_seqlens batches
    paged_kv: bool = dataclasses.field(default=False, metadata=_feature("paged"))  # K/V through a page table
    split_kv: bool = dataclasses.field(default=False, metadata=_feature("split"))  # keys split across CTAs
    softcap: bool = dataclasses.field(default=False, metadata=_feature("softcap"))  # c * tanh(s / c)
    alibi: bool = dataclasses.field(default=False, metadata=_feature("alibi"))  # -slope * |i - j|
    sinks: bool = dataclasses.field(default=False, metadata=_feature("sinks"))  # a per-head extra logit

    @property
    def tokens(self) -> list[str]:
        return [f.metadata["token"] for f in dataclasses.fields(self) if getattr(self, f.name)]

    @property
    def any(self) -> bool:
        return bool(self.tokens)


PACKED = Features(varlen=True)  # packed sequences with no other feature axis

_FEATURE_TOKENS = {f.metadata["token"]: f.name for f in dataclasses.fields(Features)}

_NAME_RE = re.compile(
    r"^cutefa_(?P<arch>sm\d+)_(?P<direction>fwd|bwd)_(?P<dtype>[a-z0-9]+)_hd(?P<head_dim>\d+)(?:v(?P<head_dim_v>\d+))?"
    r"_(?P<tile_m>\d+)x(?P<tile_n>\d+)_s(?P<stages>\d+)_w(?P<warps>\d+)(?P<tokens>(?:_[a-z0-9]+)*)$"
)


@dataclass(frozen=True, order=True, init=False)
class VariantSpec:
    """One kernel variant.

    ``VariantSpec(arch, direction, dtype, head_dim, tile_m, tile_n, stages, warps, *, mask=...,
    causal=..., features=..., head_dim_v=..., options=..., **option_fields)``: ``causal=True`` is
    short for ``mask=Mask.CAUSAL``; option fields given by name (``schedule=Schedule.OVERLAP``) go
    into the family's record, which defaults to its all-default value.
    """

    arch: str  # kernel family: sm80 (FA2 design), sm90 (FA3 design), sm100 (FA4 design)
    direction: str  # fwd | bwd
    dtype: str  # fp16 | bf16 | e4m3
    head_dim: int  # of q and k
    tile_m: int  # query rows per CTA tile
    tile_n: int  # key/value rows per mainloop step
    stages: int  # shared-memory buffers for each of K and V
    warps: int  # warps per CTA
    mask: Mask
    features: Features
    head_dim_v: int  # of v and the output (equal to head_dim unless given)
    options: Options

    def __init__(
        self,
        arch: str,
        direction: str,
        dtype: str,
        head_dim: int,
        tile_m: int,
        tile_n: int,
        stages: int,
        warps: int,
        *,
        mask: Mask | None = None,
        causal: bool | None = None,
        features: Features | None = None,
        head_dim_v: int | None = None,
        options: Options | None = None,
        **option_fields: object,
    ) -> None:
        for field, value, allowed in (("arch", arch, ARCHS), ("direction", direction, DIRECTIONS), ("dtype", dtype, DTYPES)):
            if value not in allowed:
                raise ValueError(f"VariantSpec.{field}={value!r} is not one of {allowed}")
        ints = {"head_dim": head_dim, "tile_m": tile_m, "tile_n": tile_n, "stages": stages, "warps": warps}
        if head_dim_v is not None:
            ints["head_dim_v"] = head_dim_v
        for field, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"VariantSpec.{field}={value!r} must be a positive int")
            if value <= 0:
                raise ValueError(f"VariantSpec.{field}={value!r} must be a positive int")
        if causal is not None:
            if not isinstance(causal, bool):
                raise TypeError(f"VariantSpec.causal={causal!r} must be a bool")
            if mask is not None and mask != (Mask.CAUSAL if causal else Mask.NONE) and not (mask is Mask.LOCAL and causal):
                raise ValueError(f"VariantSpec: causal={causal} contradicts mask={mask}")
            if mask is None:
                mask = Mask.CAUSAL if causal else Mask.NONE
        mask = Mask.NONE if mask is None else mask
        if not isinstance(mask, Mask):
            raise TypeError(f"VariantSpec.mask={mask!r} must be a cutefa Mask")
        features = Features() if features is None else features
        if not isinstance(features, Features):
            raise TypeError(f"VariantSpec.features={features!r} must be a Features record")
        cls = options_class(arch, direction, dtype)
        if options is None:
            options = cls()
        if type(options) is not cls:
            raise TypeError(
                f"VariantSpec.options={options!r}: a {arch} {direction} {dtype} variant takes {cls.__name__}"
            )
        if option_fields:
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(option_fields) - known)
            if unknown:
                raise TypeError(
                    f"VariantSpec: {unknown} are not options of the {arch} {direction} {dtype} family "
                    f"({cls.__name__}: {sorted(known) or 'none'})"
                )
            options = dataclasses.replace(options, **option_fields)
        _check_options(options)
        values = {
            "arch": arch, "direction": direction, "dtype": dtype, "head_dim": head_dim, "tile_m": tile_m,
            "tile_n": tile_n, "stages": stages, "warps": warps, "mask": mask, "features": features,
            "head_dim_v": head_dim if head_dim_v is None else head_dim_v, "options": options,
        }  # fmt: skip
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def causal(self) -> bool:
        return self.mask is Mask.CAUSAL

    @property
    def name(self) -> str:
        head = f"hd{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        tokens = [*self.mask.tokens, *self.features.tokens, *option_tokens(self.options)]
        return (
            f"cutefa_{self.arch}_{self.direction}_{self.dtype}_{head}"
            f"_{self.tile_m}x{self.tile_n}_s{self.stages}_w{self.warps}" + "".join(f"_{t}" for t in tokens)
        )

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def elem_bytes(self) -> int:
        return 1 if self.dtype == "e4m3" else 2

    def replace(self, **changes: object) -> VariantSpec:
        """A copy with ``changes``: spec fields, ``causal``, or option fields by name."""
        fields = {
            "mask": self.mask, "features": self.features, "options": self.options,
            "head_dim_v": None if self.head_dim_v == self.head_dim else self.head_dim_v,
        }  # fmt: skip
        positional = {k: getattr(self, k) for k in ("arch", "direction", "dtype", "head_dim", "tile_m", "tile_n", "stages", "warps")}
        for key in list(changes):
            if key in positional:
                positional[key] = changes.pop(key)
            elif key in fields:
                fields[key] = changes.pop(key)
        if "causal" in changes:
            fields["mask"] = None
        family = (positional["arch"], positional["direction"], positional["dtype"])
        if family != (self.arch, self.direction, self.dtype) and fields["options"] is self.options:
            # another family's record, unless both take the same one (e.g. sm100 fp16 -> e4m3)
            same = family[0] in ARCHS and family[1] in DIRECTIONS and family[2] in DTYPES and (
                options_class(*family) is type(self.options)
            )
            fields["options"] = self.options if same else None
        return VariantSpec(*positional.values(), **fields, **changes)

    def runs_on(self, target: str) -> bool:
        """Whether this family's kernels are valid on compile target ``target`` (e.g. 'sm_90a')."""
        cc = target_cc(target)
        fam = _FAMILY_CC[self.arch]
        if self.arch == "sm80":
            return cc >= fam
        # WGMMA/setmaxnreg (sm90a) and tcgen05 (sm100a/sm103a) are arch-specific, not forward compatible.
        return cc in _FAMILY_TARGET_CCS.get(self.arch, (fam,))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"VariantSpec({self.name!r})"


def _check_options(options: Options) -> None:
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if field.name == "exp_emu":
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{type(options).__name__}.exp_emu={value!r} must be an int percentage")
            if not 0 <= value <= 100:
                raise ValueError(f"{type(options).__name__}.exp_emu={value!r} must be a percentage in [0, 100]")
        elif isinstance(field.default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{type(options).__name__}.{field.name}={value!r} must be a bool")
        elif type(value) is not type(field.default):
            raise TypeError(
                f"{type(options).__name__}.{field.name}={value!r} must be a {type(field.default).__name__}"
            )


def parse_name(name: str) -> VariantSpec:
    """Inverse of :attr:`VariantSpec.name`. Raises ``ValueError`` naming what is wrong."""
    m = _NAME_RE.match(name)
    if not m:
        raise ValueError(
            f"not a cutefa variant name: {name!r} "
            "(expected like 'cutefa_sm80_fwd_bf16_hd128_128x64_s1_w4_causal')"
        )
    if m["arch"] not in ARCHS or m["dtype"] not in DTYPES:
        raise ValueError(f"variant name {name!r}: unknown family or dtype (families {ARCHS}, dtypes {DTYPES})")
    tokens = [t for t in m["tokens"].split("_") if t]
    mask = Mask.NONE
    if tokens and tokens[0] in ("causal", "local"):
        mask = Mask(tokens.pop(0))
    feature_values = {}
    while tokens and tokens[0] in _FEATURE_TOKENS:
        feature_values[_FEATURE_TOKENS[tokens.pop(0)]] = True
    cls = options_class(m["arch"], m["direction"], m["dtype"])
    options, rest = parse_option_tokens(cls, tokens)
    if rest:
        raise ValueError(
            f"variant name {name!r}: token(s) {rest} are not options of {cls.__name__} "
            "(or not in its field order)"
        )
    spec = VariantSpec(
        m["arch"], m["direction"], m["dtype"], int(m["head_dim"]), int(m["tile_m"]), int(m["tile_n"]),
        int(m["stages"]), int(m["warps"]), mask=mask, features=Features(**feature_values),
        head_dim_v=int(m["head_dim_v"]) if m["head_dim_v"] else None, options=options,
    )  # fmt: skip
    if spec.name != name:  # e.g. leading zeros in a number, or tokens out of order
        raise ValueError(f"variant name {name!r} is not canonical; the canonical form is {spec.name!r}")
    return spec


def target_cc(target: str) -> int:
    """Compute capability number (80, 90, 100...) of a compile target like 'sm_90a'."""
    if target not in _TARGET_CC:
        raise ValueError(f"unknown compile target {target!r}; known targets: {TARGETS}")
    return _TARGET_CC[target]


def target_for_capability(major: int, minor: int) -> str:
    """The compile target cutefa uses for a GPU of compute capability (major, minor)."""
    cc = major * 10 + minor
    if cc >= 100:
        # sm_100a code does not load on a cc 10.3 GPU (B300): it gets its own target.
        return {100: "sm_100a", 103: "sm_103a"}.get(cc, f"sm_{cc}")
    if cc >= 90:
        return "sm_90a"
    if cc in (86, 87):
        return "sm_86"
    if cc >= 89:
        return "sm_89"
    if cc >= 80:
        return "sm_80"
    return f"sm_{cc}"


def families_for_target(target: str) -> list[str]:
    """Kernel families that can run on ``target``, best (newest) first."""
    target_cc(target)  # validates the name
    return [a for a in reversed(ARCHS) if VariantSpec(a, "fwd", "bf16", 128, 128, 64, 1, 4).runs_on(target)]
