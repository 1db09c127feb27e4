"""Causal depthwise conv1d with optional SiLU (the causal_conv1d package's op): ``tk.causal_conv1d``.

    pre[b, d, t] = bias[d] + sum_{s=0..W-1} weight[d, s] * x[b, d, t - (W - 1) + s]   (x = 0 at t < 0)
    out = silu(pre) if silu else pre
for x (B, D, L), weight (D, W) with W >= 1, bias (D,) optional. The last tap weight[d, W - 1]
multiplies the current position. This is causal_conv1d's reference exactly:
``F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :L]`` (conv1d is a
cross-correlation, so no flip), then ``F.silu`` for activation "silu" / "swish".

Forward op
  tk::causal_conv1d(Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor          out (B, D, L)
Backward op
  tk::causal_conv1d_bwd(Tensor grad, Tensor x, Tensor weight, Tensor? bias, bool silu)
      -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)
  With g = grad * silu'(pre) (silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))), or g = grad:
      grad_x[b, d, u]   = sum_s weight[d, s] * g[b, d, u + (W - 1) - s]     (g = 0 at t >= L: anti-causal)
      grad_weight[d, s] = sum_{b, t} g[b, d, t] * x[b, d, t - (W - 1) + s]
      grad_bias[d]      = sum_{b, t} g[b, d, t]
  grad_x has x's dtype and layout, grad_weight weight's dtype, grad_bias bias's dtype; grad_bias
  is empty (shape (0,)) when bias is None.
  What the autograd keeps: x, weight and bias, never the pre-activation. With SiLU the backward
  recomputes pre from x (W multiply-adds per element on data it reads anyway to form
  grad_weight), where storing it would hold one more (B, D, L) tensor from forward to backward
  and cost as many bytes to write and read back as x costs to re-read.

Dtypes: x is fp16, bf16, fp32 or fp64; weight and bias each have x's dtype, or fp32 when x is
fp16/bf16 (fp32 parameters under mixed precision, which the causal_conv1d kernels also take).
The output has x's dtype. Arithmetic is fp32 (fp64 for fp64 inputs).

Layouts. The ops take x (and grad) in either of causal_conv1d's two layouts: channel-first (a unit
stride along L, any other strides) or channel-last (a unit stride along D: the (B, L, D) output of
an input projection, or a column slice of it, transposed to (B, D, L)); the public function copies
anything else to a contiguous tensor. The output (and grad_x) is channel-last, allocated as
(B, L, D) and seen as (B, D, L), when x is channel-last and L > 1, and contiguous (B, D, L)
otherwise, so a Mamba-2 mixer's (B, L, D) activations stay (B, L, D). weight and bias reach the
ops contiguous.

CUDA kernels (csrc/kernels/causal_conv1d, registered by csrc/torch/causal_conv1d.cpp), forward and
backward: x bf16, fp16 or fp32 (weight and bias in x's dtype or fp32), W in {2, 3, 4}, any B, D and
L >= 1, either layout read in place. Channel-first: a warp takes 1024 (fp32: 512) consecutive
positions of one (b, d) row, 16-byte vectors along L when every row is 16-byte aligned (else element
by element), the W - 1 inputs before a lane's vector passed by a shuffle from the lane before.
Channel-last: a lane takes 2 channels (a 4-byte vector of 16-bit x, 8-byte of fp32, when D is even and
rows aligned) and walks along L with its last W - 1 inputs in registers; a grid as large as the
device holds at once cuts the positions into equal ranges. The output and grad_x have x's layout (as
above); a gradient whose unit stride is not x's is copied to x's layout first. Arithmetic in fp32;
the backward recomputes the pre-activation from x, and sums grad_weight and grad_bias in fp32 per warp
or block, then over those partial sums in a fixed order (no atomics: the same bits on every run).
Everything else (fp64, W = 1 or W > 4, another GPU than sm_90, an x with no unit stride along L or D,
which the public function copies but a direct call of the op may pass) runs the reference, on a GPU
with a one-time warning. The schema has no seq_idx, initial_states or final_states (causal_conv1d_fn's
options for packed sequences and chunked prefill): every sequence starts from zeros.

The reference is vectorised over B, D and L with one pass per tap (W passes, no loop over L) and
O(B D L) memory: a zero-padded fp32 copy of x and an fp32 accumulator.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tk_ops import _checks, _library

_LOW_PRECISION = (torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "silu", "swish")  # causal_conv1d_fn's; "swish" is another name of "silu"



def is_channel_last(x: torch.Tensor) -> bool:
    """(B, D, L) with a unit stride along D and not along L: a (B, L, D) layout seen as (B, D, L)."""
    return x.shape[2] > 1 and x.stride(2) != 1 and x.stride(1) == 1


def _new_like_x(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, D, L) tensor in x's dtype: channel-last when x is, contiguous otherwise."""
    batch, dim, seq_len = x.shape
    if is_channel_last(x):
        return x.new_empty(batch, seq_len, dim).transpose(1, 2)
    return x.new_empty(batch, dim, seq_len)


def _in_x_layout(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out = _new_like_x(x)
    out.copy_(values)
    return out


# ----------------------------------------------------------------------------------- reference


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x in the compute dtype with W - 1 zeros before t = 0: padded[..., i] = x[..., i - (W - 1)]."""
    return F.pad(x.to(_checks.compute_dtype(x.dtype)), (width - 1, 0))


def _pre_activation(padded: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], seq_len: int):
    """bias[d] + sum_s weight[d, s] * padded[..., t + s]: one pass per tap."""
    weight = weight.to(padded.dtype)
    pre = padded[..., :seq_len] * weight[:, 0, None]
    for s in range(1, weight.shape[1]):
        pre.addcmul_(padded[..., s : s + seq_len], weight[:, s, None])
    if bias is not None:
        pre += bias.to(padded.dtype)[:, None]
    return pre


def _causal_conv1d_reference(x, weight, bias, silu):
    pre = _pre_activation(_padded(x, weight.shape[1]), weight, bias, x.shape[2])
    return _in_x_layout(F.silu(pre) if silu else pre, x)


def _causal_conv1d_fake(x, weight, bias, silu):
    return _new_like_x(x)


def _causal_conv1d_bwd_reference(grad, x, weight, bias, silu):
    seq_len, width = x.shape[2], weight.shape[1]
    padded = _padded(x, width)
    g = grad.to(padded.dtype)
    if silu:
        pre = _pre_activation(padded, weight, bias, seq_len)
        sigmoid = torch.sigmoid(pre)
        g = g * (sigmoid * (1 + pre * (1 - sigmoid)))
    # grad_x: the anti-causal correlation of g with the taps (W - 1 zeros after t = L - 1).
    g_padded = F.pad(g, (0, width - 1))
    w = weight.to(padded.dtype)
    grad_x = g_padded[..., width - 1 : width - 1 + seq_len] * w[:, 0, None]
    for s in range(1, width):
        start = width - 1 - s
        grad_x.addcmul_(g_padded[..., start : start + seq_len], w[:, s, None])
    grad_weight = torch.stack([(g * padded[..., s : s + seq_len]).sum((0, 2)) for s in range(width)], dim=-1)
    grad_bias = x.new_empty(0) if bias is None else g.sum((0, 2)).to(bias.dtype)
    return _in_x_layout(grad_x, x), grad_weight.to(weight.dtype).contiguous(), grad_bias


def _causal_conv1d_bwd_fake(grad, x, weight, bias, silu):
    grad_bias = x.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return _new_like_x(x), weight.new_empty(weight.shape), grad_bias


causal_conv1d_op = _library.define(
    "causal_conv1d",
    "(Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor",
    reference=_causal_conv1d_reference,
    fake=_causal_conv1d_fake,
)
causal_conv1d_bwd_op = _library.define(
    "causal_conv1d_bwd",
    "(Tensor grad, Tensor x, Tensor weight, Tensor? bias, bool silu)"
    " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
    reference=_causal_conv1d_bwd_reference,
    fake=_causal_conv1d_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


def in_accepted_layout(t: torch.Tensor) -> torch.Tensor:
    """t (B, D, L) as it is when channel-first (unit stride along L) or channel-last; else a contiguous copy."""
    if t.shape[2] == 1 or t.stride(2) == 1 or is_channel_last(t):
        return t
    return t.contiguous()


_library.register_derivatives(
    causal_conv1d_op, "causal_conv1d_bwd(grad, x, weight, bias, silu) -> x, weight, bias", layout=in_accepted_layout
)


# ----------------------------------------------------------------------------------- public API


def _silu_flag(activation) -> bool:
    if activation is None:
        return False
    if isinstance(activation, str) and activation in ACTIVATIONS:
        return True
    raise ValueError(f"activation must be None, 'silu' or 'swish' (causal_conv1d_fn's values), got {activation!r}")


def _check_parameter(name: str, t: torch.Tensor, x: torch.Tensor, ndim: int) -> None:
    allowed = (x.dtype, torch.float32) if x.dtype in _LOW_PRECISION else (x.dtype,)
    _checks.check_tensor(name, t, ndim=ndim, dtypes=_checks.FLOAT_DTYPES)
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names} (x is {x.dtype}), got {t.dtype}")


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, activation: Optional[str] = None
) -> torch.Tensor:
    """Causal depthwise conv1d of x (B, D, L) with per-channel taps weight (D, W), plus bias (D,).

    ``out[b, d, t] = act(bias[d] + sum_{s < W} weight[d, s] * x[b, d, t - (W - 1) + s])``, x = 0 at
    negative times: ``F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :L]``,
    as causal_conv1d's ``causal_conv1d_fn``. activation: None, "silu" or "swish" (the same SiLU);
    booleans are refused, as causal_conv1d_fn refuses them. weight and bias have x's dtype, or fp32
    when x is fp16/bf16; the output has x's dtype and, when x is a (B, L, D) tensor transposed,
    that channel-last layout. Arithmetic in fp32 (fp64 for fp64 inputs).
    """
    silu = _silu_flag(activation)
    _checks.check_tensor("x", x, ndim=3)
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1:
        raise ValueError(
            f"weight must have 2 dimensions (D, W), got shape {tuple(weight.shape)}; "
            "for an nn.Conv1d weight (D, 1, W) pass weight.squeeze(1)"
        )
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] < 1:
        raise ValueError(f"weight.shape[1] (the kernel width W) must be >= 1, got shape {tuple(weight.shape)}")
    _check_parameter("weight", weight, x, 2)
    if bias is not None:
        _check_parameter("bias", bias, x, 1)
    _checks.check_same_device(x=x, weight=weight, bias=bias)
    _checks.check_dim("weight", weight, 0, x.shape[1], "x.shape[1] (D)")
    if bias is not None:
        _checks.check_dim("bias", bias, 0, x.shape[1], "x.shape[1] (D)")
        bias = bias.contiguous()
    return causal_conv1d_op(in_accepted_layout(x), weight.contiguous(), bias, silu)
