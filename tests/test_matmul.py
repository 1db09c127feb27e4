"""tk.matmul / tk.linear against a sum-of-outer-products reference in float64, and the Hopper GEMM."""

from __future__ import annotations

import warnings

import pytest
import torch

import tk_ops
import tk_testing
from inputs.matmul import float64_product
from tk_ops import _library
from tk_testing import TOLERANCE, assert_rel_close, rel_err, requires_kernel

# (M, K, N): odd sizes, a size of 1 in each position, nothing a multiple of 16.
SHAPES = [(7, 13, 5), (1, 9, 3), (11, 1, 6), (5, 8, 1), (3, 17, 19)]


def reference_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_k a[:, k] (outer) b[k, :] in float64: a different formulation from torch.matmul."""
    a64, b64 = a.double(), b.double()
    return (a64[:, :, None] * b64[None, :, :]).sum(1)


def reference_linear(x, weight, bias=None):
    out = reference_product(x.reshape(-1, x.shape[-1]), weight.mT)
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matmul_matches_outer_products(shape, dtype):
    M, K, N = shape
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    out = tk_ops.matmul(a, b)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (M, N)
    assert_rel_close(out, reference_product(a, b), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_low_precision_on_cpu(dtype):
    a, b = torch.randn(9, 21, dtype=dtype), torch.randn(21, 6, dtype=dtype)
    out = tk_ops.matmul(a, b)
    assert out.dtype == dtype
    assert_rel_close(out, reference_product(a, b), TOLERANCE[dtype])


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("x_shape", [(7,), (5, 7), (2, 3, 7)], ids=["1d", "2d", "3d"])
def test_linear_matches_reference(x_shape, with_bias):
    x = torch.randn(*x_shape, dtype=torch.float64)
    weight = torch.randn(9, 7, dtype=torch.float64)
    bias = torch.randn(9, dtype=torch.float64) if with_bias else None
    out = tk_ops.linear(x, weight, bias)
    assert out.shape == (*x_shape[:-1], 9)
    assert_rel_close(out, reference_linear(x, weight, bias), TOLERANCE[torch.float64])


@pytest.mark.parametrize("transpose", ["a", "b", "both"])
def test_transposed_views_reach_the_op_without_a_copy(transpose):
    a = torch.randn(13, 7, dtype=torch.float64).mT if transpose in ("a", "both") else torch.randn(7, 13, dtype=torch.float64)
    b = torch.randn(5, 13, dtype=torch.float64).mT if transpose in ("b", "both") else torch.randn(13, 5, dtype=torch.float64)
    with tk_testing.RecordTkCalls() as record:
        out = tk_ops.matmul(a, b)
    got_a, got_b = record.calls["matmul"][-1]
    assert got_a.data_ptr() == a.data_ptr() and got_a.stride() == a.stride()
    assert got_b.data_ptr() == b.data_ptr() and got_b.stride() == b.stride()
    assert_rel_close(out, tk_ops.matmul(a.contiguous(), b.contiguous()), TOLERANCE[torch.float64])


def test_operand_without_any_unit_stride_is_copied_not_misread():
    a = torch.randn(6, 14, dtype=torch.float64)[:, ::2]  # strides (14, 2): neither row- nor column-major
    b = torch.randn(7, 4, dtype=torch.float64)
    assert_rel_close(tk_ops.matmul(a, b), reference_product(a, b), TOLERANCE[torch.float64])


def test_transposed_weight_in_linear():
    x = torch.randn(4, 6, dtype=torch.float64)
    weight = torch.randn(6, 3, dtype=torch.float64).mT  # (3, 6), column-major
    assert_rel_close(tk_ops.linear(x, weight), reference_linear(x, weight), TOLERANCE[torch.float64])


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "a", "b"])
def test_matmul_gradients(needs):
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=needs[0])
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=needs[1])
    grad = torch.randn(6, 3, dtype=torch.float64)
    tk_ops.matmul(a, b).backward(grad)
    a_ref, b_ref = a.detach().clone().requires_grad_(needs[0]), b.detach().clone().requires_grad_(needs[1])
    reference_product(a_ref, b_ref).backward(grad)
    for got, expected in ((a.grad, a_ref.grad), (b.grad, b_ref.grad)):
        assert (got is None) == (expected is None)
        if got is not None:
            assert_rel_close(got, expected, TOLERANCE[torch.float64])


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_gradients(with_bias):
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_bias else None
    grad = torch.randn(2, 5, 4, dtype=torch.float64)
    tk_ops.linear(x, weight, bias).backward(grad)
    leaves = [t for t in (x, weight, bias) if t is not None]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    reference_linear(*refs, *([None] if not with_bias else [])).backward(grad)
    for got, ref in zip(leaves, refs):
        assert_rel_close(got.grad, ref.grad, TOLERANCE[torch.float64])


def test_linear_gradient_of_weight_only():
    x = torch.randn(3, 7, dtype=torch.float64)
    weight = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64)
    tk_ops.linear(x, weight, bias).sum().backward()
    assert_rel_close(weight.grad, torch.ones(3, 4, dtype=torch.float64).mT @ x, TOLERANCE[torch.float64])


def test_backward_ops_return_empty_for_unrequested_gradients():
    grad, a, b = torch.randn(4, 3), torch.randn(4, 5), torch.randn(5, 3)
    grad_a, grad_b = torch.ops.tk.matmul_bwd(grad, a, b, [True, False])
    assert grad_a.shape == a.shape and grad_b.numel() == 0
    grad_x, grad_w, grad_bias = torch.ops.tk.linear_bwd(grad, a, b.mT, [False, True, False])
    assert grad_x.numel() == 0 and grad_w.shape == (3, 5) and grad_bias.numel() == 0


# ------------------------------------------------------------------------------ Hopper kernel

LAYOUTS = ["nn", "nt", "tn", "tt"]  # A then B: n = row-major, t = column-major (a transposed view)
# (M, K, N): tails in every dimension, sizes of 1 in each position, primes where TMA allows them
# (strides must be multiples of 16 bytes, so a dimension that is a stride is a multiple of 8).
# The kernel picks its tile plan per problem (gemm.cuh, faster_with_narrow_tiles): every shape here
# but (1500, 72, 2600) (12 x 11 = 132 tiles of 128 x 256, one full round) runs 128 x 64 tiles.
KERNEL_SHAPES = [
    (1, 8, 8), (1, 8, 1), (5, 1, 8), (97, 1, 136), (131, 72, 264), (7, 1000, 40), (256, 64, 256),
    (383, 200, 520), (2000, 136, 4104), (1500, 72, 2600),
]


def operand(rows: int, cols: int, column_major: bool, dtype, device="cuda") -> torch.Tensor:
    if column_major:
        return torch.randn(cols, rows, dtype=dtype, device=device).mT
    return torch.randn(rows, cols, dtype=dtype, device=device)


def allocate_poisoned(shape, dtype) -> None:
    """Leave a freed block of NaNs where the caching allocator will place the next output."""
    poison = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del poison


def tma_readable(t: torch.Tensor) -> bool:
    """As csrc/torch/gemm.cpp decides: read row- or column-major with 16-byte row strides, or as a
    single stored row (whose stride does not matter)."""
    rows, cols = t.shape
    forms = []
    if t.stride(1) == 1 or cols == 1:
        forms.append((rows, t.stride(0)))
    if t.stride(0) == 1 or rows == 1:
        forms.append((cols, t.stride(1)))
    return t.data_ptr() % 16 == 0 and any(n == 1 or stride * t.element_size() % 16 == 0 for n, stride in forms)


@requires_kernel("matmul")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=str)
def test_matmul_kernel(shape, layout, dtype):
    M, K, N = shape
    a = operand(M, K, layout[0] == "t", dtype)
    b = operand(K, N, layout[1] == "t", dtype)
    if not (tma_readable(a) and tma_readable(b) and (N % 8 == 0 or M == 1)):
        pytest.skip("a stride TMA cannot take: covered by the fallback samples of tests/op_db.py")
    allocate_poisoned((M, N), dtype)
    _library._REFERENCE_WARNED.discard("matmul")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference path would warn: this must run on the kernel
        out = tk_ops.matmul(a, b)
    assert out.dtype == dtype and out.shape == (M, N) and out.is_contiguous()
    assert_rel_close(out, float64_product(a, b), TOLERANCE[dtype])


@requires_kernel("matmul")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [512, 1024, 2048])
def test_matmul_kernel_square_against_cublas(size, dtype):
    a = torch.randn(size, size, dtype=dtype, device="cuda")
    b = torch.randn(size, size, dtype=dtype, device="cuda")
    expected = float64_product(a, b)
    out = tk_ops.matmul(a, b)
    assert_rel_close(out, expected, TOLERANCE[dtype])
    assert rel_err(out, expected) <= 2 * rel_err(a @ b, expected) + 1e-4  # no worse than cuBLAS


@requires_kernel("linear")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(1, 64, 8), (137, 264, 1000), (300, 520, 72)], ids=str)
def test_linear_kernel(shape, with_bias, dtype):
    M, K, N = shape
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    weight = torch.randn(N, K, dtype=dtype, device="cuda") / K**0.5
    bias = torch.randn(N, dtype=dtype, device="cuda") if with_bias else None
    allocate_poisoned((M, N), dtype)
    _library._REFERENCE_WARNED.discard("linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tk_ops.linear(x, weight, bias)
    expected = float64_product(x, weight.mT) + (0 if bias is None else bias.double())
    assert_rel_close(out, expected, TOLERANCE[dtype])


@requires_kernel("linear_bwd")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_kernel_gradients(dtype):
    x = torch.randn(3, 67, 136, dtype=dtype, device="cuda", requires_grad=True)
    weight = (torch.randn(264, 136, dtype=dtype, device="cuda") / 12).requires_grad_()
    bias = torch.randn(264, dtype=dtype, device="cuda", requires_grad=True)
    grad = torch.randn(3, 67, 264, dtype=dtype, device="cuda")
    _library._REFERENCE_WARNED.discard("linear_bwd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tk_ops.linear(x, weight, bias).backward(grad)
    refs = [t.detach().cpu().double().requires_grad_() for t in (x, weight, bias)]
    reference_linear(*refs).backward(grad.cpu().double())
    for got, ref in zip((x, weight, bias), refs):
        assert_rel_close(got.grad, ref.grad, TOLERANCE[dtype])


@requires_kernel("linear_bwd")
def test_linear_kernel_weight_gradient_over_many_tokens():
    """The shape of a Llama K or V projection's weight gradient, scaled down: few output tiles over a
    long K (the tokens, with a tail), which the kernel runs in 128 x 64 tiles."""
    dtype = torch.bfloat16
    x = torch.randn(4100, 1032, dtype=dtype, device="cuda", requires_grad=True)
    weight = (torch.randn(264, 1032, dtype=dtype, device="cuda") / 32).requires_grad_()
    grad = torch.randn(4100, 264, dtype=dtype, device="cuda")
    tk_ops.linear(x, weight).backward(grad)
    assert_rel_close(weight.grad, float64_product(grad.mT, x.detach()), TOLERANCE[dtype])
    assert_rel_close(x.grad, float64_product(grad, weight.detach()), TOLERANCE[dtype])


@requires_kernel("matmul_bwd")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matmul_kernel_gradients(layout):
    dtype = torch.bfloat16
    a = operand(200, 72, layout[0] == "t", dtype).requires_grad_()
    b = operand(72, 136, layout[1] == "t", dtype).requires_grad_()
    grad = torch.randn(200, 136, dtype=dtype, device="cuda")
    tk_ops.matmul(a, b).backward(grad)
    a_ref, b_ref = (t.detach().cpu().double().requires_grad_() for t in (a, b))
    reference_product(a_ref, b_ref).backward(grad.cpu().double())
    assert_rel_close(a.grad, a_ref.grad, TOLERANCE[dtype])
    assert_rel_close(b.grad, b_ref.grad, TOLERANCE[dtype])


@requires_kernel("matmul_bwd")
def test_expanded_output_gradient_runs_the_backward_kernels():
    """out.sum().backward() hands the backward ones with zero strides: copied, not sent to the reference."""
    a = torch.randn(64, 40, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = torch.randn(40, 48, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = torch.randn(64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    _library._REFERENCE_WARNED.difference_update({"matmul_bwd", "linear_bwd"})
    tk_ops.matmul(a, b).sum().backward()
    tk_ops.linear(b.mT, a, bias).sum().backward()
    assert not {"matmul_bwd", "linear_bwd"} & _library._REFERENCE_WARNED, "a backward ran the reference"
    a_ref, b_ref, bias_ref = (t.detach().cpu().double().requires_grad_() for t in (a, b, bias))
    reference_product(a_ref, b_ref).sum().backward()
    torch.nn.functional.linear(b_ref.mT, a_ref, bias_ref).sum().backward()
    for got, ref in ((a, a_ref), (b, b_ref), (bias, bias_ref)):
        assert_rel_close(got.grad, ref.grad, TOLERANCE[torch.bfloat16])


@requires_kernel("matmul")
def test_matmul_kernel_is_deterministic():
    a = torch.randn(1000, 512, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(512, 2056, dtype=torch.bfloat16, device="cuda")
    first = tk_ops.matmul(a, b)
    for _ in range(20):
        assert torch.equal(tk_ops.matmul(a, b), first)


# ------------------------------------------------------------------------------------- autocast


def test_linear_and_matmul_follow_autocast_like_torch():
    """fp32 master weights under autocast: cast to the autocast dtype, as F.linear / matmul do."""
    x, weight, bias = torch.randn(6, 40), torch.randn(24, 40, requires_grad=True), torch.randn(24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tk_ops.linear(x, weight, bias)
        expected = torch.nn.functional.linear(x, weight, bias)
        product = tk_ops.matmul(out, weight)
        expected_product = torch.matmul(expected, weight)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_rel_close(out, expected, 1e-2)
    assert product.dtype == torch.bfloat16
    assert_rel_close(product, expected_product, 1e-2)
    out.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32


def test_fp64_is_not_autocast():
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tk_ops.matmul(a, b).dtype == torch.float64
