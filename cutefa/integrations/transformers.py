"""cutefa as an attention implementation of Hugging Face transformers: ``attn_implementation="cutefa"``.

:func:`register` adds ``"cutefa"`` to transformers' ``AttentionInterface`` (:func:`attention_forward`)
and to its ``AttentionMaskInterface`` (flash attention's mask function: the model's 2-D padding
mask, or None where there is no padding), after which::

    model = AutoModelForCausalLM.from_config(config, attn_implementation="cutefa")

runs every attention layer on cutefa's kernels. Per call (the layer's q, k, v are (batch, heads,
seqlen, head_dim); cutefa gets (batch, seqlen, heads, head_dim) views of them):

- no padding and no packing: :func:`cutefa.flash_attn_func`;
- a padded batch (left or right padding): the tokens are packed (``unpad_input``, the host sync once
  per mask for all layers), attended by :func:`cutefa.flash_attn_varlen_func` and scattered back
  (``pad_input``; both :mod:`cutefa.api.padding`); a decoding step's one query row per sequence too;
- packed sequences in one row (batch 1, ``position_ids`` restarting), or the
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments of a flattening collator:
  :func:`cutefa.flash_attn_varlen_func` over them;
- a sliding window (the layer's ``sliding_window`` argument or attribute, transformers' meaning: a
  query attends the ``sliding_window`` latest keys, itself included) is ``window_size=(w - 1, 0)``
  (``(w - 1, w - 1)`` for a non-causal layer), applied where the keys exceed it;
- logit softcapping (``softcap``, else ``config.attn_logit_softcapping``: Gemma 2), attention sinks
  (``s_aux``, else the layer's ``sinks``: gpt-oss), grouped-query heads, causal or not
  (``is_causal``, else the layer's);
- a V head dim of its own (MLA-style layers): (192, 128), DeepSeek's prefill, as it is; another
  smaller one padded to q's head dim (the output cropped back);
- attention dropout other than 0 (a layer in training with ``config.attention_dropout > 0``) is a
  NotImplementedError saying what to set; so are 4-D custom masks and chunked attention.

Where cutefa raises NotImplementedError (a feature or head dim it has no kernel for), the error is
raised on with the model's feature named. float32 inputs (layer norms upcast by PEFT) are cast to
the autocast dtype, else to the dtype of the layer's weights, as transformers' flash path does.
"""

from __future__ import annotations

import weakref
from typing import Any

NAME = "cutefa"


def register() -> None:
    """Add ``"cutefa"`` to transformers' attention and mask interfaces (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError(
            f"cutefa's transformers integration needs transformers 5 (AttentionInterface, "
            f"AttentionMaskInterface): {exc}"
        ) from exc
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


# ---------------------------------------------------------------------------------------------
# What a layer asks for, as cutefa's options


def flash_options(
    module: Any, *, query_length: int, key_length: int, dropout: float = 0.0, scaling: float | None = None,
    sliding_window: int | None = None, softcap: float | None = None, sinks: Any = None, is_causal: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of cutefa's calls for one layer call: ``causal``, ``softmax_scale``
    and, where they apply, ``window_size``, ``softcap`` and ``sinks``. Raises NotImplementedError
    for attention dropout and chunked attention, ValueError for a window that is not a positive
    int."""
    config = getattr(module, "config", None)
    if dropout:
        where = getattr(config, "attention_dropout", None)
        raise NotImplementedError(
            f"attention dropout {dropout} ({type(module).__name__}"
            + (f", config.attention_dropout={where}" if where is not None else "")
            + "): cutefa has no attention dropout; set config.attention_dropout = 0.0, or use "
            "attn_implementation='sdpa' for this model"
        )
    if getattr(config, "attention_chunk_size", None):
        raise NotImplementedError(
            f"chunked attention (config.attention_chunk_size={config.attention_chunk_size}): cutefa has no "
            "chunked mask; use attn_implementation='sdpa' for this model"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    options: dict[str, Any] = {"causal": bool(causal), "softmax_scale": scaling}
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None; got {window!r}")
        if key_length > window:
            options["window_size"] = (window - 1, 0 if causal else window - 1)
    if softcap is None:
        softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        options["softcap"] = float(softcap)
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    if sinks is not None:
        options["sinks"] = sinks.float()
    return options


def describe(module: Any, options: dict[str, Any], layout: str) -> str:
    """The layer and the model features a call used, for errors."""
    parts = [type(module).__name__ + (f" (layer {module.layer_idx})" if hasattr(module, "layer_idx") else "")]
    if "window_size" in options:
        parts.append(f"sliding window {options['window_size'][0] + 1}")
    if "softcap" in options:
        parts.append(f"logit softcapping {options['softcap']}")
    if "sinks" in options:
        parts.append("attention sinks")
    if layout != "dense":
        parts.append(layout)
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Packed sequences: from position ids, and from a padding mask


def is_packed(position_ids: Any, batch: int) -> bool:
    """Whether ``position_ids`` (batch, seqlen) packs several sequences into one row: batch 1 and
    the positions restart somewhere (one host sync)."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] < 2:
        return False
    row = position_ids.reshape(-1)
    return bool((row[1:] - row[:-1] != 1).any())


def packed_lengths(position_ids: Any) -> tuple[Any, int]:
    """(cu_seqlens int32 (sequences + 1,), max_seqlen) of one row of packed ``position_ids``: a new
    sequence starts wherever the position does not follow the one before (one host sync)."""
    import torch

    row = position_ids.reshape(-1)
    starts = torch.nonzero(row[1:] - row[:-1] != 1).flatten() + 1
    zero = torch.zeros(1, dtype=starts.dtype, device=row.device)
    end = torch.full((1,), row.shape[0], dtype=starts.dtype, device=row.device)
    cu_seqlens = torch.cat([zero, starts, end]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


# Per kind ("mask", "positions"): the last tensor looked at, its version, and what was found in
# it. Every layer of a forward pass gets the same mask and position ids objects, so the host sync
# of reading them happens once per pass, not once per layer.
_memo: dict[str, tuple[Any, int, Any]] = {}


def _once_per_tensor(kind: str, t: Any, compute: Any) -> Any:
    """``compute(t)``, memoized for the last tensor of ``kind`` while it is unchanged (not while
    torch.compile traces)."""
    import torch

    if torch.compiler.is_compiling():
        return compute(t)
    held = _memo.get(kind)
    if held is not None and held[0]() is t and t._version == held[1]:
        return held[2]
    found = compute(t)
    _memo[kind] = (weakref.ref(t), t._version, found)
    return found


def _unpad_keys(mask: Any) -> tuple[Any, Any, int]:
    """(indices, cu_seqlens, max_seqlen) of the tokens of a (batch, seqlen) padding mask."""
    from cutefa.api.padding import unpad_input

    def unpad(m: Any) -> tuple[Any, Any, int]:
        _, indices, cu_seqlens, max_seqlen, _ = unpad_input(m[..., None], m)
        return indices, cu_seqlens, max_seqlen

    return _once_per_tensor("mask", mask, unpad)


def _rows(t: Any, indices: Any) -> Any:
    return t.flatten(0, 1)[indices]


def _padded(q: Any, k: Any, v: Any, mask: Any, options: dict[str, Any]) -> Any:
    """Attention of a padded batch through the packed layout (transformers' flash rules: the
    queries are the last ``seqlen_q`` positions of the mask)."""
    import torch

    import cutefa
    from cutefa.api.padding import pad_input, unpad_input

    batch, query_length = q.shape[:2]
    if k.shape[1] > mask.shape[-1]:  # a static cache longer than the tokens seen
        k, v = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]]
    indices_k, cu_k, max_k = _unpad_keys(mask)
    k_rows, v_rows = _rows(k, indices_k), _rows(v, indices_k)
    if query_length == k.shape[1]:
        q_rows, indices_q, cu_q, max_q = _rows(q, indices_k), indices_k, cu_k, max_k
    elif query_length == 1:  # a decoding step: one query per sequence
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        q_rows, indices_q, max_q = q.reshape(batch, *q.shape[2:]), cu_q[:-1].long(), 1
    else:
        q_rows, indices_q, cu_q, max_q, _ = unpad_input(q, mask[:, -query_length:])
    out = cutefa.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, **options)
    return pad_input(out, indices_q, batch, query_length)


# ---------------------------------------------------------------------------------------------
# The attention function


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function contract: q, k, v (batch, heads, seqlen, head_dim), the
    mask of :func:`register`'s mask function; returns ((batch, seqlen, heads, head_dim_v), None)."""
    import cutefa

    query_length, key_length = query.shape[2], key.shape[2]
    options = flash_options(
        module, query_length=query_length, key_length=key_length, dropout=dropout, scaling=scaling,
        sliding_window=sliding_window, softcap=softcap, sinks=s_aux, is_causal=is_causal,
    )  # fmt: skip
    q, k, v = _cast(module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    head_dim_v = v.shape[-1]
    if head_dim_v < q.shape[-1] and not _separate_v_head_dim(q.shape[-1], head_dim_v):
        import torch.nn.functional as F  # a V head dim cutefa has no kernel for: pad v, crop the output

        v = F.pad(v, (0, q.shape[-1] - head_dim_v))
    layout = "dense"
    try:
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise NotImplementedError(
                    f"a {attention_mask.dim()}-D attention mask: cutefa takes the 2-D padding mask of its mask "
                    "function (custom masks: attn_implementation='sdpa' or 'eager')"
                )
            layout = "padded batch (varlen)"
            out = _padded(q, k, v, attention_mask, options)
        elif (lengths := _packed(q, kwargs)) is not None:
            layout = "packed sequences (varlen)"
            cu_q, cu_k, max_q, max_k = lengths
            flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
            out = cutefa.flash_attn_varlen_func(*flat, cu_q, cu_k, max_q, max_k, **options)
            out = out.view(q.shape[0], -1, *out.shape[1:])
        else:
            out = cutefa.flash_attn_func(q, k, v, **options)
    except NotImplementedError as exc:
        raise NotImplementedError(f"{describe(module, options, layout)}: {exc}") from exc
    return out[..., :head_dim_v], None


def _separate_v_head_dim(head_dim: int, head_dim_v: int) -> bool:
    """Whether cutefa's kernels take v of ``head_dim_v`` beside q and k of ``head_dim`` as it is
    (DeepSeek's (192, 128) prefill: :data:`cutefa.model.spec.HEAD_DIM_V_PAIRS`), which reads and
    computes less than v padded to ``head_dim``."""
    from cutefa.model.spec import HEAD_DIM_V_PAIRS

    return (head_dim, head_dim_v) in HEAD_DIM_V_PAIRS


def _packed(q: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, int, int] | None:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed call, or None."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    given = [kwargs.get(n) for n in names]
    if all(x is not None for x in given):
        cu_q, cu_k, max_q, max_k = given
        return cu_q.int(), cu_k.int(), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1:
        return None

    def lengths(positions: Any) -> tuple[Any, int] | None:
        return packed_lengths(positions) if is_packed(positions, 1) else None

    found = _once_per_tensor("positions", position_ids, lengths)
    return None if found is None else (found[0], found[0], found[1], found[1])


def _cast(module: Any, *tensors: Any) -> tuple[Any, ...]:
    """float32 inputs in the dtype transformers' flash path gives them (autocast's, else the
    layer's weights'); others as they are."""
    import torch

    q = tensors[0]
    if q.dtype != torch.float32:
        return tensors
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    else:
        dtype = next((p.dtype for p in module.parameters() if p.dtype != torch.float32), None)
        if dtype is None:
            raise TypeError(
                f"{type(module).__name__}: float32 attention inputs with float32 weights: cutefa takes float16 "
                "or bfloat16 (load the model in bfloat16, or run under torch.autocast)"
            )
    return tuple(t.to(dtype) for t in tensors)
