"""LayerNorm with a fused residual add and dropout: ``tk.layer_norm``.

Forward op
  tk::layer_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? dropout_seed,
                 float eps, float dropout_p) -> (Tensor out, Tensor h, Tensor mean, Tensor rstd)
      h    = dropout(x, dropout_p) + residual          (each part optional)
      out  = (h - mean(h)) * rstd * weight + bias     over the last dim, rstd = 1 / sqrt(var(h) + eps)
Backward op
  tk::layer_norm_bwd(Tensor grad_out, Tensor? grad_h, Tensor h, Tensor? weight, Tensor? bias,
                     Tensor mean, Tensor rstd, Tensor? dropout_seed, float dropout_p,
                     bool[4] output_mask) -> (Tensor grad_x, Tensor grad_residual,
                                              Tensor grad_weight, Tensor grad_bias)
      xhat = (h - mean) * rstd,  g = grad_out * weight
      dh   = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_h
      grad_residual = dh,  grad_x = dh * keep / (1 - dropout_p)   (grad_x = dh without dropout)
      grad_weight = sum over rows of grad_out * xhat,  grad_bias = sum over rows of grad_out
  ``output_mask`` says which of (grad_x, grad_residual, grad_weight, grad_bias) to compute; the
  others come back as empty tensors. ``bias`` is read only for its dtype (that of grad_bias).

Shapes and dtypes
  x (..., C), any leading dims and strides with a unit last stride; weight, bias (C,) in x's dtype
  or fp32; residual like x, in x's dtype or fp32. out: x's dtype. mean, rstd: x's leading shape,
  fp32 (fp64 for fp64 x, which only the reference accepts). Math in fp32 (fp64 for fp64 x).
  h (the pre-norm residual stream) has x's dtype, or fp32 when residual is fp32. The norm reads
  h *after* rounding it to that dtype, so out == LayerNorm(h) exactly for the h returned, as in
  an eager ``h = x + residual; F.layer_norm(h)``, and the backward recomputes xhat from h exactly.
  grad_x has grad_out's dtype (x's), grad_residual h's dtype, grad_weight/grad_bias their
  parameter's dtype; the parameter gradients are reduced over rows in fp32.

When h is materialised
  With a residual or dropout, h is a fresh contiguous tensor (the backward needs it, and
  ``return_residual`` hands it to the user). Without either, h would be a copy of x: the op
  returns ``x.new_empty(0)`` instead and the backward receives x as ``h``. This saves a full
  write of the activation and the memory to keep it in the common case (plain LayerNorm), at the
  price of one ``x.clone()`` in the public function when ``return_residual=True`` has nothing to
  add (the first block of a pre-norm model).

Dropout (the CUDA kernel must reproduce this bit for bit)
  The public function draws ``seed = torch.randint(0, 2**62, (), dtype=int64)`` on x's device from
  the default generator, only when dropout_p > 0; the op reads the seed from device memory and is
  deterministic given it (no RNG inside the op: such an op is CSE'd in training graphs, and the
  backward regenerates the mask from the seed). With all arithmetic on unsigned 32-bit words
  (multiplication modulo 2**32):
      mix32(v):  v ^= v >> 16;  v *= 0x7FEB352D;  v ^= v >> 15;  v *= 0x846CA68B;  v ^= v >> 16
      seed_lo, seed_hi = low and high 32 bits of the seed's 64-bit two's complement pattern
      key_a = mix32(seed_lo ^ 0x9E3779B9);  key_b = mix32(seed_hi ^ key_a)
      i = row * C + col, the row-major index over the logical (rows, C) layout, where row is the
          row-major flat index over x's leading dims (independent of x's strides)
      hash(i) = mix32(mix32(i_lo ^ key_b) ^ i_hi ^ key_a),  i_lo, i_hi the 32-bit halves of i
      keep(i) = hash(i) >= floor(dropout_p * 2**32 + 0.5)   (exact in double precision)
  A kept element is x * scale with scale = 1 / (1 - dropout_p) computed in double and rounded to
  the compute dtype; then h = round_to_h_dtype(x * scale + residual), multiplication and addition
  rounded separately (``__fmul_rn``/``__fadd_rn`` on CUDA: no FMA contraction).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tk_ops import _checks, _library

_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
_MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_SEED_SALT = 0x9E3779B9
DROPOUT_SEED_BOUND = 2**62  # seeds are drawn in [0, 2**62); the compiler rewrite draws them the same way

# ------------------------------------------------------------------------------ shared by the norms



def stream_dtype(x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.dtype:
    """The residual stream h has x's dtype, or the wider residual's (fp32 residual with bf16 x)."""
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _plain_parameter(t, dtype, hidden, device) -> bool:
    """An absent norm parameter, or a (hidden,) tensor of x's dtype on x's device."""
    return t is None or (
        isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == 1 and t.shape[0] == hidden and t.device == device
    )


def _plain_norm_arguments(x, residual, eps, weight, bias=None) -> bool:
    """The norms' fast path: True when check_norm_arguments would pass with every tensor in x's dtype.

    The conditions of ``_checks.uniform_floats`` (tensors of one float dtype on one device, none
    empty; no autocast: the norms do not cast) and the norms' shape relations, spelled out for the
    norms' arguments: each call costs no tuple, dict or Size. The parameters and the residual cannot
    be empty once their shapes match x's non-empty one. A False runs check_norm_arguments."""
    if not (isinstance(x, torch.Tensor) and type(eps) is float and eps > 0):
        return False
    dtype = x.dtype
    if dtype not in _checks.FLOAT_DTYPES or x.dim() < 1 or x.numel() == 0:
        return False
    device, hidden = x.device, x.shape[-1]
    if not (_plain_parameter(weight, dtype, hidden, device) and _plain_parameter(bias, dtype, hidden, device)):
        return False
    return residual is None or (
        isinstance(residual, torch.Tensor)
        and residual.dtype == dtype
        and residual.shape == x.shape
        and residual.device == device
    )


def check_norm_arguments(
    x: torch.Tensor, residual: Optional[torch.Tensor], eps: float, **parameters: Optional[torch.Tensor]
) -> None:
    """Checks shared by layer_norm and rms_norm; ``parameters`` are the (C,) weight and bias. The
    public functions run them when _plain_norm_arguments says no; they raise the error that names
    the argument, or pass (an fp32 weight, bias or residual beside x of another float dtype)."""
    _checks.check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., hidden), got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    allowed_dtypes = (x.dtype, torch.float32)
    for name, parameter in parameters.items():
        _checks.check_optional(name, parameter, ndim=1, dtypes=allowed_dtypes)
        if parameter is not None:
            _checks.check_dim(name, parameter, 0, hidden, "x.shape[-1] (hidden size)")
    if residual is not None:
        _checks.check_tensor("residual", residual, dtypes=allowed_dtypes)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got shape {tuple(residual.shape)}")
    _checks.check_same_device(x=x, residual=residual, **parameters)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


# ------------------------------------------------------------------------------------- dropout


def _mul_low32(v: torch.Tensor, multiplier: int) -> torch.Tensor:
    """(v * multiplier) mod 2**32 for 0 <= v < 2**32 on int64: 16-bit halves keep products < 2**48."""
    low, high = v & _LOW16, v >> 16
    return (low * multiplier + (((high * multiplier) & _LOW16) << 16)) & _LOW32


def _mix32(v: torch.Tensor) -> torch.Tensor:
    v = v ^ (v >> 16)
    v = _mul_low32(v, _MIX_MULTIPLIERS[0])
    v = v ^ (v >> 15)
    v = _mul_low32(v, _MIX_MULTIPLIERS[1])
    return v ^ (v >> 16)


def dropout_hash(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (seed, element index) defined in the module docstring, as int64 in [0, 2**32)."""
    key_a = _mix32((seed & _LOW32) ^ _SEED_SALT)
    key_b = _mix32(((seed >> 32) & _LOW32) ^ key_a)
    return _mix32(_mix32((index & _LOW32) ^ key_b) ^ ((index >> 32) & _LOW32) ^ key_a)


def dropout_threshold(dropout_p: float) -> int:
    return math.floor(dropout_p * 2**32 + 0.5)


def dropout_keep_mask(seed: torch.Tensor, shape: torch.Size, dropout_p: float) -> torch.Tensor:
    """Boolean keep mask of ``shape`` for a 0-dim int64 ``seed``, element i = row-major flat index."""
    index = torch.arange(math.prod(shape), device=seed.device, dtype=torch.int64).view(shape)
    return dropout_hash(seed, index) >= dropout_threshold(dropout_p)


def _draw_dropout_seed(device: torch.device) -> torch.Tensor:
    return torch.randint(0, DROPOUT_SEED_BOUND, (), device=device, dtype=torch.int64)


def _materialises_h(residual: Optional[torch.Tensor], dropout_p: float) -> bool:
    return residual is not None or dropout_p > 0


def _check_dropout_seed(dropout_seed: Optional[torch.Tensor], dropout_p: float) -> None:
    torch._check_value(
        dropout_p == 0 or dropout_seed is not None, lambda: "tk.layer_norm: dropout_p > 0 needs a dropout_seed"
    )


# ----------------------------------------------------------------------------------- reference


def _layer_norm_reference(x, weight, bias, residual, dropout_seed, eps, dropout_p):
    _check_dropout_seed(dropout_seed, dropout_p)
    compute = _checks.compute_dtype(x.dtype)
    stream = x.to(compute)
    if dropout_p > 0:
        keep = dropout_keep_mask(dropout_seed, x.shape, dropout_p)
        stream = torch.where(keep, stream * (1.0 / (1.0 - dropout_p)), 0.0)
    if residual is not None:
        stream = stream + residual.to(compute)
    h = stream.to(stream_dtype(x, residual))
    normed_input = h.to(compute)
    mean = normed_input.mean(-1, keepdim=True)
    centered = normed_input - mean
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    h_out = h.contiguous() if _materialises_h(residual, dropout_p) else x.new_empty(0)
    return out.to(x.dtype).contiguous(), h_out, mean.squeeze(-1).contiguous(), rstd.squeeze(-1).contiguous()


def _layer_norm_fake(x, weight, bias, residual, dropout_seed, eps, dropout_p):
    _check_dropout_seed(dropout_seed, dropout_p)
    statistics_dtype = _checks.compute_dtype(x.dtype)
    if _materialises_h(residual, dropout_p):
        h = x.new_empty(x.shape, dtype=stream_dtype(x, residual))
    else:
        h = x.new_empty(0)
    mean = x.new_empty(x.shape[:-1], dtype=statistics_dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=statistics_dtype)
    return x.new_empty(x.shape), h, mean, rstd


def _reduce_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def _layer_norm_bwd_reference(grad_out, grad_h, h, weight, bias, mean, rstd, dropout_seed, dropout_p, output_mask):
    _check_dropout_seed(dropout_seed, dropout_p)
    compute = _checks.compute_dtype(h.dtype)
    grad = grad_out.to(compute)
    rstd = rstd.to(compute).unsqueeze(-1)
    xhat = (h.to(compute) - mean.to(compute).unsqueeze(-1)) * rstd
    grad_xhat = grad * weight.to(compute) if weight is not None else grad
    grad_h_total = rstd * (
        grad_xhat - grad_xhat.mean(-1, keepdim=True) - xhat * (grad_xhat * xhat).mean(-1, keepdim=True)
    )
    if grad_h is not None:
        grad_h_total = grad_h_total + grad_h.to(compute)
    grad_x, grad_residual, grad_weight, grad_bias = (grad_out.new_empty(0) for _ in range(4))
    if output_mask[0]:
        grad_x = grad_h_total
        if dropout_p > 0:
            keep = dropout_keep_mask(dropout_seed, h.shape, dropout_p)
            grad_x = torch.where(keep, grad_x * (1.0 / (1.0 - dropout_p)), 0.0)
        grad_x = grad_x.to(grad_out.dtype).contiguous()
    if output_mask[1]:
        # a copy: grad_x may be grad_h_total itself, and outputs must not alias each other
        grad_residual = grad_h_total.to(h.dtype, memory_format=torch.contiguous_format, copy=True)
    if output_mask[2]:
        grad_weight = _reduce_rows(grad * xhat).to(weight.dtype)
    if output_mask[3]:
        grad_bias = _reduce_rows(grad).to(bias.dtype)
    return grad_x, grad_residual, grad_weight, grad_bias


def _layer_norm_bwd_fake(grad_out, grad_h, h, weight, bias, mean, rstd, dropout_seed, dropout_p, output_mask):
    _check_dropout_seed(dropout_seed, dropout_p)
    grad_x = grad_out.new_empty(h.shape) if output_mask[0] else grad_out.new_empty(0)
    grad_residual = h.new_empty(h.shape) if output_mask[1] else grad_out.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if output_mask[2] else grad_out.new_empty(0)
    grad_bias = bias.new_empty(bias.shape) if output_mask[3] else grad_out.new_empty(0)
    return grad_x, grad_residual, grad_weight, grad_bias


layer_norm_op = _library.define(
    "layer_norm",
    "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? dropout_seed, float eps, float dropout_p)"
    " -> (Tensor out, Tensor h, Tensor mean, Tensor rstd)",
    reference=_layer_norm_reference,
    fake=_layer_norm_fake,
)
layer_norm_bwd_op = _library.define(
    "layer_norm_bwd",
    "(Tensor grad_out, Tensor? grad_h, Tensor h, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd,"
    " Tensor? dropout_seed, float dropout_p, bool[4] output_mask)"
    " -> (Tensor grad_x, Tensor grad_residual, Tensor grad_weight, Tensor grad_bias)",
    reference=_layer_norm_bwd_reference,
    fake=_layer_norm_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


# mean and rstd are not differentiable, nor h when the op returns an empty tensor for it: the backward
# then gets x as h. An unused output gets no gradient; when only h was used, out's gradient is zeros
# and the parameters get none.
_library.register_derivatives(
    layer_norm_op,
    "layer_norm_bwd(grad_out, grad_h, h if residual or dropout_p else x, weight, bias, mean, rstd, dropout_seed,"
    " dropout_p, mask) -> x, residual, weight if grad_out, bias if grad_out",
    differentiable="out, h if residual or dropout_p",
    materialize_grads=False,
    zeros="grad_out like h",
)


# ----------------------------------------------------------------------------------- public API


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    *,
    residual: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    return_residual: bool = False,
):
    """LayerNorm over the last dim of ``h = dropout(x, dropout_p) + residual``.

    Returns ``out`` in x's dtype, or ``(out, h)`` with ``return_residual=True``: h is the pre-norm
    residual stream in x's dtype (fp32 when residual is fp32). Dropout draws its seed from the
    default generator of x's device (reproducible under ``torch.manual_seed``, CUDA-graph safe).
    """
    if _library.EXTENSION is not None and not torch.compiler.is_compiling():
        # Plain eager CUDA calls in C++ (csrc/torch/fast_entry.cpp); None: take the path below.
        result = _library.EXTENSION.layer_norm(x, weight, bias, eps, residual, dropout_p, return_residual)
        if result is not None:
            return result
    if not (type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and _plain_norm_arguments(x, residual, eps, weight, bias)):
        check_norm_arguments(x, residual, eps, weight=weight, bias=bias)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
            raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
        if not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        eps, dropout_p = float(eps), float(dropout_p)
    x, weight, bias, residual = (_checks.unit_last_stride(t) for t in (x, weight, bias, residual))
    dropout_seed = _draw_dropout_seed(x.device) if dropout_p > 0 else None
    out, h, _, _ = layer_norm_op(x, weight, bias, residual, dropout_seed, eps, dropout_p)
    if not return_residual:
        return out
    if not _materialises_h(residual, dropout_p):
        h = x.clone(memory_format=torch.contiguous_format)
    return out, h
