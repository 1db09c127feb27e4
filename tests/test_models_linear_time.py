"""models.based, models.mamba2 and models.hyena: the tk path against the pure-PyTorch reference path
(on CPU the tk ops run their references, so this checks the wiring), the FLOP counts, and Mamba-2
against Hugging Face's Mamba2ForCausalLM (a tiny random one built from a config; skips without
transformers)."""

from __future__ import annotations

import pytest
import torch

from models.based import BasedConfig, BasedForCausalLM
from tk_testing import RecordTkCalls, assert_rel_close

VOCAB, BATCH, SEQ_LEN = 101, 3, 13

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def based(reference: bool) -> BasedForCausalLM:
    """A hybrid: block 1 of 2 is full attention."""
    config = BasedConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=83, num_hidden_layers=2, num_heads=3,
        attention_every=2, num_attention_heads=4, num_key_value_heads=2, reference=reference,
    )  # fmt: skip
    return BasedForCausalLM(config)


# model factory, the tk ops its tk path must call
MODELS = {
    "based": (based, {"based_attention", "based_attention_bwd", "attention", "rms_norm", "linear_bwd"}),
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
