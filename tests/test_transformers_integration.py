"""The transformers integration (cutefa.integrations.transformers) on the CPU: a layer's arguments
as cutefa's options, packed sequences from position ids, and the three ways a call goes (dense,
padded batch through the packed layout, packed sequences), with cutefa's calls replaced by a
float32 reference. The registration and a small model end to end need transformers, which the
CPU machines do not install: those tests skip there, saying so.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import cutefa
from cutefa.integrations import transformers as hf

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


def attend(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None):
    """Reference attention of (batch, seqlen, heads, head_dim) inputs, differentiable, float32
    inside; bottom-right aligned masks; rows that attend nothing are 0."""
    b, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    scale = softmax_scale or 1 / math.sqrt(d)
    kk, vv = (t.float().repeat_interleave(group, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(b, hq, sq, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv).to(q.dtype)


def attend_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    outs = []
    for b in range(cu_q.shape[0] - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        outs.append(attend(q[None, qs], k[None, ks], v[None, ks], **options)[0])
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


@pytest.fixture
def calls(monkeypatch):
    """cutefa's calls replaced by the reference; the list of (function, options) made."""
    made = []

    def dense(q, k, v, **options):
        made.append(("flash_attn_func", options))
        return attend(q, k, v, **options)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        made.append(
            ("flash_attn_varlen_func", {**options, "cu": (cu_q.tolist(), cu_k.tolist(), max_q, max_k)})
        )
        return attend_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)

    monkeypatch.setattr(cutefa, "flash_attn_func", dense)
    monkeypatch.setattr(cutefa, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(hf, "_memo", {})
    return made


class Layer(torch.nn.Module):
    """What an attention layer of a transformers model shows the attention function."""

    def __init__(self, is_causal=True, sliding_window=None, sinks=None, **config):
        super().__init__()
        self.is_causal = is_causal
        self.layer_idx = 3
        self.proj = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        if sliding_window is not None:
            self.sliding_window = sliding_window
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.config = type("Config", (), config)()


def heads(batch, seqlen, n, d=64, dtype=torch.bfloat16):
    """(batch, heads, seqlen, head_dim), as a model's layer hands them over."""
    return torch.randn(batch, seqlen, n, d, dtype=dtype).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# A layer's arguments as cutefa's options (no transformers needed)


def test_options_of_a_plain_causal_layer():
    options = hf.flash_options(Layer(), query_length=8, key_length=8, scaling=0.125)
    assert options == {"causal": True, "softmax_scale": 0.125}


def test_a_sliding_window_applies_where_the_keys_exceed_it():
    layer = Layer(sliding_window=4096)
    assert "window_size" not in hf.flash_options(layer, query_length=4096, key_length=4096)
    assert hf.flash_options(layer, query_length=1, key_length=4097)["window_size"] == (4095, 0)
    assert hf.flash_options(Layer(is_causal=False), query_length=9, key_length=9, sliding_window=4)[
        "window_size"
    ] == (3, 3)
    with pytest.raises(ValueError, match="sliding_window"):
        hf.flash_options(Layer(), query_length=9, key_length=9, sliding_window=0)


def test_softcap_and_sinks_come_from_the_call_or_the_layer():
    layer = Layer(attn_logit_softcapping=50.0, sinks=torch.zeros(4, dtype=torch.bfloat16))
    options = hf.flash_options(layer, query_length=8, key_length=8)
    assert options["softcap"] == 50.0 and options["sinks"].dtype == torch.float32
    given = torch.ones(4)
    options = hf.flash_options(
        Layer(), query_length=8, key_length=8, softcap=30.0, sinks=given, is_causal=False
    )
    assert options["softcap"] == 30.0 and options["sinks"] is given and options["causal"] is False


def test_attention_dropout_is_refused_with_what_to_set():
    with pytest.raises(NotImplementedError, match=r"config.attention_dropout=0.1.*attention_dropout = 0.0"):
        hf.flash_options(Layer(attention_dropout=0.1), query_length=8, key_length=8, dropout=0.1)
    with pytest.raises(NotImplementedError, match="chunked attention"):
        hf.flash_options(Layer(attention_chunk_size=8192), query_length=8, key_length=8)


def test_packed_sequences_are_found_in_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert hf.is_packed(positions, 1) and not hf.is_packed(torch.arange(9)[None], 1)
    assert not hf.is_packed(positions.expand(2, -1), 2)  # several rows: padding, not packing
    cu, longest = hf.packed_lengths(positions)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    cu, longest = hf.packed_lengths(torch.tensor([[5, 6, 7, 2, 3]]))  # restarts need not be at 0
    assert cu.tolist() == [0, 3, 5] and longest == 3


# ---------------------------------------------------------------------------------------------
# The attention function, with cutefa's calls replaced


@pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 4), (8, 2)])
def test_a_batch_without_padding_is_one_dense_call(calls, heads_q, heads_kv):
    q, k, v = heads(2, 16, heads_q), heads(2, 16, heads_kv), heads(2, 16, heads_kv)
    out, weights = hf.attention_forward(Layer(), q, k, v, None, scaling=0.1)
    assert weights is None and out.shape == (2, 16, heads_q, 64)
    assert calls == [("flash_attn_func", {"causal": True, "softmax_scale": 0.1})]
    want = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=0.1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(("head_dim", "head_dim_v", "passed_v"), [(192, 128, 128), (96, 64, 96)])
def test_a_v_head_dim_of_its_own_is_passed_as_it_is_where_cutefa_takes_it(
    calls, monkeypatch, head_dim, head_dim_v, passed_v
):
    """(192, 128) goes to cutefa as it is (its kernels take the pair); another pair is padded to q's
    head dim and the output cropped: the same result either way."""
    seen = []
    dense = cutefa.flash_attn_func

    def spy(q, k, v, **options):
        seen.append(v.shape[-1])
        return dense(q, k, v, **options)

    monkeypatch.setattr(cutefa, "flash_attn_func", spy)
    q, k, v = heads(2, 16, 4, head_dim), heads(2, 16, 4, head_dim), heads(2, 16, 4, head_dim_v)
    out, _ = hf.attention_forward(Layer(), q, k, v, None, scaling=0.1)
    assert seen == [passed_v] and out.shape == (2, 16, 4, head_dim_v)
    want = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=0.1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_goes_through_the_packed_layout(calls, side):
    lengths = [16, 9, 1]
    mask = torch.zeros(3, 16, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    if side == "left":
        mask = mask.flip(1)
    q, k, v = heads(3, 16, 8), heads(3, 16, 2), heads(3, 16, 2)
    out, _ = hf.attention_forward(Layer(), q, k, v, mask)
    ((name, options),) = calls
    assert name == "flash_attn_varlen_func" and options["cu"] == ([0, 16, 25, 26], [0, 16, 25, 26], 16, 16)
    for b in range(3):
        rows = mask[b]
        sub = [t.transpose(1, 2)[b : b + 1, rows] for t in (q, k, v)]
        torch.testing.assert_close(out[b : b + 1, rows], attend(*sub, causal=True))
        assert (out[b, ~rows] == 0).all()


def test_every_layer_reuses_the_mask_unpacked_once(calls, monkeypatch):
    from cutefa.api import padding

    seen = []
    real = padding.unpad_input
    monkeypatch.setattr(padding, "unpad_input", lambda *a: seen.append(a[1].shape) or real(*a))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    for _ in range(3):
        hf.attention_forward(Layer(), heads(2, 8, 4), heads(2, 8, 4), heads(2, 8, 4), mask)
    assert seen == [(2, 8)]
    mask[0, 7] = False  # written in place: unpacked again
    hf.attention_forward(Layer(), heads(2, 8, 4), heads(2, 8, 4), heads(2, 8, 4), mask)
    assert len(seen) == 2


def test_every_layer_reuses_the_packed_lengths_read_once(calls, monkeypatch):
    seen = []
    real = hf.packed_lengths
    monkeypatch.setattr(hf, "packed_lengths", lambda p: seen.append(p.shape) or real(p))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    for _ in range(3):
        hf.attention_forward(
            Layer(), heads(1, 8, 4), heads(1, 8, 4), heads(1, 8, 4), None, position_ids=positions
        )
    assert seen == [(1, 8)] and len(calls) == 3


def test_a_decoding_step_of_a_padded_batch(calls):
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # left padding of the prompt
    q, k, v = heads(2, 1, 4), heads(2, 12, 4), heads(2, 12, 4)
    out, _ = hf.attention_forward(Layer(), q, k, v, mask)
    ((_, options),) = calls
    assert options["cu"] == ([0, 1, 2], [0, 12, 19], 1, 12)
    for b in range(2):
        sub_k, sub_v = (t.transpose(1, 2)[b : b + 1, mask[b]] for t in (k, v))
        torch.testing.assert_close(
            out[b : b + 1], attend(q.transpose(1, 2)[b : b + 1], sub_k, sub_v, causal=True)
        )


def test_packed_sequences_from_position_ids_and_from_collator_kwargs(calls):
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    q, k, v = heads(1, 12, 4), heads(1, 12, 2), heads(1, 12, 2)
    out, _ = hf.attention_forward(Layer(), q, k, v, None, position_ids=positions)
    cu = torch.tensor([0, 4, 7, 12], dtype=torch.int32)
    out2, _ = hf.attention_forward(
        Layer(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5
    )
    assert [c[1]["cu"] for c in calls] == [([0, 4, 7, 12], [0, 4, 7, 12], 5, 5)] * 2
    for lo, hi in ((0, 4), (4, 7), (7, 12)):
        want = attend(*(t.transpose(1, 2)[:, lo:hi] for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[:, lo:hi], want)
    torch.testing.assert_close(out2, out)


def test_what_cutefa_does_not_implement_names_the_model_feature(monkeypatch):
    def refuse(*args, **options):
        raise NotImplementedError("no kernel with softcap on this GPU")

    monkeypatch.setattr(cutefa, "flash_attn_func", refuse)
    layer = Layer(attn_logit_softcapping=50.0)
    q = heads(1, 8, 4)
    with pytest.raises(
        NotImplementedError, match=r"Layer \(layer 3\), logit softcapping 50.0: no kernel with softcap"
    ):
        hf.attention_forward(layer, q, q, q, None)


def test_a_custom_4d_mask_is_refused(calls):
    q = heads(1, 8, 4)
    with pytest.raises(NotImplementedError, match="4-D attention mask"):
        hf.attention_forward(Layer(), q, q, q, torch.zeros(1, 1, 8, 8))


def test_float32_inputs_take_the_layers_dtype(calls):
    q = heads(1, 8, 4, dtype=torch.float32)
    out, _ = hf.attention_forward(Layer(), q, q, q, None)
    assert out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# With transformers


@needs_transformers
def test_register_adds_the_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    hf.register()
    hf.register()
    assert AttentionInterface()["cutefa"] is hf.attention_forward
    assert AttentionMaskInterface()["cutefa"] is flash_attention_mask


@needs_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_a_small_llama_matches_eager(calls, padded):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf.register()
    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    if padded:
        mask[1, :7] = 0  # left padding
    logits = {}
    for impl in ("eager", "cutefa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits
    used = mask.bool()
    torch.testing.assert_close(logits["cutefa"][used], logits["eager"][used], atol=5e-2, rtol=5e-2)
    assert {name for name, _ in calls} == {"flash_attn_varlen_func" if padded else "flash_attn_func"}
