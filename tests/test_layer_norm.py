"""tk.layer_norm (residual add, dropout) against a float64 reference built on torch.var_mean."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import tk_ops
from inputs.layer_norm import EPS, make_inputs
from tk_ops.ops.layer_norm import dropout_hash, dropout_keep_mask
from tk_testing import (TOLERANCE, assert_rel_close, capture_cuda_graph, on_gpu_rows, on_gpu_with_canary,
                        requires_kernel)

# Odd row counts and hidden sizes that are no multiple of 8; one 1-D input, one 4-D input.
SHAPES = [(37,), (5, 100), (3, 7, 37), (2, 3, 5, 19)]
SHAPE_IDS = ["1d-C37", "2d-C100", "3d-C37", "4d-C19"]


def reference_layer_norm(x, weight, bias, eps=EPS, residual=None, keep=None, dropout_p=0.0):
    """float64 (out, h): h = x * keep / (1 - p) + residual; out = (h - E[h]) / sqrt(Var[h] + eps) * w + b."""
    h = x.double()
    if keep is not None:
        h = h * keep / (1 - dropout_p)
    if residual is not None:
        h = h + residual.double()
    variance, mean = torch.var_mean(h, dim=-1, unbiased=False, keepdim=True)
    out = (h - mean) / torch.sqrt(variance + eps)
    if weight is not None:
        out = out * weight.double()
    if bias is not None:
        out = out + bias.double()
    return out, h


def python_dropout_hash(seed: int, index: int) -> int:
    """The hash of the tk_ops.ops.layer_norm docstring on unbounded Python integers."""
    low32 = 0xFFFFFFFF

    def mix32(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & low32
        v ^= v >> 15
        v = (v * 0x846CA68B) & low32
        return v ^ (v >> 16)

    seed &= 0xFFFFFFFFFFFFFFFF
    key_a = mix32((seed & low32) ^ 0x9E3779B9)
    key_b = mix32((seed >> 32) ^ key_a)
    return mix32(mix32((index & low32) ^ key_b) ^ (index >> 32) ^ key_a)


def seed_drawn_after(generator_seed: int) -> torch.Tensor:
    """The dropout seed tk.layer_norm draws right after ``torch.manual_seed(generator_seed)``."""
    torch.manual_seed(generator_seed)
    return torch.randint(0, 2**62, (), dtype=torch.int64)


# ------------------------------------------------------------------------------------ forward

VARIANTS = {
    "plain": dict(affine="both"),
    "no-affine": dict(affine="none"),
    "weight-only": dict(affine="weight"),
    "bias-only": dict(affine="bias"),
    "residual": dict(affine="both", residual_dtype=torch.float64),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference_float64(shape, variant):
    x, weight, bias, residual = make_inputs(shape, **VARIANTS[variant])
    out, h = tk_ops.layer_norm(x, weight, bias, EPS, residual=residual, return_residual=True)
    expected_out, expected_h = reference_layer_norm(x, weight, bias, residual=residual)
    assert out.dtype == h.dtype == torch.float64 and out.is_contiguous() and h.is_contiguous()
    assert_rel_close(out, expected_out, TOLERANCE[torch.float64])
    assert_rel_close(h, expected_h, 0.0, "h")  # h = x + residual: one float64 add each side, exact anywhere
    # The same call in the same process (return_residual only picks the outputs): the same bits.
    assert torch.equal(tk_ops.layer_norm(x, weight, bias, EPS, residual=residual), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual_kind", ["x-dtype", "fp32"])
def test_low_precision_matches_reference(dtype, residual_kind):
    residual_dtype = dtype if residual_kind == "x-dtype" else torch.float32
    x, weight, bias, residual = make_inputs((9, 77), dtype, residual_dtype=residual_dtype)
    out, h = tk_ops.layer_norm(x, weight, bias, residual=residual, return_residual=True)
    assert out.dtype == dtype and h.dtype == residual_dtype
    expected_out, expected_h = reference_layer_norm(x, weight, bias, residual=residual)
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    assert_rel_close(h, expected_h, TOLERANCE[residual_dtype], "h")
    # The norm reads h as returned (rounded to its dtype), like an eager add followed by F.layer_norm.
    eager = torch.nn.functional.layer_norm(h.float(), (77,), weight.float(), bias.float(), EPS)
    assert_rel_close(out, eager.to(dtype), TOLERANCE[dtype])


def test_fp32_parameters_with_bf16_input():
    x, _, _, residual = make_inputs((7, 45), torch.bfloat16, affine="none", residual_dtype=torch.bfloat16)
    weight, bias = torch.randn(45), torch.randn(45)
    out = tk_ops.layer_norm(x, weight, bias, residual=residual)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, reference_layer_norm(x, weight, bias, residual=residual)[0], TOLERANCE[torch.bfloat16])


def test_statistics_are_fp32_with_leading_shape():
    x, weight, bias, _ = make_inputs((3, 5, 21), torch.bfloat16)
    out, h, mean, rstd = torch.ops.tk.layer_norm(x, weight, bias, None, None, EPS, 0.0)
    assert mean.shape == rstd.shape == (3, 5) and mean.dtype == rstd.dtype == torch.float32
    assert h.numel() == 0  # nothing to add: the backward reads x itself
    variance, expected_mean = torch.var_mean(x.double(), dim=-1, unbiased=False)
    assert_rel_close(mean, expected_mean, 1e-6, "mean")
    assert_rel_close(rstd, torch.rsqrt(variance + EPS), 1e-6, "rstd")


def test_return_residual_without_residual_is_a_copy_of_x():
    x, weight, bias, _ = make_inputs((5, 33), requires_grad=True)
    out, h = tk_ops.layer_norm(x, weight, bias, return_residual=True)
    assert torch.equal(h, x) and h.data_ptr() != x.data_ptr()
    (out.sum() + (3 * h).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    reference_layer_norm(x_ref, weight, bias)[0].sum().backward()
    assert_rel_close(x.grad, x_ref.grad + 3, TOLERANCE[torch.float64], "grad x")


def test_transposed_view_matches_contiguous_copy():
    base = torch.randn(11, 3, 40, dtype=torch.float64)
    x = base.transpose(0, 1)  # (3, 11, 40), unit last stride, leading dims permuted
    residual = torch.randn(3, 11, 40, dtype=torch.float64)
    weight, bias = torch.randn(40, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    for dropout_p in (0.0, 0.4):
        torch.manual_seed(7)
        strided = tk_ops.layer_norm(x, weight, bias, residual=residual, dropout_p=dropout_p)
        torch.manual_seed(7)
        dense = tk_ops.layer_norm(x.contiguous(), weight, bias, residual=residual, dropout_p=dropout_p)
        # Bit-equal on any machine: the rows hold the same values and each row's statistics are
        # reduced over the same unit-stride row of 40 (the leading strides pick only which row).
        assert torch.equal(strided, dense)


def test_non_unit_last_stride_is_copied_not_misread():
    x = torch.randn(5, 60, dtype=torch.float64)[:, ::2]
    weight = torch.randn(60, dtype=torch.float64)[::2]
    out = tk_ops.layer_norm(x, weight, None)
    assert_rel_close(out, reference_layer_norm(x, weight, None)[0], TOLERANCE[torch.float64])


# ------------------------------------------------------------------------------------ dropout


def test_dropout_hash_matches_python_integers():
    seeds = [0, 1, 2**62 - 1, 0x0123456789ABCDEF, -5, *torch.randint(0, 2**62, (4,)).tolist()]
    indices = [0, 1, 2, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 11, *torch.randint(0, 2**45, (20,)).tolist()]
    for seed in seeds:
        got = dropout_hash(torch.tensor(seed), torch.tensor(indices)).tolist()
        assert got == [python_dropout_hash(seed, i) for i in indices], f"seed {seed}"
    # Known answers pin the definition the CUDA kernel reproduces.
    assert python_dropout_hash(0, 0) == 0x9E0D11A8
    assert python_dropout_hash(0x0123456789ABCDEF, 2**32 + 5) == 0x8F7F3721


def test_dropout_output_uses_the_mask_and_scale():
    p = 0.3
    x, weight, bias, residual = make_inputs((13, 57), residual_dtype=torch.float64)
    torch.manual_seed(123)
    out, h = tk_ops.layer_norm(x, weight, bias, residual=residual, dropout_p=p, return_residual=True)
    keep = dropout_keep_mask(seed_drawn_after(123), x.shape, p)
    expected_out, expected_h = reference_layer_norm(x, weight, bias, residual=residual, keep=keep, dropout_p=p)
    assert_rel_close(h, expected_h, TOLERANCE[torch.float64], "h")
    assert_rel_close(out, expected_out, TOLERANCE[torch.float64])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_and_independence(p):
    x = torch.rand(1021, 1027) + 0.5  # never zero, so h == 0 exactly where dropped
    h = tk_ops.layer_norm(x, None, None, residual=torch.zeros_like(x), dropout_p=p, return_residual=True)[1]
    kept = h != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.003
    # One correctly rounded product by the same fp32 scale (plus an exact + 0): bit-equal anywhere.
    assert torch.equal(h[kept], x[kept] * torch.tensor(1 / (1 - p), dtype=torch.float32))
    # No structure along rows or columns, nor between neighbours.
    assert (kept.float().mean(0) - (1 - p)).abs().max() < 0.07
    assert (kept.float().mean(1) - (1 - p)).abs().max() < 0.07
    neighbours = torch.corrcoef(torch.stack([kept[:, :-1].flatten().float(), kept[:, 1:].flatten().float()]))
    assert abs(neighbours[0, 1].item()) < 0.01


def test_dropout_reproducible_under_manual_seed_and_fresh_otherwise():
    p = 0.3
    x = torch.rand(33, 129) + 0.5
    zeros = torch.zeros_like(x)

    def dropped():
        return tk_ops.layer_norm(x, None, None, residual=zeros, dropout_p=p, return_residual=True)[1] == 0

    torch.manual_seed(2024)
    first, second = dropped(), dropped()
    torch.manual_seed(2024)
    assert torch.equal(dropped(), first)
    # Two draws agree where both keep or both drop: p^2 + (1-p)^2 for independent masks.
    agreement = (first == second).float().mean().item()
    assert abs(agreement - (p**2 + (1 - p) ** 2)) < 0.03


def test_no_dropout_draws_no_random_numbers():
    x, weight, bias, residual = make_inputs((3, 17), residual_dtype=torch.float64)
    state = torch.get_rng_state()
    tk_ops.layer_norm(x, weight, bias, residual=residual, return_residual=True)
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------------------------- gradients

GRADIENT_CASES = {
    "plain": dict(affine="both"),
    "no-affine": dict(affine="none"),
    "residual-return": dict(affine="both", residual_dtype=torch.float64, return_residual=True),
    "dropout": dict(affine="weight", dropout_p=0.35),
    "dropout-residual-return": dict(affine="both", residual_dtype=torch.float64, dropout_p=0.2, return_residual=True),
}


@pytest.mark.parametrize("shape", [(7, 37), (2, 5, 100)], ids=["2d-C37", "3d-C100"])
@pytest.mark.parametrize("case", GRADIENT_CASES)
def test_gradients_match_reference(shape, case):
    options = dict(GRADIENT_CASES[case])
    return_residual = options.pop("return_residual", False)
    dropout_p = options.pop("dropout_p", 0.0)
    inputs = make_inputs(shape, requires_grad=True, **options)
    x, weight, bias, residual = inputs
    grad_out, grad_h = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)

    torch.manual_seed(99)
    result = tk_ops.layer_norm(x, weight, bias, residual=residual, dropout_p=dropout_p, return_residual=return_residual)
    out, h = result if return_residual else (result, None)
    loss = (out * grad_out).sum() + ((h * grad_h).sum() if return_residual else 0)
    present = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(loss, present)

    keep = dropout_keep_mask(seed_drawn_after(99), shape, dropout_p) if dropout_p > 0 else None
    expected_out, expected_h = reference_layer_norm(x, weight, bias, residual=residual, keep=keep, dropout_p=dropout_p)
    expected_loss = (expected_out * grad_out).sum() + ((expected_h * grad_h).sum() if return_residual else 0)
    expected_grads = torch.autograd.grad(expected_loss, present)
    for name, got, expected in zip("x weight bias residual".split(), grads, expected_grads):
        assert_rel_close(got, expected, 1e-9, f"grad {name}")


def test_gradient_through_h_only():
    x, weight, bias, residual = make_inputs((6, 23), residual_dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    _, h = tk_ops.layer_norm(x, weight, bias, residual=residual, dropout_p=0.25, return_residual=True)
    h.sum().backward()
    keep = dropout_keep_mask(seed_drawn_after(5), x.shape, 0.25)
    assert torch.equal(residual.grad, torch.ones_like(residual))
    assert_rel_close(x.grad, keep.double() / 0.75, 1e-12, "grad x")
    assert weight.grad is None and bias.grad is None


def test_fp32_residual_gets_fp32_gradient():
    x, weight, bias, residual = make_inputs((5, 31), torch.bfloat16, residual_dtype=torch.float32, requires_grad=True)
    out, h = tk_ops.layer_norm(x, weight, bias, residual=residual, return_residual=True)
    (out.float().sum() + h.sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and residual.grad.dtype == torch.float32
    assert weight.grad.dtype == bias.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------------------- CUDA kernel

HIDDEN_SIZES = [256, 1000, 1024, 4000, 4096, 8192]

# Row plans that leave accesses past the end of a row (37: one element per access, 32 threads x 8
# for 37 elements; 1032: a second warp for one 16-byte access; 1000, 4000: a partial last warp),
# with dropout and no residual, and row-strided inputs with a residual (and dropout).
EDGE_CASES = {  # id: (hidden, residual, dropout_p, layout)
    "C37-dropout": (37, False, 0.15, "contiguous"),
    "C1032-dropout": (1032, False, 0.15, "contiguous"),
    "C4000-residual-strided": (4000, True, 0.0, "row-strided"),
    "C1000-residual-dropout-strided": (1000, True, 0.15, "row-strided"),
}
EDGE_ROWS = 67


@requires_kernel("layer_norm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("parameter_kind", ["x-dtype", "fp32"])
@pytest.mark.parametrize("case", EDGE_CASES)
def test_kernel_writes_every_output_and_reads_nothing_past_the_ends(poisoned_allocations, dtype, parameter_kind, case):
    hidden, with_residual, p, layout = EDGE_CASES[case]
    parameter_dtype = dtype if parameter_kind == "x-dtype" else torch.float32
    residual_dtype = torch.float64 if with_residual else None
    x64, weight64, bias64, residual64 = make_inputs((EDGE_ROWS, hidden), residual_dtype=residual_dtype)
    x = on_gpu_rows(x64.to(dtype), layout)
    residual = on_gpu_rows(residual64.to(dtype), layout) if with_residual else None
    weight, bias = on_gpu_with_canary(weight64.to(parameter_dtype)), on_gpu_with_canary(bias64.to(parameter_dtype))
    seed = torch.tensor(0x0123_4567_89AB_CDEF, dtype=torch.int64, device="cuda") if p > 0 else None
    out, h, mean, rstd = torch.ops.tk.layer_norm(x, weight, bias, residual, seed, EPS, p)

    leaves = [t.cpu().double().requires_grad_() for t in (x, weight, bias, residual) if t is not None]
    keep = dropout_keep_mask(seed.cpu(), x.shape, p) if p > 0 else None
    expected_out, expected_h = reference_layer_norm(
        *leaves[:3], residual=leaves[3] if with_residual else None, keep=keep, dropout_p=p
    )
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    grad_out = on_gpu_rows(torch.randn(EDGE_ROWS, hidden, dtype=dtype), layout)
    grad_h = on_gpu_rows(torch.randn(EDGE_ROWS, hidden, dtype=h.dtype), layout) if with_residual else None
    loss = (expected_out * grad_out.cpu().double()).sum()
    if with_residual:
        loss = loss + (expected_h * grad_h.cpu().double()).sum()
    grads = torch.autograd.grad(loss, leaves)
    expected = {"x": grads[0], "weight": grads[1], "bias": grads[2], "residual": grads[3] if with_residual else None}

    saved_h = h if h.numel() else x
    masks = ([True, with_residual, True, True], [True, False, False, False], [True, False, True, True],
             [False, False, True, True])
    for mask in masks:
        got = torch.ops.tk.layer_norm_bwd(grad_out, grad_h, saved_h, weight, bias, mean, rstd, seed, p, mask)
        for name, wanted, gradient in zip(("x", "residual", "weight", "bias"), mask, got):
            if wanted:
                assert_rel_close(gradient, expected[name], TOLERANCE[dtype], f"grad {name}, output_mask {mask}")
            else:
                assert gradient.numel() == 0


@requires_kernel("layer_norm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_kernel_matches_reference(dtype, hidden):
    shape = (3, 59, hidden)
    x, weight, bias, residual = (
        t.cuda() for t in make_inputs(shape, dtype, residual_dtype=torch.float32, requires_grad=False)
    )
    for t in (x, weight, bias, residual):
        t.requires_grad_()
    out, h = tk_ops.layer_norm(x, weight, bias, residual=residual, return_residual=True)
    expected_out, expected_h = reference_layer_norm(x, weight, bias, residual=residual)
    assert_rel_close(out, expected_out, TOLERANCE[dtype])
    assert_rel_close(h, expected_h, TOLERANCE[torch.float32], "h")
    grad_out, grad_h = torch.randn_like(out), torch.randn_like(h)
    grads = torch.autograd.grad((out * grad_out).sum() + (h * grad_h).sum(), (x, weight, bias, residual))
    expected_loss = (expected_out * grad_out.double()).sum() + (expected_h * grad_h.double()).sum()
    expected_grads = torch.autograd.grad(expected_loss, (x, weight, bias, residual))
    for name, got, expected in zip("x weight bias residual".split(), grads, expected_grads):
        assert_rel_close(got, expected, TOLERANCE[dtype], f"grad {name}")


@requires_kernel("layer_norm")
@pytest.mark.parametrize("hidden", [1000, 4096])
def test_kernel_dropout_mask_is_the_reference_mask(hidden):
    x = (torch.rand(67, hidden) + 0.5).bfloat16()
    zeros = torch.zeros_like(x)
    seed = torch.tensor(0x0FED_CBA9_8765_4321, dtype=torch.int64)
    args = (None, None, zeros, seed, EPS, 0.3)
    _, h_cpu, _, _ = torch.ops.tk.layer_norm(x, *args)
    _, h_cuda, _, _ = torch.ops.tk.layer_norm(x.cuda(), *(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    assert torch.equal(h_cuda.cpu() == 0, h_cpu == 0)
    assert torch.equal(h_cuda.cpu(), h_cpu)


@requires_kernel("layer_norm")
def test_kernel_cuda_graph_draws_fresh_masks_per_replay():
    p = 0.4
    x = (torch.rand(129, 1000, device="cuda") + 0.5).bfloat16()
    zeros = torch.zeros_like(x)
    weight, bias = torch.ones(1000, device="cuda", dtype=torch.bfloat16), None
    graph, (_, h) = capture_cuda_graph(
        lambda: tk_ops.layer_norm(x, weight, bias, residual=zeros, dropout_p=p, return_residual=True))
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        masks.append((h != 0).cpu())
    for mask in masks:
        assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


# A fresh process's order of backward calls: first with only the bias's gradient (one array of column
# sums in the kernel's shared memory), then with the weight's and the bias's (two). The limit the first
# launch set must not hold the second to it (it failed with "CUDA error: invalid argument" when
# tk::pipeline::allow_shared_bytes kept the first limit for good).
GROWING_SHARED_MEMORY = """
import torch, tk_ops
x = torch.randn(15, 48, dtype=torch.bfloat16, device="cuda", requires_grad=True)
frozen = torch.randn(48, dtype=torch.bfloat16, device="cuda")
weight, bias = (torch.randn(48, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
for w in (frozen, weight):
    grads = torch.autograd.grad(tk_ops.layer_norm(x, w, bias).float().square().sum(), [x, bias] + [w] * w.requires_grad)
    x64, w64, b64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, bias))
    expected = torch.autograd.grad(torch.nn.functional.layer_norm(x64, (48,), w64, b64, 1e-5).square().sum(),
                                   [x64, b64] + [w64] * w.requires_grad)
    for got, want in zip(grads, expected):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 2e-2, error
print("ok")
"""


@requires_kernel("layer_norm_bwd")
def test_kernel_backward_after_a_smaller_one_in_a_fresh_process():
    child = subprocess.run([sys.executable, "-c", GROWING_SHARED_MEMORY], capture_output=True, text=True,
                           cwd=pathlib.Path(__file__).resolve().parents[1], timeout=300)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stdout + child.stderr
