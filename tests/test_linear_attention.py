"""tk.linear_attention: causal linear attention on feature-mapped q, k vs a naive quadratic float64 form."""

from __future__ import annotations

import pytest
import torch

import tk_ops
import tk_testing
from tk_ops.ops import linear_attention as linear_attention_module
from tk_testing import TOLERANCE, assert_rel_close

B, H, F, DV = 2, 3, 9, 7


def naive_linear_attention(q, k, v, normalize, eps):
    """out_i = sum_{j<=i} (q_i . k_j) v_j (/ (sum_{j<=i} q_i . k_j + eps)), the full N x N matrix in float64."""
    n = q.shape[-2]
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    scores = torch.where(causal.to(q.device), torch.einsum("bhif,bhjf->bhij", q.double(), k.double()), 0.0)
    numerator = torch.einsum("bhij,bhjd->bhid", scores, v.double())
    if not normalize:
        return numerator
    return numerator / (scores.sum(-1, keepdim=True) + eps)


def make_inputs(n, *, normalize, f=F, dv=DV, dtype=torch.float64, device="cpu", requires_grad=False):
    """Random q, k, v; normalised cases get positive features so the denominator stays away from 0."""
    if normalize:
        q, k = (torch.rand(B, H, n, f, dtype=dtype, device=device) + 0.1 for _ in range(2))
    else:
        q, k = (torch.randn(B, H, n, f, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(B, H, n, dv, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


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
def test_opcheck_forward(small_chunks, normalize):
    q, k, v = make_inputs(37, normalize=normalize, dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.tk.linear_attention.default, (q, k, v, 1e-6, normalize))


@pytest.mark.parametrize("normalize", [False, True])
def test_opcheck_backward(small_chunks, normalize):
    q, k, v = make_inputs(37, normalize=normalize, dtype=torch.float32)
    out, denominator = torch.ops.tk.linear_attention(q, k, v, 1e-6, normalize)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.tk.linear_attention_bwd.default, (grad_out, q, k, v, out, denominator, 1e-6, normalize)
    )


@pytest.mark.parametrize("normalize", [False, True])
def test_compile_fullgraph_forward_and_backward(normalize):
    grad = torch.randn(B, H, 29, DV)
    tk_testing.check_compile_fullgraph(
        lambda q, k, v: tk_ops.linear_attention(q, k, v, normalize=normalize),
        make_inputs(29, normalize=normalize, dtype=torch.float32, requires_grad=True),
        ["linear_attention", "linear_attention_bwd"],
        loss=lambda out: (out * grad).sum(),
    )


def test_export():
    class Mixer(torch.nn.Module):
        def forward(self, q, k, v):
            return tk_ops.linear_attention(q, k, v, normalize=True, eps=1e-6)

    tk_testing.check_export(Mixer(), make_inputs(19, normalize=True, dtype=torch.float32), ["linear_attention"])


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


def _bad(**changes):
    q, k, v = make_inputs(9, normalize=False, dtype=torch.float32)
    args = {"q": q, "k": k, "v": v, "eps": 1e-12}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(q=[[1.0]]), TypeError, "q"),
        (_bad(q=torch.ones(B, H, 9, F, dtype=torch.int32)), TypeError, "q"),
        (_bad(k=torch.randn(B, H, 9, F, dtype=torch.float64)), TypeError, "k"),
        (_bad(v=torch.randn(B, H, 9, DV, dtype=torch.bfloat16)), TypeError, "v"),
        (_bad(q=torch.randn(H, 9, F)), ValueError, "q"),
        (_bad(v=torch.randn(1, B, H, 9, DV)), ValueError, "v"),
        (_bad(k=torch.randn(B, H, 9, F + 1)), ValueError, r"k.*feature dim"),
        (_bad(k=torch.randn(B + 1, H, 9, F)), ValueError, r"k.*batch"),
        (_bad(v=torch.randn(B, H + 1, 9, DV)), ValueError, r"v.*heads"),
        (_bad(v=torch.randn(B, H, 10, DV)), ValueError, r"v.*sequence length"),
        (_bad(q=torch.randn(B, H, 0, F), k=torch.randn(B, H, 0, F), v=torch.randn(B, H, 0, DV)), ValueError, "q"),
        (_bad(v=torch.randn(B, H, 9, 0)), ValueError, "v"),
        (_bad(eps=-1e-6), ValueError, "eps"),
        (_bad(eps=float("nan")), ValueError, "eps"),
        (_bad(eps=torch.tensor(1e-6)), TypeError, "eps"),
    ],
)
def test_bad_inputs(args, error, match):
    eps = args.pop("eps")
    with pytest.raises(error, match=match):
        tk_ops.linear_attention(**args, eps=eps)


@tk_testing.requires_cuda
def test_device_mismatch():
    q, k, v = make_inputs(9, normalize=False, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="k"):
        tk_ops.linear_attention(q, k.cpu(), v)


# ------------------------------------------------------------------------------------ GPU kernel


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("f, dv", [(16, 64), (64, 64), (128, 128), (256, 64)])
@pytest.mark.parametrize("n", [1, 77, 333])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64(dtype, normalize, n, f, dv):
    q, k, v = make_inputs(n, normalize=normalize, f=f, dv=dv, dtype=dtype, device="cuda", requires_grad=True)
    # unit-scale scores keep the unnormalised fp16 output in range
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = f**-0.5
    out = tk_ops.linear_attention(q * scale, k, v, normalize=normalize)
    ref = naive_linear_attention(q64 * scale, k64, v64, normalize, 1e-12)
    assert out.dtype == dtype
    assert_rel_close(out, ref, 2 * TOLERANCE[dtype])
    # One position, normalised: out = v whatever q and k, so their exact gradients are of order eps and
    # what the output's rounding leaves in them (as in the reference) cannot be compared relatively.
    names = "v" if normalize and n == 1 else "qkv"
    inputs, reference_inputs = ((q, k, v), (q64, k64, v64)) if names == "qkv" else ((v,), (v64,))
    tk_testing.assert_gradients_close(out, inputs, ref, reference_inputs, 3 * TOLERANCE[dtype], names)


@tk_testing.requires_kernel("linear_attention")
@pytest.mark.parametrize("dtype, f, dv", [(torch.float32, 16, 64), (torch.bfloat16, 8, 64), (torch.bfloat16, 16, 40)])
def test_unsupported_inputs_fall_back_to_reference(dtype, f, dv):
    q, k, v = make_inputs(77, normalize=True, f=f, dv=dv, dtype=dtype, device="cuda")
    out = tk_ops.linear_attention(q, k, v, normalize=True)
    assert_rel_close(out, naive_linear_attention(q, k, v, True, 1e-12), TOLERANCE[dtype])
