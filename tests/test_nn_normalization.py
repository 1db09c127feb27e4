"""tk_ops.nn.LayerNorm / RMSNorm as drop-ins for torch.nn.LayerNorm / RMSNorm and HF's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from tk_testing import TOLERANCE, assert_rel_close, check_export


class LlamaRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm as transformers writes it (transformers is not installed here)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def randomise_parameters(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(1 + 0.5 * torch.randn_like(parameter))


def assert_same_forward_and_backward(ours, theirs, x, tol):
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours(x_ours), theirs(x_theirs)
    assert out_ours.dtype == out_theirs.dtype and out_ours.shape == out_theirs.shape
    assert_rel_close(out_ours, out_theirs, tol)
    grad = torch.randn_like(out_theirs)
    out_ours.backward(grad)
    out_theirs.backward(grad)
    assert_rel_close(x_ours.grad, x_theirs.grad, tol, "grad input")
    for (name, p_ours), p_theirs in zip(ours.named_parameters(), theirs.parameters()):
        assert_rel_close(p_ours.grad, p_theirs.grad, tol, f"grad {name}")


# (torch module, tk module, constructor arguments)
DROP_IN_CASES = {
    "LayerNorm-C37": (torch.nn.LayerNorm, tk_ops.nn.LayerNorm, dict(normalized_shape=37)),
    "LayerNorm-no-affine": (
        torch.nn.LayerNorm, tk_ops.nn.LayerNorm, dict(normalized_shape=37, elementwise_affine=False)
    ),
    "LayerNorm-no-bias": (torch.nn.LayerNorm, tk_ops.nn.LayerNorm, dict(normalized_shape=37, bias=False)),
    "LayerNorm-multi-dim": (torch.nn.LayerNorm, tk_ops.nn.LayerNorm, dict(normalized_shape=(5, 7), eps=1e-3)),
    "RMSNorm-C37-default-eps": (torch.nn.RMSNorm, tk_ops.nn.RMSNorm, dict(normalized_shape=37)),
    "RMSNorm-eps": (torch.nn.RMSNorm, tk_ops.nn.RMSNorm, dict(normalized_shape=37, eps=1e-5)),
    "RMSNorm-no-affine": (torch.nn.RMSNorm, tk_ops.nn.RMSNorm, dict(normalized_shape=37, elementwise_affine=False)),
    "RMSNorm-multi-dim": (torch.nn.RMSNorm, tk_ops.nn.RMSNorm, dict(normalized_shape=[5, 7], eps=1e-6)),
}


@pytest.mark.parametrize("case", DROP_IN_CASES)
def test_loads_torch_state_dict_and_matches(case):
    torch_module, tk_module, kwargs = DROP_IN_CASES[case]
    theirs = torch_module(**kwargs, dtype=torch.float64)
    randomise_parameters(theirs)
    ours = tk_module(**kwargs, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    shape = (3, 9, *theirs.normalized_shape)
    assert_same_forward_and_backward(ours, theirs, torch.randn(shape, dtype=torch.float64), TOLERANCE[torch.float64])


def test_layer_norm_state_dict_round_trip_and_low_precision():
    ours = tk_ops.nn.LayerNorm(100, eps=1e-6)
    randomise_parameters(ours)
    theirs = torch.nn.LayerNorm(100, eps=1e-6)
    theirs.load_state_dict(ours.state_dict())
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    x = torch.randn(7, 100, dtype=torch.bfloat16)
    assert_rel_close(ours(x), theirs(x), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rms_norm_default_eps_is_torch_s(dtype):
    theirs = torch.nn.RMSNorm(64, dtype=dtype)
    randomise_parameters(theirs)
    ours = tk_ops.nn.RMSNorm(64, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    # Tiny inputs: the eps term decides the result, so a wrong eps (e.g. finfo(bf16).eps) shows.
    x = 1e-3 * torch.randn(5, 64, dtype=dtype)
    assert_rel_close(ours(x), theirs(x), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_loads_hugging_face_llama_state_dict(dtype):
    hf = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    randomise_parameters(hf)
    ours = tk_ops.nn.RMSNorm(96, eps=1e-6, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    assert ours.state_dict().keys() == hf.state_dict().keys() == {"weight"}
    x = torch.randn(2, 11, 96, dtype=dtype)
    # Bit-equal on any machine: ours runs HF's own operations (fp32 pow(2).mean, rsqrt, round, * weight)
    # on the same rows, so both sides sum each row in the same order whatever the CPU.
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    assert_same_forward_and_backward(ours, hf, x, TOLERANCE[dtype])


def test_modules_reject_wrong_trailing_shape():
    with pytest.raises(ValueError, match=r"input must end with normalized_shape \(5, 7\)"):
        tk_ops.nn.LayerNorm((5, 7))(torch.randn(3, 7, 5))
    with pytest.raises(ValueError, match=r"input must end with normalized_shape \(16,\)"):
        tk_ops.nn.RMSNorm(16)(torch.randn(3, 15))


def test_modules_run_tk_ops_under_export():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_norm = tk_ops.nn.LayerNorm(24)
            self.rms_norm = tk_ops.nn.RMSNorm(24)

        def forward(self, x):
            return self.rms_norm(self.layer_norm(x))

    check_export(Block(), (torch.randn(3, 5, 24),), ["layer_norm", "rms_norm"])
