"""tk.mamba2_ssd's inputs (tests/op_db.py and tests/test_mamba2_ssd.py)."""

from __future__ import annotations

import torch

import tk_ops

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
