"""models.llama and models.bert: Hugging Face compatibility, tk path vs reference path, autocast, compile;
Llama's sliding window (as Mistral's) and packed documents.

The Hugging Face models are tiny random ones built from configs (no hub); the tests that need
``transformers`` skip without it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from models.bert import BertConfig, BertForMaskedLM
from models.layers import PackedDocuments
from models.llama import LlamaConfig, LlamaForCausalLM
from tk_ops import _library
from tk_testing import RecordTkCalls, assert_rel_close, check_compile_fullgraph, requires_cuda

try:
    import transformers
except ImportError:  # a test dependency
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")

# a window shorter than SEQ_LEN, so that it hides keys
WINDOW = 4
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
@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_llama_with_a_window_loads_hf_mistral_and_matches_logits(reference):
    hf_config = transformers.MistralConfig(**LLAMA, sliding_window=WINDOW, rms_norm_eps=1e-5)
    hf_config._attn_implementation = "eager"
    hf = transformers.MistralForCausalLM(hf_config).eval()
    ours = LlamaForCausalLM(LlamaConfig.from_hf(hf_config, reference=reference)).eval()
    assert ours.config.sliding_window == WINDOW and not ours.config.tie_word_embeddings
    ours.load_state_dict(hf.state_dict())
    ids = tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")


@needs_transformers
def test_llama_with_a_window_is_a_mistral_for_hf():
    ours = llama(reference=False, sliding_window=WINDOW).eval()
    hf_config = transformers.AutoConfig.for_model(**ours.config.to_hf_dict())
    assert isinstance(hf_config, transformers.MistralConfig) and hf_config.sliding_window == WINDOW
    hf = transformers.MistralForCausalLM(hf_config).eval()
    hf.load_state_dict(ours.state_dict())
    ids = tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
    assert LlamaConfig.from_hf(hf_config) == ours.config
    with pytest.raises(ValueError, match="no attention or MLP biases"):
        LlamaConfig(**LLAMA, sliding_window=WINDOW, attention_bias=True).to_hf_dict()


@needs_transformers
def test_configs_reject_what_the_models_do_not_implement():
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_hf(transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_hf(transformers.BertConfig(**BERT, hidden_act="relu"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(**{**LLAMA, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaConfig(**LLAMA, sliding_window=0)


# ------------------------------------------------------------------------- tk path vs reference


def _loss_and_grads(model, ids, targets, **arguments):
    loss = model(ids, targets, **arguments)
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


def test_the_fused_loss_is_used_on_the_cpu_and_where_its_kernel_serves(monkeypatch):
    """On a GPU without a linear_cross_entropy kernel the tk path keeps the lm_head GEMM and F.cross_entropy
    (the op's tiled fp32 reference would be far slower there); on the CPU it always fuses."""
    from models import layers

    for kernel in (False, True):
        monkeypatch.setattr(layers, "LINEAR_CROSS_ENTROPY_KERNEL", kernel)
        assert layers.fuses_head_and_loss(torch.device("cpu"))
        assert layers.fuses_head_and_loss(torch.device("cuda", 0)) == kernel
    monkeypatch.setattr(layers, "fuses_head_and_loss", lambda device: False)
    tk_model = llama(reference=False)
    head_calls = []
    tk_model.lm_head.register_forward_hook(lambda module, inputs, output: head_calls.append(output.shape))
    reference_model = llama(reference=True)
    reference_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(LLAMA["vocab_size"]), tokens(LLAMA["vocab_size"])
    unfused_loss, _ = _loss_and_grads(tk_model, ids, targets)
    assert head_calls == [(BATCH, SEQ_LEN, LLAMA["vocab_size"])]
    assert_rel_close(unfused_loss, _loss_and_grads(reference_model, ids, targets)[0], 1e-5, "loss")


def _float64_pair(**overrides):
    """The tk and reference Llama in float64 with the same weights."""
    tk_model = llama(reference=False, **overrides).double()
    reference_model = llama(reference=True, **overrides).double()
    reference_model.load_state_dict(tk_model.state_dict())
    return tk_model, reference_model


def _assert_same_loss_and_grads(tk_model, reference_model, ids, targets, **arguments):
    tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets, **arguments)
    reference_loss, reference_grads = _loss_and_grads(reference_model, ids, targets, **arguments)
    assert_rel_close(tk_loss, reference_loss, 1e-12, "loss")
    for name, grad in reference_grads.items():
        torch.testing.assert_close(tk_grads[name], grad, rtol=1e-9, atol=1e-15, msg=f"grad of {name}")


def test_llama_sliding_window_tk_path_matches_reference_path_in_float64():
    tk_model, reference_model = _float64_pair(sliding_window=WINDOW)
    ids, targets = tokens(LLAMA["vocab_size"]), tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        assert_rel_close(tk_model(ids), reference_model(ids), 1e-12, "logits")
    with RecordTkCalls() as recorded:
        _assert_same_loss_and_grads(tk_model, reference_model, ids, targets)
    assert {"attention", "attention_bwd"} <= recorded.calls.keys()


def test_llama_sliding_window_changes_the_result_only_beyond_the_window():
    windowed, _ = _float64_pair(sliding_window=WINDOW)
    unwindowed = llama(reference=False).double()
    unwindowed.load_state_dict(windowed.state_dict())
    ids = tokens(LLAMA["vocab_size"])
    with torch.no_grad():
        with_window, without = windowed(ids), unwindowed(ids)
    # the first WINDOW tokens see all their keys either way; every later one loses some
    torch.testing.assert_close(with_window[:, :WINDOW], without[:, :WINDOW], rtol=1e-12, atol=1e-12)
    assert ((with_window - without)[:, WINDOW:].abs().amax(-1) > 1e-6).all()


def test_llama_sliding_window_counts_the_keys_each_query_sees():
    config = LlamaConfig(**LLAMA, sliding_window=WINDOW)
    per_layer_and_head = 4 * config.head_dim
    without = LlamaForCausalLM(LlamaConfig(**LLAMA)).flops_per_token(100)
    windowed = LlamaForCausalLM(config).flops_per_token(100)
    keys_seen = WINDOW * (1 - WINDOW / 200)
    saved = config.num_hidden_layers * config.num_attention_heads * per_layer_and_head * (50 - keys_seen)
    assert without - windowed == pytest.approx(3 * saved)


# Three rows of SEQ_LEN tokens: documents of 4, 3 and 6 tokens; one row-long document; single-token documents
# then a longer one.
POSITIONS = torch.tensor([
    [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5],
    list(range(SEQ_LEN)),
    [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
])  # fmt: skip


def test_packed_documents_from_positions():
    documents = PackedDocuments.from_positions(POSITIONS)
    assert documents.cu_seqlens.tolist() == [0, 4, 7, 13, 26, 27, 28, 29, 39] and documents.max_seqlen == 13
    assert documents.cu_seqlens.dtype == torch.int32
    same = documents.same_document()[0, 0]
    assert same[6, 4] and not same[4, 3] and same.shape == (SEQ_LEN, SEQ_LEN)
    for bad in (POSITIONS[:, 1:], POSITIONS + 1, torch.tensor([[0, 1, 3]])):
        with pytest.raises(ValueError, match="positions"):
            PackedDocuments.from_positions(bad)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["no_window", "window"])
def test_llama_packed_tk_path_matches_reference_path_in_float64(window):
    """The tk path (attention_varlen over the documents) against the reference path (SDPA with the
    block-diagonal causal mask), logits and gradients."""
    tk_model, reference_model = _float64_pair(sliding_window=window)
    ids, targets = tokens(LLAMA["vocab_size"]), tokens(LLAMA["vocab_size"])
    documents = PackedDocuments.from_positions(POSITIONS)
    with torch.no_grad():
        assert_rel_close(tk_model(ids, documents=documents), reference_model(ids, documents=documents), 1e-12)
    with RecordTkCalls() as recorded:
        _assert_same_loss_and_grads(tk_model, reference_model, ids, targets, documents=documents)
    assert {"attention_varlen", "attention_varlen_bwd", "rope_qk", "rope_qk_bwd"} <= recorded.calls.keys()
    assert "attention" not in recorded.calls


@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_llama_packed_row_equals_each_document_alone(reference):
    """A packed row's logits, and the gradients of a function of them, are those of its documents run one
    by one as batches of their own (positions from 0, no attention across them)."""
    model = llama(reference=reference, sliding_window=WINDOW).double()
    ids = tokens(LLAMA["vocab_size"])[:1]
    documents = PackedDocuments.from_positions(POSITIONS[:1])
    packed_logits = model(ids, documents=documents)
    packed_logits.square().sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    bounds = documents.cu_seqlens.tolist()
    alone = torch.cat([model(ids[:, start:stop]) for start, stop in zip(bounds[:-1], bounds[1:])], dim=1)
    alone.square().sum().backward()
    assert_rel_close(packed_logits, alone, 1e-12, "logits")
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-9, atol=1e-15, msg=f"grad of {name}")
    # and packing is not a no-op: one row-long document attends across the boundaries
    assert (model(ids) - packed_logits).abs().amax() > 1e-6


def test_packed_documents_are_refused_by_models_without_them():
    from models.mamba2 import Mamba2Config, Mamba2ForCausalLM

    model = Mamba2ForCausalLM(Mamba2Config(vocab_size=31, hidden_size=64, num_hidden_layers=1, num_heads=2,
                                           head_dim=64, state_size=16, chunk_size=16, reference=True))  # fmt: skip
    with pytest.raises(NotImplementedError, match="packed documents"):
        model(torch.zeros(1, 4, dtype=torch.long), documents=PackedDocuments.from_positions(torch.arange(4)[None]))


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
    for config in (LlamaConfig(**LLAMA, rope_theta=1234.0), LlamaConfig(**LLAMA, sliding_window=7), BertConfig(**BERT)):
        assert type(config).from_hf(transformers.AutoConfig.for_model(**config.to_hf_dict())) == config
