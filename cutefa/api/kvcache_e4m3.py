"""An e4m3 KV cache in :func:`cutefa.api.kvcache.flash_attn_with_kvcache` (whose custom op
``cutefa::kvcache_attn_e4m3`` appends and attends; it mutates ``k_cache`` and ``v_cache``): the
descales, and the quantization of appended tokens in torch (:func:`quantize`, the reference).

``k_cache``/``v_cache`` are torch.float8_e4m3fn and q 16-bit; ``k_descale``/``v_descale`` float32
(batch, heads_kv), FA3's spelling: the cache's values are ``descale * stored``. The decode kernel
(templates/decode_sm80.py.j2 with the ``kv_e4m3`` option, sm_90a and newer) widens the tiles on
chip and folds the descales into the scores' scale and the output rows. New tokens ``k``/``v`` (q's
dtype) are appended by its append launch (cutefa/kernels/sm80/decode_append.py), k rotated first
(rounded to q's dtype), each value quantized with the descale of its (batch, kv head) as
:func:`quantize` does. The descales are fixed per (batch, kv head), never updated by an append: a
new value past ``448 * descale`` saturates to +-448.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def quantize(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """x (batch, seqlen, heads_kv, head_dim) as the append stores it into an e4m3 cache with
    ``descale`` (batch, heads_kv): ``x / descale`` in float32, saturated to +-448, rounded to nearest
    even e4m3 (NaN stays NaN)."""
    scaled = x.float() / descale.float()[:, None, :, None]
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def kv_descales(
    q: torch.Tensor, k_cache: torch.Tensor, k_descale: object, v_descale: object
) -> tuple[torch.Tensor, ...]:
    """(k_descale, v_descale) float32 (batch, heads_kv) with a contiguous last dim for an e4m3 cache
    (None: ones), () for a 16-bit one. Their values are checked finite and positive by an
    asynchronous assert on their device (no host sync: a bad value fails the stream later)."""
    given = [(name, t) for name, t in (("k_descale", k_descale), ("v_descale", v_descale)) if t is not None]
    if k_cache.dtype != torch.float8_e4m3fn:
        if given:
            raise ValueError(f"{given[0][0]} is for an e4m3 cache; k_cache has dtype {k_cache.dtype}")
        return ()
    shape = (q.shape[0], k_cache.shape[2])
    out = []
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            out.append(torch.ones(shape, dtype=torch.float32, device=q.device))
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32; got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape (batch, heads_kv) = {shape}; got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        t = t if t.stride(-1) == 1 else t.contiguous()
        torch._assert_async(torch.all(torch.isfinite(t) & (t > 0)), f"{name} must be finite and positive")
        out.append(t)
    return tuple(out)
