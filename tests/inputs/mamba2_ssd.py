"""tk.mamba2_ssd's inputs (tests/op_db.py and tests/test_mamba2_ssd.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tk_ops
import tk_testing
from tk_ops.ops import mamba2_ssd as mamba2_ssd_module
from tk_testing import assert_rel_close

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")

# Variants the contract lists; L is never a multiple of 16 except in "multiple", and P, N are odd.
CASES = {
    "plain": dict(Bt=2, L=37, H=4, P=5, G=1, N=3, chunk_size=16),
    "all options": dict(
        Bt=2, L=37, H=4, P=5, G=2, N=3, chunk_size=16, D="H", z=True, dt_bias=True, dt_softplus=True, initial=True
    ),
    "D per channel, softplus": dict(
        Bt=1, L=29, H=4, P=3, G=2, N=5, chunk_size=8, D="HP", z=True, dt_softplus=True, initial=True
    ),
    "shorter than a chunk": dict(Bt=2, L=5, H=2, P=3, G=1, N=3, chunk_size=16, D="HP", dt_bias=True),
    "multiple": dict(Bt=1, L=48, H=4, P=3, G=2, N=3, chunk_size=16, initial=True),
}

# The kernel rounds its matmul operands (decayed scores, states) to the input dtype and
# accumulates in fp32: a few roundings more than the output alone.
KERNEL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# The backward rounds a few more operands than the forward (the gated gy, the scores and their
# gradients, the states and their gradient) to the input dtype: in bf16 the reduced grad_A and
# grad_dt_bias come closest (a float64 emulation of the kernels' roundings measured up to 9e-3,
# from the gated gy; every other gradient below 4e-3; fp16 below 1e-3).
BACKWARD_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
GRADIENT_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_inputs(
    Bt, L, H, P, G, N, chunk_size=16, *, D=None, z=False, dt_bias=False, dt_softplus=False, initial=False,
    dtype=torch.float64, param_dtype=None, device="cpu",
):
    """Inputs by name (None when absent) and the dt_softplus flag; steps dt stay in (0.05, 1)."""
    param_dtype = param_dtype or dtype

    def randn(*shape, scale=1.0, to=dtype):
        return (torch.randn(*shape, device=device) * scale).to(to)

    if dt_softplus:
        dt = randn(Bt, L, H, scale=0.5, to=param_dtype) - 1.5
    else:
        dt = (torch.rand(Bt, L, H, device=device) * 0.5 + 0.05).to(param_dtype)
    inputs = dict(
        x=randn(Bt, L, H, P),
        dt=dt,
        A=(-0.3 - torch.rand(H, device=device)).to(param_dtype),
        B=randn(Bt, L, G, N),
        C=randn(Bt, L, G, N),
        D=None if D is None else randn(*((H,) if D == "H" else (H, P)), to=param_dtype),
        z=randn(Bt, L, H, P) if z else None,
        dt_bias=randn(H, scale=0.3, to=param_dtype) if dt_bias else None,
        initial_states=randn(Bt, H, P, N, to=param_dtype) if initial else None,
    )
    return inputs, dt_softplus


def ssd(inputs, dt_softplus, chunk_size):
    return tk_ops.mamba2_ssd(
        inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk_size=chunk_size, D=inputs["D"],
        z=inputs["z"], dt_bias=inputs["dt_bias"], dt_softplus=dt_softplus, initial_states=inputs["initial_states"],
        return_final_states=True,
    )


def recurrence(inputs, dt_softplus):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = (h_t C_t + D x_t) silu(z_t), one step at a time in float64."""
    t64 = {name: None if t is None else t.double() for name, t in inputs.items()}
    x, dt, A, B, C = (t64[name] for name in ("x", "dt", "A", "B", "C"))
    if t64["dt_bias"] is not None:
        dt = dt + t64["dt_bias"]
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=0)
    Bt, L, H, P = x.shape
    heads_per_group = H // B.shape[2]
    B, C = B.repeat_interleave(heads_per_group, 2), C.repeat_interleave(heads_per_group, 2)
    state = t64["initial_states"] if t64["initial_states"] is not None else x.new_zeros(Bt, H, P, B.shape[-1])
    ys = []
    for t in range(L):
        step = dt[:, t, :, None, None]
        state = torch.exp(step * A[:, None, None]) * state + step * x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if t64["D"] is not None:
        y = y + x * (t64["D"] if t64["D"].dim() == 2 else t64["D"][:, None])
    if t64["z"] is not None:
        y = y * F.silu(t64["z"])
    return y, state


def forward_op(inputs, dt_softplus, chunk_size):
    """(y, final_states, chunk_states) of the forward op itself."""
    return torch.ops.tk.mamba2_ssd(
        inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk_size, inputs["D"], inputs["z"],
        inputs["dt_bias"], dt_softplus, inputs["initial_states"],
    )


def reference_chunk_states(inputs, dt_softplus, chunk_size):
    """The op's chunked reference in float64: the state entering each chunk."""
    t64 = {name: None if t is None else t.double() for name, t in inputs.items()}
    return mamba2_ssd_module._mamba2_ssd_reference(
        t64["x"], t64["dt"], t64["A"], t64["B"], t64["C"], chunk_size, t64["D"], t64["z"], t64["dt_bias"],
        dt_softplus, t64["initial_states"],
    )[2]


def check_kernel_outputs(inputs, softplus, chunk_size, dtype, outputs=None):
    y, final, chunks = forward_op(inputs, softplus, chunk_size) if outputs is None else outputs
    want_y, want_final = recurrence(inputs, softplus)
    L = inputs["x"].shape[1]
    assert y.dtype == dtype and final.dtype == torch.float32 and chunks.dtype == torch.float32
    assert chunks.shape[1] == (L + chunk_size - 1) // chunk_size
    assert_rel_close(y, want_y, KERNEL_TOLERANCE[dtype], "y")
    assert_rel_close(final, want_final, KERNEL_TOLERANCE[dtype], "final_states")
    assert_rel_close(chunks, reference_chunk_states(inputs, softplus, chunk_size), KERNEL_TOLERANCE[dtype],
                     "chunk_states")


def backward_op(inputs, dt_softplus, chunk_size, grad_y, grad_final, chunk_states):
    """The nine gradients of tk.mamba2_ssd_bwd, by name."""
    grads = torch.ops.tk.mamba2_ssd_bwd(
        grad_y, grad_final, inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk_size,
        inputs["D"], inputs["z"], inputs["dt_bias"], dt_softplus, inputs["initial_states"], chunk_states,
    )
    return dict(zip(GRADIENT_NAMES, grads))


def reference_gradients(inputs, dt_softplus, chunk_size, grad_y, grad_final, device):
    """The op's chunked reference backward in float64 on `device`, from its own float64 chunk states."""
    t64 = {name: None if t is None else t.to(device, torch.float64) for name, t in inputs.items()}
    args = [t64[name] for name in ("x", "dt", "A", "B", "C")]
    options = [t64[name] for name in ("D", "z", "dt_bias")]
    _, _, chunk_states = mamba2_ssd_module._mamba2_ssd_reference(
        *args, chunk_size, *options, dt_softplus, t64["initial_states"]
    )
    grads = mamba2_ssd_module._mamba2_ssd_bwd_reference(
        grad_y.to(device, torch.float64), None if grad_final is None else grad_final.to(device, torch.float64),
        *args, chunk_size, *options, dt_softplus, t64["initial_states"], chunk_states,
    )
    return dict(zip(GRADIENT_NAMES, grads))


def backward_errors(inputs, dt_softplus, chunk_size, with_final_grad, reference_device=None, seed=0):
    """{name: relative error} of every gradient the kernels return for these inputs (absent options:
    empty, checked), against the float64 reference; asserts the gradients' dtypes and shapes."""
    x = inputs["x"]
    gen = torch.Generator(device=x.device).manual_seed(seed)
    _, final, chunk_states = forward_op(inputs, dt_softplus, chunk_size)
    grad_y = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
    grad_final = torch.randn(final.shape, device=x.device, generator=gen) if with_final_grad else None
    got = backward_op(inputs, dt_softplus, chunk_size, grad_y, grad_final, chunk_states)
    want = reference_gradients(inputs, dt_softplus, chunk_size, grad_y, grad_final, reference_device or x.device)
    errors = {}
    for name in GRADIENT_NAMES:
        if inputs[name] is None:
            assert got[name].numel() == 0, f"grad_{name} of an absent input"
            continue
        dtype = torch.float32 if name in ("A", "dt_bias") else inputs[name].dtype
        assert got[name].dtype == dtype and got[name].shape == inputs[name].shape, name
        errors[name] = tk_testing.rel_err(got[name], want[name])
    return errors
