"""``parallel_based`` as fla-core 0.6.0 documents it, in plain PyTorch: q, k (B, T, H, K), v (B, T, H, V)
(fla's layout, not tk_ops'), scores f(s) = 1 + s + s^2/2 with s = (q * scale) . k and scale defaulting
to K**-0.5, causal, divided by their row sum + 1e-6 when ``use_norm``. Written from the contract, not
from the models' code, so that a wrong layout, scale or epsilon in the peer wiring changes the result.
``CALLS`` records each call's shapes and arguments."""

import torch

CALLS: list[dict] = []


def parallel_based(q, k, v, scale=None, use_norm=True):
    if q.shape[-1] > 128:
        raise AssertionError("only support feature dim up to 128")
    CALLS.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "scale": scale, "use_norm": use_norm})
    if scale is None:
        scale = q.shape[-1] ** -0.5
    s = torch.einsum("bthk,bshk->bhts", q * scale, k)
    weights = (1 + s + s * s / 2).tril()
    out = torch.einsum("bhts,bshv->bthv", weights, v)
    if use_norm:
        out = out / (weights.sum(-1).transpose(1, 2).unsqueeze(-1) + 1e-6)
    return out.to(q.dtype)
