"""models.based, models.mamba2 and models.hyena: the tk path against the pure-PyTorch reference path
(on CPU the tk ops run their references, so this checks the wiring) and against the peer path (on
CPU with fakes of fla and mamba_ssm, tests/fake_peers; torch.fft for Hyena), the FLOP counts, and
Mamba-2 against Hugging Face's Mamba2ForCausalLM (a tiny random one built from a config; skips
without transformers).

HF's gated norm normalises per group of intermediate_size // n_groups channels, as models.mamba2
(and mamba_ssm) do, only from transformers 5.23; before, over all intermediate channels whatever
n_groups. On those releases the comparisons with n_groups > 1 give HF's norms the per-group
normalisation (``per_group_hf_norms``) and check that without it the logits differ."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import tk_ops
from models import peers
from models.based import BasedConfig, BasedForCausalLM
from models.hyena import HyenaConfig, HyenaForCausalLM
from models.mamba2 import Mamba2Config, Mamba2ForCausalLM
from tk_testing import RecordTkCalls, assert_rel_close, hf_gated_norm_per_group, rel_err, requires_cuda

try:
    import transformers
except ImportError:  # a test dependency
    transformers = None

VOCAB, BATCH, SEQ_LEN = 101, 3, 13

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


BASED = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=83, num_hidden_layers=2, num_heads=3, attention_every=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def based(reference: bool, **overrides) -> BasedForCausalLM:
    """A hybrid: block 1 of 2 is full attention."""
    return BasedForCausalLM(BasedConfig(**{**BASED, **overrides}, reference=reference))


# odd sizes, 2 groups, a sequence of 1 full chunk and a partial one
MAMBA2 = dict(
    vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_heads=6, head_dim=8, state_size=8, n_groups=2,
    chunk_size=8,
)


def mamba2(reference: bool, **overrides) -> Mamba2ForCausalLM:
    return Mamba2ForCausalLM(Mamba2Config(**{**MAMBA2, **overrides}, reference=reference))


def hyena(reference: bool, **overrides) -> HyenaForCausalLM:
    """Filters of 16 taps: longer than the sequence (SEQ_LEN = 13)."""
    config = HyenaConfig(
        **{"vocab_size": VOCAB, "hidden_size": 24, "intermediate_size": 41, "num_hidden_layers": 2, "filter_width": 16,
           "filter_frequencies": 3, "max_position_embeddings": 16, **overrides},
        reference=reference,
    )  # fmt: skip
    return HyenaForCausalLM(config)


# model factory, the tk ops its tk path must call (the training loss: the shared head's linear_cross_entropy)
LOSS_OPS = {"linear_cross_entropy", "linear_cross_entropy_bwd"}
MODELS = {
    "based": (based, {"based_attention", "based_attention_bwd", "attention", "rms_norm", "linear_bwd", *LOSS_OPS}),
    "mamba2": (mamba2, {"mamba2_ssd", "causal_conv1d", "causal_conv1d_bwd", "rms_norm", "linear_bwd", *LOSS_OPS}),
    "hyena": (hyena, {"fftconv", "causal_conv1d", "causal_conv1d_bwd", "rms_norm", "linear_bwd", *LOSS_OPS}),
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


# the peer calls a forward of each model makes: (number, the arguments recorded by tests/fake_peers)
PEER_CALLS = {
    "based": (1, {"q": (BATCH, SEQ_LEN, 3, 16), "k": (BATCH, SEQ_LEN, 3, 16), "v": (BATCH, SEQ_LEN, 3, 16),
                  "scale": 0.25, "use_norm": True}),  # (B, N, H, F): fla's layout; block 1 is attention
    "mamba2": (2, {"x": (BATCH, SEQ_LEN, 6, 8), "B": (BATCH, SEQ_LEN, 2, 8), "chunk_size": 8, "dt_softplus": True,
                   "dt_limit": (0.0, float("inf"))}),
    "hyena": (0, None),  # torch.fft, the reference path's own
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_peer_path_matches_tk_path_in_float64(name, fake_peers):
    """The same weights on the peer path (the fakes of fla and mamba_ssm, written from the peers'
    contracts; torch.fft for Hyena) give the tk path's loss and gradients, and call the peer op once
    per mixer with the peer's layout and arguments."""
    make = MODELS[name][0]
    tk_model = make(reference=False).double()
    randomize_ssm_parameters(tk_model)
    peer_model = make(reference=True, peer=True).double()
    peer_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(), tokens()
    tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets)
    with RecordTkCalls() as recorded:
        peer_loss, peer_grads = _loss_and_grads(peer_model, ids, targets)
    assert not recorded.calls
    assert_rel_close(peer_loss, tk_loss, 1e-12, "loss")
    for key, grad in tk_grads.items():
        torch.testing.assert_close(peer_grads[key], grad, rtol=1e-9, atol=1e-14, msg=f"grad of {key}")
    count, arguments = PEER_CALLS[name]
    assert fake_peers.get(name, []) == [arguments] * count


@pytest.mark.parametrize("name", ["based", "mamba2"])
def test_compiled_peer_model_runs_the_peer_op_as_shipped(name, fake_peers):
    """Under torch.compile the peer op is called, not traced (Dynamo would re-compile the peer's own
    Triton kernels): every mixer holds the op behind torch.compiler.disable, the fakes record one call
    per mixer per forward, and the loss is the eager one."""
    make = MODELS[name][0]
    peer_model = make(reference=True, peer=True).double()
    randomize_ssm_parameters(peer_model)
    ids, targets = tokens(), tokens()
    eager_loss, _ = _loss_and_grads(peer_model, ids, targets)
    fake_peers.get(name, []).clear()
    torch._dynamo.reset()
    compiled_loss, _ = _loss_and_grads(torch.compile(peer_model, backend="eager"), ids, targets)
    mixers = [m for m in peer_model.modules() if getattr(m, "peer_attention", None) or getattr(m, "peer_ssd", None)]
    assert mixers and all(getattr(m.peer_attention if name == "based" else m.peer_ssd, "_torchdynamo_disable", False)
                          for m in mixers)
    count, arguments = PEER_CALLS[name]
    assert fake_peers.get(name, []) == [arguments] * count
    assert_rel_close(compiled_loss, eager_loss, 1e-12, "loss")


def test_hyena_peer_model_is_its_reference_model():
    reference_model = hyena(reference=True)
    peer_model = hyena(reference=True, peer=True)
    peer_model.load_state_dict(reference_model.state_dict())
    ids = tokens()
    # The same class, weights and input in the same process: the same computation, the same bits.
    assert torch.equal(peer_model(ids), reference_model(ids))


@pytest.mark.parametrize("name, package", [("based", "fla"), ("mamba2", "mamba_ssm")])
def test_peer_model_without_its_library_says_what_is_missing(name, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # import fails, as where the package is absent
    with pytest.raises(peers.PeerUnavailable, match=f"{package.replace('_', '-')}.*does not import here"):
        MODELS[name][0](reference=True, peer=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_peer_needs_the_reference_path(name):
    with pytest.raises(ValueError, match="peer=True needs reference=True"):
        MODELS[name][0](reference=False, peer=True)


# shapes the peers' Triton kernels and the tk kernels take (head dims 16 / 64, chunk 64)
GPU_VOCAB = 512
GPU_PEER_SHAPES = {
    "based": dict(vocab_size=GPU_VOCAB, hidden_size=256, intermediate_size=512, num_heads=4, num_attention_heads=4,
                  num_key_value_heads=4),
    "mamba2": dict(vocab_size=GPU_VOCAB, hidden_size=256, num_heads=8, head_dim=64, state_size=64, n_groups=1,
                   chunk_size=64),
}  # fmt: skip


@requires_cuda
@pytest.mark.parametrize("name", sorted(GPU_PEER_SHAPES))
def test_real_peer_follows_the_tk_path_in_bf16(name):
    """fla's parallel_based / mamba_ssm's SSD (when they import) on the GPU: the tk path's loss and gradients
    to bf16 rounding."""
    make = MODELS[name][0]
    torch.manual_seed(0)
    with torch.device("cuda"):
        tk_model = make(reference=False, **GPU_PEER_SHAPES[name])
        try:
            peer_model = make(reference=True, peer=True, **GPU_PEER_SHAPES[name])
        except peers.PeerUnavailable as error:
            pytest.skip(str(error))
    randomize_ssm_parameters(tk_model)
    peer_model.load_state_dict(tk_model.state_dict())
    ids, targets = (torch.randint(0, GPU_VOCAB, (2, 256), device="cuda") for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets)
        peer_loss, peer_grads = _loss_and_grads(peer_model, ids, targets)
    assert_rel_close(peer_loss, tk_loss, 2e-3, "loss")
    for key, grad in tk_grads.items():
        assert_rel_close(peer_grads[key], grad, 5e-2, f"grad of {key}")


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


def per_group_hf_norms(hf: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor) -> None:
    """transformers < 5.23 with n_groups > 1: HF's gated norms normalise over all intermediate channels, so
    its logits differ from ours; they are given the per-group normalisation of 5.23 and later (and of
    models.mamba2), in fp32 as HF's, so that the rest can be compared. A no-op where HF already does so."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    mixers = [m for m in hf.modules() if isinstance(m, HFMamba2Mixer)]
    if hf_gated_norm_per_group() or mixers[0].n_groups == 1:
        return
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) > 1e-3, "HF's norm before 5.23 should differ from ours"

    def per_group(norm, hidden_states, gate=None):
        h = hidden_states.float() * F.silu(gate.float())
        groups = h.unflatten(-1, (norm.n_groups, -1))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * groups.flatten(-2).to(hidden_states.dtype)

    for mixer in mixers:
        mixer.norm.n_groups = mixer.n_groups
        mixer.norm.forward = types.MethodType(per_group, mixer.norm)


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
    per_group_hf_norms(hf, ours, ids)
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")


@pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")
def test_mamba2_state_dict_loads_into_hf():
    ours = mamba2(reference=False).eval()
    randomize_ssm_parameters(ours)
    hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**ours.config.to_hf_dict())).eval()
    hf.load_state_dict(ours.state_dict())
    ids = tokens()
    per_group_hf_norms(hf, ours, ids)
    with torch.no_grad():
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
    assert Mamba2Config.from_hf(hf.config) == ours.config
