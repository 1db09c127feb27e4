"""tk_ops.nn.GatedDeltaNet and tk_ops.transformers.apply_tk_kernels_to_qwen3_next against Hugging Face's
Qwen3-Next (CPU).

HF's torch path computes its delta rule and its gated norm in fp32 whatever the model dtype, and its decays
from exp(A_log) in fp32. The float64 comparisons therefore run HF's mixer with those pieces replaced by float64
equivalents written here (``exact_hf``: the token-by-token recurrence of tests/inputs/gated_delta_rule.py, an
algorithm independent of tk.gated_delta_rule's chunked one; the gated norm without the fp32 cast; the decays
from the mixer's own projection in float64); everything else (projections, their head layout, conv, masking,
splits) is HF's own code. The unmodified HF path is compared within fp32 tolerances.

The tests run on whatever transformers is installed (CI: both ends of tk_ops.transformers'
SUPPORTED_TRANSFORMERS): the mixer's cache argument is ``cache`` from 5.24 and ``cache_params`` before, the
model's ``cache`` and ``past_key_values``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

import tk_ops.transformers as tk_transformers  # noqa: E402
from inputs import gated_delta_rule as gdn_inputs  # noqa: E402
from tk_ops.nn import GatedDeltaNet  # noqa: E402
from tk_testing import RecordTkCalls, assert_rel_close, check_compile_fullgraph, parametrize_with_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HIDDEN = 32
TK_OPS = ("causal_conv1d", "gated_delta_rule", "rms_norm", "causal_conv1d_bwd", "gated_delta_rule_bwd")
LINEAR_LAYERS = (0, 2)  # the tiny model's linear-attention layers; layer 1 is full attention


def tiny_config(key_heads=2, value_heads=4) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_only_layers=[0, 1, 2],
    )


@torch.no_grad()
def randomize(mixer: torch.nn.Module) -> None:
    """Random parameters of a realistic scale: decays exp(-exp(A_log) softplus(a + dt_bias)) spread over (0, 1)."""
    for name, p in mixer.named_parameters():
        if name == "A_log":
            p.copy_(torch.log(torch.rand_like(p) * 2 + 0.1))
        elif name == "dt_bias":
            p.copy_(torch.randn_like(p) * 0.5 - 1.0)
        elif name == "norm.weight":
            p.copy_(1 + 0.2 * torch.randn_like(p))
        else:
            p.normal_(0, 0.3)


def hf_mixer(config: Qwen3NextConfig, dtype=torch.float64) -> hf.Qwen3NextGatedDeltaNet:
    mixer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).to(dtype)
    randomize(mixer)
    return mixer


def tk_copy(reference: hf.Qwen3NextGatedDeltaNet, config: Qwen3NextConfig) -> GatedDeltaNet:
    mixer = GatedDeltaNet.from_config(config, layer_idx=0).to(next(reference.parameters()).dtype)
    mixer.load_state_dict(reference.state_dict(), strict=True)
    return mixer


def left_padding_mask(batch: int, seq_len: int) -> torch.Tensor:
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        mask[b, : (b * seq_len) // (2 * batch)] = 0  # row 0 unpadded, the others padded more and more
    return mask


# ------------------------------------------------------------- float64 reference pieces for HF's mixer


def exact_hf(monkeypatch) -> None:
    """HF's mixers in float64 throughout (see the module docstring). HF's g rounds exp(A_log) to fp32, so the
    recurrence takes the decays g = -exp(A_log) softplus(a + dt_bias) computed in float64 from the calling
    mixer's own in_proj_ba (its split by HF's fix_query_key_value_ordering), recorded by a wrapper of
    HF's forward; their gradients reach A_log, dt_bias and in_proj_ba through that computation."""
    original_forward = hf.Qwen3NextGatedDeltaNet.forward
    decays = []

    def recording_forward(self, hidden_states, *args, **kwargs):
        masked = hf.apply_mask_to_padding_states(hidden_states, kwargs.get("attention_mask"))
        *_, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(masked), self.in_proj_ba(masked))
        decays.append(-torch.exp(self.A_log) * F.softplus(a + self.dt_bias))
        try:
            return original_forward(self, hidden_states, *args, **kwargs)
        finally:
            decays.pop()

    def exact_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
        assert initial_state is None and use_qk_l2norm_in_kernel
        inputs = dict(q=query, k=key, v=value, g=decays[-1], beta=beta, initial_state=None)
        o, final_state = gdn_inputs.recurrence(inputs, use_qk_l2norm=True)
        return o.to(query.dtype), (final_state if output_final_state else None)

    def gated_norm(self, hidden_states, gate):
        normed = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * normed * F.silu(gate)

    monkeypatch.setattr(hf.Qwen3NextGatedDeltaNet, "forward", recording_forward)
    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", exact_rule)
    monkeypatch.setattr(hf.Qwen3NextRMSNormGated, "forward", gated_norm)


# (id, L, key heads, value heads, masked); L = 100 spans two of tk.gated_delta_rule's 64-position chunks.
CASES = [
    ("L1", 1, 2, 4, False),
    ("L17-Hv-over-Hk-2", 17, 2, 4, False),
    ("L17-Hv-equals-Hk", 17, 3, 3, False),
    ("L100-Hv-over-Hk-4-leftpad", 100, 1, 4, True),
    ("L23-Hv-over-Hk-2-leftpad", 23, 2, 4, True),
]
CASE_ARGS = "seq_len, key_heads, value_heads, masked"


def setup_case(seq_len, key_heads, value_heads, masked, dtype=torch.float64):
    config = tiny_config(key_heads, value_heads)
    reference = hf_mixer(config, dtype)
    x = torch.randn(3, seq_len, HIDDEN, dtype=dtype)
    return reference, tk_copy(reference, config), x, left_padding_mask(3, seq_len) if masked else None


# ------------------------------------------------------------------------------------- the module


def test_state_dicts_load_both_ways():
    config = tiny_config()
    reference = hf_mixer(config)
    mixer = GatedDeltaNet.from_config(config, layer_idx=0).double()
    expected = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in mixer.state_dict().items()} == expected
    assert set(expected) == {
        "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
        "out_proj.weight",
    }
    mixer.load_state_dict(reference.state_dict(), strict=True)
    randomize(mixer)
    reference.load_state_dict(mixer.state_dict(), strict=True)
    for name, p in mixer.state_dict().items():
        assert torch.equal(p, reference.state_dict()[name]), name


def test_constructor_mirrors_hf_attributes():
    config = tiny_config()
    config.rms_norm_eps = 1e-5
    mixer, reference = GatedDeltaNet.from_config(config, layer_idx=2), hf.Qwen3NextGatedDeltaNet(config, layer_idx=2)
    for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                 "conv_kernel_size", "layer_idx", "activation", "layer_norm_epsilon", "conv_dim"):
        assert getattr(mixer, name) == getattr(reference, name), name
    assert mixer.norm.variance_epsilon == reference.norm.variance_epsilon == 1e-5
    assert torch.equal(mixer.dt_bias, torch.ones(4))
    A = torch.exp(mixer.A_log)
    assert bool(((A >= 0.01 - 1e-6) & (A <= 16 + 1e-5)).all())
    assert torch.equal(mixer.norm.weight, torch.ones(5))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(linear_num_key_heads=3, linear_num_value_heads=4), "multiple of linear_num_key_heads"),
        (dict(hidden_act="gelu"), "silu"),
    ],
)
def test_constructor_rejects_inconsistent_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(HIDDEN, **kwargs)


@parametrize_with_ids(CASE_ARGS, CASES)
def test_matches_hf_float64(monkeypatch, seq_len, key_heads, value_heads, masked):
    reference, mixer, x, mask = setup_case(seq_len, key_heads, value_heads, masked)
    out = mixer(x, attention_mask=mask)
    assert out.shape == x.shape and out.dtype == torch.float64
    # HF unchanged (fp32 delta rule, norm and exp(A_log) inside).
    assert_rel_close(out, reference(x, attention_mask=mask), 1e-5, "output vs HF's torch path")
    exact_hf(monkeypatch)
    assert_rel_close(out, reference(x, attention_mask=mask), 1e-11, "output vs HF in float64")


@parametrize_with_ids(CASE_ARGS, CASES)
def test_matches_hf_float32(seq_len, key_heads, value_heads, masked):
    reference, mixer, x, mask = setup_case(seq_len, key_heads, value_heads, masked, dtype=torch.float32)
    out = mixer(x, attention_mask=mask)
    assert out.dtype == torch.float32
    assert_rel_close(out, reference(x, attention_mask=mask), 2e-5, "output vs HF's torch path")


@parametrize_with_ids(CASE_ARGS, CASES[1:])
def test_gradients_match_hf_float64(monkeypatch, seq_len, key_heads, value_heads, masked):
    reference, mixer, x, mask = setup_case(seq_len, key_heads, value_heads, masked)
    exact_hf(monkeypatch)
    x_tk, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = mixer(x_tk, attention_mask=mask), reference(x_hf, attention_mask=mask)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert_rel_close(x_tk.grad, x_hf.grad, 1e-10, "grad of hidden_states")
    reference_params = dict(reference.named_parameters())
    for name, p in mixer.named_parameters():
        assert p.grad is not None, name
        assert_rel_close(p.grad, reference_params[name].grad, 1e-10, f"grad of {name}")


def test_bf16_matches_hf():
    """bf16 weights and activations: the same roundings as HF's path where both round (projections, conv, the
    delta rule's output), fp32 inside the rule."""
    reference, mixer, x, mask = setup_case(40, 2, 4, True, dtype=torch.bfloat16)
    expected = reference(x, attention_mask=mask)
    out = mixer(x, attention_mask=mask)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, expected, 2e-2, "output vs HF's torch path")


def test_calls_the_tk_ops():
    _, mixer, x, mask = setup_case(17, 2, 4, True, dtype=torch.float32)
    with RecordTkCalls() as record:
        mixer(x, attention_mask=mask).sum().backward()
    for op in ("linear",) + TK_OPS:
        assert op in record.calls, op
    # The conv reads the concatenated projections as a (B, L, conv_dim) tensor transposed: channel-last, no copy.
    (x_conv, *_), = record.calls["causal_conv1d"]
    assert x_conv.stride(1) == 1 and x_conv.shape[1] == mixer.conv_dim


@pytest.mark.parametrize("name", ["cache_params", "cache"])
def test_cache_is_refused(name):
    config = tiny_config()
    mixer = GatedDeltaNet.from_config(config, layer_idx=0)
    with pytest.raises(NotImplementedError, match="full sequences"):
        mixer(torch.randn(1, 4, HIDDEN), **{name: transformers.DynamicCache(config=config)})


def test_packed_sequences_are_refused():
    mixer = GatedDeltaNet.from_config(tiny_config(), layer_idx=0)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        mixer(torch.randn(1, 4, HIDDEN), cu_seq_lens_q=torch.tensor([0, 2, 4], dtype=torch.int32))


def test_compile_fullgraph():
    config = tiny_config()
    mixer = tk_copy(hf_mixer(config, torch.float32), config)
    x = torch.randn(2, 19, HIDDEN, requires_grad=True)
    check_compile_fullgraph(
        lambda x, mask: mixer(x, attention_mask=mask), [x, left_padding_mask(2, 19)],
        ["causal_conv1d", "gated_delta_rule", "gated_delta_rule_bwd"], loss=lambda out: out.square().sum(), tol=1e-5,
    )


# ------------------------------------------------------------------------------------ the switch


@pytest.fixture
def unpatched():
    """Every test of the switch starts and ends with HF's own Qwen3NextGatedDeltaNet.forward."""
    original = hf.Qwen3NextGatedDeltaNet.forward
    tk_transformers.undo_tk_kernels_for_qwen3_next()
    assert hf.Qwen3NextGatedDeltaNet.forward is original
    yield original
    tk_transformers.undo_tk_kernels_for_qwen3_next()
    hf.Qwen3NextGatedDeltaNet.forward = original


def tiny_model(dtype=torch.float32) -> Qwen3NextForCausalLM:
    model = Qwen3NextForCausalLM(tiny_config()).to(dtype)
    for layer in LINEAR_LAYERS:
        randomize(model.model.layers[layer].linear_attn)
    return model


def logits_and_grads(model, input_ids, attention_mask=None):
    model.zero_grad()
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_tk_calls(record) -> None:
    for op in TK_OPS:
        assert len(record.calls.get(op, ())) == len(LINEAR_LAYERS), op  # one per linear-attention layer


def check_switch_against_unpatched(model, batch, length, switched_model, logits_tol, grads_tol):
    """Logits and parameter gradients of ``model`` on a left-padded batch, before and after
    apply_tk_kernels_to_qwen3_next(switched_model) (the switched run on the tk ops)."""
    input_ids = torch.randint(0, 64, (batch, length))
    mask = left_padding_mask(batch, length)
    expected_logits, expected_grads = logits_and_grads(model, input_ids, mask)
    tk_transformers.apply_tk_kernels_to_qwen3_next(switched_model)
    with RecordTkCalls() as record:
        logits, grads = logits_and_grads(model, input_ids, mask)
    check_tk_calls(record)
    assert_rel_close(logits, expected_logits, logits_tol, "logits")
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert_rel_close(grad, expected_grads[name], grads_tol, f"grad of {name}")


@pytest.mark.parametrize("scope", ["class", "model"])
def test_switch_matches_unpatched_model(unpatched, scope):
    model = tiny_model()
    check_switch_against_unpatched(model, 3, 21, model if scope == "model" else None, 1e-5, 1e-4)


def test_switch_matches_unpatched_model_float64(unpatched, monkeypatch):
    """HF's own model around the mixers (RMSNorms, attention, MLPs) is the same code in both runs; its mixers
    in float64 (exact_hf) against the switched ones."""
    model = tiny_model(torch.float64)
    exact_hf(monkeypatch)
    check_switch_against_unpatched(model, 2, 19, None, 1e-10, 1e-9)


def test_switch_matches_hf_torch_path_float64(unpatched):
    """Against HF's own, unmodified torch path (its delta rule and gated norm in fp32: fp32-level tolerances)."""
    model = tiny_model(torch.float64)
    input_ids = torch.randint(0, 64, (3, 21))
    mask = left_padding_mask(3, 21)
    expected_logits, expected_grads = logits_and_grads(model, input_ids, mask)
    tk_transformers.apply_tk_kernels_to_qwen3_next()
    logits, grads = logits_and_grads(model, input_ids, mask)
    assert_rel_close(logits, expected_logits, 1e-6, "logits")
    for name, grad in grads.items():
        assert_rel_close(grad, expected_grads[name], 1e-5, f"grad of {name}")


def test_switch_scopes_idempotence_and_undo(unpatched):
    original = unpatched
    model, other = tiny_model(), tiny_model()
    mixers = [model.model.layers[layer].linear_attn for layer in LINEAR_LAYERS]
    parameters = [(name, p.data_ptr()) for name, p in other.named_parameters()]
    tk_transformers.apply_tk_kernels_to_qwen3_next(model)
    tk_transformers.apply_tk_kernels_to_qwen3_next(model)
    assert hf.Qwen3NextGatedDeltaNet.forward is original
    assert tk_transformers.is_tk_kernels_applied_to_qwen3_next(model)
    assert not tk_transformers.is_tk_kernels_applied_to_qwen3_next(other)
    assert not tk_transformers.is_tk_kernels_applied_to_qwen3_next()
    tk_transformers.undo_tk_kernels_for_qwen3_next(model)
    assert all("forward" not in vars(mixer) for mixer in mixers)
    assert not tk_transformers.is_tk_kernels_applied_to_qwen3_next(model)

    tk_transformers.apply_tk_kernels_to_qwen3_next()
    tk_transformers.apply_tk_kernels_to_qwen3_next()
    assert hf.Qwen3NextGatedDeltaNet.forward is not original
    assert tk_transformers.is_tk_kernels_applied_to_qwen3_next()
    assert tk_transformers.is_tk_kernels_applied_to_qwen3_next(other)
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2()
    input_ids = torch.randint(0, 64, (1, 9))
    with RecordTkCalls() as record:
        other(input_ids, use_cache=False)
    assert len(record.calls["gated_delta_rule"]) == len(LINEAR_LAYERS)
    tk_transformers.undo_tk_kernels_for_qwen3_next()
    tk_transformers.undo_tk_kernels_for_qwen3_next()
    assert hf.Qwen3NextGatedDeltaNet.forward is original
    assert not tk_transformers.is_tk_kernels_applied_to_qwen3_next()
    with RecordTkCalls() as record:
        other(input_ids, use_cache=False)
    assert record.calls == {}
    # The parameters are the model's own: nothing was copied or re-registered.
    assert [(name, p.data_ptr()) for name, p in other.named_parameters()] == parameters

    with pytest.raises(ValueError, match="no transformers Qwen3NextGatedDeltaNet"):
        tk_transformers.apply_tk_kernels_to_qwen3_next(torch.nn.Linear(2, 2))


def test_switch_refuses_unsupported_transformers(unpatched, monkeypatch):
    monkeypatch.setattr(tk_transformers, "_installed_transformers_version", lambda: "5.16.1")
    with pytest.raises(ImportError, match="transformers 5.16.1 is installed; .*>=5.17.0,<6"):
        tk_transformers.apply_tk_kernels_to_qwen3_next()
    assert not tk_transformers.is_tk_kernels_applied_to_qwen3_next()


def output_cache(output):
    """The model output's cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def cached_states(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[layer_idx]
    assert layer.has_previous_state[0]
    return layer.conv_states[0], layer.recurrent_states[0]


def decode(model, input_ids, next_tokens):
    """A prefill of input_ids with a cache, then one step per column of next_tokens: the logits of each call
    and the cache after the prefill's states (cloned: decode steps update them in place)."""
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids, use_cache=True)
    cache = output_cache(out)
    prefill_states = {layer: tuple(t.clone() for t in cached_states(cache, layer)) for layer in LINEAR_LAYERS}
    logits = [out.logits]
    for step in range(next_tokens.shape[1]):
        out = model(next_tokens[:, step : step + 1], use_cache=True, **{cache_argument: cache})
        logits.append(out.logits)
    return logits, prefill_states


def test_switch_prefill_cache_and_decode(unpatched):
    """Eval with a cache: the prefill runs the tk ops and fills the cache as HF does (conv and recurrent
    states); decode steps run HF's code from that cache and give HF's logits."""
    model = tiny_model().eval()
    input_ids, next_tokens = torch.randint(0, 64, (2, 11)), torch.randint(0, 64, (2, 4))
    with torch.no_grad():
        expected_logits, expected_states = decode(model, input_ids, next_tokens)
        tk_transformers.apply_tk_kernels_to_qwen3_next()
        with RecordTkCalls() as record:
            logits, states = decode(model, input_ids, next_tokens)
    assert len(record.calls["gated_delta_rule"]) == len(LINEAR_LAYERS)  # the prefill only
    for layer in LINEAR_LAYERS:
        (conv, recurrent), (expected_conv, expected_recurrent) = states[layer], expected_states[layer]
        assert recurrent.dtype == expected_recurrent.dtype == torch.float32
        assert_rel_close(conv, expected_conv, 1e-6, f"conv state {layer}")
        assert_rel_close(recurrent, expected_recurrent, 1e-5, f"recurrent state {layer}")
    for step, (got, want) in enumerate(zip(logits, expected_logits, strict=True)):
        assert_rel_close(got, want, 1e-5, f"logits of call {step}")


def test_switch_compile_fullgraph(unpatched):
    config = tiny_config()
    mixer = hf_mixer(config, torch.float32)
    tk_transformers.apply_tk_kernels_to_qwen3_next()
    x = torch.randn(2, 19, HIDDEN, requires_grad=True)
    check_compile_fullgraph(
        lambda x: mixer(x), [x], ["causal_conv1d", "gated_delta_rule"], loss=lambda out: out.square().sum(), tol=1e-5
    )
