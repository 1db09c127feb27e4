"""models.based, models.mamba2 and models.hyena: the tk path against the pure-PyTorch reference path
(on CPU the tk ops run their references, so this checks the wiring), the FLOP counts, and Mamba-2
against Hugging Face's Mamba2ForCausalLM (a tiny random one built from a config; skips without
transformers)."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from models.based import BasedConfig, BasedForCausalLM
from models.hyena import HyenaConfig, HyenaForCausalLM
from models.mamba2 import Mamba2Config, Mamba2ForCausalLM
from tk_testing import RecordTkCalls, assert_rel_close

try:
    import transformers
except ImportError:  # a test dependency
    transformers = None

VOCAB, BATCH, SEQ_LEN = 101, 3, 13

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def based(reference: bool) -> BasedForCausalLM:
    """A hybrid: block 1 of 2 is full attention."""
    config = BasedConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=83, num_hidden_layers=2, num_heads=3,
        attention_every=2, num_attention_heads=4, num_key_value_heads=2, reference=reference,
    )  # fmt: skip
    return BasedForCausalLM(config)


# odd sizes, 2 groups, a sequence of 1 full chunk and a partial one
MAMBA2 = dict(
    vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_heads=6, head_dim=8, state_size=8, n_groups=2,
    chunk_size=8,
)


def mamba2(reference: bool, **overrides) -> Mamba2ForCausalLM:
    return Mamba2ForCausalLM(Mamba2Config(**{**MAMBA2, **overrides}, reference=reference))


def hyena(reference: bool) -> HyenaForCausalLM:
    """Filters of 16 taps: longer than the sequence (SEQ_LEN = 13)."""
    config = HyenaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=41, num_hidden_layers=2, filter_width=16,
        filter_frequencies=3, max_position_embeddings=16, reference=reference,
    )  # fmt: skip
    return HyenaForCausalLM(config)


# model factory, the tk ops its tk path must call
MODELS = {
    "based": (based, {"based_attention", "based_attention_bwd", "attention", "rms_norm", "linear_bwd"}),
    "mamba2": (mamba2, {"mamba2_ssd", "causal_conv1d", "causal_conv1d_bwd", "rms_norm", "linear_bwd"}),
    "hyena": (hyena, {"fftconv", "causal_conv1d", "causal_conv1d_bwd", "rms_norm", "linear_bwd"}),
}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN))


def _loss_and_grads(model, ids, targets):
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tk_path_matches_reference_path_in_float64(name):
    make, expected_ops = MODELS[name]
    tk_model = make(reference=False).double()
    reference_model = make(reference=True).double()
    reference_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(), tokens()
    targets[0, :4] = -100
    with RecordTkCalls() as recorded:
        tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets)
    reference_loss, reference_grads = _loss_and_grads(reference_model, ids, targets)
    assert_rel_close(tk_loss, reference_loss, 1e-12, "loss")
    for key, grad in reference_grads.items():
        torch.testing.assert_close(tk_grads[key], grad, rtol=1e-9, atol=1e-14, msg=f"grad of {key}")
    assert expected_ops <= recorded.calls.keys()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_reference_path_calls_no_tk_op(name):
    model = MODELS[name][0](reference=True)
    with RecordTkCalls() as recorded:
        model(tokens(), tokens()).backward()
    assert not recorded.calls


def test_based_flops_per_token_counts_every_linear_and_the_mixers():
    model = based(reference=True)
    c = model.config
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    features = 1 + 16 + 16 * 17 // 2
    linear_attention = c.num_heads * 4 * features * (c.hidden_size // c.num_heads + 1)  # block 0
    attention = c.num_attention_heads * 2 * 100 * c.head_dim  # block 1
    assert model.flops_per_token(100) == pytest.approx(3 * (2 * linear_params + linear_attention + attention))


def test_mamba2_flops_per_token_counts_every_linear_conv_and_ssd():
    model = mamba2(reference=True)
    c = model.config
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    conv = 2 * c.conv_kernel * (2 * c.hidden_size + 2 * c.n_groups * c.state_size)
    ssd = c.num_heads * 4 * c.head_dim * c.state_size
    assert model.flops_per_token(100) == pytest.approx(3 * (2 * linear_params + c.num_hidden_layers * (conv + ssd)))


def test_hyena_flops_per_token_counts_the_per_token_linears_and_convolutions():
    model = hyena(reference=True)
    c = model.config
    filters = {
        id(inner) for f in model.modules() if isinstance(f, tk_ops.nn.ImplicitLongFilter) for inner in f.modules()
    }
    linear_params = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in filters
    )
    convolutions = 2 * 3 * 3 * c.hidden_size + c.hidden_size * (10 * 8 + 6)  # short (W = 3), long (2N = 256)
    assert model.flops_per_token(128) == pytest.approx(
        3 * (2 * linear_params + c.num_hidden_layers * convolutions)
    )


def test_hyena_keeps_the_implicit_filters_initialisation():
    """The model's N(0, 0.02) init would flatten the filters' sine MLPs: they keep nn.Linear's default."""
    first_layer = hyena(reference=False).blocks[0].mixer.long_conv.implicit_filter.mlp[0]
    bound = 1 / first_layer.in_features**0.5
    assert first_layer.weight.abs().max() <= bound and first_layer.weight.std() > 0.5 * bound


@torch.no_grad()
def randomize_ssm_parameters(model: torch.nn.Module) -> None:
    """A_log, dt_bias, D and the norms away from their initial values (which would hide mix-ups)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5 - 1.0)
        elif name.endswith(".D") or "norm" in name:
            p.copy_(1 + 0.2 * torch.randn_like(p))


@pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_mamba2_loads_hf_state_dict_and_matches_logits(tied, reference):
    hf_config = transformers.Mamba2Config(**MAMBA2, tie_word_embeddings=tied)
    hf = transformers.Mamba2ForCausalLM(hf_config).eval()
    randomize_ssm_parameters(hf)
    ours = Mamba2ForCausalLM(Mamba2Config.from_hf(hf_config, reference=reference)).eval()
    assert ours.config.tie_word_embeddings == tied
    hf_state = hf.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}
    ours.load_state_dict(hf_state)
    ids = torch.randint(0, VOCAB, (BATCH, 21))
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")


@pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")
def test_mamba2_state_dict_loads_into_hf():
    ours = mamba2(reference=False).eval()
    randomize_ssm_parameters(ours)
    hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**ours.config.to_hf_dict())).eval()
    hf.load_state_dict(ours.state_dict())
    ids = tokens()
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
    assert Mamba2Config.from_hf(hf.config) == ours.config
