"""tk_ops.transformers.enable_attention: attn_implementation="tk_ops" against attn_implementation="eager" on tiny
random-weight Hugging Face models in float64 (CPU): Llama (GQA), Mistral (sliding window), Gemma 2 (softcap and
sliding window, head dim 256) and GPT-OSS (sinks, sliding window). Logits and every parameter's gradient, for
padded batches (right and left padding, unpadded into tk_ops.attention_varlen), packed batches
(DataCollatorWithFlattening's position_ids, with and without its flash-attention kwargs) and greedy generation
with HF's caches. Runs on whatever transformers is installed (CI: both ends of tk_ops.transformers'
SUPPORTED_TRANSFORMERS)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tk_ops  # noqa: E402
import tk_ops.transformers as tk_transformers  # noqa: E402
import tk_testing  # noqa: E402
from tk_testing import parametrize_with_ids  # noqa: E402

VOCAB = 61
# float64 models, but HF's eager attention (Llama, Mistral, Gemma 2) takes its softmax in float32
# (softmax(..., dtype=torch.float32)), so eager itself is float32-accurate: ~5e-8 relative in the logits. A wrong
# mask, window, softcap or sink moves them by 1e-2 or more.
LOGITS_TOL = 1e-6
GRAD_TOL = 2e-5


def _llama():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _mistral():
    return transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      sliding_window=4)


def _gemma2():
    return transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                     max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=2.0,
                                     final_logit_softcapping=None, query_pre_attn_scalar=64,
                                     layer_types=["sliding_attention", "full_attention"])


def _gpt_oss():
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     experts_implementation="eager")  # grouped_mm takes no float64


CONFIGS = [("llama", _llama), ("mistral", _mistral), ("gemma2", _gemma2), ("gpt-oss", _gpt_oss)]


@pytest.fixture(scope="module", autouse=True)
def registered():
    tk_transformers.enable_attention()
    tk_transformers.enable_attention()  # idempotent


def make_models(make_config, seed=0):
    """(eager model, tk_ops model) in float64 with the same random weights, in eval mode (no dropout)."""
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_class = transformers.AutoModelForCausalLM.from_config(config).__class__
    eager = model_class(config).double().eval()
    if hasattr(eager.model.layers[0].self_attn, "sinks"):  # GPT-OSS: sinks of a visible size
        with torch.no_grad():
            for layer in eager.model.layers:
                layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    tk = copy.deepcopy(eager)
    tk.set_attn_implementation(tk_transformers.ATTENTION_IMPLEMENTATION)
    assert tk.config._attn_implementation == "tk_ops" and eager.config._attn_implementation == "eager"
    return eager, tk


def run(model, weights, valid, **inputs):
    """Logits at the valid positions and every parameter's gradient of sum(logits * weights) over them."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    (logits * weights * valid[..., None]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[valid], grads


def compare(eager, tk, valid, **inputs):
    torch.manual_seed(1)
    weights = torch.randn(*valid.shape, VOCAB, dtype=torch.float64)
    with tk_testing.RecordTkCalls() as recorder:
        tk_logits, tk_grads = run(tk, weights, valid, **inputs)
    eager_logits, eager_grads = run(eager, weights, valid, **inputs)
    tk_testing.assert_rel_close(tk_logits, eager_logits, LOGITS_TOL, "logits")
    assert tk_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        tk_testing.assert_rel_close(tk_grads[name], grad, GRAD_TOL, name)
    return recorder.calls


def padding_mask(lengths, width, left):
    positions = torch.arange(width)[None, :]
    lengths = torch.tensor(lengths)[:, None]
    return (positions >= width - lengths) if left else (positions < lengths)


@parametrize_with_ids("make_config", CONFIGS)
def test_full_batch_runs_dense_attention(make_config):
    eager, tk = make_models(make_config)
    input_ids = torch.randint(0, VOCAB, (2, 11))
    calls = compare(eager, tk, torch.ones(2, 11, dtype=torch.bool), input_ids=input_ids)
    assert {"attention", "attention_bwd"} <= calls.keys() and "attention_varlen" not in calls


def run_separately(model, sequences):
    """Each sequence alone (batch 1, no padding, no mask), ``sequences`` = [(input_ids (L,), weights (L, V))]:
    the logits, concatenated, and every parameter's gradient of the summed losses sum(logits * weights).

    The reference for padded and packed batches. HF's eager attention gives NaN in float64 for query rows
    that see no key (left padding, or a sliding window past the end of a right-padded sequence), and the NaN
    reaches the valid rows of the next layer through 0 * NaN; and eager GPT-OSS does not split a packed row
    (its logits differ from the sequences' own). RoPE scores depend on relative positions only, so a
    left-padded sequence (positions shifted by its padding) has the logits it has alone."""
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for input_ids, weights in sequences:
        sequence_logits = model(input_ids=input_ids[None], use_cache=False).logits[0]
        loss = loss + (sequence_logits * weights).sum()
        logits.append(sequence_logits.detach())
    loss.backward()
    return torch.cat(logits), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def compare_with_sequences(tk, eager, sequences, valid, **inputs):
    torch.manual_seed(1)
    weights = torch.randn(*valid.shape, VOCAB, dtype=torch.float64)
    with tk_testing.RecordTkCalls() as recorder:
        tk_logits, tk_grads = run(tk, weights, valid, **inputs)
    eager_logits, eager_grads = run_separately(eager, sequences(weights))
    tk_testing.assert_rel_close(tk_logits, eager_logits, LOGITS_TOL, "logits")
    assert tk_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        tk_testing.assert_rel_close(tk_grads[name], grad, GRAD_TOL, name)
    return recorder.calls


@parametrize_with_ids("make_config", CONFIGS)
@pytest.mark.parametrize("left", [False, True], ids=["right-padding", "left-padding"])
def test_padded_batch_is_unpadded_into_varlen(make_config, left):
    eager, tk = make_models(make_config)
    lengths, width = [11, 6, 1], 11
    mask = padding_mask(lengths, width, left)
    input_ids = torch.randint(0, VOCAB, (3, width))
    calls = compare_with_sequences(
        tk, eager, lambda weights: [(input_ids[b][mask[b]], weights[b][mask[b]]) for b in range(3)], mask,
        input_ids=input_ids, attention_mask=mask.long(),
    )
    assert {"attention_varlen", "attention_varlen_bwd"} <= calls.keys() and "attention" not in calls
    assert calls["attention_varlen"][0][3].tolist() == [0, 11, 17, 18]


@parametrize_with_ids("make_config", CONFIGS)
def test_right_padded_batch_matches_eager_on_the_batch(make_config):
    """Where eager's own padded batch has no NaN (every query row sees a key: long right-padded sequences)."""
    eager, tk = make_models(make_config)
    mask = padding_mask([11, 9, 10], 11, left=False)
    compare(eager, tk, mask, input_ids=torch.randint(0, VOCAB, (3, 11)), attention_mask=mask.long())


def _packed(lengths, seed=2):
    generator = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).tolist()} for n in lengths]
    return features


@parametrize_with_ids("make_config", CONFIGS)
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "collator-cu-seqlens"])
def test_packed_batch(make_config, flash_kwargs):
    """DataCollatorWithFlattening's padding-free row (with or without its flash-attention kwargs) gives every
    sequence the logits and gradients it has alone."""
    eager, tk = make_models(make_config)
    lengths = [5, 7, 1, 4]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(_packed(lengths))
    batch.pop("labels")
    valid = torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    starts = [0, 5, 12, 13, 17]

    def sequences(weights):
        return [(batch["input_ids"][0, a:b], weights[0, a:b]) for a, b in zip(starts[:-1], starts[1:])]

    calls = compare_with_sequences(tk, eager, sequences, valid, **batch)
    assert {"attention_varlen", "attention_varlen_bwd"} <= calls.keys() and "attention" not in calls
    assert calls["attention_varlen"][0][3].tolist() == starts


@parametrize_with_ids("make_config", CONFIGS[:3])
def test_packed_batch_matches_eager_on_the_packed_row(make_config):
    """Llama, Mistral and Gemma 2's eager masks split a packed row by its position_ids (with no cache)."""
    eager, tk = make_models(make_config)
    batch = transformers.DataCollatorWithFlattening()(_packed([5, 7, 1, 4]))
    batch.pop("labels")
    compare(eager, tk, torch.ones(batch["input_ids"].shape, dtype=torch.bool), **batch)


@parametrize_with_ids("make_config", CONFIGS)
def test_greedy_generation_with_cache_and_left_padding(make_config):
    """A left-padded batch through generate (HF's caches; sliding-window layers keep only the window) gives
    each sequence the tokens eager generates for it alone (eager's padded batch has NaN rows in float64)."""
    eager, tk = make_models(make_config)
    lengths, width, new_tokens = [9, 5], 9, 6
    mask = padding_mask(lengths, width, left=True)
    input_ids = torch.randint(1, VOCAB, (2, width)).masked_fill(~mask, 0)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = tk.generate(input_ids, attention_mask=mask.long(), **options)
        for b in range(2):
            expected = eager.generate(input_ids[b][mask[b]][None], **options)
            assert got[b, width:].tolist() == expected[0, lengths[b]:].tolist(), f"sequence {b}"


def test_attention_dropout_raises():
    config = _llama()
    config.attention_dropout = 0.1
    config._attn_implementation = "tk_ops"
    model = transformers.LlamaForCausalLM(config).train()
    with pytest.raises(ValueError, match="tk_ops attention has no dropout"):
        model(torch.randint(0, VOCAB, (1, 5)))


def test_custom_4d_mask_raises():
    _, tk = make_models(_llama)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.double)
    with pytest.raises(ValueError, match="2D padding mask"):
        tk(torch.randint(0, VOCAB, (1, 5)), attention_mask=mask)


def test_sinks_reach_the_op_in_fp32_with_their_gradient():
    """GPT-OSS's sinks (a bf16/fp32 parameter in practice) are cast to fp32 for the op; fp64 models keep fp64."""
    config = _gpt_oss()
    config._attn_implementation = "tk_ops"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with tk_testing.RecordTkCalls() as recorder:
        model(torch.randint(0, VOCAB, (1, 6))).logits.sum().backward()
    sinks = recorder.calls["attention"][0][9]
    assert sinks.dtype == torch.float32 and sinks.shape == (4,)
    assert all(layer.self_attn.sinks.grad is not None for layer in model.model.layers)


def test_enable_attention_refuses_unsupported_transformers(monkeypatch):
    for version in ("5.16.0", "6.0.0"):
        monkeypatch.setattr(tk_transformers, "_installed_transformers_version", lambda: version)
        with pytest.raises(ImportError, match=f"transformers {version} is installed; .*>=5.17.0,<6"):
            tk_transformers.enable_attention()


def test_public_names():
    assert tk_transformers.ATTENTION_IMPLEMENTATION == "tk_ops"
    assert "tk_ops" in transformers.AttentionInterface()
    assert callable(tk_ops.attention_varlen)
