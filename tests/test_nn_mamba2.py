"""tk_ops.nn.Mamba2Mixer and tk_ops.transformers.apply_tk_kernels_to_mamba2 against Hugging Face's Mamba2 (CPU).

HF's torch path computes its SSD (and A = -exp(A_log.float())) and its gated norm in fp32 whatever
the model dtype. The float64 comparisons therefore run HF's mixer with those two pieces replaced
by float64 equivalents written here (a sequential, step-by-step scan: an algorithm independent of
the chunked one in tk.mamba2_ssd, and the gated norm without the fp32 cast); everything else
(projections, conv, masking, splits, the order of operations) is HF's own code. The unmodified HF
path is compared in float32 (and float64) within fp32 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import Mamba2Config, Mamba2ForCausalLM  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as hf  # noqa: E402

import tk_ops  # noqa: E402
import tk_ops.transformers as tk_transformers  # noqa: E402
from tk_ops.nn import Mamba2Mixer  # noqa: E402
from tk_testing import RecordTkCalls, assert_rel_close, check_compile_fullgraph, parametrize_with_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HIDDEN, HEADS, HEAD_DIM, STATE = 16, 4, 8, 8


def tiny_config(**overrides) -> Mamba2Config:
    fields = dict(
        hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, state_size=STATE, n_groups=1, conv_kernel=4,
        expand=2, chunk_size=8, num_hidden_layers=2, vocab_size=64, use_bias=False, use_conv_bias=True,
    )
    fields.update(overrides)
    return Mamba2Config(**fields)


@torch.no_grad()
def randomize(module: torch.nn.Module) -> None:
    """Random parameters of a realistic scale (HF leaves A_log, D and dt_bias uninitialised in a bare mixer)."""
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5 - 1.0)
        elif name.endswith("norm.weight") or name == "D":
            p.copy_(1 + 0.2 * torch.randn_like(p))
        else:
            p.normal_(0, 0.3)


def hf_mixer(config: Mamba2Config, dtype=torch.float64) -> hf.Mamba2Mixer:
    mixer = hf.Mamba2Mixer(config, layer_idx=0).to(dtype)
    randomize(mixer)
    return mixer


def tk_copy(reference: hf.Mamba2Mixer, config: Mamba2Config) -> Mamba2Mixer:
    mixer = Mamba2Mixer.from_config(config, layer_idx=0).to(next(reference.parameters()).dtype)
    mixer.load_state_dict(reference.state_dict(), strict=True)
    return mixer


def left_padding_mask(batch: int, seq_len: int) -> torch.Tensor:
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        mask[b, : (b * seq_len) // (2 * batch)] = 0  # row 0 unpadded, the others padded more and more
    return mask


# ------------------------------------------------------------- float64 reference pieces for HF's mixer


def exact_hf(monkeypatch, mixers) -> None:
    """HF's mixers in float64 throughout: its fp32 SSD (and fp32 A) and fp32 gated norm replaced by
    float64 ones. The scan finds its mixer by the A it is handed (the mixers' A_log must differ)."""
    mixers = list(mixers)

    def sequential_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                        dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, z=None, **kwargs):
        assert z is None and initial_states is None and not return_final_states
        # A lookup: HF computes A by these very operations on the same tensor, so the bits match.
        (mixer,) = [m for m in mixers if torch.equal(-torch.exp(m.A_log.float()), A)]
        A = -torch.exp(mixer.A_log)
        if dt_bias is not None:
            dt = dt + dt_bias
        if dt_softplus:
            dt = F.softplus(dt)
        dt = dt.clamp(dt_limit[0], dt_limit[1])
        batch, seq_len, heads, head_dim = x.shape
        B = B.repeat_interleave(heads // B.shape[2], dim=2)
        C = C.repeat_interleave(heads // C.shape[2], dim=2)
        state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
        ys = []
        for t in range(seq_len):
            step = dt[:, t, :, None, None]
            state = torch.exp(step * A[:, None, None]) * state + step * x[:, t, :, :, None] * B[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
        return torch.stack(ys, dim=1)

    def gated_norm(self, hidden_states, gate=None):
        h = hidden_states * F.silu(gate)
        groups = h.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * groups.flatten(-2)

    monkeypatch.setattr(hf, "mamba2_chunk_scan", sequential_scan)
    monkeypatch.setattr(hf.MambaRMSNormGated, "forward", gated_norm)


# (id, L, n_groups, use_bias, use_conv_bias, chunk_size, masked)
CASES = [
    ("L1", 1, 1, False, True, 8, False),
    ("L17-g2-bias-chunk8", 17, 2, True, True, 8, False),
    ("L17-g1-nobias-chunk17", 17, 1, False, False, 17, False),
    ("L100-g2-convbias-chunk25", 100, 2, False, True, 25, False),
    ("L100-g1-bias-chunk32-leftpad", 100, 1, True, False, 32, True),
    ("L17-g2-chunk4-leftpad", 17, 2, False, True, 4, True),
]
CASE_ARGS = "seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked"


def setup_case(seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked, dtype=torch.float64, **overrides):
    config = tiny_config(n_groups=n_groups, use_bias=use_bias, use_conv_bias=use_conv_bias, chunk_size=chunk_size,
                         **overrides)
    reference = hf_mixer(config, dtype)
    mixer = tk_copy(reference, config)
    x = torch.randn(3, seq_len, HIDDEN, dtype=dtype)
    mask = left_padding_mask(3, seq_len) if masked else None
    return reference, mixer, x, mask


# ------------------------------------------------------------------------------------- the module


def test_state_dicts_load_both_ways():
    config = tiny_config(n_groups=2, use_bias=True)
    reference = hf_mixer(config)
    mixer = Mamba2Mixer.from_config(config, layer_idx=0).double()
    expected = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in mixer.state_dict().items()} == expected
    assert set(expected) == {
        "in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
        "norm.weight", "out_proj.weight", "out_proj.bias",
    }
    mixer.load_state_dict(reference.state_dict(), strict=True)
    randomize(mixer)
    reference.load_state_dict(mixer.state_dict(), strict=True)
    for name, p in mixer.state_dict().items():
        assert torch.equal(p, reference.state_dict()[name]), name


def test_constructor_mirrors_hf_attributes():
    config = tiny_config(n_groups=2, chunk_size=16, layer_norm_epsilon=1e-4, time_step_limit=(0.0, 2.0))
    mixer, reference = Mamba2Mixer.from_config(config, layer_idx=1), hf.Mamba2Mixer(config, layer_idx=1)
    for name in ("hidden_size", "num_heads", "head_dim", "ssm_state_size", "n_groups", "conv_kernel_size",
                 "intermediate_size", "conv_dim", "chunk_size", "use_bias", "use_conv_bias", "activation",
                 "layer_norm_epsilon", "layer_idx"):
        assert getattr(mixer, name) == getattr(reference, name), name
    assert tuple(mixer.time_step_limit) == tuple(reference.time_step_limit)
    assert mixer.norm.group_size == reference.norm.group_size and mixer.norm.variance_epsilon == 1e-4
    # HF's initialisation of the SSM parameters (the same log of the same integers; ones): exact.
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, HEADS + 1)))
    assert torch.equal(mixer.D, torch.ones(HEADS))
    dt = F.softplus(mixer.dt_bias)
    assert bool(((dt > 0.001 - 1e-6) & (dt < 0.1 + 1e-6)).all())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden_size=16, num_heads=3, head_dim=8), "num_heads \\* head_dim"),
        (dict(hidden_size=16, num_heads=4, head_dim=8, n_groups=3), "multiple of n_groups"),
        (dict(hidden_size=16, num_heads=4, head_dim=8, n_groups=1, hidden_act="gelu"), "silu"),
        (dict(hidden_size=16, num_heads=4, head_dim=8, n_groups=1, time_step_limit=(1.0, 0.5)), "time_step_limit"),
    ],
)
def test_constructor_rejects_inconsistent_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Mamba2Mixer(**kwargs)


@parametrize_with_ids(CASE_ARGS, CASES)
def test_matches_hf_float64(monkeypatch, seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked):
    reference, mixer, x, mask = setup_case(seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked)
    out = mixer(x, attention_mask=mask)
    assert out.shape == x.shape and out.dtype == torch.float64
    # HF unchanged (fp32 SSD and norm inside).
    assert_rel_close(out, reference(x, attention_mask=mask), 1e-5, "output vs HF's torch path")
    exact_hf(monkeypatch, [reference])
    assert_rel_close(out, reference(x, attention_mask=mask), 1e-10, "output vs HF in float64")


@parametrize_with_ids(CASE_ARGS, CASES)
def test_matches_hf_float32(seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked):
    reference, mixer, x, mask = setup_case(seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked,
                                           dtype=torch.float32)
    out = mixer(x, attention_mask=mask)
    assert out.dtype == torch.float32
    assert_rel_close(out, reference(x, attention_mask=mask), 2e-5, "output vs HF's torch path")


@parametrize_with_ids(CASE_ARGS, [CASES[0], CASES[1], CASES[3], CASES[4], CASES[5]])
def test_gradients_match_hf_float64(monkeypatch, seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked):
    reference, mixer, x, mask = setup_case(seq_len, n_groups, use_bias, use_conv_bias, chunk_size, masked)
    exact_hf(monkeypatch, [reference])
    x_tk, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = mixer(x_tk, attention_mask=mask), reference(x_hf, attention_mask=mask)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert_rel_close(x_tk.grad, x_hf.grad, 1e-9, "grad of hidden_states")
    reference_params = dict(reference.named_parameters())
    for name, p in mixer.named_parameters():
        assert p.grad is not None, name
        assert_rel_close(p.grad, reference_params[name].grad, 1e-9, f"grad of {name}")


def test_time_step_limit_matches_hf(monkeypatch):
    reference, mixer, x, _ = setup_case(33, 2, False, True, 16, False, time_step_limit=(0.05, 0.4))
    exact_hf(monkeypatch, [reference])
    x_tk, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = mixer(x_tk), reference(x_hf)
    assert_rel_close(out, expected, 1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert_rel_close(x_tk.grad, x_hf.grad, 1e-9, "grad of hidden_states")
    assert_rel_close(mixer.dt_bias.grad, reference.dt_bias.grad, 1e-9, "grad of dt_bias")
    assert_rel_close(mixer.A_log.grad, reference.A_log.grad, 1e-9, "grad of A_log")


def test_left_padding_leaves_real_tokens_unchanged():
    """Without an in_proj bias, padded (zeroed) inputs add nothing: a left-padded row's real tokens get the
    output of the unpadded sequence."""
    config = tiny_config(n_groups=2, use_bias=False, use_conv_bias=True, chunk_size=8)
    mixer = tk_copy(hf_mixer(config), config)
    tokens = torch.randn(1, 13, HIDDEN, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 6, HIDDEN, dtype=torch.float64), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 13, dtype=torch.long)], dim=1)
    out = mixer(padded, attention_mask=mask)
    assert_rel_close(out[:, 6:], mixer(tokens), 1e-12)
    assert_rel_close(mixer(padded, attention_mask=mask.bool()), out, 0)


def test_calls_the_tk_ops():
    reference, mixer, x, mask = setup_case(17, 2, False, True, 8, True, dtype=torch.float32)
    with RecordTkCalls() as record:
        mixer(x, attention_mask=mask).sum().backward()
    for op in ("linear", "causal_conv1d", "mamba2_ssd", "rms_norm", "causal_conv1d_bwd", "mamba2_ssd_bwd"):
        assert op in record.calls, op
    # The conv reads the in_proj output's column slice in place: channel-last, no copy.
    (x_conv, *_), = record.calls["causal_conv1d"]
    assert x_conv.stride(1) == 1 and x_conv.shape[1] == mixer.conv_dim


def test_cache_is_refused():
    config = tiny_config()
    mixer = Mamba2Mixer.from_config(config, layer_idx=0)
    with pytest.raises(NotImplementedError, match="full sequences"):
        mixer(torch.randn(1, 4, HIDDEN), cache_params=transformers.DynamicCache(config=config))


def test_compile_fullgraph():
    config = tiny_config(n_groups=2, use_bias=True, chunk_size=8)
    mixer = tk_copy(hf_mixer(config, torch.float32), config)
    x = torch.randn(2, 19, HIDDEN, requires_grad=True)
    mask = left_padding_mask(2, 19)
    check_compile_fullgraph(
        lambda x, mask: mixer(x, attention_mask=mask), [x, mask], ["causal_conv1d", "mamba2_ssd"],
        loss=lambda out: out.square().sum(), tol=1e-5,
    )


# ------------------------------------------------------------------------------------ the switch


@pytest.fixture
def unpatched():
    """Every test of the switch starts and ends with HF's own Mamba2Mixer.forward."""
    original = hf.Mamba2Mixer.forward
    tk_transformers.undo_tk_kernels_for_mamba2()
    assert hf.Mamba2Mixer.forward is original
    yield original
    tk_transformers.undo_tk_kernels_for_mamba2()
    hf.Mamba2Mixer.forward = original


def tiny_model(dtype=torch.float32, **overrides) -> Mamba2ForCausalLM:
    config = tiny_config(n_groups=2, chunk_size=8, **overrides)
    model = Mamba2ForCausalLM(config).to(dtype)
    for block in model.backbone.layers:
        randomize(block.mixer)
    return model


def logits_and_grads(model, input_ids, attention_mask=None):
    model.zero_grad()
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scope", ["class", "model"])
def test_switch_matches_unpatched_model(unpatched, scope):
    model = tiny_model()
    input_ids = torch.randint(0, 64, (3, 21))
    mask = left_padding_mask(3, 21)
    expected_logits, expected_grads = logits_and_grads(model, input_ids, mask)
    tk_transformers.apply_tk_kernels_to_mamba2(model if scope == "model" else None)
    with RecordTkCalls() as record:
        logits, grads = logits_and_grads(model, input_ids, mask)
    for op in ("causal_conv1d", "mamba2_ssd", "rms_norm", "causal_conv1d_bwd", "mamba2_ssd_bwd"):
        assert len(record.calls.get(op, ())) == 2, op  # one per layer
    assert_rel_close(logits, expected_logits, 1e-5, "logits")
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert_rel_close(grad, expected_grads[name], 1e-4, f"grad of {name}")


def test_switch_matches_unpatched_model_float64(unpatched, monkeypatch):
    model = tiny_model(torch.float64, residual_in_fp32=False)
    exact_hf(monkeypatch, [block.mixer for block in model.backbone.layers])
    input_ids = torch.randint(0, 64, (2, 19))
    mask = left_padding_mask(2, 19)
    expected_logits, expected_grads = logits_and_grads(model, input_ids, mask)
    tk_transformers.apply_tk_kernels_to_mamba2()
    logits, grads = logits_and_grads(model, input_ids, mask)
    assert_rel_close(logits, expected_logits, 1e-10, "logits")
    for name, grad in grads.items():
        assert_rel_close(grad, expected_grads[name], 1e-9, f"grad of {name}")


def test_switch_scopes_idempotence_and_undo(unpatched):
    original = unpatched
    model, other = tiny_model(), tiny_model()
    mixers = [block.mixer for block in model.backbone.layers]
    parameters = [(name, p.data_ptr()) for name, p in other.named_parameters()]
    tk_transformers.apply_tk_kernels_to_mamba2(model)
    tk_transformers.apply_tk_kernels_to_mamba2(model)
    assert hf.Mamba2Mixer.forward is original
    assert tk_transformers.is_tk_kernels_applied_to_mamba2(model)
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2(other)
    tk_transformers.undo_tk_kernels_for_mamba2(model)
    assert all("forward" not in vars(mixer) for mixer in mixers)
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2(model)

    tk_transformers.apply_tk_kernels_to_mamba2()
    tk_transformers.apply_tk_kernels_to_mamba2()
    assert hf.Mamba2Mixer.forward is not original
    assert tk_transformers.is_tk_kernels_applied_to_mamba2()
    assert tk_transformers.is_tk_kernels_applied_to_mamba2(other)
    input_ids = torch.randint(0, 64, (1, 9))
    with RecordTkCalls() as record:
        other(input_ids, use_cache=False)
    assert "mamba2_ssd" in record.calls
    tk_transformers.undo_tk_kernels_for_mamba2()
    tk_transformers.undo_tk_kernels_for_mamba2()
    assert hf.Mamba2Mixer.forward is original
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2()
    with RecordTkCalls() as record:
        other(input_ids, use_cache=False)
    assert record.calls == {}
    # The parameters are the model's own: nothing was copied or re-registered.
    assert [(name, p.data_ptr()) for name, p in other.named_parameters()] == parameters

    with pytest.raises(ValueError, match="no transformers Mamba2Mixer"):
        tk_transformers.apply_tk_kernels_to_mamba2(torch.nn.Linear(2, 2))


def output_cache(output):
    """The model output's cache: ``cache`` from transformers 5.24, ``cache_params`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.cache_params


def test_switch_prefill_cache_and_generate(unpatched):
    """Eval with a cache: the prefill runs the tk ops and fills the cache as HF does; decode steps run
    HF's code; greedy generation gives the same tokens."""
    model = tiny_model().eval()
    input_ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        expected = model(input_ids, use_cache=True)
        expected_tokens = model.generate(input_ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        tk_transformers.apply_tk_kernels_to_mamba2()
        with RecordTkCalls() as record:
            out = model(input_ids, use_cache=True)
        assert len(record.calls["mamba2_ssd"]) == 2
        assert_rel_close(out.logits, expected.logits, 1e-5, "logits")
        for layer in range(2):
            assert_rel_close(output_cache(out).get_conv_state(layer), output_cache(expected).get_conv_state(layer),
                             1e-6, f"conv state {layer}")
            assert_rel_close(output_cache(out).get_recurrent_state(layer),
                             output_cache(expected).get_recurrent_state(layer), 1e-5, f"ssm state {layer}")
        with RecordTkCalls() as record:
            tokens = model.generate(input_ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert len(record.calls["mamba2_ssd"]) == 2  # the prefill only
    # Integer tokens: each greedy step's top-2 logit gap (here >= 5e-3 of the largest logit) is ~10^4
    # times what the two paths' logits differ by, so the argmaxes agree whatever the CPU or BLAS.
    assert torch.equal(tokens, expected_tokens)


def test_switch_compile_fullgraph(unpatched):
    config = tiny_config(n_groups=2, chunk_size=8)
    mixer = hf_mixer(config, torch.float32)
    tk_transformers.apply_tk_kernels_to_mamba2()
    x = torch.randn(2, 19, HIDDEN, requires_grad=True)
    check_compile_fullgraph(
        lambda x: mixer(x), [x], ["causal_conv1d", "mamba2_ssd"], loss=lambda out: out.square().sum(), tol=1e-5
    )
