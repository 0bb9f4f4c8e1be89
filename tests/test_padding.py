"""CPU checks of the padded-batch helpers (cutefa/api/padding.py): unpad_input / pad_input with
flash-attn's bert_padding return values, int32 prefix sums, and their errors."""

from __future__ import annotations

import pytest
import torch

from cutefa.api.padding import pad_input, unpad_input


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (batch, seqlen) masks: right padding, left padding, holes, a row of padding only, full rows
MASKS = {
    "right": [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]],
    "left": [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]],
    "holes": [[1, 0, 1, 0, 1, 0], [0, 1, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1]],
    "empty_row": [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
    "all_padding": [[0] * 6, [0] * 6, [0] * 6],
    "full": [[1] * 6, [1] * 6, [1] * 6],
}


def expected(mask):
    """What flash-attn's unpad_input returns, computed the obvious way on the host."""
    rows = [[j for j, x in enumerate(r) if x] for r in mask]
    seqlen = len(mask[0])
    indices = [b * seqlen + j for b, r in enumerate(rows) for j in r]
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    return indices, cu, max((len(r) for r in rows), default=0), [len(r) for r in rows]


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("name", MASKS)
def test_unpad_returns_flash_attn_values(name, mask_dtype):
    mask = torch.tensor(MASKS[name]).to(mask_dtype)
    x = rand(3, 6, 4, 8, seed=1)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    want_indices, want_cu, want_max, want_used = expected(MASKS[name])
    assert indices.dtype == torch.int64 and indices.tolist() == want_indices
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == want_cu
    assert type(max_seqlen) is int and max_seqlen == want_max
    assert seqused.dtype == torch.int32 and seqused.tolist() == want_used
    assert x_unpad.shape == (len(want_indices), 4, 8) and x_unpad.dtype == x.dtype
    assert torch.equal(x_unpad, x.flatten(0, 1)[want_indices])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("name", MASKS)
def test_round_trip(name, dtype):
    """pad_input(unpad_input(x)) is x on the tokens and 0 on the padding, in x's dtype."""
    mask = torch.tensor(MASKS[name], dtype=torch.bool)
    x = (
        rand(3, 6, 2, 5, seed=2, dtype=dtype)
        if dtype.is_floating_point
        else torch.arange(180).view(3, 6, 2, 5).to(dtype)
    )
    x_unpad, indices, _, _, _ = unpad_input(x, mask)
    back = pad_input(x_unpad, indices, 3, 6)
    assert back.shape == x.shape and back.dtype == dtype
    assert torch.equal(back, torch.where(mask[..., None, None], x, torch.zeros_like(x)))


def test_hidden_states_of_any_rank():
    """(batch, seqlen) alone and (batch, seqlen, a, b, c): the trailing dims ride along."""
    mask = torch.tensor(MASKS["holes"], dtype=torch.bool)
    for shape in ((3, 6), (3, 6, 7), (3, 6, 2, 3, 4)):
        x = rand(*shape, seed=3)
        x_unpad, indices, _, _, _ = unpad_input(x, mask)
        assert x_unpad.shape == (int(mask.sum()), *shape[2:])
        assert torch.equal(pad_input(x_unpad, indices, 3, 6), x * mask.view(3, 6, *[1] * (len(shape) - 2)))


def test_length_zero_sequences_and_empty_batches():
    """Rows without tokens are sequences of length 0 (repeated prefix sums); no batch, or no
    columns, is an empty packing with max_seqlen 0."""
    mask = torch.tensor([[0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    x = rand(5, 3, 4, seed=4)
    x_unpad, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert cu.tolist() == [0, 0, 2, 2, 2, 3] and seqused.tolist() == [0, 2, 0, 0, 1] and max_seqlen == 2
    assert indices.tolist() == [3, 4, 12]
    for batch, seqlen in ((0, 4), (3, 0), (0, 0)):
        x = torch.zeros(batch, seqlen, 2)
        x_unpad, indices, cu, max_seqlen, seqused = unpad_input(
            x, torch.zeros(batch, seqlen, dtype=torch.bool)
        )
        assert x_unpad.shape == (0, 2) and indices.shape == (0,) and max_seqlen == 0
        assert cu.tolist() == [0] * (batch + 1) and cu.dtype == torch.int32
        assert seqused.tolist() == [0] * batch and seqused.dtype == torch.int32
        assert pad_input(x_unpad, indices, batch, seqlen).shape == (batch, seqlen, 2)


def test_unused_mask_is_packed_but_not_counted_in_seqused():
    """unused tokens (allocated slack after a row's tokens) are in the packing and in cu_seqlens
    and max_seqlen, not in seqused: flash-attn's unpad_input(x, attention_mask, unused_mask)."""
    attention = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]])
    x = rand(4, 5, 3, seed=5)
    x_unpad, indices, cu, max_seqlen, seqused = unpad_input(x, attention, unused)
    assert indices.tolist() == [0, 1, 2, 3, 5, 6, 10, 11, 12, 13, 14, 15]
    assert cu.tolist() == [0, 4, 6, 11, 12] and max_seqlen == 5
    assert seqused.tolist() == [2, 0, 4, 1]
    assert torch.equal(x_unpad, x.flatten(0, 1)[indices])
    back = pad_input(x_unpad, indices, 4, 5)
    keep = (attention + unused).bool()
    assert torch.equal(back, torch.where(keep[..., None], x, torch.zeros_like(x)))
    # an all-zero unused_mask is no unused_mask
    plain = unpad_input(x, attention)
    with_zero = unpad_input(x, attention, torch.zeros_like(attention))
    for a, b in zip(plain, with_zero):
        assert a == b if isinstance(a, int) else torch.equal(a, b)


def test_unused_mask_errors():
    attention = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    x = rand(2, 3, 4, seed=6)
    with pytest.raises(ValueError, match="unused_mask.*attention_mask marks too"):
        unpad_input(x, attention, torch.tensor([[0, 1, 1], [0, 0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match="unused_mask.*before"):
        unpad_input(x, torch.tensor([[0, 1, 0], [1, 0, 0]]), torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="unused_mask must have shape"):
        unpad_input(x, attention, torch.zeros(2, 4, dtype=torch.bool))


def test_gradients_flow_through_both_directions():
    """d(unpad)/dx scatters back to the token rows (0 on padding); d(pad)/dx_unpad gathers."""
    mask = torch.tensor(MASKS["holes"], dtype=torch.bool)
    x = rand(3, 6, 4, seed=7).requires_grad_()
    x_unpad, indices, _, _, _ = unpad_input(x, mask)
    weight = rand(*x_unpad.shape, seed=8)
    (x_unpad * weight).sum().backward()
    assert torch.equal(x.grad, pad_input(weight, indices, 3, 6))
    leaf = x_unpad.detach().requires_grad_()
    padded_weight = rand(3, 6, 4, seed=9)
    (pad_input(leaf, indices, 3, 6) * padded_weight).sum().backward()
    assert torch.equal(leaf.grad, padded_weight.flatten(0, 1)[indices])


def test_indices_of_int32_are_accepted_by_pad_input():
    mask = torch.tensor(MASKS["left"], dtype=torch.bool)
    x = rand(3, 6, 2, seed=10)
    x_unpad, indices, _, _, _ = unpad_input(x, mask)
    assert torch.equal(pad_input(x_unpad, indices.int(), 3, 6), pad_input(x_unpad, indices, 3, 6))


def test_unpad_input_errors_name_the_argument():
    x = rand(2, 3, 4)
    good = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="hidden_states"):
        unpad_input(x.numpy(), good)
    with pytest.raises(ValueError, match="hidden_states"):
        unpad_input(rand(6), torch.ones(6, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        unpad_input(x, [[1, 1, 1], [1, 1, 1]])
    with pytest.raises(TypeError, match="attention_mask.*float32"):
        unpad_input(x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, seqlen\) = \(2, 3\)"):
        unpad_input(x, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        unpad_input(x, torch.ones(2, 3, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="unused_mask"):
        unpad_input(x, good, torch.zeros(2, 3, dtype=torch.float16))
    meta = torch.ones(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="attention_mask is on meta"):
        unpad_input(x, meta)


def test_pad_input_errors_name_the_argument():
    x = rand(5, 4)
    indices = torch.arange(5)
    with pytest.raises(TypeError, match="hidden_states"):
        pad_input(x.tolist(), indices, 1, 5)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor"):
        pad_input(x, list(range(5)), 1, 5)
    with pytest.raises(TypeError, match="indices must be an int64 or int32"):
        pad_input(x, indices.float(), 1, 5)
    with pytest.raises(ValueError, match="indices must have shape"):
        pad_input(x, indices[:4], 1, 5)
    with pytest.raises(TypeError, match="batch must be an int"):
        pad_input(x, indices, 1.0, 5)
    with pytest.raises(TypeError, match="seqlen must be an int"):
        pad_input(x, indices, 1, True)
    with pytest.raises(ValueError, match="seqlen must be >= 0"):
        pad_input(x, indices, 1, -5)
    with pytest.raises(ValueError, match="indices is on meta"):
        pad_input(x, indices.to("meta"), 1, 5)
    with pytest.raises(IndexError):  # an index past batch * seqlen: torch's own indexing error
        pad_input(x, indices + 1, 1, 5)
