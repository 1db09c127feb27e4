"""tk.based_attention: causal Based attention vs a naive float64 form that materialises the Taylor features."""

from __future__ import annotations

import math

import pytest
import torch

import tk_ops
import tk_testing
from inputs.based_attention import B, DV, F, H, make_inputs, naive_based_attention, taylor_features
from tk_ops.ops import based_attention as based_attention_module
from tk_testing import TOLERANCE, assert_rel_close


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 positions, so that short sequences cross several chunk boundaries."""
    monkeypatch.setattr(based_attention_module, "CHUNK_SIZE", 16)


def test_naive_features_give_the_taylor_scores():
    q, k, _ = make_inputs(11)
    s = torch.einsum("bhif,bhjf->bhij", q, k) / math.sqrt(F)
    phi_scores = torch.einsum("bhip,bhjp->bhij", taylor_features(q), taylor_features(k))
    torch.testing.assert_close(phi_scores, 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("n", [1, 5, 77, 200])
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_matches_naive(monkeypatch, normalize, n, chunk_size):
    monkeypatch.setattr(based_attention_module, "CHUNK_SIZE", chunk_size)
    q, k, v = make_inputs(n)
    out = tk_ops.based_attention(q, k, v, normalize=normalize, eps=1e-3)
    assert out.dtype == torch.float64 and out.is_contiguous()
    assert_rel_close(out, naive_based_attention(q, k, v, normalize, 1e-3), TOLERANCE[torch.float64])


def test_default_is_normalised_and_kernel_sizes_run_on_reference(small_chunks):
    q, k, v = make_inputs(77, f=16, dv=64)
    assert_rel_close(tk_ops.based_attention(q, k, v), naive_based_attention(q, k, v, True, 1e-12), 1e-10)


@pytest.mark.parametrize("normalize", [False, True])
def test_denominator_output(small_chunks, normalize):
    q, k, v = make_inputs(45, dtype=torch.float32)
    out, denominator = torch.ops.tk.based_attention(q, k, v, 1e-6, normalize)
    if not normalize:
        assert denominator.shape == (0,) and denominator.dtype == torch.float32
        return
    s = torch.einsum("bhif,bhjf->bhij", q.double(), k.double()) / math.sqrt(F)
    assert denominator.dtype == torch.float32 and denominator.shape == (B, H, 45)
    assert_rel_close(denominator, (1 + s + s**2 / 2).tril().sum(-1), TOLERANCE[torch.float32], "denominator")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normalize", [False, True])
def test_low_precision_inputs_on_reference(small_chunks, dtype, normalize):
    q, k, v = make_inputs(53, dtype=dtype)
    out = tk_ops.based_attention(q, k, v, normalize=normalize)
    assert out.dtype == dtype
    assert_rel_close(out, naive_based_attention(q, k, v, normalize, 1e-12), TOLERANCE[dtype])


@pytest.mark.parametrize("n", [5, 77])
@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_autograd_of_naive(small_chunks, normalize, n):
    q, k, v = make_inputs(n, requires_grad=True)
    out = tk_ops.based_attention(q, k, v, normalize=normalize, eps=1e-2)
    ref = naive_based_attention(q, k, v, normalize, 1e-2)
    tk_testing.assert_gradients_close(out, (q, k, v), ref, (q, k, v), 1e-10, "qkv")


@pytest.mark.parametrize("normalize", [False, True])
def test_strided_views(small_chunks, normalize):
    """(B, N, H, F) tensors viewed as (B, H, N, F), and a non-unit last stride, match contiguous copies."""
    n = 41
    q_bnhf, k_bnhf = (torch.randn(B, n, H, F, dtype=torch.float64) for _ in range(2))
    v_bnhd = torch.randn(B, n, H, DV, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in (q_bnhf, k_bnhf, v_bnhd))
    v_columns = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q.stride(-1) == 1 and v_columns.stride(-1) != 1
    tk_testing.check_matches_contiguous_copies(
        lambda q, k, v: tk_ops.based_attention(q, k, v, normalize=normalize), (q, k, v_columns)
    )


# ------------------------------------------------------------------------------------ GPU kernel


def reference_based_attention(q, k, v, normalize, eps):
    """The op's chunked reference in float64 (checked against the naive form above), for long N."""
    return based_attention_module.based_attention_op(q.double(), k.double(), v.double(), eps, normalize)


def poisoned_allocations(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs a kernel forgets to write stay NaN."""
    torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")


@tk_testing.requires_kernel("based_attention")
@pytest.mark.parametrize("n", [1, 17, 64, 77, 333, 1000])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64(dtype, normalize, n):
    q, k, v = make_inputs(n, f=16, dv=64, dtype=dtype, device="cuda", requires_grad=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = tk_ops.based_attention(q, k, v, normalize=normalize)
    ref = naive_based_attention(q64, k64, v64, normalize, 1e-12)
    assert out.dtype == dtype
    assert_rel_close(out, ref, 2 * TOLERANCE[dtype])
    # One position, normalised: out = v whatever q and k, so their exact gradients are of order eps and
    # what the output's rounding leaves in them (as in the reference) cannot be compared relatively.
    names = "v" if normalize and n == 1 else "qkv"
    inputs, reference_inputs = ((q, k, v), (q64, k64, v64)) if names == "qkv" else ((v,), (v64,))
    tk_testing.assert_gradients_close(out, inputs, ref, reference_inputs, 3 * TOLERANCE[dtype], names)


@tk_testing.requires_kernel("based_attention")
@pytest.mark.parametrize("n, dv", [(4097, 64), (1000, 32), (333, 128), (200, 256)])
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_value_dims_and_long_sequences(normalize, n, dv):
    q, k, v = make_inputs(n, f=16, dv=dv, dtype=torch.bfloat16, device="cuda")
    poisoned_allocations(v.numel() * 2 + q[..., 0].numel() * 4)
    out, denominator = based_attention_module.based_attention_op(q, k, v, 1e-12, normalize)
    ref_out, ref_denominator = reference_based_attention(q, k, v, normalize, 1e-12)
    assert_rel_close(out, ref_out, 2 * TOLERANCE[torch.bfloat16])
    if normalize:
        assert_rel_close(denominator, ref_denominator, 1e-3, "denominator")
    else:
        assert denominator.numel() == 0


@tk_testing.requires_kernel("based_attention")
def test_kernel_denominator_output():
    q, k, v = make_inputs(1000, f=16, dv=64, dtype=torch.float16, device="cuda")
    poisoned_allocations(q[..., 0].numel() * 4 * 2)
    _, denominator = based_attention_module.based_attention_op(q, k, v, 1e-12, True)
    scores_sum = naive_based_attention(q, k, torch.ones_like(v[..., :1]), False, 0.0)[..., 0]
    assert denominator.dtype == torch.float32
    assert_rel_close(denominator, scores_sum, 1e-3, "denominator")


@tk_testing.requires_kernel("based_attention")
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("b, n, h", [(2, 300, 3), (1, 4096 + 33, 2)], ids=["one_pass", "split"])
def test_kernel_strided_views(normalize, b, n, h):
    """(B, N, H, F) tensors transposed to (B, H, N, F), and v a column slice: no copies, same numbers,
    in one pass and in a forward that splits the sequences (few tasks: see the split tests below)."""
    q, k = (torch.randn(b, n, h, 16, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(2))
    v = torch.randn(b, h, n, 96, dtype=torch.bfloat16, device="cuda")[..., 16:80]
    assert not q.is_contiguous() and not v.is_contiguous()
    with tk_testing.RecordTkCalls() as calls:
        out = tk_ops.based_attention(q, k, v, normalize=normalize)
    assert calls.calls["based_attention"][0][0].data_ptr() == q.data_ptr()
    expected = tk_ops.based_attention(q.contiguous(), k.contiguous(), v.contiguous(), normalize=normalize)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    ref_out, _ = reference_based_attention(q, k, v, normalize, 1e-12)
    assert_rel_close(out, ref_out, 2 * TOLERANCE[torch.bfloat16])


# Few (batch, head, value block) tasks for the SMs: the forward cuts each sequence into segments of whole
# chunks (its split rule, plan_segments in based_attention_fwd.cu, picks 22 segments of 6 chunks at
# B = H = 1, N = 8209, Dv <= 64 on an H100's 132 SMs, 16 of 20 at B = 1, H = 2, N = 20000, Dv = 128,
# 13 of 5 at N = 4097), computes each segment's moments, prefix-sums them and runs the output from each
# segment's entering state. Tails: N is not a multiple of the chunk, the last segment is shorter. Every
# output and denominator must be written (poisoned allocations) and match float64.
SPLIT_CASES = {
    "B=1 H=1 N=8209 Dv=64": (1, 1, 8192 + 17, 64),
    "B=1 H=1 N=8209 Dv=32": (1, 1, 8192 + 17, 32),
    "B=1 H=2 N=20000 Dv=128": (1, 2, 20000, 128),
    "B=2 H=1 N=4097 Dv=64": (2, 1, 4097, 64),
    "B=1 H=3 N=1100 Dv=256": (1, 3, 1100, 256),
}


@tk_testing.requires_kernel("based_attention")
@pytest.mark.parametrize("case", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_split_sequences(dtype, normalize, case):
    b, h, n, dv = case
    torch.manual_seed(0)
    q, k = (torch.randn(b, h, n, 16, dtype=dtype, device="cuda") for _ in range(2))
    v = torch.randn(b, h, n, dv, dtype=dtype, device="cuda")
    # NaN where the outputs, the denominator and the segment states will be allocated.
    poisoned_allocations(4 * v.numel() * 2 + 4 * q[..., 0].numel() * 4 + b * h * (dv // 32) * 64 * 10752 * 4)
    out, denominator = based_attention_module.based_attention_op(q, k, v, 1e-12, normalize)
    ref_out, ref_denominator = reference_based_attention(q, k, v, normalize, 1e-12)
    assert out.dtype == dtype and not out.isnan().any()
    assert_rel_close(out, ref_out, 2 * TOLERANCE[dtype])
    if normalize:
        assert not denominator.isnan().any()
        assert_rel_close(denominator, ref_denominator, 1e-3, "denominator")
    # The same call again (fresh workspace, NaN-poisoned again) gives the same bits: no state is read
    # before it is written.
    poisoned_allocations(4 * v.numel() * 2 + b * h * (dv // 32) * 64 * 10752 * 4)
    again, _ = based_attention_module.based_attention_op(q, k, v, 1e-12, normalize)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@tk_testing.requires_kernel("based_attention")
def test_kernel_split_sequences_gradients():
    """The backward reads the split forward's out and denominator: gradients against float64."""
    q, k, v = (torch.randn(1, 1, 3000, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for d in (16, 16, 64))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = tk_ops.based_attention(q, k, v)
    ref = based_attention_module.based_attention_op(q64, k64, v64, 1e-12, True)[0]
    assert_rel_close(out, ref, 2 * TOLERANCE[torch.bfloat16])
    tk_testing.assert_gradients_close(out, (q, k, v), ref, (q64, k64, v64), 3 * TOLERANCE[torch.bfloat16], "qkv")


# ------------------------------------------------------------------------------- GPU backward kernel


def reference_based_attention_bwd(grad_out, q, k, v, out, denominator, normalize, eps):
    """The op's chunked reference backward in float64 (checked against autograd of the naive form above)."""
    as64 = [t.double() for t in (grad_out, q, k, v, out, denominator)]
    return based_attention_module._based_attention_bwd_reference(*as64, eps, normalize)


@tk_testing.requires_kernel("based_attention_bwd")
@pytest.mark.parametrize("dv", [32, 64, 128])
@pytest.mark.parametrize("n", [1, 17, 64, 77, 1000])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernel_matches_float64(dtype, normalize, n, dv):
    q, k, v = make_inputs(n, f=16, dv=dv, dtype=dtype, device="cuda", requires_grad=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = tk_ops.based_attention(q, k, v, normalize=normalize)
    ref = naive_based_attention(q64, k64, v64, normalize, 1e-12)
    # One position, normalised: out = v whatever q and k (see test_kernel_matches_float64).
    names = "v" if normalize and n == 1 else "qkv"
    inputs, reference_inputs = ((q, k, v), (q64, k64, v64)) if names == "qkv" else ((v,), (v64,))
    tk_testing.assert_gradients_close(out, inputs, ref, reference_inputs, 3 * TOLERANCE[dtype], names)


@tk_testing.requires_kernel("based_attention_bwd")
@pytest.mark.parametrize("n, dv", [(4097, 64), (300, 256)])
@pytest.mark.parametrize("normalize", [False, True])
def test_backward_kernel_long_sequences_and_poisoned_allocations(normalize, n, dv):
    """The backward op against the reference backward on the same forward outputs; NaN left in free memory
    shows any output (or workspace row) the kernels forget to write."""
    q, k, v = make_inputs(n, f=16, dv=dv, dtype=torch.bfloat16, device="cuda")
    out, denominator = based_attention_module.based_attention_op(q, k, v, 1e-12, normalize)
    grad_out = torch.randn_like(out)
    poisoned_allocations(4 * (q.numel() + k.numel()) * (dv // 32 + 1) + 2 * v.numel())
    grads = based_attention_module.based_attention_bwd_op(grad_out, q, k, v, out, denominator, 1e-12, normalize)
    expected = reference_based_attention_bwd(grad_out, q, k, v, out, denominator, normalize, 1e-12)
    for name, got, want in zip("qkv", grads, expected):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert_rel_close(got, want, 3 * TOLERANCE[torch.bfloat16], f"grad_{name}")


@tk_testing.requires_kernel("based_attention_bwd")
@pytest.mark.parametrize("normalize", [False, True])
def test_backward_kernel_strided_views(normalize):
    """(B, N, H, *) views of q, k, grad_out and a column slice of v reach the kernels as they are and give
    the gradients of contiguous copies, bit for bit."""
    b, n, h = 2, 300, 3
    q, k = (torch.randn(b, n, h, 16, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(2))
    v = torch.randn(b, h, n, 96, dtype=torch.bfloat16, device="cuda")[..., 16:80]
    grad_out = torch.randn(b, n, h, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    out, denominator = based_attention_module.based_attention_op(q, k, v, 1e-12, normalize)
    with tk_testing.RecordTkCalls() as calls:
        grads = based_attention_module.based_attention_bwd_op(grad_out, q, k, v, out, denominator, 1e-12, normalize)
    assert calls.calls["based_attention_bwd"][0][0].data_ptr() == grad_out.data_ptr()
    contiguous = [t.contiguous() for t in (grad_out, q, k, v)]
    expected = based_attention_module.based_attention_bwd_op(*contiguous, out, denominator, 1e-12, normalize)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

