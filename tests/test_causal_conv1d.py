"""tk.causal_conv1d: causal depthwise conv1d (+ SiLU), against a naive loop and against
F.conv1d(padding=W - 1)[..., :L] in float64; on an sm_90 GPU, its kernels (both layouts, every
dtype and width they take, tails, strided views, NaN past every input and in every fresh
allocation, determinism). Its CUDA graphs and fallbacks: tests/op_db.py, run by tests/test_op_contract.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_ops
import tk_testing
from inputs.causal_conv1d import (conv1d_reference, gpu_activation, kernel_case, make_inputs,
                                  reference_out_and_grads)
from tk_ops.ops import causal_conv1d as causal_conv1d_module
from tk_ops.ops.causal_conv1d import is_channel_last
from tk_testing import TOLERANCE, assert_rel_close, requires_cuda, requires_kernel

SEQ_LENS = [1, 17, 1000]
WIDTHS = [1, 2, 3, 4]


def naive_reference(x, weight, bias=None, silu=False):
    """The definition, one output position and one tap at a time (small shapes only)."""
    batch, dim, seq_len = x.shape
    width = weight.shape[1]
    out = torch.zeros(batch, dim, seq_len, dtype=torch.float64)
    for t in range(seq_len):
        for s in range(width):
            source = t - (width - 1) + s
            if source >= 0:
                out[:, :, t] = out[:, :, t] + weight[:, s].double() * x[:, :, source].double()
    if bias is not None:
        out = out + bias.double()[:, None]
    return F.silu(out) if silu else out


def float64_reference(x, weight, bias, silu):
    """conv1d_reference of the same (already rounded) values in float64."""
    return conv1d_reference(x.double(), weight.double(), None if bias is None else bias.double(), silu)


def activation(silu: bool):
    return "silu" if silu else None


def test_naive_reference_is_conv1d_reference():
    for width in WIDTHS:
        for silu in (False, True):
            x, weight, bias = make_inputs(2, 3, 9, width)
            assert_rel_close(conv1d_reference(x, weight, bias, silu), naive_reference(x, weight, bias, silu), 1e-14)


def test_index_convention():
    """The last tap multiplies the current position, the first the one W - 1 steps back."""
    x = torch.zeros(1, 1, 6, dtype=torch.float64)
    x[0, 0, 2] = 1.0  # an impulse at t = 2
    weight = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    out = tk_ops.causal_conv1d(x, weight)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.0, 0.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("L", [1, 5, 17])
def test_forward_matches_naive_loop(L, W, with_bias, silu):
    x, weight, bias = make_inputs(2, 3, L, W, with_bias=with_bias)
    out = tk_ops.causal_conv1d(x, weight, bias, activation=activation(silu))
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert_rel_close(out, naive_reference(x, weight, bias, silu), TOLERANCE[torch.float64])


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("L", SEQ_LENS)
def test_forward_float64(L, W, with_bias, silu):
    x, weight, bias = make_inputs(3, 5, L, W, with_bias=with_bias)
    out = tk_ops.causal_conv1d(x, weight, bias, activation=activation(silu))
    assert_rel_close(out, conv1d_reference(x, weight, bias, silu), TOLERANCE[torch.float64])


def test_swish_is_silu():
    x, weight, bias = make_inputs(2, 3, 20, 4)
    torch.testing.assert_close(
        tk_ops.causal_conv1d(x, weight, bias, activation="swish"),
        tk_ops.causal_conv1d(x, weight, bias, activation="silu"),
        rtol=0,
        atol=0,
    )


def test_width_longer_than_sequence():
    x, weight, bias = make_inputs(2, 3, 3, 7)
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert_rel_close(out, naive_reference(x, weight, bias, True), TOLERANCE[torch.float64])


LOW_PRECISION_CASES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype, param_dtype", LOW_PRECISION_CASES)
def test_forward_low_precision(dtype, param_dtype, silu):
    x, weight, bias = make_inputs(2, 64, 1000, 4, dtype=dtype, param_dtype=param_dtype)
    out = tk_ops.causal_conv1d(x, weight, bias, activation=activation(silu))
    assert out.dtype == dtype
    assert_rel_close(out, float64_reference(x, weight, bias, silu), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_accumulation(dtype):
    """A 16-bit output is the float64 result rounded once: accumulating in 16 bits would round
    after every tap and miss that rounding on a large share of the elements."""
    x, weight, bias = make_inputs(4, 64, 1000, 4, dtype=dtype)
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    rounded_once = float64_reference(x, weight, bias, True).to(dtype)
    mismatches = (out != rounded_once).sum().item()
    assert mismatches <= 1e-3 * out.numel(), f"{mismatches} of {out.numel()} elements not rounded once"


# ----------------------------------------------------------------------------------- gradients


def op_grads(x, weight, bias, silu, grad):
    leaves = [t.detach().requires_grad_() for t in (x, weight) + (() if bias is None else (bias,))]
    out = tk_ops.causal_conv1d(leaves[0], leaves[1], leaves[2] if bias is not None else None, activation=activation(silu))
    out.backward(grad)
    return [t.grad for t in leaves]


def reference_grads(reference, x, weight, bias, silu, grad):
    leaves = [t.detach().double().requires_grad_() for t in (x, weight) + (() if bias is None else (bias,))]
    out = reference(leaves[0], leaves[1], leaves[2] if bias is not None else None, silu)
    out.backward(grad.double())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("W", WIDTHS)
def test_gradients_match_naive_loop(W, with_bias, silu):
    x, weight, bias = make_inputs(2, 3, 11, W, with_bias=with_bias)
    grad = torch.randn_like(x)
    got = op_grads(x, weight, bias, silu, grad)
    want = reference_grads(naive_reference, x, weight, bias, silu, grad)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert_rel_close(g, w, TOLERANCE[torch.float64], f"grad_{name}")


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("W", WIDTHS)
@pytest.mark.parametrize("L", SEQ_LENS)
def test_gradients_float64(L, W, with_bias, silu):
    x, weight, bias = make_inputs(3, 5, L, W, with_bias=with_bias)
    grad = torch.randn_like(x)
    got = op_grads(x, weight, bias, silu, grad)
    want = reference_grads(conv1d_reference, x, weight, bias, silu, grad)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert_rel_close(g, w, TOLERANCE[torch.float64], f"grad_{name}")


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("W", [1, 3, 4])
def test_gradcheck(W, silu):
    x, weight, bias = (t.requires_grad_() for t in make_inputs(2, 3, 6, W))
    fn = lambda x, weight, bias: tk_ops.causal_conv1d(x, weight, bias, activation=activation(silu))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, weight, bias))


@pytest.mark.parametrize("dtype, param_dtype", LOW_PRECISION_CASES)
def test_gradients_low_precision(dtype, param_dtype):
    x, weight, bias = make_inputs(2, 32, 300, 4, dtype=dtype, param_dtype=param_dtype)
    grad = torch.randn_like(x)
    got = op_grads(x, weight, bias, True, grad)
    want = reference_grads(conv1d_reference, x, weight, bias, True, grad)
    assert [g.dtype for g in got] == [dtype, param_dtype, param_dtype]
    assert_rel_close(got[0], want[0], TOLERANCE[dtype], "grad_x")
    # grad_weight and grad_bias are fp32 reductions of the same rounded values, rounded once.
    assert_rel_close(got[1], want[1], TOLERANCE[param_dtype], "grad_weight")
    assert_rel_close(got[2], want[2], TOLERANCE[param_dtype], "grad_bias")


def test_only_x_requires_grad():
    x, weight, bias = make_inputs(2, 3, 17, 4)
    x.requires_grad_()
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    (grad_x,) = torch.autograd.grad(out, x, torch.ones_like(out))
    want = reference_grads(conv1d_reference, x, weight, bias, True, torch.ones_like(out))[0]
    assert_rel_close(grad_x, want, TOLERANCE[torch.float64])


def test_backward_keeps_the_inputs_not_the_pre_activation():
    x, weight, bias = (t.requires_grad_() for t in make_inputs(2, 3, 17, 4))
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 3 and all(s is t or s.data_ptr() == t.data_ptr() for s, t in zip(saved, (x, weight, bias)))


# -------------------------------------------------------------------------------------- layouts


def x_strides(recorder: tk_testing.RecordTkCalls, op: str = "causal_conv1d") -> list[tuple[int, ...]]:
    return [args[0 if op == "causal_conv1d" else 1].stride() for args in recorder.calls[op]]


def test_channel_last_view_is_read_in_place_and_gives_a_channel_last_output():
    B, D, L, W = 2, 6, 33, 4
    x = torch.randn(B, L, D, dtype=torch.float64).transpose(1, 2)  # a (B, L, D) projection output
    _, weight, bias = make_inputs(B, D, L, W)
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert x_strides(recorder) == [x.stride()]  # no copy
    assert is_channel_last(out) and out.transpose(1, 2).is_contiguous()
    assert_rel_close(out, conv1d_reference(x, weight, bias, True), TOLERANCE[torch.float64])
    tk_testing.check_matches_contiguous_copies(
        lambda x, weight, bias: tk_ops.causal_conv1d(x, weight, bias, activation="silu"), (x, weight, bias)
    )


def test_column_slice_of_a_projection():
    """Mamba-2's xBC: a column slice of the (B, L, d_in_proj) projection, transposed."""
    B, L, D = 2, 29, 5
    projection = torch.randn(B, L, 3 * D, dtype=torch.float64)
    x = projection[..., D : 2 * D].transpose(1, 2)
    _, weight, bias = make_inputs(B, D, L, 4)
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert x_strides(recorder) == [x.stride()]
    assert is_channel_last(out)
    assert_rel_close(out, naive_reference(x, weight, bias, True), TOLERANCE[torch.float64])
    grad = torch.randn_like(out)
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    out = tk_ops.causal_conv1d(*leaves, activation="silu")
    got = torch.autograd.grad(out, leaves, grad)  # .grad of a non-dense leaf would be made contiguous
    assert is_channel_last(got[0])
    for name, g, w in zip(("x", "weight", "bias"), got, reference_grads(conv1d_reference, x, weight, bias, True, grad)):
        assert_rel_close(g, w, TOLERANCE[torch.float64], f"grad_{name}")


def test_other_layouts_are_copied():
    B, D, L = 2, 4, 19
    x = torch.randn(B, D, 2 * L, dtype=torch.float64)[..., ::2]  # stride 2 along L, D not unit either
    weight = torch.randn(4, D, dtype=torch.float64).t()  # a transposed (D, W) weight
    bias = torch.randn(2 * D, dtype=torch.float64)[::2]
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.causal_conv1d(x, weight, bias)
    x_seen, weight_seen, bias_seen, _ = recorder.calls["causal_conv1d"][0]
    assert x_seen.is_contiguous() and weight_seen.is_contiguous() and bias_seen.is_contiguous()
    assert out.is_contiguous()
    assert_rel_close(out, naive_reference(x, weight, bias), TOLERANCE[torch.float64])
    tk_testing.check_matches_contiguous_copies(tk_ops.causal_conv1d, (x, weight, bias))


def test_channel_first_view_with_unit_last_stride_is_not_copied():
    x = torch.randn(6, 2, 40, dtype=torch.float64).transpose(0, 1)  # (B, D, L), unit stride along L
    _, weight, bias = make_inputs(2, 6, 40, 3)
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.causal_conv1d(x, weight, bias)
    assert x_strides(recorder) == [x.stride()]
    assert out.is_contiguous()
    assert_rel_close(out, conv1d_reference(x, weight, bias), TOLERANCE[torch.float64])


# ------------------------------------------------------------------------------------------ GPU


@requires_cuda
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_gpu_forward_and_gradients(dtype, param_dtype):
    """Whatever serves CUDA tensors (the kernels on sm_90, the reference elsewhere) against float64."""
    B, D, L = 2, 96, 1000
    x = torch.randn(B, L, D, device="cuda").to(dtype).transpose(1, 2)  # channel-last, as in a mixer
    _, weight, bias = make_inputs(B, D, L, 4, dtype=dtype, param_dtype=param_dtype, device="cuda")
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert out.dtype == dtype and out.device == x.device
    assert_rel_close(out, float64_reference(x, weight, bias, True), TOLERANCE[dtype])
    grad = torch.randn_like(out)
    got = op_grads(x, weight, bias, True, grad)
    want = reference_grads(conv1d_reference, x, weight, bias, True, grad)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert_rel_close(g, w, 2 * TOLERANCE[dtype], f"grad_{name}")


# ------------------------------------------------------------------------------------ GPU kernels

KERNEL_WIDTHS = [2, 3, 4]
KERNEL_DTYPES = [  # (x dtype, weight and bias dtype)
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.float32, torch.float32),
]
# 4099: odd, past several 1024-position segments and not a multiple of any vector
KERNEL_SEQ_LENS = [1, 17, 1000, 4099]


def on_kernel():
    """Both ops must run their kernels (a reference would warn)."""
    return tk_testing.runs_the_kernels("causal_conv1d", "causal_conv1d_bwd")


def check_kernel_case(gpu, cpu, silu, dtype, param_dtype):
    x, weight, bias, grad = gpu
    with on_kernel():
        out = torch.ops.tk.causal_conv1d(x, weight, bias, silu)
        grads = torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, silu)
    want = reference_out_and_grads(*cpu[:3], silu, cpu[3])
    layout = causal_conv1d_module._new_like_x(x).stride()  # the reference's (and the fake's) strides
    assert out.dtype == dtype and out.stride() == layout
    assert grads[0].dtype == dtype and grads[0].stride() == layout
    assert grads[1].dtype == param_dtype and grads[1].shape == weight.shape
    assert_rel_close(out, want[0], TOLERANCE[dtype])
    assert_rel_close(grads[0], want[1], 2 * TOLERANCE[dtype], "grad_x")
    assert_rel_close(grads[1], want[2], 2 * TOLERANCE[param_dtype], "grad_weight")
    if bias is None:
        assert grads[2].numel() == 0
    else:
        assert grads[2].dtype == param_dtype
        assert_rel_close(grads[2], want[3], 2 * TOLERANCE[param_dtype], "grad_bias")


@requires_kernel("causal_conv1d")
@pytest.mark.parametrize("layout", ["bdl", "bld", "bdl-padded", "bld-slice"])
@pytest.mark.parametrize("L", KERNEL_SEQ_LENS)
@pytest.mark.parametrize("W", KERNEL_WIDTHS)
@pytest.mark.parametrize("dtype, param_dtype", KERNEL_DTYPES)
def test_kernel_matches_float64(poisoned_allocations, dtype, param_dtype, W, L, layout):
    """Forward and backward kernels against float64, with NaN in every fresh allocation (outputs and
    the partial sums a kernel forgets to write stay NaN) and, for the padded layouts, around x, the
    gradient, the weight and the bias (what a kernel reads past an end shows)."""
    gpu, cpu = kernel_case(2, 72, L, W, dtype, param_dtype, layout)
    check_kernel_case(gpu, cpu, True, dtype, param_dtype)


@requires_kernel("causal_conv1d")
@pytest.mark.parametrize("with_bias, silu", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("layout", ["bdl", "bld", "bdl-padded", "bld-slice"])
@pytest.mark.parametrize("W", KERNEL_WIDTHS)
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_kernel_bias_and_silu_options(poisoned_allocations, dtype, param_dtype, W, layout, with_bias, silu):
    gpu, cpu = kernel_case(3, 40, 333, W, dtype, param_dtype, layout, with_bias=with_bias)
    check_kernel_case(gpu, cpu, silu, dtype, param_dtype)


@requires_kernel("causal_conv1d")
@pytest.mark.parametrize("D", [1, 3, 63, 65, 130])
@pytest.mark.parametrize("layout", ["bdl", "bld", "bld-slice"])
def test_kernel_channel_counts(poisoned_allocations, D, layout):
    """Channel counts around a channel-last tile (64 channels) and odd ones (no 4-byte vectors of bf16)."""
    gpu, cpu = kernel_case(2, D, 257, 4, torch.bfloat16, torch.bfloat16, layout)
    check_kernel_case(gpu, cpu, True, torch.bfloat16, torch.bfloat16)


@requires_kernel("causal_conv1d")
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("L", [1, 17, 1000, 4096])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_forward_and_gradients(dtype, W, L, channel_last):
    """Mamba-2's conv width (D = 4096 + 2 * 128) through the public function and autograd."""
    B, D = 2, 4096 + 2 * 128
    x = torch.randn(B, D, L, device="cuda").to(dtype)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    _, weight, bias = make_inputs(B, D, L, W, dtype=dtype, device="cuda")
    with on_kernel():
        out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert_rel_close(out, float64_reference(x, weight, bias, True), TOLERANCE[dtype])
    grad = torch.randn_like(out)
    with on_kernel():
        got = op_grads(x, weight, bias, True, grad)
    want = reference_grads(conv1d_reference, x, weight, bias, True, grad)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert_rel_close(g, w, 2 * TOLERANCE[dtype], f"grad_{name}")


@requires_kernel("causal_conv1d")
def test_kernel_strided_channel_first_views_are_read_in_place():
    """A channel slice and a batch-major view (unit stride along L) reach the kernels uncopied and give
    the numbers of contiguous copies, bit for bit."""
    B, D, L = 3, 40, 300
    storage = torch.randn(D + 16, B, L, device="cuda", dtype=torch.bfloat16)
    x = storage[8 : 8 + D].transpose(0, 1)  # (B, D, L), batch stride L, channel stride B * L
    _, weight, bias = make_inputs(B, D, L, 3, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(B, D, L, device="cuda", dtype=torch.bfloat16)
    with on_kernel(), tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
        grads = torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, True)
    assert recorder.calls["causal_conv1d"][0][0].data_ptr() == x.data_ptr()
    contiguous = x.contiguous()
    torch.testing.assert_close(out, torch.ops.tk.causal_conv1d(contiguous, weight, bias, True), rtol=0, atol=0)
    for got, want in zip(grads, torch.ops.tk.causal_conv1d_bwd(grad, contiguous, weight, bias, True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@requires_kernel("causal_conv1d_bwd")
@pytest.mark.parametrize("x_layout, grad_layout", [("bld", "bdl"), ("bdl", "bld"), ("bld-slice", "bdl-padded")])
def test_kernel_gradient_in_the_other_layout(x_layout, grad_layout):
    """A gradient whose unit stride is not x's is copied to x's layout: same numbers, x's layout out."""
    x, weight, bias = make_inputs(2, 48, 129, 4, dtype=torch.bfloat16)
    grad = torch.randn(2, 48, 129).to(torch.bfloat16)
    x_gpu, grad_gpu = gpu_activation(x, x_layout), gpu_activation(grad, grad_layout)
    weight, bias = weight.cuda(), bias.cuda()
    with on_kernel():
        got = torch.ops.tk.causal_conv1d_bwd(grad_gpu, x_gpu, weight, bias, True)
        same_layout = torch.ops.tk.causal_conv1d_bwd(gpu_activation(grad, x_layout), x_gpu, weight, bias, True)
    assert is_channel_last(got[0]) == is_channel_last(x_gpu)
    for g, w in zip(got, same_layout):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@requires_kernel("causal_conv1d_bwd")
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_kernel_parameter_gradients_are_deterministic(layout):
    """Fixed-order sums of per-block partials: grad_weight and grad_bias are the same bits on every run."""
    gpu, _ = kernel_case(4, 256, 2000, 4, torch.bfloat16, torch.float32, layout)
    x, weight, bias, grad = gpu
    with on_kernel():
        first = torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, True)
        for _ in range(3):
            again = torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, True)
            for got, want in zip(again, first):
                assert torch.equal(got, want)

