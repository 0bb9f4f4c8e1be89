"""FP8 (e4m3) inputs for :func:`cutefa.flash_attn_func`: quantization with descales, and
FlashAttention-3's incoherent processing.

``quantize_fp8(x)`` returns ``(x_e4m3, descale)`` with ``x ~= x_e4m3.float() * descale``. The
attention kernel takes one descale per (batch, kv head) for each of q, k and v; a per-tensor
descale (shape ``()``) is broadcast. Granularity ``"head"`` gives a descale per (batch, head), or
per (batch, group of ``group`` consecutive heads): for grouped-query attention, quantize q with
``group=heads_q // heads_kv`` so that its descale has the (batch, heads_kv) shape of k's and v's.

Granularity ``"block"`` (FlashAttention-3's block quantization) gives one descale per ``block``
consecutive rows along seqlen as well: shape (batch, heads // group, ceil(seqlen / block)), the
last block partial. A token with large activations then costs precision only to the rows of its
own block. The sm90 fp8 kernel takes q's blocks of its tile_m rows and k's and v's of its tile_n
rows: :func:`cutefa.fp8_block_sizes` returns the pair for a problem.

Incoherent processing (``hadamard=True``): q and k are multiplied along head_dim by the same
random orthogonal matrix M = diag(signs) H / sqrt(n) (H a Sylvester Hadamard matrix, block-diagonal
for head dims that are not powers of two; the signs drawn from ``seed``) before they are quantized.
Q M (K M)^T = Q K^T, so the attention is unchanged, while outlier channels get spread over all
channels and quantize with less error. v is never rotated (it would rotate the output).
"""

from __future__ import annotations

import functools

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
)
GRANULARITIES = ("tensor", "head", "block")


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(head_dim: int, seed: int) -> torch.Tensor:
    block = head_dim & -head_dim  # largest power of two dividing head_dim (64 for 192, 32 for 96)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*([h / block**0.5] * (head_dim // block)))
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1
    return (signs[:, None].to(torch.float64) * h).to(torch.float32)


def hadamard_matrix(
    head_dim: int, *, seed: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The orthogonal (head_dim x head_dim) float32 matrix ``quantize_fp8(hadamard=True)`` multiplies
    the last dim by: diag(random signs from ``seed``) @ H / sqrt(block), H Hadamard blocks of the
    largest power of two dividing head_dim."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int; got {head_dim!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {seed!r}")
    return _hadamard_cpu(head_dim, seed).to(device)


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "tensor",
    hadamard: bool = False,
    *,
    group: int = 1,
    seed: int = 0,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (batch, seqlen, heads, head_dim) to float8_e4m3fn with float32 descales.

    Returns ``(x_e4m3, descale)``: descale has shape ``()`` for granularity ``"tensor"``,
    ``(batch, heads // group)`` for ``"head"`` and ``(batch, heads // group, ceil(seqlen / block))``
    for ``"block"`` (``block`` rows along seqlen per descale, required there), and
    ``x_e4m3 * descale`` (per its head group and block) approximates ``x`` (rotated by
    :func:`hadamard_matrix` when ``hadamard``). Each scale maps the group's largest magnitude to
    448, the largest e4m3 value; an all-zero group gets descale 1.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x must be a float16, bfloat16 or float32 tensor; got dtype {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (batch, seqlen, heads, head_dim); got shape {tuple(x.shape)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool; got {hadamard!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or x.shape[2] % group:
        raise ValueError(f"group={group!r} must be a positive int dividing heads={x.shape[2]}")
    if granularity == "tensor" and group != 1:
        raise ValueError(f"group={group} applies to granularity 'head' or 'block' only")
    if granularity == "block":
        if block is None:
            raise ValueError(
                "granularity='block' needs block= (rows along seqlen per descale): the fp8 kernel takes q in "
                "blocks of its tile_m rows and k, v in blocks of its tile_n rows; cutefa.fp8_block_sizes(q, k, "
                "causal=...) returns them"
            )
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block={block!r} must be a positive int (rows along seqlen per descale)")
    elif block is not None:
        raise ValueError(
            f"block={block!r} applies to granularity 'block' only; got granularity={granularity!r}"
        )
    xf = x.float()
    if hadamard:
        xf = xf @ hadamard_matrix(x.shape[-1], seed=seed, device=x.device)
    batch, seqlen, heads, head_dim = xf.shape
    if granularity == "tensor":
        amax = xf.abs().amax()
    elif granularity == "head":
        grouped = xf.reshape(batch, seqlen, heads // group, group * head_dim)
        amax = grouped.abs().amax(dim=(1, 3))  # (batch, heads // group)
    else:
        blocks = -(-seqlen // block)
        # zero rows pad the last block: they leave its amax as it is
        padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, blocks * block - seqlen))
        grouped = padded.reshape(batch, blocks, block, heads // group, group * head_dim)
        amax = grouped.abs().amax(dim=(2, 4)).transpose(1, 2)  # (batch, heads // group, blocks)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    q = (xf / expand_descale(descale, xf.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, descale.contiguous()


def center_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v - mean, mean)``: ``v`` (batch, seqlen, heads, head_dim) less its mean over seqlen per
    (batch, head, column), in float32, and that mean, float32 (batch, heads, head_dim).

    For the fp8 forward: quantize the centered v and pass the mean as ``flash_attn_func(...,
    v_mean=mean)``, which adds it to the output of every row that attends a key (each row's
    softmax weights sum to 1, so the result is the same attention). Hopper's e4m3 tensor cores
    accumulate P V with fewer mantissa bits than fp32, and an output summed over many keys comes
    out low by about (keys x 2^-16) of the part V's column means carry (13% at 16k keys on
    V = 1 + noise); with the mean taken out, what they sum is centered and the output keeps the
    e4m3 rounding's own error (0.17% there; docs/log/perf-notes.md)."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v must be a torch.Tensor; got {type(v).__name__}")
    if not v.is_floating_point() or v.dtype in FP8_DTYPES:
        raise TypeError(f"v must be a float16, bfloat16 or float32 tensor (before quantization); got dtype {v.dtype}")
    if v.dim() != 4 or v.shape[1] == 0:
        raise ValueError(f"v must be 4-D (batch, seqlen, heads, head_dim) with seqlen >= 1; got shape {tuple(v.shape)}")
    vf = v.float()
    mean = vf.mean(dim=1)
    return vf - mean[:, None], mean.contiguous()


def add_v_mean(out: torch.Tensor, v_mean: torch.Tensor, seqlen_k: int, causal: bool) -> torch.Tensor:
    """``out`` (batch, seqlen_q, heads_q, head_dim) plus ``v_mean`` (batch, heads_kv, head_dim;
    each kv head's mean to its group of query heads) on the rows that attend a key, in place
    (one elementwise pass, the sum taken in float32 and rounded to ``out``'s dtype); returns ``out``.
    Every row attends a key when ``seqlen_k > 0``, except with ``causal`` (aligned bottom-right)
    the first ``seqlen_q - seqlen_k`` rows: those, which attend none, stay as they are (0)."""
    _, seqlen_q, heads_q, _ = out.shape
    first = seqlen_q if seqlen_k == 0 else max(0, seqlen_q - seqlen_k) if causal else 0
    rows = out[:, first:]
    if rows.numel():
        rows.unflatten(2, (v_mean.shape[1], heads_q // v_mean.shape[1])).add_(v_mean[:, None, :, None, :])
    return out


def expand_descale(
    descale: torch.Tensor, shape: tuple[int, ...] | torch.Size, block: int | None = None
) -> torch.Tensor:
    """``descale`` of shape (), (batch, heads // group) or (batch, heads // group, blocks) as a
    float32 tensor that broadcasts against ``shape`` (batch, seqlen, heads, head_dim): each head of
    a group and, for 3-D descales, each of the ``block`` rows of a block take its value."""
    d = descale.float()
    if d.dim() == 0:
        return d
    batch, seqlen, heads, _ = shape
    if d.dim() not in (2, 3) or d.shape[0] != batch or heads % d.shape[1]:
        raise ValueError(
            f"descale of shape {tuple(d.shape)} does not fit x of shape {tuple(shape)}: expected (), "
            "(batch, heads // group) or (batch, heads // group, blocks)"
        )
    d = d.repeat_interleave(heads // d.shape[1], 1)
    if d.dim() == 2:
        return d[:, None, :, None]
    if block is None or isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(
            f"a 3-D (block) descale needs block=, a positive int (rows per block); got {block!r}"
        )
    if d.shape[2] != -(-seqlen // block):
        raise ValueError(
            f"descale has {d.shape[2]} blocks; seqlen={seqlen} in blocks of {block} rows needs {-(-seqlen // block)}"
        )
    return d.repeat_interleave(block, 2)[:, :, :seqlen].transpose(1, 2)[..., None]


def dequantize_fp8(x: torch.Tensor, descale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """float32 ``x * descale``, descale of shape () or (batch, heads // group) broadcast over the
    seqlen and head_dim of x (batch, seqlen, heads, head_dim), or (batch, heads // group, blocks)
    with ``block`` rows along seqlen per descale."""
    return x.float() * expand_descale(descale, x.shape, block)
