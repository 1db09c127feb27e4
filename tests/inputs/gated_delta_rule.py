"""tk.gated_delta_rule's inputs and its float64 definition (tests/op_db.py and tests/test_gated_delta_rule.py)."""

from __future__ import annotations

import torch

import tk_ops

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
L2NORM_EPS = 1e-6


def make_inputs(B, T, Hk, Hv, K, V, *, initial=False, states=None, dtype=torch.float64, gate_dtype=None,
                device="cpu"):
    """Inputs by name (initial_state None unless ``initial``; ``states`` of them, default B). q ~ N(0, 1);
    k ~ N(0, 1 / K), so that beta k k^T stays a contraction; g = log decays in (-0.5, 0); beta in (0.05, 0.95);
    the initial state fp32 (fp64 for fp64 inputs)."""
    gate_dtype = gate_dtype or dtype
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(
        q=torch.randn(B, T, Hk, K, device=device).to(dtype),
        k=(torch.randn(B, T, Hk, K, device=device) / K**0.5).to(dtype),
        v=torch.randn(B, T, Hv, V, device=device).to(dtype),
        g=(-0.5 * torch.rand(B, T, Hv, device=device)).to(gate_dtype),
        beta=(0.05 + 0.9 * torch.rand(B, T, Hv, device=device)).to(gate_dtype),
        initial_state=(torch.randn(states or B, Hv, K, V, device=device).to(state_dtype) if initial else None),
    )


def call(inputs, *, cu_seqlens=None, use_qk_l2norm=False, scale=None):
    """tk_ops.gated_delta_rule on ``inputs`` (by name), returning (o, final_state)."""
    return tk_ops.gated_delta_rule(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale=scale,
        initial_state=inputs["initial_state"], output_final_state=True, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
    )


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _one_sequence(q, k, v, g, beta, scale, state):
    """q, k, v, g, beta of one batch row (T, H, ...) with q, k already per value head; state (H, K, V)."""
    identity = torch.eye(k.shape[-1], dtype=torch.float64, device=k.device)
    outputs = []
    for t in range(q.shape[0]):
        k_t, b_t = k[t], beta[t][:, None, None]
        transition = torch.exp(g[t])[:, None, None] * (identity - b_t * k_t[:, :, None] * k_t[:, None, :])
        state = transition @ state + b_t * k_t[:, :, None] * v[t][:, None, :]
        outputs.append(scale * (state.mT @ q[t][:, :, None])[..., 0])
    out = torch.stack(outputs) if outputs else v.new_zeros(v.shape)
    return out, state


def recurrence(inputs, *, cu_seqlens=None, use_qk_l2norm=False, scale=None):
    """The definition, one token at a time in float64: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} +
    beta_t k_t v_t^T, o_t = scale S_t^T q_t, value head h reading key head h // (Hv / Hk); with cu_seqlens each
    packed sequence from its own initial state. Differentiable (autograd through the loop). Returns
    (o, final states)."""
    q, k, v, g, beta = (inputs[name].double() for name in NAMES[:5])
    if use_qk_l2norm:
        q, k = _l2_normalised(q), _l2_normalised(k)
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2:]
    q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    scale = K**-0.5 if scale is None else scale
    rows = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [
        (0, start, stop) for start, stop in zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:])
    ]
    initial = inputs["initial_state"]
    outputs, finals = [], []
    for n, (b, start, stop) in enumerate(rows):
        state = q.new_zeros(Hv, K, V) if initial is None else initial[n].double()
        out, state = _one_sequence(*(t[b, start:stop] for t in (q, k, v, g, beta)), scale, state)
        outputs.append(out)
        finals.append(state)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
    return o, torch.stack(finals)
