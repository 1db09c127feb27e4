"""tk.rms_norm (residual add) against a float64 reference written as h / ||h||_rms."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from inputs.rms_norm import EPS, make_inputs
from tk_testing import TOLERANCE, assert_rel_close, on_gpu_rows, on_gpu_with_canary, requires_kernel

# Odd row counts and hidden sizes that are no multiple of 8; one 1-D input, one 4-D input.
SHAPES = [(37,), (5, 100), (3, 7, 37), (2, 3, 5, 19)]
SHAPE_IDS = ["1d-C37", "2d-C100", "3d-C37", "4d-C19"]


def reference_rms_norm(x, weight, eps=EPS, residual=None):
    """float64 (out, h): h = x + residual; out = h / sqrt(sum(h^2) / C + eps) * weight."""
    h = x.double()
    if residual is not None:
        h = h + residual.double()
    out = h / torch.sqrt(h.pow(2).sum(-1, keepdim=True) / h.shape[-1] + eps)
    if weight is not None:
        out = out * weight.double()
    return out, h


# ------------------------------------------------------------------------------------ forward

VARIANTS = {
    "plain": dict(),
    "no-weight": dict(weight=False),
    "residual": dict(residual_dtype=torch.float64),
    "residual-no-weight": dict(weight=False, residual_dtype=torch.float64),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference_float64(shape, variant):
    x, weight, residual = make_inputs(shape, **VARIANTS[variant])
    out, h = tk_ops.rms_norm(x, weight, EPS, residual=residual, return_residual=True)
    expected_out, expected_h = reference_rms_norm(x, weight, residual=residual)
    assert out.dtype == h.dtype == torch.float64 and out.is_contiguous() and h.is_contiguous()
    assert_rel_close(out, expected_out, TOLERANCE[torch.float64])
    assert_rel_close(h, expected_h, 0.0, "h")  # h = x + residual: one float64 add each side, exact anywhere
    # The same call in the same process (return_residual only picks the outputs): the same bits.
    assert torch.equal(tk_ops.rms_norm(x, weight, EPS, residual=residual), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual_kind", ["x-dtype", "fp32"])
def test_low_precision_matches_reference(dtype, residual_kind):
    residual_dtype = dtype if residual_kind == "x-dtype" else torch.float32
    x, weight, residual = make_inputs((9, 77), dtype, residual_dtype=residual_dtype)
    out, h = tk_ops.rms_norm(x, weight, residual=residual, return_residual=True)
    assert out.dtype == dtype and h.dtype == residual_dtype
    expected_out, expected_h = reference_rms_norm(x, weight, residual=residual)
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    assert_rel_close(h, expected_h, TOLERANCE[residual_dtype], "h")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_rounding_order(dtype):
    """Normalise in fp32, round to x's dtype, then multiply by the weight: bit-exact with that recipe
    (the reference runs these very operations on the same shapes, so the bits agree on any machine)."""
    x, weight, _ = make_inputs((7, 64), dtype)
    h32 = x.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    assert torch.equal(tk_ops.rms_norm(x, weight), normed * weight)
    fp32_weight = weight.float()
    assert torch.equal(tk_ops.rms_norm(x, fp32_weight), (normed * fp32_weight).to(dtype))


def test_return_residual_without_residual_is_a_copy_of_x():
    x, weight, _ = make_inputs((5, 33), requires_grad=True)
    out, h = tk_ops.rms_norm(x, weight, return_residual=True)
    assert torch.equal(h, x) and h.data_ptr() != x.data_ptr()
    (out.sum() + (3 * h).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    reference_rms_norm(x_ref, weight)[0].sum().backward()
    assert_rel_close(x.grad, x_ref.grad + 3, TOLERANCE[torch.float64], "grad x")


def test_statistics_are_fp32_with_leading_shape():
    x, weight, _ = make_inputs((3, 5, 21), torch.bfloat16)
    out, h, rstd = torch.ops.tk.rms_norm(x, weight, None, EPS)
    assert rstd.shape == (3, 5) and rstd.dtype == torch.float32 and h.numel() == 0
    assert_rel_close(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + EPS), 1e-6, "rstd")


def test_transposed_view_matches_contiguous_copy():
    x = torch.randn(11, 3, 40, dtype=torch.float64).transpose(0, 1)
    residual = torch.randn(3, 11, 40, dtype=torch.float64)
    weight = torch.randn(40, dtype=torch.float64)
    dense = tk_ops.rms_norm(x.contiguous(), weight, residual=residual)
    # Bit-equal on any machine: the rows hold the same values and each row's mean square is reduced
    # over the same unit-stride row of 40 (the leading strides pick only which row).
    assert torch.equal(tk_ops.rms_norm(x, weight, residual=residual), dense)
    strided = torch.randn(5, 60, dtype=torch.float64)[:, ::2]
    assert_rel_close(tk_ops.rms_norm(strided, None), reference_rms_norm(strided, None)[0], TOLERANCE[torch.float64])


# ---------------------------------------------------------------------------------- gradients

GRADIENT_CASES = {
    "plain": dict(),
    "no-weight": dict(weight=False),
    "residual": dict(residual_dtype=torch.float64),
    "residual-return": dict(residual_dtype=torch.float64, return_residual=True),
}


@pytest.mark.parametrize("shape", [(7, 37), (2, 5, 100)], ids=["2d-C37", "3d-C100"])
@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_gradients_match_reference(shape, case):
    options = dict(GRADIENT_CASES[case])
    return_residual = options.pop("return_residual", False)
    inputs = make_inputs(shape, requires_grad=True, **options)
    x, weight, residual = inputs
    grad_out, grad_h = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)

    result = tk_ops.rms_norm(x, weight, residual=residual, return_residual=return_residual)
    out, h = result if return_residual else (result, None)
    loss = (out * grad_out).sum() + ((h * grad_h).sum() if return_residual else 0)
    present = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(loss, present)

    expected_out, expected_h = reference_rms_norm(x, weight, residual=residual)
    expected_loss = (expected_out * grad_out).sum() + ((expected_h * grad_h).sum() if return_residual else 0)
    expected_grads = torch.autograd.grad(expected_loss, present)
    names = [name for name, t in zip(["x", "weight", "residual"], inputs) if t is not None]
    for name, got, expected in zip(names, grads, expected_grads):
        assert_rel_close(got, expected, 1e-9, f"grad {name}")


def test_gradient_through_h_only():
    x, weight, residual = make_inputs((6, 23), residual_dtype=torch.float64, requires_grad=True)
    _, h = tk_ops.rms_norm(x, weight, residual=residual, return_residual=True)
    (2 * h).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2)) and torch.equal(residual.grad, torch.full_like(x, 2))
    assert weight.grad is None


def test_fp32_residual_gets_fp32_gradient():
    x, weight, residual = make_inputs((5, 31), torch.bfloat16, residual_dtype=torch.float32, requires_grad=True)
    out, h = tk_ops.rms_norm(x, weight, residual=residual, return_residual=True)
    (out.float().sum() + h.sum()).backward()
    assert x.grad.dtype == weight.grad.dtype == torch.bfloat16 and residual.grad.dtype == torch.float32


# ------------------------------------------------------------------------------- CUDA kernel

HIDDEN_SIZES = [256, 1000, 1024, 4000, 4096, 8192]

# Row plans that leave accesses past the end of a row (37: one element per access, 32 threads x 8
# for 37 elements; 1032: a second warp for one 16-byte access; 1000, 4000: a partial last warp),
# without a residual (h is x), and row-strided inputs with a residual.
EDGE_CASES = {  # id: (hidden, residual, layout)
    "C37": (37, False, "contiguous"),
    "C1032": (1032, False, "contiguous"),
    "C1000-residual-strided": (1000, True, "row-strided"),
    "C4000-residual-strided": (4000, True, "row-strided"),
}
EDGE_ROWS = 67


@requires_kernel("rms_norm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_kind", ["x-dtype", "fp32"])
@pytest.mark.parametrize("case", EDGE_CASES)
def test_kernel_writes_every_output_and_reads_nothing_past_the_ends(poisoned_allocations, dtype, weight_kind, case):
    hidden, with_residual, layout = EDGE_CASES[case]
    weight_dtype = dtype if weight_kind == "x-dtype" else torch.float32
    residual_dtype = torch.float64 if with_residual else None
    x64, weight64, residual64 = make_inputs((EDGE_ROWS, hidden), residual_dtype=residual_dtype)
    x = on_gpu_rows(x64.to(dtype), layout)
    residual = on_gpu_rows(residual64.to(dtype), layout) if with_residual else None
    weight = on_gpu_with_canary(weight64.to(weight_dtype))
    out, h, rstd = torch.ops.tk.rms_norm(x, weight, residual, EPS)

    leaves = [t.cpu().double().requires_grad_() for t in (x, weight, residual) if t is not None]
    expected_out, expected_h = reference_rms_norm(*leaves[:2], residual=leaves[2] if with_residual else None)
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    grad_out = on_gpu_rows(torch.randn(EDGE_ROWS, hidden, dtype=dtype), layout)
    grad_h = on_gpu_rows(torch.randn(EDGE_ROWS, hidden, dtype=h.dtype), layout) if with_residual else None
    loss = (expected_out * grad_out.cpu().double()).sum()
    if with_residual:
        loss = loss + (expected_h * grad_h.cpu().double()).sum()
    grads = torch.autograd.grad(loss, leaves)
    expected = {"x": grads[0], "weight": grads[1], "residual": grads[2] if with_residual else None}

    masks = ([True, with_residual, True], [True, False, False], [True, False, True], [False, False, True])
    for mask in masks:
        got = torch.ops.tk.rms_norm_bwd(grad_out, grad_h, h if h.numel() else x, weight, rstd, mask)
        for name, wanted, gradient in zip(("x", "residual", "weight"), mask, got):
            if wanted:
                assert_rel_close(gradient, expected[name], TOLERANCE[dtype], f"grad {name}, output_mask {mask}")
            else:
                assert gradient.numel() == 0


@requires_kernel("rms_norm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("residual_kind", ["x-dtype", "fp32"])
def test_kernel_matches_reference(dtype, hidden, residual_kind):
    residual_dtype = dtype if residual_kind == "x-dtype" else torch.float32
    inputs = [t.cuda().requires_grad_() for t in make_inputs((3, 59, hidden), dtype, residual_dtype=residual_dtype)]
    x, weight, residual = inputs
    out, h = tk_ops.rms_norm(x, weight, residual=residual, return_residual=True)
    expected_out, expected_h = reference_rms_norm(x, weight, residual=residual)
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    assert_rel_close(h, expected_h, TOLERANCE[residual_dtype], "h")
    grad_out, grad_h = torch.randn_like(out), torch.randn_like(h)
    grads = torch.autograd.grad((out * grad_out).sum() + (h * grad_h).sum(), inputs)
    expected_loss = (expected_out * grad_out.double()).sum() + (expected_h * grad_h.double()).sum()
    expected_grads = torch.autograd.grad(expected_loss, inputs)
    for name, got, expected in zip(["x", "weight", "residual"], grads, expected_grads):
        assert_rel_close(got, expected, TOLERANCE[dtype], f"grad {name}")


@requires_kernel("rms_norm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_agrees_with_reference_path(dtype):
    x, weight, residual = make_inputs((67, 4000), dtype, residual_dtype=dtype)
    cpu = torch.ops.tk.rms_norm(x, weight, residual, EPS)
    cuda = torch.ops.tk.rms_norm(x.cuda(), weight.cuda(), residual.cuda(), EPS)
    for name, got, expected in zip(["out", "h", "rstd"], cuda, cpu):
        assert_rel_close(got, expected, TOLERANCE[torch.float32] if name != "out" else TOLERANCE[dtype], name)
