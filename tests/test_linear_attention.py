"""tk.linear_attention: causal linear attention on feature-mapped q, k vs a naive quadratic float64 form."""

from __future__ import annotations

import pytest
import torch

import tk_ops
import tk_testing
from inputs.linear_attention import B, DV, F, H, make_inputs, naive_linear_attention, scaled_inputs
from tk_ops.ops import linear_attention as linear_attention_module
from tk_testing import TOLERANCE, assert_rel_close


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 positions, so that short sequences cross several chunk boundaries."""
    monkeypatch.setattr(linear_attention_module, "CHUNK_SIZE", 16)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("n", [1, 5, 77, 200])
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_matches_naive(monkeypatch, normalize, n, chunk_size):
    monkeypatch.setattr(linear_attention_module, "CHUNK_SIZE", chunk_size)
    q, k, v = make_inputs(n, normalize=normalize)
    out = tk_ops.linear_attention(q, k, v, normalize=normalize, eps=1e-3)
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert_rel_close(out, naive_linear_attention(q, k, v, normalize, 1e-3), TOLERANCE[torch.float64])


def test_default_is_unnormalised():
    q, k, v = make_inputs(21, normalize=False)
    assert_rel_close(tk_ops.linear_attention(q, k, v), naive_linear_attention(q, k, v, False, 0.0), 1e-10)


@pytest.mark.parametrize("normalize", [False, True])
def test_denominator_output(small_chunks, normalize):
    q, k, v = make_inputs(45, normalize=normalize, dtype=torch.float32)
    out, denominator = torch.ops.tk.linear_attention(q, k, v, 1e-6, normalize)
    if not normalize:
        assert denominator.shape == (0,) and denominator.dtype == torch.float32
        return
    scores = torch.einsum("bhif,bhjf->bhij", q.double(), k.double()).tril()
    assert denominator.dtype == torch.float32 and denominator.shape == (B, H, 45)
    assert_rel_close(denominator, scores.sum(-1), TOLERANCE[torch.float32], "denominator")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalize", [False, True])
def test_low_precision_inputs_on_reference(small_chunks, dtype, normalize):
    q, k, v = make_inputs(53, normalize=normalize, dtype=dtype)
    out = tk_ops.linear_attention(q, k, v, normalize=normalize)
    assert out.dtype == dtype
    assert_rel_close(out, naive_linear_attention(q, k, v, normalize, 1e-12), TOLERANCE[dtype])


@pytest.mark.parametrize("n", [5, 77])
@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_autograd_of_naive(small_chunks, normalize, n):
    q, k, v = make_inputs(n, normalize=normalize, requires_grad=True)
    out = tk_ops.linear_attention(q, k, v, normalize=normalize, eps=1e-2)
    ref = naive_linear_attention(q, k, v, normalize, 1e-2)
    tk_testing.assert_gradients_close(out, (q, k, v), ref, (q, k, v), 1e-10, "qkv")


def test_unnormalised_never_divides(small_chunks):
    """Scores that sum to zero (here q = 0) give finite outputs and gradients when not normalising."""
    _, k, v = make_inputs(37, normalize=False, requires_grad=True)
    q = torch.zeros_like(k, requires_grad=True)
    out = tk_ops.linear_attention(q, k, v, eps=0.0)
    out.backward(torch.randn_like(out))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("normalize", [False, True])
def test_strided_views(small_chunks, normalize):
    """(B, N, H, F) tensors viewed as (B, H, N, F), and a non-unit last stride, match contiguous copies."""
    n = 41
    q_bnhf, k_bnhf = (torch.rand(B, n, H, F, dtype=torch.float64) + 0.1 for _ in range(2))
    v_bnhd = torch.randn(B, n, H, DV, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in (q_bnhf, k_bnhf, v_bnhd))
    k_columns = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q.stride(-1) == 1 and k_columns.stride(-1) != 1
    tk_testing.check_matches_contiguous_copies(
        lambda q, k, v: tk_ops.linear_attention(q, k, v, normalize=normalize), (q, k_columns, v)
    )


# ------------------------------------------------------------------------------------ GPU kernel

# Each kernel feature dim once, each value dim of the benchmarks at least twice.
KERNEL_SIZES = [(16, 64), (32, 128), (64, 64), (128, 128), (256, 64)]


def reference_linear_attention(q, k, v, normalize, eps):
    """The op's chunked reference in float64 (checked against the naive form above), for long N."""
    return linear_attention_module.linear_attention_op(q.double(), k.double(), v.double(), eps, normalize)


def poisoned_allocations(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs a kernel forgets to write stay NaN."""
    torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")


def on_kernel():
    """The forward must run on the kernel (its reference would warn)."""
    return tk_testing.runs_the_kernels("linear_attention")


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f, dv", KERNEL_SIZES)
@pytest.mark.parametrize("n", [1, 17, 64, 77, 1000])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64(dtype, normalize, n, f, dv):
    q, k, v = scaled_inputs(n, normalize=normalize, f=f, dv=dv, dtype=dtype, requires_grad=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    poisoned_allocations(v.numel() * 2 + q[..., 0].numel() * 4)
    with on_kernel():
        out = tk_ops.linear_attention(q, k, v, normalize=normalize)
    ref = naive_linear_attention(q64, k64, v64, normalize, 1e-12)
    assert out.dtype == dtype
    assert_rel_close(out, ref, 2 * TOLERANCE[dtype])
    # One position, normalised: out = v whatever q and k, so their exact gradients are of order eps and
    # what the output's rounding leaves in them (as in the reference) cannot be compared relatively.
    names = "v" if normalize and n == 1 else "qkv"
    inputs, reference_inputs = ((q, k, v), (q64, k64, v64)) if names == "qkv" else ((v,), (v64,))
    tk_testing.assert_gradients_close(out, inputs, ref, reference_inputs, 3 * TOLERANCE[dtype], names)


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f, dv", [(16, 64), (64, 128), (256, 64)])
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_long_sequence(normalize, f, dv):
    n = 4097
    q, k, v = scaled_inputs(n, normalize=normalize, f=f, dv=dv, dtype=torch.bfloat16)
    poisoned_allocations(v.numel() * 2 + q[..., 0].numel() * 4)
    with on_kernel():
        out, denominator = linear_attention_module.linear_attention_op(q, k, v, 1e-12, normalize)
    ref_out, ref_denominator = reference_linear_attention(q, k, v, normalize, 1e-12)
    assert_rel_close(out, ref_out, 2 * TOLERANCE[torch.bfloat16])
    if normalize:
        assert denominator.dtype == torch.float32 and denominator.shape == (B, H, n)
        assert_rel_close(denominator, ref_denominator, 1e-4, "denominator")
    else:
        assert denominator.numel() == 0


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f, dv, n", [(32, 32, 333), (128, 96, 200), (64, 256, 130), (256, 160, 65)])
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_value_dims(normalize, f, dv, n):
    q, k, v = scaled_inputs(n, normalize=normalize, f=f, dv=dv, dtype=torch.float16)
    poisoned_allocations(v.numel() * 2 + q[..., 0].numel() * 4)
    with on_kernel():
        out, denominator = linear_attention_module.linear_attention_op(q, k, v, 1e-12, normalize)
    ref_out, ref_denominator = reference_linear_attention(q, k, v, normalize, 1e-12)
    assert_rel_close(out, ref_out, 2 * TOLERANCE[torch.float16])
    if normalize:
        assert_rel_close(denominator, ref_denominator, 1e-4, "denominator")


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f", [16, 32, 64, 128, 256])
def test_kernel_denominator_output(f):
    q, k, v = scaled_inputs(1000, normalize=True, f=f, dv=64, dtype=torch.bfloat16)
    poisoned_allocations(q[..., 0].numel() * 4 * 2)
    with on_kernel():
        _, denominator = linear_attention_module.linear_attention_op(q, k, v, 1e-12, True)
    scores_sum = naive_linear_attention(q, k, torch.ones_like(v[..., :1]), False, 0.0)[..., 0]
    assert denominator.dtype == torch.float32
    assert_rel_close(denominator, scores_sum, 1e-4, "denominator")


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f", [16, 128])
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_strided_views(normalize, f):
    """(B, N, H, F) tensors transposed to (B, H, N, F), and v a column slice: no copies, same numbers."""
    b, n, h = 2, 300, 3
    q, k = (
        (torch.rand(b, n, h, f, device="cuda") * f**-0.5).to(torch.bfloat16).transpose(1, 2) for _ in range(2)
    )
    v = torch.randn(b, h, n, 96, dtype=torch.bfloat16, device="cuda")[..., 16:80]
    assert not q.is_contiguous() and not v.is_contiguous()
    with on_kernel(), tk_testing.RecordTkCalls() as calls:
        out = tk_ops.linear_attention(q, k, v, normalize=normalize)
    assert calls.calls["linear_attention"][0][0].data_ptr() == q.data_ptr()
    expected = tk_ops.linear_attention(q.contiguous(), k.contiguous(), v.contiguous(), normalize=normalize)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------- GPU backward kernel


def reference_linear_attention_bwd(grad_out, q, k, v, out, denominator, normalize, eps):
    """The op's chunked reference backward in float64 (checked against autograd of the naive form above)."""
    as64 = [t.double() for t in (grad_out, q, k, v, out, denominator)]
    return linear_attention_module._linear_attention_bwd_reference(*as64, eps, normalize)


def backward_workspace_bytes(q, v):
    """An upper bound of the backward's workspace and outputs: per-value-block fp32 partials of grad_q and
    grad_k (rows padded to whole chunks), two fp32 statistics per row, the gradients."""
    b, h, n, f = q.shape
    padded = -(-n // 64) * 64
    return 4 * (2 * (v.shape[-1] // 32) * b * h * padded * f + 2 * b * h * padded) + 2 * (2 * q.numel() + v.numel())


@tk_testing.requires_kernel("linear_attention_bwd")
@pytest.mark.parametrize("f, dv, n", [(64, 96, 4097), (256, 256, 4097), (16, 256, 300), (128, 96, 130), (32, 32, 1)])
@pytest.mark.parametrize("normalize", [False, True])
def test_backward_kernel_long_sequences_and_poisoned_allocations(normalize, f, dv, n):
    """The backward op against the reference backward on the same forward outputs; NaN left in free memory
    shows any output (or workspace row) the kernels forget to write."""
    q, k, v = scaled_inputs(n, normalize=normalize, f=f, dv=dv, dtype=torch.bfloat16)
    out, denominator = linear_attention_module.linear_attention_op(q, k, v, 1e-12, normalize)
    grad_out = torch.randn_like(out)
    poisoned_allocations(backward_workspace_bytes(q, v))
    grads = linear_attention_module.linear_attention_bwd_op(grad_out, q, k, v, out, denominator, 1e-12, normalize)
    expected = reference_linear_attention_bwd(grad_out, q, k, v, out, denominator, normalize, 1e-12)
    # One position, normalised: grad_q and grad_k are of order eps (see test_kernel_matches_float64).
    names = "v" if normalize and n == 1 else "qkv"
    for name, got, want in zip("qkv", grads, expected):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.isfinite(got).all(), f"grad_{name}"
        if name in names:
            assert_rel_close(got, want, 3 * TOLERANCE[torch.bfloat16], f"grad_{name}")


@tk_testing.requires_kernel("linear_attention_bwd")
@pytest.mark.parametrize("f, dv", [(32, 64), (256, 160)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernel_matches_float64_wide(dtype, f, dv):
    """Autograd through the op (forward and backward kernels) at value dims past one 128-column tile."""
    q, k, v = scaled_inputs(333, normalize=True, f=f, dv=dv, dtype=dtype, requires_grad=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with on_kernel():
        out = tk_ops.linear_attention(q, k, v, normalize=True)
    ref = naive_linear_attention(q64, k64, v64, True, 1e-12)
    tk_testing.assert_gradients_close(out, (q, k, v), ref, (q64, k64, v64), 3 * TOLERANCE[dtype], "qkv")


@tk_testing.requires_kernel("linear_attention_bwd")
@pytest.mark.parametrize("f", [16, 128])
@pytest.mark.parametrize("normalize", [False, True])
def test_backward_kernel_strided_views(normalize, f):
    """(B, N, H, *) views of q, k, grad_out and a column slice of v reach the kernels as they are and give
    the gradients of contiguous copies, bit for bit."""
    b, n, h = 2, 300, 3
    q, k = (
        (torch.rand(b, n, h, f, device="cuda") * f**-0.5).to(torch.bfloat16).transpose(1, 2) for _ in range(2)
    )
    v = torch.randn(b, h, n, 96, dtype=torch.bfloat16, device="cuda")[..., 16:80]
    grad_out = torch.randn(b, n, h, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    out, denominator = linear_attention_module.linear_attention_op(q, k, v, 1e-12, normalize)
    with tk_testing.RecordTkCalls() as calls:
        grads = linear_attention_module.linear_attention_bwd_op(grad_out, q, k, v, out, denominator, 1e-12, normalize)
    assert calls.calls["linear_attention_bwd"][0][0].data_ptr() == grad_out.data_ptr()
    contiguous = [t.contiguous() for t in (grad_out, q, k, v)]
    expected = linear_attention_module.linear_attention_bwd_op(*contiguous, out, denominator, 1e-12, normalize)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = reference_linear_attention_bwd(grad_out, q, k, v, out, denominator, normalize, 1e-12)
    for name, got, want in zip("qkv", grads, reference):
        assert_rel_close(got, want, 3 * TOLERANCE[torch.bfloat16], f"grad_{name}")

