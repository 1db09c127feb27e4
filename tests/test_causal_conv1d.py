"""tk.causal_conv1d: causal depthwise conv1d (+ SiLU), against a naive loop and against
F.conv1d(padding=W - 1)[..., :L] in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tk_ops
import tk_testing
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


def conv1d_reference(x, weight, bias=None, silu=False):
    """causal_conv1d's reference: a depthwise conv1d padded by W - 1 on both sides, cut to L."""
    dim, width = weight.shape
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., : x.shape[-1]]
    return F.silu(out) if silu else out


def float64_reference(x, weight, bias, silu):
    """conv1d_reference of the same (already rounded) values in float64."""
    return conv1d_reference(x.double(), weight.double(), None if bias is None else bias.double(), silu)


def make_inputs(B, D, L, W, *, dtype=torch.float64, param_dtype=None, with_bias=True, device="cpu"):
    """x ~ N(0, 1); taps scaled by W**-0.5 so the output stays O(1); bias ~ N(0, 1)."""
    param_dtype = param_dtype or dtype
    x = torch.randn(B, D, L, device=device).to(dtype)
    weight = (torch.randn(D, W, device=device) / W**0.5).to(param_dtype)
    bias = torch.randn(D, device=device).to(param_dtype) if with_bias else None
    return x, weight, bias


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


# ------------------------------------------------------------------------ opcheck, compile, export


OPCHECK_CASES = [
    ("fp64 bias silu", torch.float64, torch.float64, True, True, False),
    ("fp32 no bias", torch.float32, torch.float32, False, False, False),
    ("bf16 fp32 params silu", torch.bfloat16, torch.float32, True, True, False),
    ("fp64 channel-last", torch.float64, torch.float64, True, True, True),
]


def opcheck_inputs(dtype, param_dtype, with_bias, channel_last):
    x, weight, bias = make_inputs(2, 3, 23, 4, dtype=dtype, param_dtype=param_dtype, with_bias=with_bias)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x, weight, bias


@tk_testing.parametrize_with_ids("dtype, param_dtype, with_bias, silu, channel_last", OPCHECK_CASES)
def test_opcheck_forward(dtype, param_dtype, with_bias, silu, channel_last):
    x, weight, bias = opcheck_inputs(dtype, param_dtype, with_bias, channel_last)
    args = [t.requires_grad_() if t is not None else None for t in (x, weight, bias)]
    torch.library.opcheck(torch.ops.tk.causal_conv1d.default, (*args, silu))


@tk_testing.parametrize_with_ids("dtype, param_dtype, with_bias, silu, channel_last", OPCHECK_CASES)
def test_opcheck_backward(dtype, param_dtype, with_bias, silu, channel_last):
    x, weight, bias = opcheck_inputs(dtype, param_dtype, with_bias, channel_last)
    grad = torch.randn_like(x)
    torch.library.opcheck(torch.ops.tk.causal_conv1d_bwd.default, (grad, x, weight, bias, silu))


@pytest.mark.parametrize("channel_last", [False, True])
def test_compile_fullgraph_forward_and_backward(channel_last):
    x, weight, bias = make_inputs(2, 6, 45, 4, dtype=torch.float32)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    inputs = [t.requires_grad_() for t in (x, weight, bias)]
    grad = torch.randn(x.shape)
    tk_testing.check_compile_fullgraph(
        lambda x, weight, bias: tk_ops.causal_conv1d(x, weight, bias, activation="silu") * 2.0,
        inputs,
        ["causal_conv1d", "causal_conv1d_bwd"],
        loss=lambda out: (out * grad).sum(),
        tol=1e-6,
    )


def test_export():
    class ShortConv(torch.nn.Module):
        def __init__(self, dim, width):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(dim, width) / width**0.5)
            self.bias = torch.nn.Parameter(torch.randn(dim))

        def forward(self, x):  # x (B, L, D), as a mixer has it
            return tk_ops.causal_conv1d(x.transpose(1, 2), self.weight, self.bias, activation="silu").transpose(1, 2)

    tk_testing.check_export(ShortConv(6, 4), (torch.randn(2, 50, 6),), ["causal_conv1d"], tol=1e-6)


# ---------------------------------------------------------------------------------- bad inputs


def _bad_inputs():
    x, weight, bias = make_inputs(2, 3, 16, 4, dtype=torch.float32)
    return [
        ("x not a tensor", lambda: tk_ops.causal_conv1d(x.tolist(), weight), TypeError, "x"),
        ("x rank 2", lambda: tk_ops.causal_conv1d(x[0], weight), ValueError, "x must have 3"),
        ("x rank 4", lambda: tk_ops.causal_conv1d(x[None], weight), ValueError, "x must have 3"),
        ("integer x", lambda: tk_ops.causal_conv1d(x.to(torch.int32), weight), TypeError, "x"),
        ("weight not a tensor", lambda: tk_ops.causal_conv1d(x, weight.tolist()), TypeError, "weight"),
        ("weight rank 1", lambda: tk_ops.causal_conv1d(x, weight[0]), ValueError, "weight must have 2"),
        ("conv1d weight (D, 1, W)", lambda: tk_ops.causal_conv1d(x, weight[:, None]), ValueError, r"squeeze\(1\)"),
        ("W = 0", lambda: tk_ops.causal_conv1d(x, weight[:, :0]), ValueError, r"kernel width W\) must be >= 1"),
        ("weight channels != D", lambda: tk_ops.causal_conv1d(x, torch.randn(4, 4)), ValueError, r"weight\.shape\[0\].*D"),
        ("bias rank 2", lambda: tk_ops.causal_conv1d(x, weight, bias[None]), ValueError, "bias must have 1"),
        ("bias length != D", lambda: tk_ops.causal_conv1d(x, weight, torch.randn(4)), ValueError, r"bias\.shape\[0\]"),
        ("fp64 weight with fp32 x", lambda: tk_ops.causal_conv1d(x, weight.double()), TypeError, "weight"),
        ("bf16 weight with fp32 x", lambda: tk_ops.causal_conv1d(x, weight.bfloat16()), TypeError, "weight"),
        ("fp16 weight with bf16 x", lambda: tk_ops.causal_conv1d(x.bfloat16(), weight.half()), TypeError, "weight"),
        ("fp16 bias with bf16 x", lambda: tk_ops.causal_conv1d(x.bfloat16(), weight, bias.half()), TypeError, "bias"),
        ("integer weight", lambda: tk_ops.causal_conv1d(x, weight.to(torch.int32)), TypeError, "weight"),
        ("activation relu", lambda: tk_ops.causal_conv1d(x, weight, activation="relu"), ValueError, "activation"),
        ("activation True", lambda: tk_ops.causal_conv1d(x, weight, activation=True), ValueError, "activation"),
        ("activation SiLU", lambda: tk_ops.causal_conv1d(x, weight, activation="SiLU"), ValueError, "activation"),
        ("empty batch", lambda: tk_ops.causal_conv1d(x[:0], weight), ValueError, "x must not be empty"),
        ("empty L", lambda: tk_ops.causal_conv1d(x[..., :0], weight), ValueError, "x must not be empty"),
    ]


@tk_testing.parametrize_with_ids("call, error, match", _bad_inputs())
def test_bad_inputs(call, error, match):
    with tk_testing.RecordTkCalls() as recorder:
        with pytest.raises(error, match=match):
            call()
    assert recorder.calls == {}  # raised before any tk op ran


# ------------------------------------------------------------------------------------------ GPU


@requires_cuda
def test_device_mismatch():
    x, weight, bias = make_inputs(2, 3, 16, 4, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        tk_ops.causal_conv1d(x, weight.cpu())
    with pytest.raises(ValueError, match="bias"):
        tk_ops.causal_conv1d(x, weight, bias.cpu())


@requires_cuda
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_gpu_forward_and_gradients(dtype, param_dtype):
    """Whatever serves CUDA tensors today (the reference until a kernel lands) against float64."""
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


@requires_kernel("causal_conv1d")
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("L", [1, 17, 1000, 4096])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_forward_and_gradients(dtype, W, L, channel_last):
    B, D = 2, 4096 + 2 * 128
    x = torch.randn(B, D, L, device="cuda").to(dtype)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    _, weight, bias = make_inputs(B, D, L, W, dtype=dtype, device="cuda")
    out = tk_ops.causal_conv1d(x, weight, bias, activation="silu")
    assert_rel_close(out, float64_reference(x, weight, bias, True), TOLERANCE[dtype])
    grad = torch.randn_like(out)
    got = op_grads(x, weight, bias, True, grad)
    want = reference_grads(conv1d_reference, x, weight, bias, True, grad)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert_rel_close(g, w, 2 * TOLERANCE[dtype], f"grad_{name}")


@requires_kernel("causal_conv1d")
def test_kernel_opcheck():
    x, weight, bias = make_inputs(2, 256, 1000, 4, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.tk.causal_conv1d_bwd.default, (torch.randn_like(x), x, weight, bias, True))
    torch.library.opcheck(torch.ops.tk.causal_conv1d.default, (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), True))
