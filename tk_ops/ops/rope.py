"""Rotary position embedding: ``tk.rope(x, cos, sin)`` and ``tk.rope_qk(q, k, cos, sin)``.

Forward ops
  tk::rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor
  tk::rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)
Backward ops (the transpose of the forward map: the rotation by -theta for half tables)
  tk::rope_bwd(Tensor grad, Tensor cos, Tensor sin, bool interleaved) -> Tensor
  tk::rope_qk_bwd(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)
rope_qk's backward: autograd (eager and compiled) gives an output that did not reach the loss a
zero gradient, never None, so rope_qk_bwd always gets two tensors; when only one of q, k
requires grad, the backward runs rope_bwd on that one alone.

What the ops receive (the public functions normalise to this with views only):
  x, q, k, grad: (B, H, N, D), any strides with a unit last stride; q and k may differ in H (GQA).
  cos, sin: (Bc, N, R/2) (half tables) or (Bc, N, D) (full tables, only when not interleaved), with
  Bc in {1, B}, unit last stride, other strides free; dtype x's or fp32.
  Half tables: the first R channels of each head are rotated, the last D - R pass through.
  Non-interleaved (GPT-NeoX / Llama ``rotate_half``): channel i pairs with i + R/2, i < R/2.
  Interleaved (GPT-J): channel 2i pairs with 2i + 1. Pair i turns by the angle whose cos and sin
  are cos[b, n, i] and sin[b, n, i]:  (a, b) -> (a cos - b sin, b cos + a sin).
  Full tables (Hugging Face's form, last dim D): out = x * cos + rotate_half(x) * sin exactly,
  i.e. (a, b) -> (a cos[i] - b sin[i], b cos[i + D/2] + a sin[i + D/2]). For HF tables, whose
  halves are equal, this is the same rotation; for any other table it is still what the
  rotate_half formula computes, which is what lets torch.compile rewrite that formula exactly.
  The backward applies the transpose: (g, h) -> (g cos[i] + h sin[i + D/2], h cos[i + D/2] - g sin[i]).
Outputs are contiguous (B, H, N, D) in x's dtype; the math runs in fp32 (fp64 for fp64 inputs).

cos and sin are constants: no gradient flows to them (as in FlashAttention's and Liger's rope).
The public functions raise a ValueError when cos or sin requires grad, rather than silently
dropping a gradient the caller asked for.
"""

from __future__ import annotations

import torch

from tk_ops import _checks, _library

# ----------------------------------------------------------------------------------- reference


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    """Turn the rotary channels of each head forwards (sign +1) or apply the transpose (sign -1).

    Half tables (last dim R/2) give pair i the angle of column i. A full table (last dim D, not
    interleaved) gives channel i of the first half cos[i], sin[i] and channel i + D/2 its own
    cos[i + D/2], sin[i + D/2]: exactly ``x * cos + rotate_half(x) * sin`` for any table.
    """
    compute_dtype = _checks.compute_dtype(x.dtype)
    full = _is_full_table(cos, x.shape[-1], interleaved)
    rotary_dim = cos.shape[-1] if full else 2 * cos.shape[-1]
    cos = cos.to(compute_dtype).unsqueeze(1)  # (Bc, 1, N, R/2 or D): shared by all heads
    sin = sin.to(compute_dtype).unsqueeze(1)
    cos_first, cos_second = cos.chunk(2, dim=-1) if full else (cos, cos)
    sin_first, sin_second = sin.chunk(2, dim=-1) if full else (sin, sin)
    rotary = x[..., :rotary_dim].to(compute_dtype)
    if interleaved:
        first, second = rotary[..., 0::2], rotary[..., 1::2]
    else:
        first, second = rotary[..., : rotary_dim // 2], rotary[..., rotary_dim // 2 :]
    if sign > 0:
        turned = (first * cos_first - second * sin_first, second * cos_second + first * sin_second)
    else:
        turned = (first * cos_first + second * sin_second, second * cos_second - first * sin_first)
    if interleaved:
        rotary = torch.stack(turned, dim=-1).flatten(-2)
    else:
        rotary = torch.cat(turned, dim=-1)
    return torch.cat((rotary.to(x.dtype), x[..., rotary_dim:]), dim=-1).contiguous()


def _is_full_table(cos: torch.Tensor, head_dim: int, interleaved: bool) -> bool:
    return not interleaved and cos.shape[-1] == head_dim


def _rope_reference(x, cos, sin, interleaved):
    return _rotate(x, cos, sin, interleaved, 1.0)


def _rope_bwd_reference(grad, cos, sin, interleaved):
    return _rotate(grad, cos, sin, interleaved, -1.0)


def _rope_qk_reference(q, k, cos, sin, interleaved):
    return _rotate(q, cos, sin, interleaved, 1.0), _rotate(k, cos, sin, interleaved, 1.0)


def _rope_qk_bwd_reference(grad_q, grad_k, cos, sin, interleaved):
    return _rotate(grad_q, cos, sin, interleaved, -1.0), _rotate(grad_k, cos, sin, interleaved, -1.0)


def _rope_fake(x, cos, sin, interleaved):
    return x.new_empty(x.shape)


def _rope_qk_fake(q, k, cos, sin, interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


rope_op = _library.define(
    "rope",
    "(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    reference=_rope_reference,
    fake=_rope_fake,
)
rope_bwd_op = _library.define(
    "rope_bwd",
    "(Tensor grad, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    reference=_rope_bwd_reference,
    fake=_rope_fake,
)
rope_qk_op = _library.define(
    "rope_qk",
    "(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
    reference=_rope_qk_reference,
    fake=_rope_qk_fake,
)
rope_qk_bwd_op = _library.define(
    "rope_qk_bwd",
    "(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
    reference=_rope_qk_bwd_reference,
    fake=_rope_qk_fake,
)


# ------------------------------------------------------------------------------------ autograd


# cos and sin are constants: saved for the backward, never differentiated. rope_qk's backward runs
# rope_bwd alone when only one of q, k requires grad.
_library.register_derivatives(rope_op, "rope_bwd(grad, cos, sin, interleaved) -> x", layout=_checks.unit_last_stride)
_library.register_derivatives(
    rope_qk_op,
    (
        "rope_qk_bwd(grad0, grad1, cos, sin, interleaved) -> q, k",
        "rope_bwd(grad0, cos, sin, interleaved) -> q",
        "rope_bwd(grad1, cos, sin, interleaved) -> k",
    ),
    layout=_checks.unit_last_stride,
)


# ----------------------------------------------------------------------------------- public API


def _rotary_tables(cos, sin, x: torch.Tensor, x_name: str, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Check cos and sin against x (B, H, N, D); return views (Bc, N, R/2) or full (Bc, N, D), Bc in {1, B}."""
    batch, _, seq_len, head_dim = x.shape
    table_dtypes = (x.dtype, torch.float32) if x.dtype != torch.float32 else (torch.float32,)
    for name, table in (("cos", cos), ("sin", sin)):
        _checks.check_tensor(name, table, ndim=(2, 3, 4), dtypes=table_dtypes)
        if torch.is_grad_enabled() and table.requires_grad:
            raise ValueError(
                f"{name} must not require grad: tk_ops rope treats cos and sin as constants "
                f"(no gradient flows to them); pass {name}.detach()"
            )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got shape {tuple(sin.shape)}")
    _checks.check_same_dtype(cos=cos, sin=sin)
    _checks.check_same_device(**{x_name: x, "cos": cos, "sin": sin})
    shape = tuple(cos.shape)
    if cos.dim() == 4 and cos.shape[1] != 1:
        raise ValueError(f"cos.shape[1] must be 1 (cos and sin are shared by all heads), got shape {shape}")
    if cos.dim() >= 3 and cos.shape[0] not in (1, batch):
        raise ValueError(f"cos.shape[0] must be 1 or {x_name}.shape[0] (B = {batch}), got shape {shape}")
    _checks.check_dim("cos", cos, -2, seq_len, f"{x_name}.shape[2] (N)")
    half_rotary_dim = cos.shape[-1]
    if half_rotary_dim == head_dim and head_dim % 2 == 0:
        # Hugging Face's form: kept whole (applied exactly as rotate_half would) unless interleaved,
        # where its halves are read as equal and the first one is the half form.
        half_rotary_dim = head_dim if not interleaved else head_dim // 2
    elif 2 * half_rotary_dim > head_dim:
        raise ValueError(
            f"cos.shape[-1] must be R/2 with the rotary dim R <= D = {head_dim} (at most {head_dim // 2}), "
            f"or D = {head_dim} for the duplicated (Hugging Face) form with D even, got shape {shape}"
        )
    if cos.dim() == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    elif cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if half_rotary_dim != cos.shape[-1]:  # a slice that keeps everything would cost a view op per table
        cos, sin = cos[..., :half_rotary_dim], sin[..., :half_rotary_dim]
    return _checks.unit_last_stride(cos), _checks.unit_last_stride(sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of x (B, H, N, D); returns a new (B, H, N, D) tensor in x's dtype.

    cos, sin: the half form (N, R/2) (FlashAttention's convention), with R <= D the rotary dim; the
    last D - R channels pass through unchanged. A batch dim (B, N, R/2), broadcastable leading 1s
    ((1, N, R/2), (1, 1, N, R/2), (B, 1, N, R/2)) and Hugging Face's form (N, D) or (B, [1,] N, D)
    (full rotary) are accepted. The HF form is applied exactly as ``x * cos + rotate_half(x) * sin``
    (the same rotation when its halves are equal, as HF's are); with interleaved=True its halves are
    read as equal. For partial rotary in the HF form pass its first half. dtype: x's or float32.
    interleaved=False is the GPT-NeoX / Llama ``rotate_half`` convention, True the GPT-J pairs
    (2i, 2i + 1). cos and sin get no gradient and must not require grad.
    """
    _checks.check_tensor("x", x, ndim=4)
    cos, sin = _rotary_tables(cos, sin, x, "x", interleaved)
    return rope_op(_checks.unit_last_stride(x), cos, sin, interleaved)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(q, cos, sin), rope(k, cos, sin))`` in one op (one kernel launch).

    q (B, Hq, N, D) and k (B, Hk, N, D) share B, N, D and dtype; Hq and Hk are free (GQA / MQA).
    cos and sin as for :func:`rope`.
    """
    _checks.check_tensor("q", q, ndim=4)
    _checks.check_tensor("k", k, ndim=4)
    _checks.check_same_device(q=q, k=k)
    _checks.check_same_dtype(q=q, k=k)
    for dim, what in ((0, "q.shape[0] (B)"), (2, "q.shape[2] (N)"), (3, "q.shape[3] (D)")):
        _checks.check_dim("k", k, dim, q.shape[dim], what)
    cos, sin = _rotary_tables(cos, sin, q, "q", interleaved)
    return rope_qk_op(_checks.unit_last_stride(q), _checks.unit_last_stride(k), cos, sin, interleaved)
