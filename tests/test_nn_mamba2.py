"""tk_ops.nn.Mamba2Mixer and tk_ops.transformers.apply_tk_kernels_to_mamba2 against Hugging Face's Mamba2 (CPU).

HF's torch path computes its SSD (and A = -exp(A_log.float())) and its gated norm in fp32 whatever
the model dtype. The float64 comparisons therefore run HF's mixer with those two pieces replaced
by float64 equivalents written here (a sequential, step-by-step scan: an algorithm independent of
the chunked one in tk.mamba2_ssd, and the gated norm without the fp32 cast); everything else
(projections, conv, masking, splits, the order of operations) is HF's own code. The unmodified HF
path is compared in float32 (and float64) within fp32 tolerances.

The tests run on whatever transformers is installed (CI: both ends of tk_ops.transformers'
SUPPORTED_TRANSFORMERS). Where releases differ they follow each one's own semantics, known here from
the release number rather than read the way tk_ops reads them: HF's gated norm normalises per group
of I / n_groups channels from 5.23 and over all I channels before (``hf_gated_norm_per_group``).
tk_ops.nn.Mamba2Mixer normalises per group (mamba_ssm's); compared with an older HF mixer it is
given HF's single group (``tk_copy``), so that the comparison checks everything else.
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
import tk_ops.nn.mamba2 as tk_mamba2  # noqa: E402
import tk_ops.transformers as tk_transformers  # noqa: E402
from tk_ops.nn import Mamba2Mixer  # noqa: E402
from tk_testing import (  # noqa: E402
    RecordTkCalls,
    assert_rel_close,
    check_compile_fullgraph,
    hf_gated_norm_per_group,
    parametrize_with_ids,
    rel_err,
)

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


def hf_norm_group_size(config: Mamba2Config) -> int:
    """The channels HF's gated norm normalises together in the installed release."""
    intermediate = config.expand * config.hidden_size
    return intermediate // config.n_groups if hf_gated_norm_per_group() else intermediate


def tk_copy(reference: hf.Mamba2Mixer, config: Mamba2Config) -> Mamba2Mixer:
    """tk_ops.nn.Mamba2Mixer with the reference's parameters and its norm grouping (see the module docstring)."""
    mixer = Mamba2Mixer.from_config(config, layer_idx=0).to(next(reference.parameters()).dtype)
    mixer.load_state_dict(reference.state_dict(), strict=True)
    mixer.norm.group_size = hf_norm_group_size(config)
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
        group_size = self.group_size if hf_gated_norm_per_group() else h.shape[-1]
        groups = h.unflatten(-1, (-1, group_size))
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
    # mamba_ssm's grouping, which HF's gated norm has from transformers 5.23 (before: no group_size, one group)
    assert mixer.norm.group_size == mixer.intermediate_size // 2
    if hf_gated_norm_per_group():
        assert reference.norm.group_size == mixer.norm.group_size
    else:
        assert not hasattr(reference.norm, "group_size")
    assert tk_mamba2.gated_norm_group_size(reference.norm) == hf_norm_group_size(config)
    assert mixer.norm.variance_epsilon == reference.norm.variance_epsilon == 1e-4
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


@pytest.mark.parametrize("name", ["cache_params", "cache"])
def test_cache_is_refused(name):
    """Under either of HF's names for the mixer's cache argument (``cache`` from transformers 5.24)."""
    config = tiny_config()
    mixer = Mamba2Mixer.from_config(config, layer_idx=0)
    with pytest.raises(NotImplementedError, match="full sequences"):
        mixer(torch.randn(1, 4, HIDDEN), **{name: transformers.DynamicCache(config=config)})


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


def test_switch_matches_hf_torch_path_float64(unpatched, monkeypatch):
    """Forward and backward through the switched Hugging Face model in float64 against HF's
    own, unmodified torch path (which runs its SSD and gated norm in fp32, hence fp32-level tolerances), with
    2 norm groups and left padding, on the installed transformers. On 5.17 the switch read the gated norm's
    ``group_size``, which only 5.23 and later have (AttributeError at the first forward). The grouping the
    switch must use differs between releases; with the other one the logits are far outside the tolerance."""
    model = tiny_model(torch.float64, residual_in_fp32=False)
    input_ids = torch.randint(0, 64, (3, 21))
    mask = left_padding_mask(3, 21)
    expected_logits, expected_grads = logits_and_grads(model, input_ids, mask)
    tk_transformers.apply_tk_kernels_to_mamba2()
    with RecordTkCalls() as record:
        logits, grads = logits_and_grads(model, input_ids, mask)
    for op in ("causal_conv1d", "mamba2_ssd", "rms_norm", "causal_conv1d_bwd", "mamba2_ssd_bwd"):
        assert len(record.calls.get(op, ())) == 2, op  # one per layer
    assert_rel_close(logits, expected_logits, 1e-6, "logits")  # HF's lm_head returns fp32 logits
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert_rel_close(grad, expected_grads[name], 1e-5, f"grad of {name}")

    intermediate = model.backbone.layers[0].mixer.intermediate_size
    other_grouping = intermediate if hf_gated_norm_per_group() else intermediate // 2
    monkeypatch.setattr(tk_mamba2, "gated_norm_group_size", lambda norm: other_grouping)
    other_logits, _ = logits_and_grads(model, input_ids, mask)
    assert rel_err(other_logits, expected_logits) > 1e-3


def test_switch_refuses_unsupported_transformers(unpatched, monkeypatch):
    """Outside SUPPORTED_TRANSFORMERS (>=5.17.0,<6) the switch raises ImportError naming the range."""
    assert tk_transformers.check_transformers_version() == transformers.__version__
    model = tiny_model()
    for version in ("5.16.1", "4.57.6", "6.0.0", "6.0.0rc1"):
        monkeypatch.setattr(tk_transformers, "_installed_transformers_version", lambda: version)
        for scope in (None, model):
            with pytest.raises(ImportError, match=f"transformers {version} is installed; .*>=5.17.0,<6"):
                tk_transformers.apply_tk_kernels_to_mamba2(scope)
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2()
    assert not tk_transformers.is_tk_kernels_applied_to_mamba2(model)
    for version in ("5.17.0", "5.24.0", "5.99.1", "5.25.0.dev0"):
        monkeypatch.setattr(tk_transformers, "_installed_transformers_version", lambda: version)
        assert tk_transformers.check_transformers_version() == version

    def missing():
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(tk_transformers, "_installed_transformers_version", missing)
    with pytest.raises(ImportError, match="transformers is not installed; .*pip install 'transformers>=5.17.0,<6'"):
        tk_transformers.apply_tk_kernels_to_mamba2()


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


def cached_states(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's conv and SSM states: the cache layer's first state (``get_conv_state`` /
    ``get_recurrent_state`` from transformers 5.21 read the same)."""
    layer = cache.layers[layer_idx]
    assert layer.has_previous_state[0]
    return layer.conv_states[0], layer.recurrent_states[0]


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
            conv, ssm = cached_states(output_cache(out), layer)
            expected_conv, expected_ssm = cached_states(output_cache(expected), layer)
            assert_rel_close(conv, expected_conv, 1e-6, f"conv state {layer}")
            assert_rel_close(ssm, expected_ssm, 1e-5, f"ssm state {layer}")
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
