"""tk.rope / tk.rope_qk against a per-position rotation-matrix reference in float64."""

from __future__ import annotations

import pytest
import torch

import tk_ops
import tk_testing
from inputs.rope import random_angles, reference_rope, tables
from tk_testing import TOLERANCE, assert_rel_close, requires_kernel

# (B, H, N, D, R): odd B, H, N; full rotary at D = 64 and 128, partial rotary at D = 80 with R = 32.
SHAPES = [(2, 3, 7, 64, 64), (1, 5, 9, 128, 128), (3, 1, 11, 80, 32)]
SHAPE_IDS = ["D64", "D128", "D80-R32"]


# ------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rope_matches_rotation_matrices(shape, dtype, interleaved):
    B, H, N, D, R = shape
    x = torch.randn(B, H, N, D, dtype=dtype)
    theta = random_angles(1, N, R)
    cos, sin = tables(theta[0], dtype)  # the half form (N, R/2)
    out = tk_ops.rope(x, cos, sin, interleaved=interleaved)
    assert out.dtype == dtype and out.is_contiguous()
    assert_rel_close(out, reference_rope(x, theta, interleaved), TOLERANCE[dtype])


TABLE_FORMS = {
    # name: (cos/sin batch Bc, how the (Bc, N, R/2) half form is laid out for the call)
    "half (N,R/2)": (1, lambda t: t[0]),
    "batch (B,N,R/2)": ("B", lambda t: t),
    "broadcast (1,N,R/2)": (1, lambda t: t),
    "broadcast (1,1,N,R/2)": (1, lambda t: t[:, None]),
    "broadcast (B,1,N,R/2)": ("B", lambda t: t[:, None]),
    "hf (N,D)": (1, lambda t: torch.cat((t, t), -1)[0]),
    "hf (B,N,D)": ("B", lambda t: torch.cat((t, t), -1)),
    "hf (B,1,N,D)": ("B", lambda t: torch.cat((t, t), -1)[:, None]),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("form", list(TABLE_FORMS))
def test_rope_table_forms(form, interleaved):
    B, H, N, D = 3, 2, 5, 16
    table_batch, layout = TABLE_FORMS[form]
    R = D if form.startswith("hf") else 10
    theta = random_angles(B if table_batch == "B" else 1, N, R)
    x = torch.randn(B, H, N, D, dtype=torch.float64)
    cos, sin = (layout(t) for t in tables(theta, torch.float64))
    out = tk_ops.rope(x, cos, sin, interleaved=interleaved)
    assert_rel_close(out, reference_rope(x, theta, interleaved), TOLERANCE[torch.float64])


def test_rope_normalises_tables_with_views_only():
    B, H, N, D = 2, 3, 5, 16
    x = torch.randn(B, N, H, D).transpose(1, 2)
    cos, sin = tables(random_angles(B, N, D), torch.float32)
    hf_cos, hf_sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    with tk_testing.RecordTkCalls() as record:
        tk_ops.rope(x, hf_cos, hf_sin)
    x_arg, cos_arg, sin_arg, _ = record.calls["rope"][-1]
    assert x_arg.stride() == x.stride() and x_arg.data_ptr() == x.data_ptr()
    assert cos_arg.shape == (B, N, D) and cos_arg.data_ptr() == hf_cos.data_ptr()
    assert sin_arg.shape == (B, N, D) and sin_arg.data_ptr() == hf_sin.data_ptr()
    with tk_testing.RecordTkCalls() as record:
        tk_ops.rope(x, hf_cos, hf_sin, interleaved=True)
    _, cos_arg, sin_arg, _ = record.calls["rope"][-1]
    assert cos_arg.shape == (B, N, D // 2) and cos_arg.data_ptr() == hf_cos.data_ptr()


def hf_rotate_half_formula(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("op", ["rope", "rope_qk"])
def test_full_tables_with_unequal_halves_follow_the_rotate_half_formula(op):
    """Any (N, D) table is applied exactly as ``x * cos + rotate_half(x) * sin`` (what torch.compile rewrites)."""
    B, H, N, D = 2, 3, 5, 8
    x = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(N, D, dtype=torch.float64), torch.randn(N, D, dtype=torch.float64)
    out = tk_ops.rope(x, cos, sin) if op == "rope" else tk_ops.rope_qk(x, x, cos, sin)[0]
    expected = hf_rotate_half_formula(x, cos, sin)
    assert_rel_close(out, expected, TOLERANCE[torch.float64])
    tk_testing.assert_gradients_close(out, (x,), expected, (x,), TOLERANCE[torch.float64], "x")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_partial_rotary_passes_channels_through(interleaved):
    B, H, N, D, R = 2, 3, 7, 80, 32
    x = torch.randn(B, H, N, D, dtype=torch.bfloat16)
    theta = random_angles(1, N, R)
    out = tk_ops.rope(x, *tables(theta[0], torch.float32), interleaved=interleaved)
    assert torch.equal(out[..., R:], x[..., R:])
    assert_rel_close(out, reference_rope(x, theta, interleaved), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table_dtype", [torch.float32, "x"], ids=["fp32-tables", "x-dtype-tables"])
def test_low_precision_x(dtype, table_dtype):
    B, H, N, D = 2, 3, 9, 64
    x = torch.randn(B, H, N, D, dtype=dtype)
    theta = random_angles(1, N, D)
    cos, sin = tables(theta[0], dtype if table_dtype == "x" else table_dtype)
    out = tk_ops.rope(x, cos, sin)
    assert out.dtype == dtype
    assert_rel_close(out, reference_rope(x, theta, False), TOLERANCE[dtype])


def test_fp32_tables_are_more_accurate_than_bf16_tables():
    B, H, N, D = 1, 4, 33, 64
    x = torch.randn(B, H, N, D, dtype=torch.bfloat16)
    theta = random_angles(1, N, D)
    ref = reference_rope(x, theta, False)
    err_fp32 = (tk_ops.rope(x, *tables(theta[0], torch.float32)).double() - ref).norm()
    err_bf16 = (tk_ops.rope(x, *tables(theta[0], torch.bfloat16)).double() - ref).norm()
    assert err_fp32 < err_bf16


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_strided_view_equals_contiguous_copy(interleaved):
    B, H, Hk, N, D = 2, 5, 3, 7, 64
    q = torch.randn(B, N, H, D).transpose(1, 2)
    k = torch.randn(B, N, Hk, D).transpose(1, 2)
    cos, sin = tables(random_angles(B, N, 48), torch.float32)
    # Bit-equal on any machine: each output element is the same few correctly rounded products and
    # sums of the same inputs whatever their strides (no reduction, no BLAS).
    assert torch.equal(tk_ops.rope(q, cos, sin, interleaved=interleaved),
                       tk_ops.rope(q.contiguous(), cos, sin, interleaved=interleaved))
    q_out, k_out = tk_ops.rope_qk(q, k, cos, sin, interleaved=interleaved)
    q_ref, k_ref = tk_ops.rope_qk(q.contiguous(), k.contiguous(), cos, sin, interleaved=interleaved)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()


def test_non_unit_last_stride_is_copied_not_misread():
    B, H, N, D = 2, 3, 5, 16
    x = torch.randn(B, H, N, 2 * D, dtype=torch.float64)[..., ::2]
    cos, sin = tables(random_angles(1, N, D)[0], torch.float64)
    assert torch.equal(tk_ops.rope(x, cos, sin), tk_ops.rope(x.contiguous(), cos, sin))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rope_qk_gqa(interleaved):
    B, Hq, Hk, N, D, R = 2, 7, 3, 9, 80, 32
    q = torch.randn(B, Hq, N, D, dtype=torch.float64)
    k = torch.randn(B, Hk, N, D, dtype=torch.float64)
    theta = random_angles(B, N, R)
    cos, sin = tables(theta, torch.float64)
    q_out, k_out = tk_ops.rope_qk(q, k, cos, sin, interleaved=interleaved)
    assert_rel_close(q_out, reference_rope(q, theta, interleaved), TOLERANCE[torch.float64], "q_out")
    assert_rel_close(k_out, reference_rope(k, theta, interleaved), TOLERANCE[torch.float64], "k_out")
    # rope_qk rotates q and k each as rope does (elementwise, the same operations): bit-equal anywhere.
    assert torch.equal(q_out, tk_ops.rope(q, cos, sin, interleaved=interleaved))
    assert torch.equal(k_out, tk_ops.rope(k, cos, sin, interleaved=interleaved))


# ---------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("table_batch", [1, 3], ids=["shared-tables", "batch-tables"])
def test_rope_gradient(interleaved, table_batch):
    B, H, N, D, R = 3, 2, 7, 80, 32
    x = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    theta = random_angles(table_batch, N, R)
    weight = torch.randn(B, H, N, D, dtype=torch.float64)
    (tk_ops.rope(x, *tables(theta, torch.float64), interleaved=interleaved) * weight).sum().backward()
    (expected,) = torch.autograd.grad((reference_rope(x, theta, interleaved) * weight).sum(), x)
    assert_rel_close(x.grad, expected, TOLERANCE[torch.float64], "grad x")


def test_rope_gradient_of_expanded_output_grad():
    B, H, N, D = 2, 3, 5, 16
    x = torch.randn(B, N, H, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    theta = random_angles(1, N, D)
    tk_ops.rope(x, *tables(theta, torch.float64)).sum().backward()  # the output grad has all strides 0
    (expected,) = torch.autograd.grad(reference_rope(x, theta, False).sum(), x)
    assert_rel_close(x.grad, expected, TOLERANCE[torch.float64], "grad x")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rope_qk_gradient(interleaved):
    B, Hq, Hk, N, D, R = 2, 5, 1, 9, 64, 48
    q = torch.randn(B, Hq, N, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hk, N, D, dtype=torch.float64, requires_grad=True)
    theta = random_angles(B, N, R)
    weight_q, weight_k = torch.randn_like(q), torch.randn_like(k)
    q_out, k_out = tk_ops.rope_qk(q, k, *tables(theta, torch.float64), interleaved=interleaved)
    ((q_out * weight_q).sum() + (k_out * weight_k).sum()).backward()
    expected_loss = (reference_rope(q, theta, interleaved) * weight_q).sum() + (
        reference_rope(k, theta, interleaved) * weight_k
    ).sum()
    expected_q, expected_k = torch.autograd.grad(expected_loss, (q, k))
    assert_rel_close(q.grad, expected_q, TOLERANCE[torch.float64], "grad q")
    assert_rel_close(k.grad, expected_k, TOLERANCE[torch.float64], "grad k")


def test_rope_qk_gradient_when_one_output_or_input_is_unused():
    B, H, N, D = 2, 3, 5, 16
    theta = random_angles(1, N, D)
    cos, sin = tables(theta, torch.float64)
    q = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    q_out, _ = tk_ops.rope_qk(q, k, cos, sin)
    q_out.pow(2).sum().backward()  # k_out gets no gradient: k.grad is zero
    (expected_q,) = torch.autograd.grad(reference_rope(q, theta, False).pow(2).sum(), q)
    assert_rel_close(q.grad, expected_q, TOLERANCE[torch.float64], "grad q")
    assert torch.equal(k.grad, torch.zeros_like(k))

    frozen_k = k.detach()
    q.grad = None
    with tk_testing.RecordTkCalls() as record:
        q_out, k_out = tk_ops.rope_qk(q, frozen_k, cos, sin)
        (q_out.pow(2).sum() + k_out.sum()).backward()
    assert "rope_bwd" in record.calls and "rope_qk_bwd" not in record.calls
    assert_rel_close(q.grad, expected_q, TOLERANCE[torch.float64], "grad q (k frozen)")


# ------------------------------------------------------------------------- autograd off


@pytest.mark.parametrize("name", ["cos", "sin"])
def test_tables_requiring_grad_are_taken_without_autograd(name):
    """Tables that require grad are rejected (tests/op_db.py), except where autograd is off."""
    x = torch.randn(2, 3, 5, 16)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    {"cos": cos, "sin": sin}[name].requires_grad_()
    with torch.no_grad():
        assert torch.equal(tk_ops.rope(x, cos, sin), tk_ops.rope(x, cos.detach(), sin.detach()))


# ------------------------------------------------------------------------------ CUDA kernels

GPU_SHAPES = [(2, 3, 1000, 64, 64), (1, 5, 333, 128, 128), (3, 7, 129, 80, 32)]


@requires_kernel("rope")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=SHAPE_IDS)
def test_rope_kernel(shape, dtype, interleaved):
    B, H, N, D, R = shape
    x = torch.randn(B, N, H, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    theta = random_angles(B, N, R, device="cuda")
    for table_dtype in (torch.float32, dtype):
        cos, sin = tables(theta, table_dtype)
        out = tk_ops.rope(x, cos, sin, interleaved=interleaved)
        assert out.dtype == dtype and out.is_contiguous()
        assert_rel_close(out, reference_rope(x, theta, interleaved), TOLERANCE[dtype])
        assert torch.equal(out[..., R:], x[..., R:])
    weight = torch.randn_like(x)
    (grad,) = torch.autograd.grad((out * weight).sum(), x)
    (expected,) = torch.autograd.grad((reference_rope(x, theta, interleaved) * weight.double()).sum(), x)
    assert_rel_close(grad, expected, TOLERANCE[dtype], "grad x")
    torch.library.opcheck(torch.ops.tk.rope.default, (x, cos, sin, interleaved))
    torch.library.opcheck(torch.ops.tk.rope_bwd.default, (weight, cos, sin, interleaved))


@requires_kernel("rope_qk")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_qk_kernel(dtype, interleaved):
    B, Hq, Hk, N, D = 3, 12, 4, 257, 128
    q = torch.randn(B, N, Hq, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, Hk, N, D, device="cuda", dtype=dtype, requires_grad=True)
    theta = random_angles(1, N, D, device="cuda")
    cos, sin = tables(theta, torch.float32)
    q_out, k_out = tk_ops.rope_qk(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), interleaved=interleaved)
    assert_rel_close(q_out, reference_rope(q, theta, interleaved), TOLERANCE[dtype], "q_out")
    assert_rel_close(k_out, reference_rope(k, theta, interleaved), TOLERANCE[dtype], "k_out")
    weight_q, weight_k = torch.randn_like(q), torch.randn_like(k)
    grads = torch.autograd.grad((q_out * weight_q).sum() + (k_out * weight_k).sum(), (q, k))
    expected_loss = (reference_rope(q, theta, interleaved) * weight_q.double()).sum() + (
        reference_rope(k, theta, interleaved) * weight_k.double()
    ).sum()
    for name, grad, expected in zip("qk", grads, torch.autograd.grad(expected_loss, (q, k))):
        assert_rel_close(grad, expected, TOLERANCE[dtype], f"grad {name}")
    torch.library.opcheck(torch.ops.tk.rope_qk.default, (q, k, cos, sin, interleaved))
    torch.library.opcheck(torch.ops.tk.rope_qk_bwd.default, (weight_q, weight_k, cos, sin, interleaved))


@requires_kernel("rope")
@pytest.mark.parametrize("op", ["rope", "rope_qk"])
@pytest.mark.parametrize("head_dim", [128, 40], ids=["vector-path", "element-path"])  # D/2 = 20: no 16-byte split
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_tables_with_unequal_halves_kernel(op, head_dim, dtype):
    B, H, N = 2, 3, 77
    x = torch.randn(B, N, H, head_dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    cos = torch.randn(N, head_dim, device="cuda")
    sin = torch.randn(N, head_dim, device="cuda")
    out = tk_ops.rope(x, cos, sin) if op == "rope" else tk_ops.rope_qk(x, x, cos, sin)[1]
    expected = hf_rotate_half_formula(x.double(), cos.double(), sin.double())
    assert_rel_close(out, expected, TOLERANCE[dtype])
    tk_testing.assert_gradients_close(out, (x,), expected, (x,), TOLERANCE[dtype], "x")


@requires_kernel("rope_qk")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("table_offset", [0, 1], ids=["aligned-tables", "misaligned-tables"])
def test_rope_qk_kernel_on_fused_projection_views(interleaved, table_offset):
    """q and k as head slices of one padded (B, N, heads, D + pad) projection; tables as strided slices."""
    B, Hq, Hk, N, D, R = 3, 6, 2, 45, 96, 64
    qkv = torch.randn(B, N, Hq + 2 * Hk, D + 16, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :, :Hq, :D].transpose(1, 2).requires_grad_()
    k = qkv[:, :, Hq : Hq + Hk, :D].transpose(1, 2).requires_grad_()
    theta = random_angles(B, N, R, device="cuda")
    storage = torch.randn(2, B, N + 3, R // 2 + 8, device="cuda")
    cos, sin = storage[:, :, 1 : N + 1, table_offset : table_offset + R // 2]
    cos.copy_(theta.cos())
    sin.copy_(theta.sin())
    q_out, k_out = tk_ops.rope_qk(q, k, cos, sin, interleaved=interleaved)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_rel_close(q_out, reference_rope(q, theta, interleaved), TOLERANCE[torch.bfloat16], "q_out")
    assert_rel_close(k_out, reference_rope(k, theta, interleaved), TOLERANCE[torch.bfloat16], "k_out")
    assert torch.equal(q_out[..., R:], q[..., R:]) and torch.equal(k_out[..., R:], k[..., R:])
    q_dense, k_dense = tk_ops.rope_qk(q.contiguous(), k.contiguous(), cos, sin, interleaved=interleaved)
    assert torch.equal(q_out, q_dense) and torch.equal(k_out, k_dense)
    grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
    got = torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k))
    expected_loss = (reference_rope(q, theta, interleaved) * grad_q.double()).sum() + (
        reference_rope(k, theta, interleaved) * grad_k.double()
    ).sum()
    for name, grad, expected in zip("qk", got, torch.autograd.grad(expected_loss, (q, k))):
        assert_rel_close(grad, expected, TOLERANCE[torch.bfloat16], f"grad {name}")


@requires_kernel("rope")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "dtype, head_dim, rotary_dim, x_offset",
    [
        (torch.float32, 64, 48, 0),  # fp32 x: 4-element vectors
        (torch.bfloat16, 64, 64, 1),  # x one element past 16-byte alignment: element path
        (torch.float16, 33, 20, 0),  # odd D, R/2 = 10: element path, 13 pass-through channels
    ],
    ids=["fp32", "misaligned-x", "odd-D"],
)
def test_rope_kernel_other_paths(interleaved, dtype, head_dim, rotary_dim, x_offset):
    B, H, N = 2, 5, 131
    numel = B * H * N * head_dim
    x = torch.randn(numel + x_offset, device="cuda", dtype=dtype)[x_offset:].view(B, H, N, head_dim)
    x.requires_grad_()
    theta = random_angles(1, N, rotary_dim, device="cuda")
    cos, sin = tables(theta[0], torch.float32)
    out = tk_ops.rope(x, cos, sin, interleaved=interleaved)
    assert_rel_close(out, reference_rope(x, theta, interleaved), TOLERANCE[dtype])
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, weight)
    (expected,) = torch.autograd.grad((reference_rope(x, theta, interleaved) * weight.double()).sum(), x)
    assert_rel_close(grad, expected, TOLERANCE[dtype], "grad x")


@requires_kernel("rope_qk")
def test_rope_qk_kernel_many_positions_and_heads():
    """More (positions x head chunks) than the grid has blocks: every block strides over several items."""
    B, Hq, Hk, N, D = 2, 16, 4, 2049, 64
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hk, N, D, device="cuda", dtype=torch.bfloat16)
    theta = random_angles(1, N, D, device="cuda")
    cos, sin = tables(theta, torch.bfloat16)
    q_out, k_out = tk_ops.rope_qk(q, k, cos, sin)
    assert_rel_close(q_out, reference_rope(q, theta, False), TOLERANCE[torch.bfloat16], "q_out")
    assert_rel_close(k_out, reference_rope(k, theta, False), TOLERANCE[torch.bfloat16], "k_out")


@requires_kernel("rope")
def test_kernel_entry_returns_an_empty_output_for_an_empty_batch():
    """Called below the public function (which rejects an empty x), the C++ entry returns an empty CUDA
    tensor; its checks of bad inputs are in tests/op_db.py."""
    x = torch.randn(2, 3, 5, 16, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(2, 1, 5, 8, device="cuda").unbind(0)
    empty = torch.ops.tk.rope(x[:0], cos, sin, False)
    assert empty.shape == (0, 3, 5, 16) and empty.is_cuda
