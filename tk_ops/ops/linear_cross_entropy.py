"""Fused linear cross-entropy (an LM head and its loss): ``tk.linear_cross_entropy``.

For rows x_i (H,), a weight W (V, H), an optional bias b (V,) and class indices t_i:
    r_i = W x_i + b                                  the logits, never held for all rows at once
    z_i = c * tanh(r_i / c)   with softcap c,  else z_i = r_i
    lse_i = log sum_v exp(z_iv)
    loss_i = lse_i - (1 - e) z_{i, t_i} - (e / V) sum_v z_iv      (label smoothing e in [0, 1])
           = (1 - e) (-log p_{i, t_i}) + e * mean_v(-log p_iv),  p_i = softmax(z_i)
and loss_i = 0 where t_i == ignore_index. reduction "none" returns loss_i, "sum" their sum, "mean"
their sum over the number of rows not ignored (NaN when every row is ignored, as in PyTorch). This
is ``F.cross_entropy(F.linear(x, W, b).float(), t, ignore_index=, label_smoothing=, reduction=)``
(softcap applied to the fp32 logits first), except that the reference does not round the logits to
x's dtype before the loss (the fp32 accumulator is used as it is; the CUDA kernels do round them, as
that unfused form does: see below) and fp64 inputs stay fp64.

Gradients. With g_i the gradient reaching loss_i (the output gradient, divided by the number of
rows not ignored under "mean"; 0 on ignored rows) and q_iv = (1 - e) [v == t_i] + e / V:
    dz_iv = g_i (p_iv - q_iv),   dr_iv = dz_iv (1 - (z_iv / c)^2) with softcap, else dz_iv
    grad_x_i = sum_v dr_iv W_v,  grad_W_v = sum_i dr_iv x_i,  grad_b_v = sum_i dr_iv
p_iv = exp(z_iv - lse_i) is recomputed from the lse the forward saves.

Forward op
  tk::linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index,
                           float label_smoothing, float? softcap, str reduction) -> (Tensor loss, Tensor lse)
  x (N, H), weight (V, H), target (N,) int64, bias (V,); loss () for "mean" and "sum", (N,) for
  "none"; lse (N,), the log-sum-exp of the (softcapped) logits of each row, not differentiable.
  Both in fp32 (fp64 for fp64 inputs).
Backward op
  tk::linear_cross_entropy_bwd(Tensor grad, Tensor x, Tensor weight, Tensor target, Tensor? bias,
                               Tensor lse, int ignore_index, float label_smoothing, float? softcap,
                               str reduction, bool[3] output_mask)
      -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)
  grad has the loss's shape. A gradient not asked for (output_mask False), and grad_bias without a
  bias, comes back empty (shape (0,)). Each gradient has its input's dtype.
Forward op with the gradients
  tk::linear_cross_entropy_with_grads(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index,
                                      float label_smoothing, float? softcap, str reduction, bool[3] output_mask)
      -> (Tensor loss, Tensor lse, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)
  reduction "mean" or "sum" only; loss and lse as the forward op's, the gradients those of the loss itself
  (output gradient 1; empty where not asked for, as the backward op's), not differentiable. Its autograd
  backward returns the output gradient g times them (g in fp32, each product rounded once to the
  gradient's dtype).

Recompute or store: both, chosen by the public function. The logits can be recomputed in the
backward (tk::linear_cross_entropy, then tk::linear_cross_entropy_bwd), or the gradients computed in
the forward while each tile of logits is at hand and kept for the backward to scale (as
Liger-Kernel's fused linear cross-entropy does: tk::linear_cross_entropy_with_grads). Recomputing
costs one more GEMM over the logits (4 instead of 3 of 2NVH FLOPs each: forward + backward 58.9 ms at
N = 16384, H = 2048, V = 128256 on an H200, four GEMMs of about 14.5 ms), and buys memory where it is
scarcest: between forward and backward the op keeps only lse (N floats) besides x, W and the targets,
which the model holds anyway, where storing keeps grad_x and grad_weight ((N + V) H values in x's
dtype: V H 2 + N H 2 bytes in bf16, 1.0 + 0.125 GiB for Llama-3's 128256 x 4096 head and 16k rows)
from the end of the forward, when a training step's activations peak, to the head's backward.
Measured with torch.profiler's CPU allocation events (fp32, N = 4096, H = 256, V = 8192: logits of
128 MiB, x 4 MiB, W 8 MiB, the default tiles of 16 MiB): this reference's forward peaks at 16.1 MiB
above its inputs and leaves 16 KiB (lse) behind, its backward peaks at 32.0 MiB (a tile plus the
gradients); the same tiles with the gradients computed in the forward leave 12.0 MiB behind the
forward. The public function stores (three GEMMs) where the CUDA kernels serve the inputs (bf16 or
fp16 CUDA tensors, H a multiple of 8, the extension loaded), a backward will follow (grad mode on, x
or weight requiring grad) and the output gradient is one scalar ("mean", "sum": the gradients of the
loss itself are then g times those computed with g = 1); it recomputes for reduction "none" (a
per-row output gradient is not known in the forward), on the reference (where the fourth GEMM costs
less than the memory), and costs nothing beyond the loss where no backward follows.

Dtypes: x fp16, bf16, fp32 or fp64; weight and bias x's dtype; target int64. Arithmetic in fp32
(fp64 for fp64 inputs). Target values other than ignore_index must lie in [0, V) (checked by the
reference, which raises otherwise). x and weight reach the ops with a unit last stride (other
strides free); anything else is copied by the public function.

CUDA kernels (csrc/torch/linear_cross_entropy.cpp; tested on the H200, where the forward measured
1.04-1.05x torch.compile's unfused form and forward + backward 0.71-0.75x with the logits recomputed:
benchmarks/results/linear_cross_entropy.md; the gradients in the forward are not measured yet) for bf16
and fp16 x
on an sm_90 GPU with H a multiple of 8 (rows 16-byte aligned, as the GEMM's TMA reads them), any N
and V, every option: the project's GEMM writes a tile of logits in x's dtype (rows x all V in the
forward, all N x a range of classes in the backward, about 2^27 elements), and one row kernel per tile
reads it once: the forward's loss pass (the streamed log-sum-exp, the target's logit, the sum of the
logits; lse and each row's loss), or the backward's gradient pass, which overwrites the tile in place
with dr / unit (g / unit folded in) for the GEMMs grad_W[classes] = unit (dr / unit)^T x (written once:
K = N; unit applied to the fp32 accumulator) and grad_x += (dr / unit) W (summed over the tiles of
classes in fp32, times unit at the end). unit = 2^(e - 8) with 2^(e - 1) <= max |g| < 2^e, a power of
two computed on the device: it keeps dr / unit inside fp16's normal range (6e-5 to 65504) where g alone
("mean" over many rows makes g small) would leave most of dr subnormal, and it is exact, so bf16
results are those of folding g in directly. Their memory beyond inputs and outputs: the forward a
tile (256 MiB in bf16) and 8 bytes a row; the backward a tile, 6 N H bytes (grad_x's fp32 sum and one
tile's share of it) and, with a bias, 4 V bytes; what the forward leaves for the backward is the lse
alone, as here. Rounding the logits to x's dtype changes a bf16 loss by about 2^-9 |z| per logit, as
in the unfused form, well inside bf16's own error on x and W; the gradients go through x's dtype
anyway (the GEMMs' operands): within their dtype's rounding, in fp16 closer to float64 than the
unfused fp16 form, whose d loss / d logits with "mean" over many rows are mostly subnormal.
With the gradients in the forward (tk::linear_cross_entropy_with_grads), per tile of rows x all V (2^28
elements: 2048 rows at V = 128256, so that grad_x's GEMM fills the SMs at H = 2048 and grad_W's fp32
sum is read and written half as often): the logits GEMM, the loss pass, the gradient pass in place
with g = 1 ("sum") or 1 / count ("mean", count on the device), the same unit, then grad_x[rows] = unit
(dr / unit) W (K = V, written once in x's dtype) and grad_W += unit (dr / unit)^T x[rows] (K = the
tile's rows: the GEMM's accumulating epilogue adds its fp32 result into grad_W's fp32 sum, read and
written once a tile of rows, 8 V H bytes), grad_b's fp32 column sums; grad_W is cast to W's dtype at
the end. Memory beyond inputs and outputs: the tile (512 MiB in bf16), grad_W's fp32 sum (4 V H bytes)
and, at the end, its copy in W's dtype: at H = 4096, V = 128256, N = 16384 about 3.1 GiB at the peak
(the unfused form peaks at 23.5); what it leaves for the backward is grad_x and grad_weight, V H 2 +
N H 2 bytes in bf16 (1.1 GiB there). The backward's g times them rounds once more (g in fp32), exactly
so for a power of two g (1, a loss scale).
A target outside [0, V) (not ignore_index) gives NaN for its row there instead of an error (checking
would stall the GPU stream). Everything else (fp32, fp64, H not a multiple of 8, another GPU, empty
inputs, a bias with a non-unit stride) runs the reference (csrc/torch/linear_cross_entropy.cpp,
kernels_take), which warns once on a GPU.

The reference walks the logits in tiles of ROWS_PER_TILE rows by VOCAB_PER_TILE classes, as a kernel
would: the forward keeps per row a running maximum and sum of exponentials (the streamed log-sum-exp),
the target's logit and the sum of the logits; the backward accumulates grad_x, grad_weight and
grad_bias in the compute dtype tile by tile. Its memory is O(N H + V H) for the inputs and gradients
plus a few tiles, never O(N V).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tk_ops import _checks, _library
from tk_ops._autocast import autocast_inputs

REDUCTIONS = ("mean", "sum", "none")  # F.cross_entropy's
# A tile of fp32 logits is 16 MiB: small beside any LM head's logits (16k rows by 128k classes are
# 8 GiB), large enough for efficient GEMMs and a short Python loop (512 tiles there).
ROWS_PER_TILE = 1024
VOCAB_PER_TILE = 4096


# ----------------------------------------------------------------------------------- reference


def _tiles(size: int, tile: int):
    return [slice(start, min(start + tile, size)) for start in range(0, size, tile)]


def _check_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> None:
    out_of_range = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(out_of_range.any()):
        bad = target[out_of_range][0].item()
        raise ValueError(f"target values must be ignore_index ({ignore_index}) or in [0, {vocab}), got {bad}")


def _logits(x_rows, weight, bias, classes: slice, softcap: Optional[float]) -> torch.Tensor:
    """The (softcapped) logits of a tile, in x_rows' dtype (the compute dtype); in place after the GEMM,
    so that a tile costs one tile of memory."""
    logits = x_rows @ weight[classes].to(x_rows.dtype).T
    if bias is not None:
        logits += bias[classes].to(x_rows.dtype)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def _target_column(target_rows: torch.Tensor, classes: slice):
    """(each row's target as a column of the tile, clamped into it; whether the target is in the tile)."""
    inside = (target_rows >= classes.start) & (target_rows < classes.stop)
    column = (target_rows - classes.start).clamp(0, classes.stop - classes.start - 1)
    return column[:, None], inside


class _RowStatistics:
    """What the forward keeps per row while it streams over the tiles of classes: the running maximum and
    sum of exponentials (the streamed log-sum-exp), the target's logit and the sum of the logits."""

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        self.max = like.new_full((rows,), -math.inf)
        self.sum_exp, self.target_logit, self.logit_sum = (like.new_zeros(rows) for _ in range(3))

    def add(self, logits: torch.Tensor, target_rows: torch.Tensor, classes: slice, smoothing: bool) -> None:
        """Fold in one tile of logits, which it overwrites (called on a temporary, so that it is freed before
        the next tile's GEMM)."""
        column, inside = _target_column(target_rows, classes)
        self.target_logit += torch.where(inside, logits.gather(1, column)[:, 0], 0.0)
        if smoothing:
            self.logit_sum += logits.sum(1)
        new_max = torch.maximum(self.max, logits.amax(1))
        self.sum_exp = self.sum_exp * torch.exp(self.max - new_max) + logits.sub_(new_max[:, None]).exp_().sum(1)
        self.max = new_max

    def lse(self) -> torch.Tensor:
        return self.max + torch.log(self.sum_exp)


def _reduce(loss_rows: torch.Tensor, counted: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    return total if reduction == "sum" else total / counted.sum()


def _linear_cross_entropy_reference(x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction):
    compute = _checks.compute_dtype(x.dtype)
    vocab = weight.shape[0]
    _check_targets(target, ignore_index, vocab)
    lse = x.new_empty(x.shape[0], dtype=compute)
    loss_rows = x.new_empty(x.shape[0], dtype=compute)
    for rows in _tiles(x.shape[0], ROWS_PER_TILE):
        x_rows, target_rows = x[rows].to(compute), target[rows]
        statistics = _RowStatistics(x_rows.shape[0], x_rows)
        for classes in _tiles(vocab, VOCAB_PER_TILE):
            statistics.add(_logits(x_rows, weight, bias, classes, softcap), target_rows, classes, label_smoothing > 0)
        lse[rows] = statistics.lse()
        row_loss = lse[rows] - (1 - label_smoothing) * statistics.target_logit
        row_loss -= (label_smoothing / vocab) * statistics.logit_sum
        loss_rows[rows] = torch.where(target_rows != ignore_index, row_loss, 0.0)
    return _reduce(loss_rows, target != ignore_index, reduction), lse


def _loss_shape(x: torch.Tensor, reduction: str) -> tuple[int, ...]:
    return (x.shape[0],) if reduction == "none" else ()


def _linear_cross_entropy_fake(x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction):
    compute = _checks.compute_dtype(x.dtype)
    return x.new_empty(_loss_shape(x, reduction), dtype=compute), x.new_empty(x.shape[0], dtype=compute)


def _row_gradients(grad, counted: torch.Tensor, reduction: str, compute: torch.dtype) -> torch.Tensor:
    """g_i: the gradient reaching each row's loss (0 on ignored rows, also when all are ignored)."""
    grad = grad.to(compute)
    if reduction == "mean":
        grad = grad / counted.sum()
    return torch.where(counted, grad.expand(counted.shape), 0.0)


def _backward_tile(grads, x_rows, target_rows, row_grad, lse_rows, weight, bias, classes, options) -> None:
    """Add one tile's share to grads (grad_x rows, grad_weight, grad_bias; None where not asked for).
    A function of its own, so that its tiles are freed before the next tile's GEMM."""
    label_smoothing, softcap = options
    grad_x, grad_weight, grad_bias = grads
    compute, vocab = x_rows.dtype, weight.shape[0]
    logits = _logits(x_rows, weight, bias, classes, softcap)
    cap_slope = None if softcap is None else (logits / softcap).square_().neg_().add_(1)  # dz/dr = 1 - (z/c)^2
    column, inside = _target_column(target_rows, classes)
    # dz = g (p - q): the softmax minus the smoothed one-hot, whose target share is added where it lies
    grad_logits = logits.sub_(lse_rows[:, None]).exp_().sub_(label_smoothing / vocab)
    grad_logits.scatter_add_(1, column, inside.to(compute)[:, None] * -(1 - label_smoothing))
    grad_logits *= row_grad[:, None]
    if cap_slope is not None:
        grad_logits *= cap_slope
    if grad_x is not None:
        grad_x += grad_logits @ weight[classes].to(compute)
    if grad_weight is not None:
        grad_weight[classes] += grad_logits.T @ x_rows
    if grad_bias is not None:
        grad_bias[classes] += grad_logits.sum(0)


def _linear_cross_entropy_bwd_reference(
    grad, x, weight, target, bias, lse, ignore_index, label_smoothing, softcap, reduction, output_mask
):
    compute = _checks.compute_dtype(x.dtype)
    row_grad = _row_gradients(grad, target != ignore_index, reduction, compute)
    grad_x = x.new_zeros(x.shape, dtype=compute) if output_mask[0] else None
    grad_weight = weight.new_zeros(weight.shape, dtype=compute) if output_mask[1] else None
    grad_bias = weight.new_zeros(weight.shape[0], dtype=compute) if output_mask[2] and bias is not None else None
    for rows in _tiles(x.shape[0], ROWS_PER_TILE):
        grads = (None if grad_x is None else grad_x[rows], grad_weight, grad_bias)
        x_rows = x[rows].to(compute)
        for classes in _tiles(weight.shape[0], VOCAB_PER_TILE):
            _backward_tile(grads, x_rows, target[rows], row_grad[rows], lse[rows], weight, bias, classes,
                           (label_smoothing, softcap))
    return (
        x.new_empty(0) if grad_x is None else grad_x.to(x.dtype),
        x.new_empty(0) if grad_weight is None else grad_weight.to(weight.dtype),
        x.new_empty(0) if grad_bias is None else grad_bias.to(bias.dtype),
    )


def _linear_cross_entropy_bwd_fake(
    grad, x, weight, target, bias, lse, ignore_index, label_smoothing, softcap, reduction, output_mask
):
    return (
        x.new_empty(x.shape) if output_mask[0] else x.new_empty(0),
        weight.new_empty(weight.shape) if output_mask[1] else x.new_empty(0),
        bias.new_empty(bias.shape) if output_mask[2] and bias is not None else x.new_empty(0),
    )


linear_cross_entropy_op = _library.define(
    "linear_cross_entropy",
    "(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing,"
    " float? softcap, str reduction) -> (Tensor loss, Tensor lse)",
    reference=_linear_cross_entropy_reference,
    fake=_linear_cross_entropy_fake,
)
def _linear_cross_entropy_with_grads_reference(
    x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction, output_mask
):
    """The forward and the gradients of the loss itself (output gradient 1): the reference's forward, then its
    backward (the same tiles walked twice: correctness first, the memory of the gradients is the same)."""
    _check_with_grads_reduction(reduction)
    loss, lse = _linear_cross_entropy_reference(x, weight, target, bias, ignore_index, label_smoothing, softcap,
                                                reduction)
    grads = _linear_cross_entropy_bwd_reference(
        torch.ones((), dtype=loss.dtype, device=loss.device), x, weight, target, bias, lse, ignore_index,
        label_smoothing, softcap, reduction, output_mask,
    )
    return (loss, lse, *grads)


def _linear_cross_entropy_with_grads_fake(
    x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction, output_mask
):
    _check_with_grads_reduction(reduction)
    loss, lse = _linear_cross_entropy_fake(x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction)
    grads = _linear_cross_entropy_bwd_fake(None, x, weight, target, bias, lse, ignore_index, label_smoothing, softcap,
                                           reduction, output_mask)
    return (loss, lse, *grads)


def _check_with_grads_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError("tk::linear_cross_entropy_with_grads: reduction must be 'mean' or 'sum' (with 'none' the "
                         f"output gradient is one per row, not known in the forward), got {reduction!r}")


linear_cross_entropy_bwd_op = _library.define(
    "linear_cross_entropy_bwd",
    "(Tensor grad, Tensor x, Tensor weight, Tensor target, Tensor? bias, Tensor lse, int ignore_index,"
    " float label_smoothing, float? softcap, str reduction, bool[3] output_mask)"
    " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
    reference=_linear_cross_entropy_bwd_reference,
    fake=_linear_cross_entropy_bwd_fake,
)
linear_cross_entropy_with_grads_op = _library.define(
    "linear_cross_entropy_with_grads",
    "(Tensor x, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing,"
    " float? softcap, str reduction, bool[3] output_mask)"
    " -> (Tensor loss, Tensor lse, Tensor grad_x, Tensor grad_weight, Tensor grad_bias)",
    reference=_linear_cross_entropy_with_grads_reference,
    fake=_linear_cross_entropy_with_grads_fake,
)


# ------------------------------------------------------------------------------------ autograd


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, ignore_index, label_smoothing, softcap, reduction = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(x, weight, target, bias, lse)
    ctx.options = (ignore_index, label_smoothing, softcap, reduction)


def _linear_cross_entropy_backward(ctx, grad, grad_lse):
    x, weight, target, bias, lse = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    grad_x, grad_weight, grad_bias = linear_cross_entropy_bwd_op(grad, x, weight, target, bias, lse, *ctx.options, mask)
    return (
        grad_x if mask[0] else None,
        grad_weight if mask[1] else None,
        None,
        grad_bias if mask[2] else None,
        None,
        None,
        None,
        None,
    )


_library.register_autograd(linear_cross_entropy_op, _linear_cross_entropy_backward, _setup_context)


def _setup_context_with_grads(ctx, inputs, output):
    _, _, target, bias, *_ = inputs
    _, lse, grad_x, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(lse, grad_x, grad_weight, grad_bias)
    ctx.save_for_backward(grad_x, grad_weight, grad_bias)
    ctx.has_bias = bias is not None


# Elements per chunk of _scaled's fp32 temporaries (256 MiB).
SCALE_CHUNK_ELEMENTS = 1 << 26


def _scaled(gradient: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad * gradient in gradient's dtype, rounded once, grad (a 0-dim tensor) taken in fp32: a 16-bit
    tensor times a 0-dim fp32 tensor would round grad to 16 bits first. 16-bit gradients go through fp32
    in chunks of rows in eager, so that the temporary (one chunk's) stays small beside grad_weight; with
    symbolic sizes (torch.compile's dynamic shapes) in one expression, which Inductor fuses into one
    kernel without a temporary."""
    if gradient.dtype not in (torch.float16, torch.bfloat16):
        return gradient * grad.to(gradient.dtype)
    if not isinstance(gradient.shape[0], int):
        return (gradient.float() * grad).to(gradient.dtype)
    out = torch.empty_like(gradient)
    rows = max(1, SCALE_CHUNK_ELEMENTS // max(1, gradient[0].numel()))
    for start in range(0, gradient.shape[0], rows):
        torch.mul(gradient[start:start + rows].float(), grad, out=out[start:start + rows])  # fp32, rounded on store
    return out


def _linear_cross_entropy_with_grads_backward(ctx, grad, *_):
    grad_x, grad_weight, grad_bias = ctx.saved_tensors
    wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[3])
    # A gradient asked for here was computed in the forward (the public function's output_mask follows
    # requires_grad); one that is empty was not asked for there.
    stored = (grad_x, grad_weight, grad_bias)
    scaled = [_scaled(g, grad) if want and g.numel() else None for want, g in zip(wanted, stored)]
    return (scaled[0], scaled[1], None, scaled[2], None, None, None, None, None)


_library.register_autograd(linear_cross_entropy_with_grads_op, _linear_cross_entropy_with_grads_backward,
                           _setup_context_with_grads)


# ----------------------------------------------------------------------------------- public API


def _check_options(ignore_index, label_smoothing, reduction, softcap) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be None or a float, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a finite number > 0 (None: no softcap), got {softcap!r}")


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """The cross-entropy of the logits ``x @ weight.T + bias`` against ``target``, without holding them.

    ``F.cross_entropy(F.linear(x, weight, bias).float().reshape(-1, V), target.reshape(-1), ...)``
    (softcap c: ``c * tanh(logits / c)`` first) for x (..., H), weight (V, H), bias (V,), target
    (...) int64 with x's leading shape: every leading index of x is one row, whatever its rank
    (F.cross_entropy itself would read a 3-D logits tensor's dim 1 as the classes). reduction "none"
    returns target's shape, "mean" and "sum" a scalar; fp32 (fp64 for fp64 x). Under torch.autocast,
    fp32 x, weight and bias are cast to the autocast dtype first, as F.linear casts them.
    """
    _check_options(ignore_index, label_smoothing, reduction, softcap)
    _checks.check_tensor("x", x, ndim=tuple(range(1, 9)))
    _checks.check_tensor("weight", weight, ndim=2)
    _checks.check_optional("bias", bias, ndim=1)
    _checks.check_tensor("target", target, dtypes=(torch.int64,), allow_empty=True)
    x, weight, bias = autocast_inputs(x, weight, bias)
    _checks.check_same_device(x=x, weight=weight, target=target, bias=bias)
    _checks.check_same_dtype(x=x, weight=weight, bias=bias)
    _checks.check_dim("weight", weight, 1, x.shape[-1], "x.shape[-1] (H)")
    if bias is not None:
        _checks.check_dim("bias", bias, 0, weight.shape[0], "weight.shape[0] (V)")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target must have x's shape without its last dim {tuple(x.shape[:-1])}, "
                         f"got shape {tuple(target.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    arguments = (
        _checks.unit_last_stride(rows), _checks.unit_last_stride(weight), target.reshape(-1), bias,
        ignore_index, float(label_smoothing), None if softcap is None else float(softcap), reduction,
    )
    output_mask = _gradients_in_the_forward(x, weight, bias, reduction)
    if output_mask is not None:
        return linear_cross_entropy_with_grads_op(*arguments, output_mask)[0]
    loss, _ = linear_cross_entropy_op(*arguments)
    return loss.view(target.shape) if reduction == "none" else loss


def _gradients_in_the_forward(x, weight, bias, reduction) -> Optional[list[bool]]:
    """The output mask of tk::linear_cross_entropy_with_grads (grad_x, grad_weight, grad_bias), or None for
    tk::linear_cross_entropy: the gradients are computed in the forward when a backward will follow (grad
    mode on, x or weight requiring grad), the output gradient is one scalar ("mean", "sum") and the CUDA
    kernels serve the inputs (bf16 or fp16 CUDA tensors, H a multiple of 8, the extension loaded: the
    checks of kernels_take in csrc/torch/linear_cross_entropy.cpp that the public function can make; on
    another GPU than sm_90 the op's reference runs, computing the same). Everything here is static under
    torch.compile (dtype, device, requires_grad, grad mode, a module global), so that the choice is traced
    rather than a graph break."""
    if reduction == "none" or not torch.is_grad_enabled():
        return None
    mask = [x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    if not (mask[0] or mask[1]):
        return None
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.shape[-1] % 8 == 0):
        return None
    if _library.EXTENSION is None:
        return None
    return mask
