"""tk_ops.attention against a naive float64 attention and SDPA, and the Hopper kernels (the op contract:
tests/test_op_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tk_ops
import tk_testing
from inputs.attention import BACKWARD_ENV, BACKWARD_METHODS, make_qkv
from tk_ops.ops import attention as attention_module

NEG_INF = float("-inf")


def naive_attention(q, k, v, causal=False, scale=None):
    """float64, the plain definition: K/V heads repeated per query head, the full score matrix, and
    a softmax written as masked exponentials over their sum. Returns (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_len, key_len = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    visible = torch.ones(q_len, key_len, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(q_len, device=q.device)[:, None]
        visible = torch.arange(key_len, device=q.device)[None, :] <= rows + (key_len - q_len)
    scores = scores.masked_fill(~visible, NEG_INF)
    row_max = scores.detach().amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    sees_a_key = visible.any(-1, keepdim=True)
    total = torch.where(sees_a_key, weights.sum(-1, keepdim=True), 1.0)  # rows that see no key: 0 / 1
    out = torch.einsum("bhij,bhjd->bhid", weights, v) / total
    lse = torch.where(sees_a_key, total.log() + row_max, NEG_INF).squeeze(-1)
    return out, lse


def finite_lse_loss(out, lse, out_weight, lse_weight):
    """A loss through both outputs; -inf lse entries (rows that see no key) contribute nothing."""
    return (out * out_weight).sum() + (lse.masked_fill(torch.isinf(lse), 0) * lse_weight).sum()


def check_forward_against_naive(q, k, v, causal, scale=None, out_tol=None, deterministic=None):
    """Compare tk_ops.attention's out and lse with naive_attention; returns both and the reference's
    (float64 leaves q64, k64, v64 that require grad, and the reference out and lse built from them)."""
    out_tol = tk_testing.TOLERANCE[q.dtype] if out_tol is None else out_tol
    out, lse = tk_ops.attention(q, k, v, causal=causal, scale=scale, return_lse=True, deterministic=deterministic)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    assert out.is_contiguous() and lse.is_contiguous()

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(q64, k64, v64, causal, scale)
    tk_testing.assert_rel_close(out, ref_out, out_tol, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    tk_testing.assert_rel_close(lse.masked_fill(torch.isinf(lse), 0), ref_lse.masked_fill(torch.isinf(ref_lse), 0),
                                max(out_tol, 1e-6), "lse")
    return out, lse, (q64, k64, v64), (ref_out, ref_lse)


def check_against_naive(q, k, v, causal, scale=None, out_tol=None, grad_tol=None, deterministic=None):
    """Compare tk_ops.attention's out, lse and gradients (through out and lse) with naive_attention."""
    out_tol = tk_testing.TOLERANCE[q.dtype] if out_tol is None else out_tol
    grad_tol = 2 * out_tol if grad_tol is None else grad_tol
    out, lse, (q64, k64, v64), (ref_out, ref_lse) = check_forward_against_naive(
        q, k, v, causal, scale, out_tol, deterministic
    )

    # lse is fp32, so its weights are fp32 numbers for both sides.
    out_weight, lse_weight = torch.randn_like(ref_out), torch.randn_like(ref_lse).float().double()
    grads = torch.autograd.grad(
        finite_lse_loss(out, lse, out_weight.to(out.dtype), lse_weight.float()), (q, k, v)
    )
    ref_grads = torch.autograd.grad(finite_lse_loss(ref_out, ref_lse, out_weight, lse_weight), (q64, k64, v64))
    for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert grad.dtype == q.dtype
        tk_testing.assert_rel_close(grad, ref_grad, grad_tol, name)
    return out, lse, grads


# ------------------------------------------------------------------------- values (reference path)


@pytest.mark.parametrize("q_len, key_len", [(1, 1), (17, 17), (33, 70), (70, 33)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_heads, kv_heads", [(3, 3), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_naive(q_len, key_len, causal, q_heads, kv_heads):
    check_against_naive(*make_qkv(2, q_heads, kv_heads, q_len, key_len, 40), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_64_and_explicit_scale(causal):
    check_against_naive(*make_qkv(1, 4, 2, 45, 29, 64), causal, scale=0.37)


@pytest.mark.parametrize("scale", [0.0, -0.37], ids=["zero", "negative"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_and_negative_scales(scale, causal):
    """Any finite scale is the op's contract: 0 gives uniform weights over the visible keys, a negative
    one favours the keys least like the query."""
    check_against_naive(*make_qkv(1, 4, 2, 70, 33, 40), causal, scale=scale)


def test_value_head_dim_may_differ():
    check_against_naive(*make_qkv(2, 2, 1, 23, 31, 40, value_dim=24), causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_low_precision_inputs_on_reference(dtype):
    check_against_naive(*make_qkv(2, 4, 2, 37, 37, 64, dtype=dtype), causal=True)


def test_rows_that_see_no_key():
    q, k, v = make_qkv(1, 4, 2, 70, 33, 40)
    out, lse, (grad_q, grad_k, grad_v) = check_against_naive(q, k, v, causal=True)
    hidden_rows = 70 - 33  # query i sees key j iff j <= i - 37
    assert torch.all(out[:, :, :hidden_rows] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :hidden_rows]))
    assert torch.isfinite(lse[:, :, hidden_rows:]).all()
    assert torch.all(grad_q[:, :, :hidden_rows] == 0)
    for grad in (grad_q, grad_k, grad_v):
        assert torch.isfinite(grad).all()


def test_lse_values_against_float64_logsumexp():
    q, k, v = make_qkv(2, 4, 2, 19, 27, 40, dtype=torch.float32, requires_grad=False)
    _, lse = tk_ops.attention(q, k, v, scale=0.3, return_lse=True)
    scores = 0.3 * torch.einsum("bhid,bhjd->bhij", q.double(), k.double().repeat_interleave(2, dim=1))
    tk_testing.assert_rel_close(lse, torch.logsumexp(scores, dim=-1), 1e-6, "lse")


def test_gradient_through_lse_only():
    q, k, v = make_qkv(1, 2, 1, 21, 18, 40)
    _, lse = tk_ops.attention(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad(lse.masked_fill(torch.isinf(lse), 0).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    _, ref_lse = naive_attention(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref_lse.masked_fill(torch.isinf(ref_lse), 0).sum(), (q64, k64, v64),
                                    allow_unused=True, materialize_grads=True)
    for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads):
        tk_testing.assert_rel_close(grad, ref_grad, 1e-10, name)
    assert torch.all(grads[2] == 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_heads, kv_heads", [(3, 3), (6, 2)], ids=["mha", "gqa"])
def test_matches_sdpa_for_equal_lengths(causal, q_heads, kv_heads):
    q, k, v = make_qkv(2, q_heads, kv_heads, 29, 29, 40)
    out = tk_ops.attention(q, k, v, causal=causal, scale=0.2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.2, enable_gqa=True)
    tk_testing.assert_rel_close(out, expected, 1e-12, "out")
    tk_testing.assert_gradients_close(out, (q, k, v), expected, (q, k, v), 1e-12, "qkv")


# --------------------------------------------------------------------------------- strides


def test_transposed_views_reach_the_op_without_copy():
    batch, q_len, key_len, head_dim = 2, 23, 19, 40
    q_rows = torch.randn(batch, q_len, 4 * head_dim, dtype=torch.float64)
    kv_rows = torch.randn(batch, key_len, 2 * 2 * head_dim, dtype=torch.float64)
    q = q_rows.view(batch, q_len, 4, head_dim).transpose(1, 2)
    k, v = (t.transpose(1, 2) for t in kv_rows.view(batch, key_len, 2, 2, head_dim).unbind(2))

    with tk_testing.RecordTkCalls() as recorder:
        tk_ops.attention(q, k, v, causal=True)
    assert [t.stride() for t in recorder.calls["attention"][-1][:3]] == [q.stride(), k.stride(), v.stride()]
    tk_testing.check_matches_contiguous_copies(lambda q, k, v: tk_ops.attention(q, k, v, causal=True), (q, k, v))


def test_non_unit_last_stride_is_copied_not_misread():
    q, k, v = make_qkv(1, 2, 2, 13, 13, 80, requires_grad=False)
    q_strided, k_strided = q[..., ::2], k[..., ::2]
    out = tk_ops.attention(q_strided, k_strided, v[..., :40])
    torch.testing.assert_close(out, naive_attention(q_strided, k_strided, v[..., :40])[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- blockwise reference (long sequences)


def test_block_budget_bounds_long_sequences():
    q = torch.empty(1, 32, 16384, 128, device="meta")
    rows = attention_module._rows_per_block(q, q)
    assert 1 <= rows < 16384
    assert rows * 32 * 16384 * 4 <= attention_module._REFERENCE_BLOCK_BYTES


@pytest.mark.parametrize("q_len, key_len", [(70, 33), (33, 70), (61, 61)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_many_blocks_match_naive(monkeypatch, q_len, key_len, causal):
    q, k, v = make_qkv(1, 4, 2, q_len, key_len, 40)
    rows_per_block = 6
    monkeypatch.setattr(attention_module, "_REFERENCE_BLOCK_BYTES", rows_per_block * 4 * key_len * 8)
    assert attention_module._rows_per_block(q, k) == rows_per_block
    check_against_naive(q, k, v, causal)


# -------------------------------------------------------------------------------- deterministic


def test_deterministic_follows_torch_switch(monkeypatch):
    """deterministic=None takes torch.are_deterministic_algorithms_enabled(); an explicit value wins."""
    seen = []
    forward = attention_module.attention_op
    monkeypatch.setattr(attention_module, "attention_op", lambda *args: seen.append(args[5]) or forward(*args))
    q, k, v = make_qkv(1, 2, 2, 5, 5, 16, requires_grad=False)
    was_enabled, was_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        tk_ops.attention(q, k, v)
        tk_ops.attention(q, k, v, deterministic=True)
        torch.use_deterministic_algorithms(True)
        tk_ops.attention(q, k, v)
        tk_ops.attention(q, k, v, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
    assert seen == [False, True, True, False]


# ------------------------------------------------------------------------------ CUDA kernel


def use_backward_method(monkeypatch, method: str) -> bool:
    """Select `method` for this test; returns the `deterministic` argument that goes with it."""
    if method == "one_pass":
        monkeypatch.setenv(BACKWARD_ENV, "one_pass")
        return False
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    return True



# The head dims of the forward kernel; the backward kernels take all but 96 (which runs them zero-padded
# to 128: test_kernel_backward_at_a_padded_head_dim). 192 and 256 split the gradient columns between the
# consumers (attention.cuh, column_split): their own kernels, recompute only.
FORWARD_HEAD_DIMS = [64, 96, 128, 192, 256]
BACKWARD_HEAD_DIMS = [64, 128, 192, 256]


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, key_len", [(1, 1), (17, 17), (1000, 1000), (4097, 4097), (300, 1000), (1000, 300)])
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_against_float64(monkeypatch, dtype, head_dim, causal, q_len, key_len, method):
    check_kernels_against_naive(monkeypatch, method, 1, q_len, key_len, head_dim, dtype, causal)


def check_kernels_against_naive(monkeypatch, method, batch, q_len, key_len, head_dim, dtype, causal):
    """Forward and backward of GQA 4/2 heads on the kernels (no fallback) against float64, by ``method``."""
    deterministic = use_backward_method(monkeypatch, method)
    inputs = make_qkv(batch, 4, 2, q_len, key_len, head_dim, dtype=dtype, device="cuda")
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        check_against_naive(*inputs, causal, deterministic=deterministic)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 1), (6, 6)], ids=["mqa", "mha"])
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_head_groups(monkeypatch, q_heads, kv_heads, head_dim, method):
    deterministic = use_backward_method(monkeypatch, method)
    inputs = make_qkv(2, q_heads, kv_heads, 333, 333, head_dim, dtype=torch.bfloat16, device="cuda")
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        check_against_naive(*inputs, True, deterministic=deterministic)


def keys_in_layout(batch, kv_heads, key_len, head_dim, layout):
    """k or v (B, Hkv, Nk, D) in bf16 on the GPU: head-major (contiguous, as Hugging Face's caches hold them)
    or tokens-major (a (B, Nk, Hkv, D) tensor's transposed view, as models make them)."""
    if layout == "head-major":
        return torch.randn(batch, kv_heads, key_len, head_dim, device="cuda", dtype=torch.bfloat16)
    return torch.randn(batch, key_len, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("layout", ["head-major", "tokens-major"])
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 2), (16, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("key_len", [256, 1000, 4097])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_one_query_row_against_many_keys(layout, q_heads, kv_heads, head_dim, key_len, causal):
    """A decoding step through tk.attention (one query row per head) runs the KV-cache decode form: out, lse
    and the gradients through both match float64, in either key layout."""
    q = torch.randn(3, q_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (keys_in_layout(3, kv_heads, key_len, head_dim, layout).requires_grad_() for _ in range(2))
    with tk_testing.runs_the_kernels("attention", "attention_with_kvcache"):
        out, lse = tk_ops.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (3, q_heads, 1, head_dim) and out.is_contiguous() and lse.shape == (3, q_heads, 1)
    check_against_naive(q, k, v, causal)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("layout", ["head-major", "tokens-major"])
def test_kernel_one_query_row_with_softcap_and_sinks(layout):
    """Softcap and sinks on the decode route (sinks with head-major keys stay on the forward kernel): out, lse
    and the gradients of q, k, v and the sinks (the backward reads the combine's lse, which holds the sinks)
    against float64, no reference anywhere."""
    from test_attention_features import check_against_naive as check_options, dense_call, dense_naive

    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (keys_in_layout(2, 2, 3000, 128, layout).requires_grad_() for _ in range(2))
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    options = dict(causal=True, softcap=20.0)
    with tk_testing.runs_the_kernels("attention", "attention_with_kvcache", "attention_bwd"):
        check_options(dense_call(**options), dense_naive(**options), [q, k, v, sinks],
                      tk_testing.TOLERANCE[torch.bfloat16])


@tk_testing.requires_kernel("attention")
def test_kernel_one_query_row_never_runs_the_cache_reference():
    """Keys the cache kernels cannot take (tokens-major, but KV heads expanded with a zero stride, which TMA
    refuses) keep tk.attention's own paths (here its reference), never attention_with_kvcache's reference,
    which reads the lengths on the host."""
    q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1, 300, 64, device="cuda", dtype=torch.bfloat16).expand(2, 2, 300, 64) for _ in range(2))
    tk_ops._library._REFERENCE_WARNED.difference_update({"attention", "attention_with_kvcache"})
    with pytest.warns(UserWarning, match=tk_testing.REFERENCE_WARNING) as record:
        out, lse = tk_ops.attention(q, k, v, causal=True, return_lse=True)
    messages = [str(warning.message) for warning in record]
    assert any("tk.attention has no" in message for message in messages), messages
    assert not any("tk.attention_with_kvcache has no" in message for message in messages), messages
    want_out, want_lse = naive_attention(q, k, v, causal=True)
    tk_testing.assert_rel_close(out, want_out, tk_testing.TOLERANCE[torch.bfloat16])
    tk_testing.assert_rel_close(lse, want_lse, tk_testing.TOLERANCE[torch.bfloat16], "lse")


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_value_head_dim_below_the_key_head_dim(monkeypatch, causal, method):
    """(D, Dv) = (192, 128), MLA's: the forward runs the D = 192 kernel on v padded to 192 and cut back, the
    backward the D = 192 kernels on v, out and grad_out padded to 192 and dv cut back (no warning); together
    they match float64 (GQA, Nq != Nk, tails)."""
    deterministic = use_backward_method(monkeypatch, method)
    q, k, v = make_qkv(2, 4, 2, 300, 333, 192, value_dim=128, dtype=torch.bfloat16, device="cuda")
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        out = tk_ops.attention(q.detach(), k.detach(), v.detach(), causal=causal)
        assert out.shape == (2, 4, 300, 128) and out.is_contiguous()
        _, _, (grad_q, grad_k, grad_v) = check_against_naive(q, k, v, causal, deterministic=deterministic)
    assert grad_v.shape == v.shape and grad_k.shape == k.shape and grad_q.shape == q.shape


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_backward_at_a_padded_head_dim(causal):
    """At D = 96, which only the forward kernel takes, the forward runs it (no warning) and the gradients run
    the backward kernels on zero-padded copies (D = 128), together matching float64 (GQA, Nq != Nk, tails)."""
    q, k, v = make_qkv(2, 4, 2, 300, 333, 96, dtype=torch.bfloat16, device="cuda")
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        check_against_naive(q, k, v, causal)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("method", BACKWARD_METHODS)
@pytest.mark.parametrize("head_dim", [96, 192, 256])
def test_kernel_backward_with_options_on_strided_views(monkeypatch, method, head_dim):
    """The padded backward (D = 96) and the split one (192, 256) with a window, a softcap and sinks, on
    (B, N, H, D) views: gradients of q, k, v and the sinks against float64 autograd of the reference."""
    from test_attention_features import check_against_naive as check_options, dense_call, dense_naive

    deterministic = use_backward_method(monkeypatch, method)
    q, k, v = (torch.randn(2, n, h, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for n, h in ((400, 4), (500, 2), (500, 2)))
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    options = dict(causal=True, window=(120, -1), softcap=5.0)
    # the gradients inside the block too: the backward is what must run its kernels
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        check_options(dense_call(deterministic=deterministic, **options), dense_naive(**options), [q, k, v, sinks],
                      tk_testing.TOLERANCE[torch.bfloat16])


@tk_testing.requires_kernel("attention")
def test_kernel_padded_backward_checks_its_shapes_first():
    """At D = 96 an out and grad_out of the wrong head dim raise, rather than being padded (or cropped) to 128."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 96, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    out, lse = torch.ops.tk.attention(q, k, v, False, 0.1, False)
    for wrong in (out[..., :64], torch.cat([out, out], dim=-1)):
        with pytest.raises(ValueError, match="out must be"):
            torch.ops.tk.attention_bwd(wrong, None, q, k, v, wrong, lse, False, 0.1, False)


def scores_along_keys(profile: str, q_len: int, key_len: int, head_dim: int, dtype):
    """q, k, v (1 batch, 2 heads) whose scores at scale 1 are a[i] * t[j] plus noise of about one unit:
    t a profile along the keys (natural-log units), a[i] in [-1, 1] shuffled over the rows, so the rows
    of one warp mix rising, flat and falling scores, and their maxima move at different key blocks.
      rising  t[j] = 300 j / Nk: a row's max climbs through every key block, by up to 28 log2 units
      late    t = 0 over the first three quarters of the keys, then climbing to 300: rescales come late
      jumps   a staircase of 96-key steps, each up by 0 to 40 log2 units (values down to 20 below
              the step): score ranges of hundreds of units, jumps far past any rescale threshold"""
    generator = torch.Generator().manual_seed(0)
    heads = 2
    keys = torch.arange(key_len, dtype=torch.float64)
    if profile == "rising":
        t = 300 * keys / key_len
    elif profile == "late":
        t = 1200 * (keys / key_len - 0.75).clamp(min=0)
    else:
        steps = math.ceil(key_len / 96)
        levels = torch.cumsum(torch.rand(steps, generator=generator, dtype=torch.float64) * 40 * math.log(2), 0)
        t = levels.repeat_interleave(96)[:key_len] - 20 * torch.rand(key_len, generator=generator, dtype=torch.float64)
    a = torch.linspace(-1, 1, q_len, dtype=torch.float64)[torch.randperm(q_len, generator=generator)]
    q = 0.3 * torch.randn(1, heads, q_len, head_dim, generator=generator, dtype=torch.float64)
    k = 0.3 * torch.randn(1, heads, key_len, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(1, heads, key_len, head_dim, generator=generator, dtype=torch.float64)
    q[..., 0], k[..., 0] = a, t
    return [x.to(device="cuda", dtype=dtype) for x in (q, k, v)]


# An lse that follows a different max than the output and sum it goes with is off by that difference.
LSE_ABSOLUTE_TOLERANCE = 5e-2


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", FORWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("profile", ["rising", "late", "jumps"])
def test_kernel_row_maxima_that_move_across_key_blocks(dtype, head_dim, causal, profile):
    """The forward's online softmax keeps each row's output scaled to a stale max until the row's max
    has moved far (lazy rescaling): rows whose max climbs through many key blocks, late, or in jumps
    far past the threshold (where fp16 P would overflow if the threshold allowed it) must still give
    the float64 out and lse."""
    q, k, v = scores_along_keys(profile, 300, 2000, head_dim, dtype)
    _, lse, _, (_, ref_lse) = check_forward_against_naive(q, k, v, causal, scale=1.0)
    assert (lse.double().cpu() - ref_lse.detach().cpu()).abs().max() <= LSE_ABSOLUTE_TOLERANCE


# Shapes the forward's query blocks make special: 192 rows (three consumers of 64) at D = 64, 128 at
# D = 128, over 128-key blocks. Nq around multiples of 64, 128 and 192 (a block whose last consumer,
# or last two, hold only rows past Nq; a last block that is exactly full), and causal Nq != Nk whose
# diagonal crosses a block's consumers at different key blocks (some consumer sees a whole key block
# hidden; rows that see no key at all).
QUERY_BLOCK_SHAPES = [(64, 64), (65, 65), (129, 129), (191, 191), (192, 192), (193, 193), (383, 383),
                      (384, 384), (385, 385), (576, 576), (577, 300), (192, 320), (320, 192), (193, 130),
                      (64, 1000), (1000, 64)]


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", FORWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, key_len", QUERY_BLOCK_SHAPES)
def test_kernel_forward_query_block_edges(dtype, head_dim, causal, q_len, key_len):
    """out and lse against float64 where the forward's query blocks end (GQA, two batches)."""
    q, k, v = make_qkv(2, 4, 2, q_len, key_len, head_dim, dtype=dtype, device="cuda")
    _, lse, _, _ = check_forward_against_naive(q, k, v, causal)
    if causal and q_len > key_len:
        assert torch.all(torch.isneginf(lse[:, :, : q_len - key_len]))


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, key_len", [(193, 193), (385, 300)])
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_query_block_edges_with_gradients(monkeypatch, head_dim, causal, q_len, key_len, method):
    """The backward reads the forward's lse, written by 192-row blocks at D = 64: gradients too."""
    deterministic = use_backward_method(monkeypatch, method)
    inputs = make_qkv(1, 4, 2, q_len, key_len, head_dim, dtype=torch.bfloat16, device="cuda")
    check_against_naive(*inputs, causal, deterministic=deterministic)


# The dK/dV kernel's query steps: 64 rows at D = 128, 128 at D = 64 (FlashAttention-3's hdim-64 tile:
# each consumer's S^T is its 64 keys x 128 queries, lse2 / delta shuffled across lanes, the mask a
# per-key query floor, the one-pass dQ partial split by rows between the consumers). Nq around
# multiples of 128 (a last step that is exactly full, holds one row, or all but one) against an Nk
# that differs (causal diagonals that cross a step at different keys for each consumer; with Nq > Nk
# rows that see no key), both dq methods; (batch, Hq, Hkv) MHA, and one GQA case whose key blocks
# stream the steps of two query heads.
DKDV_STEP_SHAPES = [(127, 300, 1, 2, 2), (128, 200, 1, 2, 2), (129, 64, 1, 2, 2), (255, 385, 1, 2, 2),
                    (257, 129, 1, 2, 2), (257, 300, 2, 4, 2)]


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, key_len, batch, q_heads, kv_heads", DKDV_STEP_SHAPES)
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_dkdv_query_steps_at_head_dim_64(monkeypatch, dtype, causal, q_len, key_len, batch, q_heads,
                                                kv_heads, method):
    """Gradients against float64 where the D = 64 dK/dV kernel's 128-query steps end."""
    deterministic = use_backward_method(monkeypatch, method)
    inputs = make_qkv(batch, q_heads, kv_heads, q_len, key_len, 64, dtype=dtype, device="cuda")
    check_against_naive(*inputs, causal, deterministic=deterministic)


# The split plans beyond D = 128 (attention.cuh, column_split): a dK/dV block owns 64 keys and each consumer
# forms S^T of half a 64-query step; a dQ block owns 64 rows and each consumer forms S of half a 64-key
# stage; both write their halves of the scores to shared memory and own half of each gradient's columns
# (D = 192: 96 each, its tiles swizzled by 64 bytes). Lengths around multiples of 32 and 64 (halves that
# hold only rows or keys past the end; causal diagonals that cross one consumer's half and not the
# other's; rows that see no key), GQA with two query heads per key block.
SPLIT_STEP_SHAPES = [(31, 33), (32, 96), (33, 65), (64, 64), (65, 127), (97, 200), (200, 97), (129, 31)]


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, key_len", SPLIT_STEP_SHAPES)
@pytest.mark.parametrize("method", BACKWARD_METHODS)
def test_kernel_split_column_step_edges(monkeypatch, head_dim, dtype, causal, q_len, key_len, method):
    """Gradients against float64 where the split plans' 32-row halves and 64-row blocks end."""
    check_kernels_against_naive(monkeypatch, method, 2, q_len, key_len, head_dim, dtype, causal)


# Scales the forward's scale-and-subtract FFMA must handle (the default 1/sqrt(D) is everywhere above):
# c = scale * log2(e) small or large; 0 and subnormal ones, which the launcher lifts to the smallest
# normal float (0 * -inf would be NaN in a hidden key's FFMA); negative ones, whose row max is c times
# the raw scores' row min and whose hidden keys are filled with +inf.
KERNEL_SCALES = {"small": 0.01, "large": 2.0, "zero": 0.0, "subnormal": 1e-40, "negative": -0.125,
                 "large_negative": -2.0}


def check_subnormal_scale(q, k, v, causal, scale):
    """A subnormal scale: out, lse and dv against float64 as usual; dq and dk are scale times numbers
    of order one, far below the smallest normal of fp32 (whose kernels flush them to zero) and of
    the outputs' dtype, so they are held to an absolute bound instead of a relative one."""
    out, lse, (q64, k64, v64), (ref_out, ref_lse) = check_forward_against_naive(q, k, v, causal, scale)
    out_weight, lse_weight = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    loss = finite_lse_loss(out, lse, out_weight.to(out.dtype), lse_weight.float())
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    ref_loss = finite_lse_loss(ref_out, ref_lse, out_weight, lse_weight)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_loss, (q64, k64, v64))
    tk_testing.assert_rel_close(dv, ref_dv, 2 * tk_testing.TOLERANCE[q.dtype], "dv")
    tiny = torch.finfo(torch.float32).tiny
    for name, grad, ref_grad in (("dq", dq, ref_dq), ("dk", dk, ref_dk)):
        assert ref_grad.abs().max() < tiny, f"{name}: the reference is not below fp32's normal range"
        assert torch.isfinite(grad).all() and grad.float().abs().max() <= tiny, f"{name}: not flushed/tiny"
    return out, lse


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", list(KERNEL_SCALES.values()), ids=list(KERNEL_SCALES))
def test_kernel_scales(dtype, head_dim, causal, scale):
    """Nq = 1100, Nk = 1000: unmasked key blocks, the masked key tail, and (causal) the diagonal blocks
    and 100 rows that see no key; out, lse and the gradients against float64."""
    inputs = make_qkv(1, 4, 2, 1100, 1000, head_dim, dtype=dtype, device="cuda")
    if abs(scale) >= torch.finfo(torch.float32).tiny:
        out, lse, _ = check_against_naive(*inputs, causal, scale=scale)
    else:
        out, lse = check_subnormal_scale(*inputs, causal, scale)
    if causal:
        assert torch.all(out[:, :, :100] == 0) and torch.all(torch.isneginf(lse[:, :, :100]))


@tk_testing.requires_kernel("attention")
def test_kernel_deterministic_wins_over_forced_one_pass(monkeypatch):
    monkeypatch.setenv(BACKWARD_ENV, "one_pass")
    q, k, v = make_qkv(1, 4, 2, 300, 300, 128, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    out, lse = torch.ops.tk.attention(q, k, v, False, 0.1, True)
    grad_out = torch.randn_like(out)
    first, second = (torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, False, 0.1, True) for _ in range(2))
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), name


@tk_testing.requires_kernel("attention")
def test_kernel_rejects_unknown_backward_method(monkeypatch):
    monkeypatch.setenv(BACKWARD_ENV, "fast")
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    out, lse = torch.ops.tk.attention(q, k, v, False, 0.1, False)
    with pytest.raises(ValueError, match=BACKWARD_ENV):
        torch.ops.tk.attention_bwd(torch.randn_like(out), None, q, k, v, out, lse, False, 0.1, False)


@tk_testing.requires_kernel("attention")
def test_kernel_transposed_views():
    batch, length, heads, head_dim = 2, 257, 4, 64
    packed = torch.randn(batch, length, 3, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.transpose(1, 2) for t in packed.unbind(2))
    out = tk_ops.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, tk_ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))


def test_attention_follows_autocast_like_sdpa():
    q, k, v = (torch.randn(2, 4, 9, 32) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tk_ops.attention(q, k, v, causal=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    tk_testing.assert_rel_close(out, expected, 2e-2)
