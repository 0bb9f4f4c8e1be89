"""Padded batches and the packed layout of :func:`cutefa.flash_attn_varlen_func`.

A model that pads its batch to one length carries ``(batch, seqlen, ...)`` tensors and a
``(batch, seqlen)`` attention mask (1 or True for a token, 0 or False for padding: Hugging Face's
``attention_mask``). The variable-length call takes the tokens packed instead: ``(total, ...)``,
sequence ``b`` in rows ``cu_seqlens[b] .. cu_seqlens[b + 1]``. :func:`unpad_input` packs a padded
batch and returns what the call needs; :func:`pad_input` scatters the packed output back::

    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, attention_mask)
    q, k, v = project(x_unpad)  # (total, heads, head_dim) each
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    out = pad_input(out, indices, batch, seqlen)  # padding rows are 0

The names, arguments and return values are flash-attn's (``flash_attn.bert_padding``), so code
written for it runs unchanged. Both functions are differentiable with respect to
``hidden_states``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_mask(name: str, mask: object, hidden_states: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor after checking it is a (batch, seqlen) bool or integer tensor on
    hidden_states' device."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise TypeError(f"{name} must be a bool or integer tensor (1 = token, 0 = padding), got {mask.dtype}")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"{name} must have shape (batch, seqlen) = {tuple(hidden_states.shape[:2])} (hidden_states' first two "
            f"dims), got {tuple(mask.shape)}"
        )
    if mask.device != hidden_states.device:
        raise ValueError(
            f"{name} is on {mask.device}, hidden_states on {hidden_states.device}: use one device"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the tokens of a padded batch.

    ``hidden_states`` (batch, seqlen, ...); ``attention_mask`` (batch, seqlen) bool or integer, a
    nonzero entry a token; ``unused_mask`` (optional, same shape): tokens that are kept in the
    packed layout but not attended (slack a buffer has allocated: they must follow a row's
    tokens, and may not be tokens of ``attention_mask`` too).

    Returns ``(hidden_states_unpad, indices, cu_seqlens, max_seqlen_in_batch, seqused)``:
    hidden_states_unpad (total, ...), the selected rows (tokens and unused ones) in order; indices
    int64 (total,), their positions in the flattened (batch * seqlen) batch (for
    :func:`pad_input`); cu_seqlens int32 (batch + 1,), the prefix sums of each row's selected
    count; max_seqlen_in_batch, the largest such count as a Python int; seqused int32 (batch,),
    each row's count of ``attention_mask`` tokens alone (pass it as ``seqused_q``/``seqused_k``
    when ``unused_mask`` is given). A row without tokens is a sequence of length 0.

    Host synchronization: one. ``max_seqlen_in_batch`` is a Python int (the call sizes its grid
    with it, and flash-attn returns an int) and ``total`` sizes the outputs, so both are read from
    the device; they are read in one transfer, together with the two checks of ``unused_mask``
    (a ValueError when they fail). Nothing else waits for the GPU. Call it once per batch and
    reuse its results for every layer.
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() < 2:
        raise ValueError(
            f"hidden_states must have shape (batch, seqlen, ...), got {tuple(hidden_states.shape)}"
        )
    used = _check_mask("attention_mask", attention_mask, hidden_states)
    selected = used
    seqlen = used.shape[1]
    checks = []
    if unused_mask is not None:
        unused = _check_mask("unused_mask", unused_mask, hidden_states)
        selected = used | unused
        if used.numel():
            position = torch.arange(seqlen, device=used.device)
            last_used = torch.where(used, position, -1).amax(dim=-1)
            first_unused = torch.where(unused, position, seqlen).amin(dim=-1)
            checks = [(used & unused).any().long(), (last_used > first_unused).any().long()]
    lengths = selected.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    longest = torch.cat([lengths, lengths.new_zeros(1)]).amax()
    # the one host synchronization (see the docstring)
    max_seqlen, total, *failed = torch.stack(
        [longest.long(), lengths.sum(dtype=torch.long), *checks]
    ).tolist()
    if failed and failed[0]:
        raise ValueError(
            "unused_mask marks tokens that attention_mask marks too: a token is either used or unused"
        )
    if failed and failed[1]:
        raise ValueError(
            "unused_mask marks a token before one of attention_mask in the same row: unused slack must follow "
            "a row's tokens (seqused counts the first tokens of each sequence)"
        )
    indices = torch.nonzero_static(selected.flatten(), size=total).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, int(max_seqlen), seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter packed rows back into a padded batch: the inverse of :func:`unpad_input`.

    ``hidden_states`` (total, ...); ``indices`` (total,) integer, each row's position in the
    flattened (batch * seqlen) batch (unpad_input's ``indices``). Returns (batch, seqlen, ...) in
    hidden_states' dtype, 0 where no row lands. No host synchronization: an index outside
    ``batch * seqlen`` is torch's indexing error (on the GPU, a device-side assertion).
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    for name, value in (("batch", batch), ("seqlen", seqlen)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices must be an int64 or int32 tensor, got {indices.dtype}")
    if hidden_states.dim() < 1 or indices.shape != hidden_states.shape[:1]:
        raise ValueError(
            f"indices must have shape (total,) with total = hidden_states.shape[0]; got indices "
            f"{tuple(indices.shape)}, hidden_states {tuple(hidden_states.shape)}"
        )
    if indices.device != hidden_states.device:
        raise ValueError(
            f"indices is on {indices.device}, hidden_states on {hidden_states.device}: use one device"
        )
    rest = hidden_states.shape[1:]
    output = hidden_states.new_zeros(batch * seqlen, *rest)
    output = output.index_copy(0, indices.long(), hidden_states)
    return output.view(batch, seqlen, *rest)
