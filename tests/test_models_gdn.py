"""models.gdn, the Qwen3-Next-style hybrid: the tk path against the pure-PyTorch reference path in float64
(on CPU the tk ops run their references, so this checks the wiring), the reference path's delta rule
against tk.gated_delta_rule, the 3:1 layout, the FLOP count, and the state_dict against Hugging Face's
Qwen3NextForCausalLM without experts (a tiny random one built from ``GDNConfig.to_hf_dict``; skips
without transformers). Training, resume and checkpoints: tests/test_train.py."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from models.gdn import GatedAttention, GatedDeltaNetMixer, GDNConfig, GDNForCausalLM, reference_gated_delta_rule
from models.presets import PRESETS
from tk_testing import RecordTkCalls, assert_rel_close

try:
    import transformers
except ImportError:  # a test dependency
    transformers = None

VOCAB, BATCH, SEQ_LEN = 101, 3, 13

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# odd sizes: attention heads of 12 channels, 6 of them rotary, GQA; 3 value heads per key head, key and value
# head dims that differ; blocks 0-2 Gated DeltaNet, block 3 attention
GDN = dict(
    vocab_size=VOCAB, hidden_size=40, intermediate_size=83, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=8, linear_value_head_dim=6,
)  # fmt: skip
TK_OPS = {
    "gated_delta_rule", "gated_delta_rule_bwd", "causal_conv1d", "causal_conv1d_bwd", "attention", "attention_bwd",
    "rope_qk", "rope_qk_bwd", "rms_norm", "rms_norm_bwd", "linear_bwd", "linear_cross_entropy",
    "linear_cross_entropy_bwd",
}  # fmt: skip


def gdn(reference: bool, **overrides) -> GDNForCausalLM:
    return GDNForCausalLM(GDNConfig(**{**GDN, **overrides}, reference=reference))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN))


@torch.no_grad()
def randomize_vectors(model: torch.nn.Module) -> None:
    """The norms away from their zero (or one) start and A_log, dt_bias away from theirs: a norm's weight
    read as its scale instead of 1 + weight, or a mixed-up decay, would otherwise go unseen."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5 - 1.0)
        elif "norm" in name:
            p.add_(0.3 * torch.randn_like(p))


def _loss_and_grads(model, ids, targets):
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_tk_path_matches_reference_path_in_float64():
    tk_model = gdn(reference=False).double()
    randomize_vectors(tk_model)
    reference_model = gdn(reference=True).double()
    reference_model.load_state_dict(tk_model.state_dict())
    ids, targets = tokens(), tokens()
    targets[0, :4] = -100
    with torch.no_grad():
        assert_rel_close(tk_model(ids), reference_model(ids), 1e-12, "logits")
    with RecordTkCalls() as recorded:
        tk_loss, tk_grads = _loss_and_grads(tk_model, ids, targets)
    reference_loss, reference_grads = _loss_and_grads(reference_model, ids, targets)
    assert_rel_close(tk_loss, reference_loss, 1e-12, "loss")
    for key, grad in reference_grads.items():
        torch.testing.assert_close(tk_grads[key], grad, rtol=1e-9, atol=1e-14, msg=f"grad of {key}")
    assert TK_OPS <= recorded.calls.keys()


def test_reference_path_calls_no_tk_op():
    model = gdn(reference=True)
    with RecordTkCalls() as recorded:
        model(tokens(), tokens()).backward()
    assert not recorded.calls


def test_reference_delta_rule_is_tk_gated_delta_rule():
    """The recurrence of the reference path and the op's chunked reference, with grouped heads and
    decays and steps far from 0 and 1, across more than one of the op's chunks."""
    batch, seq_len, key_heads, value_heads, key_dim, value_dim = 2, 75, 2, 4, 5, 7
    q, k = (torch.randn(batch, seq_len, key_heads, key_dim, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, seq_len, value_heads, value_dim, dtype=torch.float64)
    g = -torch.rand(batch, seq_len, value_heads, dtype=torch.float64) * 2
    beta = torch.rand(batch, seq_len, value_heads, dtype=torch.float64)
    expected, _ = tk_ops.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    torch.testing.assert_close(reference_gated_delta_rule(q, k, v, g, beta), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("preset", ["nano", "tiny", "1b"])
def test_every_fourth_block_is_attention(preset):
    """Qwen3-Next's layout: blocks 3, 7, 11, ... full attention, the others Gated DeltaNet."""
    with torch.device("meta"):
        model = GDNForCausalLM(GDNConfig(**PRESETS["gdn"][preset].model, vocab_size=VOCAB))
    layers = model.blocks
    assert len(layers) % 4 == 0
    for index, layer in enumerate(layers):
        attention = index % 4 == 3
        mixer = layer.self_attn if attention else layer.linear_attn
        assert isinstance(mixer, GatedAttention if attention else GatedDeltaNetMixer)
        assert hasattr(layer, "linear_attn") != attention


def test_config_refuses_an_odd_rotary_slice():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        GDNConfig(head_dim=12, partial_rotary_factor=0.25)


def test_flops_per_token_counts_every_linear_conv_delta_rule_and_attention():
    model = gdn(reference=True)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    conv = 2 * 4 * (2 * 2 * 8 + 6 * 6)
    delta_rule = 6 * 6 * 8 * 6
    attention = 4 * 2 * 100 * 12  # block 3
    assert model.flops_per_token(100) == pytest.approx(3 * (2 * linear_params + 3 * (conv + delta_rule) + attention))


@pytest.mark.skipif(transformers is None, reason="needs transformers (pip install transformers)")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("reference", [False, True], ids=["tk", "reference"])
def test_state_dict_loads_into_hf_qwen3_next_and_matches_logits(tied, reference):
    ours = gdn(reference=reference, tie_word_embeddings=tied).eval()
    randomize_vectors(ours)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**ours.config.to_hf_dict())).eval()
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    hf_state = hf.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}
    hf.load_state_dict(ours.state_dict())
    ids = tokens()
    with torch.no_grad():
        # HF computes the delta rule and its norms in fp32: the logits agree to fp32 rounding
        assert_rel_close(ours(ids), hf(ids).logits, 1e-5, "logits")
