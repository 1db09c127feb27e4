"""tk.fftconv: causal long convolution through the FFT, against a direct float64 convolution."""

from __future__ import annotations

import pytest
import torch

import tk_ops
import tk_testing
from inputs.fftconv import KERNEL_TOLERANCE, check_backward, conv_reference, float64_reference, make_inputs
from tk_ops.ops.fftconv import _fft_size
from tk_testing import TOLERANCE, assert_rel_close, requires_kernel

# (B, H, N, L): L == N, L < N, L == 1, N not a power of two, N a power of two with L == N.
SHAPES = [(2, 3, 37, 37), (3, 5, 100, 29), (2, 3, 53, 1), (1, 7, 100, 100), (2, 3, 256, 256)]


def test_conv_reference_matches_the_definition():
    u, k, D = make_inputs(2, 3, 11, 5)
    expected = D[:, None] * u
    for s in range(k.shape[1]):  # y[t] += k[s] * u[t - s], straight from the contract
        expected[..., s:] += k[:, s, None] * u[..., : u.shape[-1] - s]
    assert_rel_close(conv_reference(u, k, D), expected, 1e-14)


def test_fft_size_is_the_smallest_5_smooth_size():
    def is_5_smooth(n):
        for p in (2, 3, 5):
            while n % p == 0:
                n //= p
        return n == 1

    for n in range(1, 400):
        size = _fft_size(n)
        assert size >= n and is_5_smooth(size)
        assert not any(is_5_smooth(m) for m in range(n, size)), n
    assert _fft_size(2 * 16384 - 1) == 2 * 16384


@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_float64(shape, with_D):
    u, k, D = make_inputs(*shape, with_D=with_D)
    out = tk_ops.fftconv(u, k, D=D)
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert_rel_close(out, conv_reference(u, k, D), TOLERANCE[torch.float64])


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_forward_low_precision(dtype, param_dtype):
    u, k, D = make_inputs(2, 3, 100, 45, dtype=dtype, param_dtype=param_dtype)
    out = tk_ops.fftconv(u, k, D=D)
    assert out.dtype == dtype
    assert_rel_close(out, float64_reference(u, k, D), TOLERANCE[dtype])


def fftconv_grads(u, k, D, grad):
    leaves = [t.detach().requires_grad_() for t in (u, k) + (() if D is None else (D,))]
    out = tk_ops.fftconv(leaves[0], leaves[1], D=leaves[2] if D is not None else None)
    out.backward(grad)
    return [t.grad for t in leaves]


def reference_grads(u, k, D, grad):
    leaves = [t.detach().double().requires_grad_() for t in (u, k) + (() if D is None else (D,))]
    out = conv_reference(leaves[0], leaves[1], leaves[2] if D is not None else None)
    out.backward(grad.double())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_float64(shape, with_D):
    u, k, D = make_inputs(*shape, with_D=with_D)
    grad = torch.randn_like(u)
    for name, got, want in zip("ukD", fftconv_grads(u, k, D, grad), reference_grads(u, k, D, grad)):
        assert_rel_close(got, want, TOLERANCE[torch.float64], f"grad_{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_low_precision_with_fp32_filter(dtype):
    u, k, D = make_inputs(3, 2, 64, 19, dtype=dtype, param_dtype=torch.float32)
    grad = torch.randn_like(u)
    got = fftconv_grads(u, k, D, grad)
    want = reference_grads(u, k, D, grad)
    assert [g.dtype for g in got] == [dtype, torch.float32, torch.float32]
    assert_rel_close(got[0], want[0], TOLERANCE[dtype], "grad_u")
    # grad_k and grad_D are reduced in fp32 from the same rounded values and kept in fp32.
    assert_rel_close(got[1], want[1], TOLERANCE[torch.float32], "grad_k")
    assert_rel_close(got[2], want[2], TOLERANCE[torch.float32], "grad_D")


def u_strides(recorder: tk_testing.RecordTkCalls) -> list[tuple[int, ...]]:
    """The strides of u in each call of tk.fftconv."""
    return [u.stride() for u, *_ in recorder.calls["fftconv"]]


def test_strided_views():
    B, H, N, L = 2, 5, 41, 13
    u_bnh = torch.randn(B, N, H, dtype=torch.float64)  # (B, N, H) storage: u's last stride is H
    k_lh = torch.randn(L, H, dtype=torch.float64)
    D_every_other = torch.randn(2 * H, dtype=torch.float64)[::2]
    u, k, D = u_bnh.transpose(1, 2), k_lh.t(), D_every_other
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.fftconv(u, k, D=D)
    assert u_strides(recorder) == [(N * H, N, 1)]  # copied, never read with stride H along N
    assert_rel_close(out, conv_reference(u, k, D), TOLERANCE[torch.float64])
    grad = torch.randn_like(out)
    for name, got, want in zip("ukD", fftconv_grads(u, k, D, grad), reference_grads(u, k, D, grad)):
        assert_rel_close(got, want, TOLERANCE[torch.float64], f"grad_{name}")

    # A head-major view with a unit last stride reaches the op as it is, without a copy.
    u_hbn = torch.randn(H, B, N, dtype=torch.float64).transpose(0, 1)
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.fftconv(u_hbn, k, D=D)
    assert u_strides(recorder) == [u_hbn.stride()]
    assert_rel_close(out, conv_reference(u_hbn, k, D), TOLERANCE[torch.float64])


# --------------------------------------------------------------------------------- CUDA kernel

KERNEL_SEQ_LENS = [256, 512, 1024, 2048, 4096, 8192, 16384]
FP32_KERNEL_SEQ_LENS = [256, 512, 1024, 2048, 4096, 8192]
def no_reference_warning():
    """Fails on the reference's warning: the kernels themselves must serve the calls."""
    return tk_testing.runs_the_kernels("fftconv", "fftconv_bwd")


def poisoned_allocations(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs a kernel forgets to write stay NaN."""
    torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")


@requires_kernel("fftconv")
@pytest.mark.parametrize("N", KERNEL_SEQ_LENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("filter_len", ["N", "odd", "1"])
def test_kernel_forward(dtype, N, filter_len):
    L = {"N": N, "odd": N // 3 + 1, "1": 1}[filter_len]
    u, k, D = make_inputs(2, 3, N, L, dtype=dtype, param_dtype=torch.float32, device="cuda")
    poisoned_allocations(4 * u.numel() * u.element_size())
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert out.dtype == dtype and out.device == u.device and out.is_contiguous()
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[dtype])


@requires_kernel("fftconv")
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("param_dtype", ["u's", "fp32"])
def test_kernel_odd_batches_skip_term_and_parameter_dtypes(B, with_D, param_dtype):
    """Sequences travel in pairs: an odd B leaves one alone; D off and 16-bit filters take the same path."""
    dtype = torch.float16
    u, k, D = make_inputs(B, 5, 1024, 700, dtype=dtype, with_D=with_D, device="cuda",
                          param_dtype=dtype if param_dtype == "u's" else torch.float32)
    poisoned_allocations(4 * u.numel() * u.element_size())
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[dtype])


@requires_kernel("fftconv")
@pytest.mark.parametrize("N", [37, 100, 1000, 3000, 9000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_forward_padded_seq_len(dtype, N):
    """Other N run at the next power of two (from 256), zero-padded at the end: still the kernel."""
    u, k, D = make_inputs(3, 5, N, N // 2 + 1, dtype=dtype, device="cuda")
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert out.shape == u.shape and out.is_contiguous()
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[dtype])


@requires_kernel("fftconv")
def test_kernel_strided_u():
    B, H, N, L = 3, 4, 2048, 999
    dtype = torch.bfloat16
    _, k, D = make_inputs(B, H, N, L, dtype=dtype, param_dtype=torch.float32, device="cuda")
    # Head-major storage (H, B, N): read in place (aligned rows, any batch/head strides).
    u_heads = torch.randn(H, B, N, device="cuda").to(dtype).transpose(0, 1)
    # Rows that start one element off 16 bytes: the op copies them first.
    u_shifted = torch.randn(B, H, N + 1, device="cuda").to(dtype)[..., 1:]
    for u in (u_heads, u_shifted):
        with no_reference_warning():
            out = tk_ops.fftconv(u, k, D=D)
        assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[dtype])


@requires_kernel("fftconv")
def test_kernel_many_heads_and_pairs():
    """More pairs than the persistent grid holds blocks: every block takes several, heads in turn."""
    u, k, D = make_inputs(16, 96, 512, 512, dtype=torch.bfloat16, param_dtype=torch.float32, device="cuda")
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[torch.bfloat16])


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("N", KERNEL_SEQ_LENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_backward(dtype, N, with_D):
    u, k, D = make_inputs(2, 3, N, N // 3 + 1, dtype=dtype, param_dtype=torch.float32, with_D=with_D, device="cuda")
    grad = torch.randn_like(u)
    poisoned_allocations(8 * u.numel() * u.element_size())
    with no_reference_warning():
        got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    check_backward(got, grad, u, k, D, dtype)


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("param_dtype", ["u's", "fp32"])
@pytest.mark.parametrize("filter_len", ["N", "1"])
def test_kernel_backward_batches_filter_lengths_and_parameter_dtypes(B, param_dtype, filter_len):
    """An odd B leaves one sequence alone in the last pair; grad_k sums B / 2 pairs per head; L = N
    and L = 1 are the longest and the shortest grad_k; 16-bit k and D get their gradients cast."""
    dtype = torch.float16
    N = 1024
    u, k, D = make_inputs(B, 5, N, N if filter_len == "N" else 1, dtype=dtype, device="cuda",
                          param_dtype=dtype if param_dtype == "u's" else torch.float32)
    grad = torch.randn_like(u)
    poisoned_allocations(8 * u.numel() * u.element_size())
    with no_reference_warning():
        got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    check_backward(got, grad, u, k, D, dtype)


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("N", [37, 1000, 3000, 9000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_backward_padded_seq_len(dtype, N):
    u, k, D = make_inputs(3, 5, N, N // 2 + 1, dtype=dtype, param_dtype=torch.float32, device="cuda")
    grad = torch.randn_like(u)
    with no_reference_warning():
        got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    check_backward(got, grad, u, k, D, dtype)


@requires_kernel("fftconv_bwd")
def test_kernel_backward_strided_inputs():
    B, H, N, L = 3, 4, 2048, 999
    dtype = torch.bfloat16
    _, k, D = make_inputs(B, H, N, L, dtype=dtype, param_dtype=torch.float32, device="cuda")
    heads_first = [torch.randn(H, B, N, device="cuda").to(dtype).transpose(0, 1) for _ in range(2)]  # read in place
    shifted = [torch.randn(B, H, N + 1, device="cuda").to(dtype)[..., 1:] for _ in range(2)]  # copied first
    last_dim_strided = torch.randn(B, H, N, 2, device="cuda").to(dtype)[..., 0]  # copied first
    for u, grad in [heads_first, shifted, (heads_first[0], shifted[0]), (shifted[1], last_dim_strided)]:
        with no_reference_warning():
            got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
        check_backward(got, grad, u, k, D, dtype)


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_backward_many_heads_is_deterministic(dtype):
    """More heads than the persistent grid holds blocks; one block owns each head's sum: same bits twice."""
    u, k, D = make_inputs(6, 400, 512, 300, dtype=dtype, param_dtype=torch.float32, device="cuda")
    grad = torch.randn_like(u)
    with no_reference_warning():
        first = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
        second = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    check_backward(first, grad, u, k, D, dtype)


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("N", [256, 4096, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_gradients_through_autograd(dtype, N):
    """tk_ops.fftconv's autograd on the kernels (forward and backward) against float64 autograd of the
    direct convolution."""
    u, k, D = make_inputs(2, 3, N, N // 2 + 1, dtype=dtype, param_dtype=torch.float32, device="cuda")
    grad = torch.randn_like(u)
    with no_reference_warning():
        got = fftconv_grads(u, k, D, grad)
    want = reference_grads(u, k, D, grad)
    for name, g, w in zip("ukD", got, want):
        assert_rel_close(g, w, KERNEL_TOLERANCE[dtype], f"grad_{name}")


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_backward_is_the_forwards_adjoint(dtype):
    """The adjoint identities of y, linear in u and in (k, D), on the kernels alone (what gradcheck
    tests, without finite differences): <y, g> = <u, grad_u> = <k, grad_k> + <D, grad_D>."""
    u, k, D = make_inputs(4, 3, 4096, 1500, dtype=dtype, param_dtype=torch.float32, device="cuda")
    grad = torch.randn_like(u)
    with no_reference_warning():
        y = tk_ops.fftconv(u, k, D=D).double()
        grad_u, grad_k, grad_D = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    pairing = (y * grad.double()).sum()
    through_u = (u.double() * grad_u.double()).sum()
    through_k_and_D = (k.double() * grad_k.double()).sum() + (D.double() * grad_D.double()).sum()
    scale = (y.double().norm() * grad.double().norm()).item()
    for other in (through_u, through_k_and_D):
        assert abs((pairing - other).item()) <= KERNEL_TOLERANCE[dtype] * scale


# ------------------------------------------------------------------- fp32 u: split operands

@requires_kernel("fftconv")
@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("filter_len", ["N", "odd"])
@pytest.mark.parametrize("N", FP32_KERNEL_SEQ_LENS)
def test_kernel_fp32_forward(N, filter_len, with_D):
    """fp32 u on the kernels (no reference warning) at fp32-level accuracy: every fp32 kernel N, L = N
    and shorter, D on and off, an odd B (one sequence without a partner), outputs poisoned with NaN."""
    L = {"N": N, "odd": N // 3 + 1}[filter_len]
    u, k, D = make_inputs(3, 2, N, L, dtype=torch.float32, with_D=with_D, device="cuda")
    poisoned_allocations(4 * u.numel() * u.element_size())
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert out.dtype == torch.float32 and out.shape == u.shape and out.is_contiguous()
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[torch.float32])


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("with_D", [False, True])
@pytest.mark.parametrize("N", FP32_KERNEL_SEQ_LENS)
def test_kernel_fp32_backward(N, with_D):
    u, k, D = make_inputs(3, 2, N, N // 3 + 1, dtype=torch.float32, with_D=with_D, device="cuda")
    grad = torch.randn_like(u)
    poisoned_allocations(8 * u.numel() * u.element_size())
    with no_reference_warning():
        got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
    assert got[1].dtype == torch.float32 and (D is None or got[2].dtype == torch.float32)
    check_backward(got, grad, u, k, D, torch.float32)


@requires_kernel("fftconv_bwd")
def test_kernel_fp32_strided_and_padded_inputs():
    """Head-major u and grad are read in place; rows one float off 16 bytes and N that is not a power
    of two (padded to 4096) go through a copy: all on the kernels."""
    B, H, N, L = 3, 4, 2048, 999
    _, k, D = make_inputs(B, H, N, L, dtype=torch.float32, device="cuda")
    heads_first = [torch.randn(H, B, N, device="cuda").transpose(0, 1) for _ in range(2)]
    shifted = [torch.randn(B, H, N + 1, device="cuda")[..., 1:] for _ in range(2)]
    for u, grad in [heads_first, shifted, (heads_first[0], shifted[0])]:
        with no_reference_warning():
            out = tk_ops.fftconv(u, k, D=D)
            got = torch.ops.tk.fftconv_bwd.default(grad, u, k, D)
        assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[torch.float32])
        check_backward(got, grad, u, k, D, torch.float32)
    u, k, D = make_inputs(3, 5, 3000, 1501, dtype=torch.float32, device="cuda")
    with no_reference_warning():
        out = tk_ops.fftconv(u, k, D=D)
    assert out.shape == u.shape
    assert_rel_close(out, float64_reference(u, k, D), KERNEL_TOLERANCE[torch.float32])


@requires_kernel("fftconv_bwd")
@pytest.mark.parametrize("N", [256, 4096, 8192])
def test_kernel_fp32_gradients_through_autograd(N):
    u, k, D = make_inputs(2, 3, N, N // 2 + 1, dtype=torch.float32, device="cuda")
    grad = torch.randn_like(u)
    with no_reference_warning():
        got = fftconv_grads(u, k, D, grad)
    want = reference_grads(u, k, D, grad)
    for name, g, w in zip("ukD", got, want):
        assert g.dtype == torch.float32
        assert_rel_close(g, w, KERNEL_TOLERANCE[torch.float32], f"grad_{name}")
