"""``attn_implementation="cutefa"`` in Hugging Face transformers on the GPU: small random-weight
models built from configs (no download) give the logits and gradients of the "eager" and "sdpa"
implementations (within 1.5x their error against a float32 eager run), on padded batches too;
a few training steps' losses agree; ``generate()`` with the default dynamic cache scores each
step as a full forward pass does. Models: Llama, Mistral (sliding window), Gemma 2 (softcap and
window), Qwen2 (grouped-query heads) and gpt-oss (attention sinks and window).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_support import sm80_skip_reason
from reference import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(sm80_skip_reason() is not None, reason=str(sm80_skip_reason())),
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
    ),
]

SEQLEN = 256  # longer than the sliding windows below, so that they bind
COMMON = {
    "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024,
}  # fmt: skip


def config(name: str):
    import transformers as tr

    if name == "llama":
        return tr.LlamaConfig(**COMMON)
    if name == "mistral":
        return tr.MistralConfig(**COMMON, sliding_window=64)
    if name == "gemma2":
        return tr.Gemma2Config(
            **COMMON, head_dim=64, sliding_window=64, attn_logit_softcapping=50.0, query_pre_attn_scalar=64
        )
    if name == "qwen2":
        return tr.Qwen2Config(**{**COMMON, "num_key_value_heads": 1})
    if name == "gpt_oss":
        if not hasattr(tr, "GptOssConfig"):
            pytest.skip(f"transformers {tr.__version__} has no gpt-oss")
        # every expert on every token: no routing decision for rounding to flip
        return tr.GptOssConfig(
            **{**COMMON, "intermediate_size": 512}, head_dim=64, sliding_window=64, num_local_experts=2,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    raise ValueError(name)


MODELS = ["llama", "mistral", "gemma2", "qwen2", "gpt_oss"]
SDPA_MODELS = {"llama", "mistral", "qwen2"}  # softcap and sinks are eager-only in transformers


def build(name: str, dtype=torch.bfloat16):
    import transformers as tr

    from cutefa.integrations import transformers as integration

    integration.register()
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(
        config(name), attn_implementation="eager", dtype=torch.float32
    )
    return model.to(device="cuda", dtype=dtype)


def batch(gen, padded: bool):
    ids = torch.randint(0, COMMON["vocab_size"], (2, SEQLEN), generator=gen, device="cuda")
    mask = torch.ones(2, SEQLEN, dtype=torch.long, device="cuda")
    if padded:
        mask[1, :77] = 0  # left padding
        mask[0, SEQLEN - 30 :] = 0  # and right padding
    return ids, mask


def labels(ids, mask):
    """Next-token labels of the tokens, -100 (ignored) where the label or the token before it is
    padding: implementations may give padding rows anything (cutefa gives 0)."""
    used = mask.bool()
    out = ids.masked_fill(~used, -100)
    out[:, 1:] = out[:, 1:].masked_fill(~used[:, :-1], -100)
    return out


def forward_backward(model, impl, ids, mask):
    """(logits of the tokens, gradient of every weight) of a cross-entropy loss on shifted ids."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    used = mask.bool()
    targets = labels(ids, mask)[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100
    )
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logits[used].detach().float(), grads


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_match_eager_and_sdpa(gen, name, padded):
    ids, mask = batch(gen, padded)
    exact = forward_backward(build(name, torch.float32), "eager", ids, mask)
    model = build(name)
    ours = forward_backward(model, "cutefa", ids, mask)
    for impl in ["eager", *(["sdpa"] if name in SDPA_MODELS else [])]:
        theirs = forward_backward(model, impl, ids, mask)
        for what, mine, other, truth in zip(("logits", "gradients"), ours, theirs, exact):
            bound = 1.5 * rel_l2(other, truth) + 1e-3
            assert rel_l2(mine, truth) <= bound, f"{name} {what} vs {impl}: {rel_l2(mine, truth)} > {bound}"


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_training_steps_lose_the_same(gen, name):
    ids, mask = batch(gen, padded=True)
    losses = {}
    for impl in ("sdpa", "cutefa"):
        model = build(name)
        model.set_attn_implementation(impl)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[impl] = []
        for _ in range(5):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels(ids, mask)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.item())
    assert losses["cutefa"][-1] < losses["cutefa"][0]  # it learns
    for mine, theirs in zip(losses["cutefa"], losses["sdpa"]):
        assert abs(mine - theirs) <= 2e-2 * abs(theirs), losses


@pytest.mark.parametrize("name", MODELS)
def test_generate_with_the_dynamic_cache_scores_like_a_full_forward(gen, name):
    model = build(name).eval()
    ids, mask = batch(gen, padded=True)
    ids, mask = ids[:, :100], mask[:, :100].clone()
    mask[0, :] = 1  # the prompt of row 1 is left-padded, row 0's is not
    model.set_attn_implementation("cutefa")
    with torch.no_grad():
        result = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        steps = torch.stack(result.scores, 1).float()  # (batch, new tokens, vocab)
        full_mask = torch.cat([mask, torch.ones_like(result.sequences[:, ids.shape[1] :])], 1)
        model.set_attn_implementation("eager")
        logits = model(input_ids=result.sequences, attention_mask=full_mask).logits.float()
    expected = logits[:, ids.shape[1] - 1 : -1]
    assert rel_l2(steps, expected) < 2e-2
