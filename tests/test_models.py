"""models.llama and models.bert: Hugging Face compatibility, tk path vs reference path, autocast, compile.

The Hugging Face models are tiny random ones built from configs (no hub); the tests that need
``transformers`` skip without it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from models.bert import BertConfig, BertForMaskedLM
from models.llama import LlamaConfig, LlamaForCausalLM
from tk_ops import _library
from tk_testing import RecordTkCalls, assert_rel_close, check_compile_fullgraph, requires_cuda

try:
    import transformers
except ImportError:  # a test dependency
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")

# odd sizes on purpose: nothing is a multiple of 16 except where a head dim must be even
SIZES = dict(
    hidden_size=48, intermediate_size=83, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
)
LLAMA = dict(SIZES, vocab_size=101, num_key_value_heads=2)
BERT = dict(SIZES, vocab_size=103, hidden_dropout_prob=0.0)
BATCH, SEQ_LEN = 3, 13

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def llama(reference: bool, **overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}, reference=reference))


def bert(reference: bool, **overrides) -> BertForMaskedLM:
    return BertForMaskedLM(BertConfig(**{**BERT, **overrides}, reference=reference))


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN))


# ------------------------------------------------------------------- Hugging Face compatibility


@needs_transformers
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_llama_loads_hf_state_dict_and_matches_logits(tied, reference):
    hf_config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=500.0)
    hf_config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    ours = LlamaForCausalLM(LlamaConfig.from_hf(hf_config, reference=reference)).eval()
    assert ours.config.rope_theta == 500.0 and ours.config.tie_word_embeddings == tied
    hf_state = hf.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}
    ours.load_state_dict(hf_state)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")


@needs_transformers
def test_llama_state_dict_loads_into_hf():
    ours = llama(reference=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ours.config.to_hf_dict())).eval()
    hf.load_state_dict(ours.state_dict())
    ids = tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        assert_rel_close(ours.eval()(ids), hf(ids).logits, 1e-5, "logits")


@needs_transformers
@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_bert_loads_hf_state_dict_and_matches_logits(reference):
    hf_config = transformers.BertConfig(**BERT, attention_probs_dropout_prob=0.1, layer_norm_eps=1e-7)
    hf_config._attn_implementation = "eager"
    hf = transformers.BertForMaskedLM(hf_config).eval()
    ours = BertForMaskedLM(BertConfig.from_hf(hf_config, reference=reference)).eval()
    assert ours.config.layer_norm_eps == 1e-7
    hf_state = hf.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}
    ours.load_state_dict(hf_state)
    ids = tokens(BERT["vocab_size"])
    token_types = torch.randint(0, 2, ids.shape)
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
        assert_rel_close(
            ours(ids, token_type_ids=token_types), hf(ids, token_type_ids=token_types).logits, 1e-5, "logits (types)"
        )


@needs_transformers
def test_bert_state_dict_loads_into_hf():
    ours = bert(reference=False)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**ours.config.to_hf_dict())).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(key.endswith(("position_ids", "token_type_ids")) for key in missing)
    ids = tokens(BERT["vocab_size"])
    with torch.no_grad():
        assert_rel_close(ours.eval()(ids), hf(ids).logits, 1e-5, "logits")


@needs_transformers
def test_configs_reject_what_the_models_do_not_implement():
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf(transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_hf(transformers.BertConfig(**BERT, hidden_act="relu"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(**{**LLAMA, "num_key_value_heads": 3})


# ------------------------------------------------------------------------- tk path vs reference


def _loss_and_grads(model, ids, targets):
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "make, vocab", [(llama, LLAMA["vocab_size"]), (bert, BERT["vocab_size"])], ids=["llama", "bert"]
)
def test_tk_path_matches_reference_path_in_float64(make, vocab):
    tk_model = make(reference=False).double()
    reference_model = make(reference=True).double()
    reference_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(vocab), tokens(vocab)
    targets[0, :4] = -100
    with RecordTkCalls() as recorded:
        tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets)
    reference_loss, reference_grads = _loss_and_grads(reference_model, ids, targets)
    assert_rel_close(tk_loss, reference_loss, 1e-12, "loss")
    for name, grad in reference_grads.items():
        # absolute slack for the key bias, whose gradient is zero up to rounding (softmax shift invariance)
        torch.testing.assert_close(tk_grads[name], grad, rtol=1e-9, atol=1e-15, msg=f"grad of {name}")
    norm = "rms_norm" if make is llama else "layer_norm"
    expected = {"linear", "linear_bwd", "attention", "attention_bwd", norm, f"{norm}_bwd"}
    if make is llama:
        expected |= {"rope_qk", "rope_qk_bwd", "linear_cross_entropy", "linear_cross_entropy_bwd"}
    assert expected <= recorded.calls.keys()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_tk_path_trains_without_the_logits(tied):
    """The tk path's training loss is the head and the loss in one op: lm_head never runs (no (B N, vocab)
    logits), its weight still gets the gradient; without targets the model returns the logits, as the
    reference path does."""
    tk_model = llama(reference=False, tie_word_embeddings=tied)
    reference_model = llama(reference=True, tie_word_embeddings=tied)
    reference_model.load_state_dict(tk_model.state_dict())
    head_calls = []
    tk_model.lm_head.register_forward_hook(lambda module, inputs, output: head_calls.append(output.shape))
    ids, targets = tokens(LLAMA["vocab_size"]), tokens(LLAMA["vocab_size"])
    tk_loss, _ = _loss_and_grads(tk_model, ids, targets)
    assert head_calls == []
    reference_loss, _ = _loss_and_grads(reference_model, ids, targets)
    assert_rel_close(tk_loss, reference_loss, 1e-5, "loss")
    assert_rel_close(tk_model.lm_head.weight.grad, reference_model.lm_head.weight.grad, 1e-4, "grad of the head")
    with torch.no_grad():
        assert_rel_close(tk_model(ids), reference_model(ids), 1e-5, "logits")
    assert head_calls == [(BATCH, SEQ_LEN, LLAMA["vocab_size"])]


@pytest.mark.parametrize(
    "make, vocab", [(llama, LLAMA["vocab_size"]), (bert, BERT["vocab_size"])], ids=["llama", "bert"]
)
def test_reference_path_calls_no_tk_op(make, vocab):
    model = make(reference=True)
    with RecordTkCalls() as recorded:
        model(tokens(vocab), tokens(vocab)).backward()
    assert not recorded.calls


@pytest.mark.parametrize(
    "make, vocab", [(llama, LLAMA["vocab_size"]), (bert, BERT["vocab_size"])], ids=["llama", "bert"]
)
def test_tk_path_under_bf16_autocast(make, vocab):
    """tk ops have no autocast rule: the tk path casts where autocast would, keeps fp32 weights and grads."""
    tk_model = make(reference=False)
    reference_model = make(reference=True)
    reference_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(vocab), tokens(vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tk_logits = tk_model(ids)
        tk_loss = tk_model(ids, targets)
        reference_loss = reference_model(ids, targets)
    assert tk_logits.dtype == torch.bfloat16
    tk_loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in tk_model.parameters())
    assert_rel_close(tk_loss, reference_loss, 2e-2, "bf16 loss")


@requires_cuda
@pytest.mark.parametrize("make", [llama, bert], ids=["llama", "bert"])
def test_tk_path_on_gpu_under_bf16_autocast_runs_kernels_and_matches_reference(make, monkeypatch):
    """Head dim 64, bf16, GEMM sizes of a real model (multiples of 64; any token count): every tk op of
    a training step must be served by a CUDA kernel (the reference fallback warns), and the loss and
    gradients must match the reference path's."""
    shape = {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 704, "vocab_size": 512}
    shape["max_position_embeddings"] = 256
    with torch.device("cuda"):
        tk_model, reference_model = make(reference=False, **shape), make(reference=True, **shape)
    reference_model.load_state_dict(tk_model.state_dict())
    vocab = tk_model.config.vocab_size
    ids, targets = torch.randint(0, vocab, (4, 197), device="cuda"), torch.randint(0, vocab, (4, 197), device="cuda")
    monkeypatch.setattr(_library, "_REFERENCE_WARNED", set())  # the fallback warns once per op and process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tk_loss = tk_model(ids, targets)
        tk_loss.backward()
    fallbacks = [str(w.message) for w in caught if "reference path" in str(w.message)]
    assert not fallbacks, fallbacks
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference_loss = reference_model(ids, targets)
    reference_loss.backward()
    assert_rel_close(tk_loss, reference_loss, 1e-2, "loss")
    # bf16 rounding differs between the paths; q/k gradients of a random model (near-uniform attention)
    # are small and the noisiest (up to 4% here on CPU in bf16); BERT's key bias gradient is ~0.
    largest = max(p.grad.norm() for p in reference_model.parameters())
    for (name, p), reference_p in zip(tk_model.named_parameters(), reference_model.parameters()):
        error = (p.grad - reference_p.grad).norm()
        assert error <= 0.1 * max(reference_p.grad.norm(), 1e-3 * largest), f"grad of {name}: error {error:.3e}"


def test_bert_tk_path_rejects_attention_dropout_in_training():
    model = bert(reference=False, attention_probs_dropout_prob=0.1)
    ids = tokens(BERT["vocab_size"])
    model.eval()(ids)  # eval: no dropout anywhere
    with pytest.raises(ValueError, match="attention_probs_dropout_prob"):
        model.train()(ids)


def test_bert_hidden_dropout_follows_the_seed():
    model = bert(reference=False, hidden_dropout_prob=0.2)
    ids = tokens(BERT["vocab_size"])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model(ids))
    torch.manual_seed(8)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], model(ids))


def test_llama_compiled_block_calls_tk_ops_and_matches_eager():
    block = llama(reference=False, num_hidden_layers=1).model.layers[0]
    x = torch.randn(2, 7, LLAMA["hidden_size"], requires_grad=True)
    residual = torch.randn(2, 7, LLAMA["hidden_size"])
    cos = torch.randn(7, LLAMA["hidden_size"] // LLAMA["num_attention_heads"] // 2)
    sin = torch.randn_like(cos)
    check_compile_fullgraph(
        block,
        [x, residual, cos, sin],
        ["rms_norm", "rms_norm_bwd", "rope_qk", "attention", "attention_bwd", "linear", "linear_bwd"],
        loss=lambda out, stream: out.square().sum() + stream.sum(),
        tol=1e-5,
    )


# ---------------------------------------------------------------------------------- the rest


def test_llama_generate_is_deterministic_and_greedy_matches_argmax():
    model = llama(reference=False).eval()
    prompt = tokens(LLAMA["vocab_size"])[:1, :5]
    greedy = model.generate(prompt, 4, temperature=0)
    assert greedy.shape == (1, 9) and torch.equal(greedy[:, :5], prompt)
    assert greedy[0, 5] == model(prompt)[0, -1].argmax()
    sampled = [model.generate(prompt, 4, top_k=5, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.parametrize("make", [llama, bert], ids=["llama", "bert"])
def test_flops_per_token_counts_every_linear(make):
    model = make(reference=True)
    config = model.config
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    causal = 1 if make is llama else 2
    head_dim = config.hidden_size // config.num_attention_heads
    attention = config.num_hidden_layers * config.num_attention_heads * 2 * causal * 100 * head_dim
    assert model.flops_per_token(100) == pytest.approx(3 * (2 * linear_params + attention))


@needs_transformers
def test_configs_round_trip_through_hf_configs():
    for config in (LlamaConfig(**LLAMA, rope_theta=1234.0), BertConfig(**BERT)):
        hf_config_class = transformers.LlamaConfig if isinstance(config, LlamaConfig) else transformers.BertConfig
        assert type(config).from_hf(hf_config_class(**config.to_hf_dict())) == config
