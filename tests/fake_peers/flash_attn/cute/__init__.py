"""``flash_attn_func`` as flash-attn-4 4.0.0b36 has it (its signature's first arguments and its return), in
plain PyTorch: q (B, Nq, H, D), k and v (B, Nk, Hkv, D) with H a multiple of Hkv (GQA: each K/V head
serves H / Hkv consecutive query heads), scores scaled by ``softmax_scale`` (D**-0.5 when None),
``causal`` masking keys after a query's position aligned to the bottom right (Nq != Nk), returning
(out (B, Nq, H, D) in q's dtype, lse (B, H, Nq) float32, natural log) and differentiable. Written from
that contract, not from the bench's code, so that a wrong layout, head count or flag in the wiring
changes the result. ``CALLS`` records each call's shapes, flags and q's storage."""

import torch

__version__ = "fake"
CALLS: list[dict] = []


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, **unsupported):
    if qv is not None or gather_kv_indices is not None or learnable_sink is not None or softcap or unsupported:
        raise TypeError("this fake of flash_attn_func takes q, k, v, softmax_scale and causal (the bench passes no other)")
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    if k.shape != (batch, k_len, kv_heads, head_dim) or v.shape != k.shape or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not (B, N, H, D) with H % Hkv == 0")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("the head dimension must be contiguous")
    CALLS.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "softmax_scale": softmax_scale,
                  "causal": causal, "contiguous": all(t.is_contiguous() for t in (q, k, v)), "q_data_ptr": q.data_ptr()})
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = heads // kv_heads
    keys, values = (t.float().repeat_interleave(group, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float() * scale, keys)
    if causal:
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), values)
    return out.to(q.dtype), lse
