"""tk_ops.attention's window, softcap and sinks, and tk_ops.attention_varlen, against a direct float64
softmax (the op contract's opcheck / compile / export / bad inputs: tests/op_db.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tk_ops
import tk_testing
from inputs.attention import (BACKWARD_METHODS, backward_method, make_qkv, make_varlen, varlen_graph_inputs,
                              varlen_graph_step)
from tk_ops.ops import attention as attention_module

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------- the definition


def visible_keys(q_len, key_len, causal=False, window=None, device="cpu"):
    """(Nq, Nk) bool: query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right (right = 0 if causal)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    rows = torch.arange(q_len, device=device)[:, None] + (key_len - q_len)
    keys = torch.arange(key_len, device=device)[None, :]
    visible = torch.ones(q_len, key_len, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= keys >= rows - left
    if right >= 0:
        visible &= keys <= rows + right
    return visible


def naive_attention(q, k, v, causal=False, scale=None, window=None, softcap=None, sinks=None):
    """float64, written out: K/V heads repeated, every score, softcap, the mask, and the softmax as
    exponentials over their sum plus exp(sink). Returns (out, lse); a row with nothing in its
    denominator (no visible key, no sink) has out 0 and lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(q.shape[2], k.shape[2], causal, window, q.device)
    scores = scores.masked_fill(~visible, NEG_INF)
    sink = None if sinks is None else sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    everything = scores if sink is None else torch.cat([scores, sink], dim=-1)
    if everything.shape[-1] == 0:  # no key and no sink
        everything = torch.full((*everything.shape[:-1], 1), NEG_INF, dtype=everything.dtype, device=everything.device)
    row_max = everything.detach().amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - row_max)
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    out = torch.einsum("bhij,bhjd->bhid", weights, v) / safe_total
    lse = torch.where(empty, NEG_INF, safe_total.log() + row_max).squeeze(-1)
    return out, lse


def naive_varlen(q, k, v, cu_q, cu_k, **options):
    """naive_attention sequence by sequence on packed (total, H, D) tensors; lse (Hq, total_q)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (t[c[b]:c[b + 1]].transpose(0, 1).unsqueeze(0) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        out, lse = naive_attention(qs, ks, vs, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def attention_options(args) -> tuple:
    """The options (window_left, window_right, softcap, sinks) of a recorded tk::attention call: the
    dispatcher drops trailing arguments equal to their defaults."""
    return tuple(args[6:]) + (-1, -1, 0.0, None)[len(args) - 6:]


def make_sinks(q_heads, dtype=torch.float32, requires_grad=True, device="cpu"):
    return (torch.randn(q_heads, dtype=dtype, device=device) * 2).requires_grad_(requires_grad)


def lse_loss_weights(lse64):
    """fp32 random weights (lse is fp32) that skip -inf entries."""
    weights = torch.randn_like(lse64).float().double()
    return weights.masked_fill(torch.isinf(lse64), 0)


def weighted_loss(out, lse, out_weight, lse_weight):
    return (out * out_weight.to(out.dtype)).sum() + (lse.masked_fill(torch.isinf(lse), 0) * lse_weight.to(lse.dtype)).sum()


def sink_gradient_terms(sinks, out, lse, out_weight, lse_weight):
    """Each row's share of d loss / d sink, in float64, laid out as lse ((B, Hq, Nq), or (Hq, total) packed):
    p_sink * (the row's lse weight - out weight . out), as a sink (a key of value 0) has d out / d sink =
    -p_sink * out and d lse / d sink = p_sink."""
    delta = (out_weight.double() * out.detach().double()).sum(-1)
    if delta.shape != lse.shape:  # packed rows (total, Hq) against lse (Hq, total)
        delta = delta.transpose(0, 1)
    sinks = sinks.detach().double()[:, None]
    p_sink = torch.exp(sinks - lse.detach().double()).masked_fill(torch.isneginf(sinks), 0)
    return p_sink * (lse_weight.double() - delta)


def per_head(terms):
    """Sum over every row of a head ((..., Hq, rows) -> (Hq,))."""
    return terms.reshape(-1, *terms.shape[-2:]).sum((0, 2))


def assert_sink_gradient(grad, ref_grad, sinks, out, lse, ref_out, ref_lse, out_weight, lse_weight, tol):
    """A sink's gradient is a sum over all of its head's rows whose terms cancel, so it is judged on the scale
    of its terms (their root sum of squares), not on its own size: against the float64 reference within tol of
    that scale (the rows' rounding in out and lse, summed), and against the same sum over the call's own out and
    lse (what its backward must compute from them) within fp32's accumulation error."""
    ref_terms = sink_gradient_terms(sinks, ref_out, ref_lse, out_weight, lse_weight)
    torch.testing.assert_close(per_head(ref_terms), ref_grad.double(), rtol=1e-9, atol=1e-9)
    scale = per_head(ref_terms.square()).sqrt()
    own = per_head(sink_gradient_terms(sinks, out, lse, out_weight.to(out.dtype), lse_weight.to(lse.dtype)))
    for what, expected, bound in (("float64", ref_grad.double(), tol * scale),
                                  ("its own out and lse", own, 1e-4 * scale + 1e-6)):
        err = (grad.double() - expected).abs()
        assert torch.all(err <= bound), f"dsinks against {what}: error {err.tolist()} > {bound.tolist()}"


def check_against_naive(call, naive, leaves, tol, grad_tol=None, sinks_tol=None):
    """call(*leaves) and naive(*leaves64) -> (out, lse): out, lse and every leaf's gradient (through out and
    lse) agree. Leaves are the differentiable inputs (q, k, v[, sinks])."""
    grad_tol = 2 * tol if grad_tol is None else grad_tol
    out, lse = call(*leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_lse = naive(*leaves64)
    assert out.dtype == leaves[0].dtype and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    tk_testing.assert_rel_close(out, ref_out, tol, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    tk_testing.assert_rel_close(lse.masked_fill(torch.isinf(lse), 0), ref_lse.masked_fill(torch.isinf(ref_lse), 0),
                                max(tol, 1e-6), "lse")
    out_weight, lse_weight = torch.randn_like(ref_out), lse_loss_weights(ref_lse)
    grads = torch.autograd.grad(weighted_loss(out, lse, out_weight, lse_weight), leaves)
    ref_grads = torch.autograd.grad(weighted_loss(ref_out, ref_lse, out_weight, lse_weight), leaves64,
                                    allow_unused=True, materialize_grads=True)
    for name, grad, ref_grad, leaf in zip(("dq", "dk", "dv"), grads, ref_grads, leaves):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        tk_testing.assert_rel_close(grad, ref_grad, grad_tol, name)
    if len(leaves) == 4:
        assert grads[3].dtype == leaves[3].dtype and grads[3].shape == leaves[3].shape, "dsinks"
        # sinks are fp32 beside fp64 q: their gradient is rounded to fp32.
        assert_sink_gradient(grads[3], ref_grads[3], leaves[3], out, lse, ref_out, ref_lse, out_weight, lse_weight,
                             grad_tol if sinks_tol is None else sinks_tol)
    return out, lse, grads


def dense_call(**options):
    def call(q, k, v, sinks=None):
        return tk_ops.attention(q, k, v, sinks=sinks, return_lse=True, **options)

    return call


def dense_naive(**options):
    def naive(q, k, v, sinks=None):
        return naive_attention(q, k, v, sinks=sinks, **options)

    return naive


# ----------------------------------------------------------------------------------- dense options

WINDOWS = [None, (3, -1), (-1, 2), (2, 1), (0, 0), (6, 0)]
SHAPES = [  # (batch, Hq, Hkv, Nq, Nk)
    (2, 4, 2, 17, 17),  # GQA
    (1, 3, 3, 9, 23),  # Nq < Nk
    (1, 4, 1, 23, 9),  # MQA, Nq > Nk: rows that see no key under causal
]


@pytest.mark.parametrize("shape", SHAPES, ids=["gqa-17x17", "mha-9x23", "mqa-23x9"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["", "softcap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window{w}".replace(" ", ""))
def test_options_match_naive(window, causal, softcap, with_sinks, shape):
    batch, q_heads, kv_heads, q_len, key_len = shape
    leaves = make_qkv(batch, q_heads, kv_heads, q_len, key_len, 24) + ([make_sinks(q_heads)] if with_sinks else [])
    options = dict(causal=causal, window=window, softcap=softcap, scale=0.4)
    check_against_naive(dense_call(**options), dense_naive(**options), leaves, 1e-12, sinks_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_in_low_precision(dtype):
    leaves = make_qkv(2, 4, 2, 33, 40, 64, dtype=dtype) + [make_sinks(4)]
    options = dict(causal=True, window=(7, -1), softcap=3.0)
    check_against_naive(dense_call(**options), dense_naive(**options), leaves, tk_testing.TOLERANCE[dtype])


def test_gradcheck_every_option():
    q, k, v = make_qkv(1, 4, 2, 7, 9, 8)
    sinks = make_sinks(4, dtype=torch.float64)
    for options in (dict(causal=True, window=(2, -1), softcap=1.5), dict(window=(1, 2), softcap=0.7)):
        assert torch.autograd.gradcheck(lambda q, k, v, s: tk_ops.attention(q, k, v, sinks=s, **options),
                                        (q, k, v, sinks), fast_mode=True)


def test_window_zero_zero_is_the_diagonal():
    q, k, v = make_qkv(1, 2, 2, 11, 11, 16, requires_grad=False)
    out = tk_ops.attention(q, k, v, window=(0, 0))
    torch.testing.assert_close(out, v.repeat_interleave(1, dim=1), rtol=1e-12, atol=1e-12)


def test_window_right_zero_is_causal():
    """A window (left, 0) without causal is the causal window: the op is called with causal=True."""
    q, k, v = make_qkv(1, 4, 2, 13, 19, 16, requires_grad=False)
    with tk_testing.RecordTkCalls() as recorder:
        out = tk_ops.attention(q, k, v, window=(4, 0))
    args = recorder.calls["attention"][-1]
    assert args[3:6] == (True, 0.25, False) and attention_options(args) == (4, -1, 0.0, None)
    torch.testing.assert_close(out, tk_ops.attention(q, k, v, causal=True, window=(4, 7)), rtol=0, atol=0)
    torch.testing.assert_close(tk_ops.attention(q, k, v, window=(-1, 0)), tk_ops.attention(q, k, v, causal=True),
                               rtol=0, atol=0)


def test_unbounded_window_and_zero_softcap_are_off():
    q, k, v = make_qkv(2, 4, 2, 9, 12, 16, requires_grad=False)
    plain = tk_ops.attention(q, k, v, causal=True)
    for options in (dict(window=(-1, -1)), dict(window=[-1, -1]), dict(softcap=0), dict(softcap=0.0)):
        with tk_testing.RecordTkCalls() as recorder:
            out = tk_ops.attention(q, k, v, causal=True, **options)
        assert attention_options(recorder.calls["attention"][-1]) == (-1, -1, 0.0, None)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_huge_softcap_is_no_softcap():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, requires_grad=False)
    tk_testing.assert_rel_close(tk_ops.attention(q, k, v, softcap=1e9), tk_ops.attention(q, k, v), 1e-12)


def test_minus_infinity_sinks_are_no_sinks():
    q, k, v = make_qkv(1, 4, 2, 23, 9, 16)
    sinks = torch.full((4,), NEG_INF, requires_grad=True)
    out, lse = tk_ops.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    plain_out, plain_lse = tk_ops.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=0)
    weighted_loss(out, lse, torch.randn_like(out), torch.randn_like(lse)).backward()
    assert torch.all(sinks.grad == 0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_rows_that_see_no_key_without_sinks():
    q, k, v = make_qkv(1, 4, 2, 20, 12, 16)  # causal, offset -8: rows 0..7 see no key
    out, lse, (dq, dk, dv) = check_against_naive(dense_call(causal=True, window=(3, -1)),
                                                 dense_naive(causal=True, window=(3, -1)), [q, k, v], 1e-12)
    assert torch.all(out[:, :, :8] == 0) and torch.all(torch.isneginf(lse[:, :, :8]))
    assert torch.all(dq[:, :, :8] == 0)
    assert torch.isfinite(lse[:, :, 8:]).all()
    # A window entirely right of the keys: (left, right) = (-1, 2) with offset -8 hides every key from rows 0..5.
    q, k, v = make_qkv(1, 4, 2, 20, 12, 16)
    out, lse, _ = check_against_naive(dense_call(window=(1, 2)), dense_naive(window=(1, 2)), [q, k, v], 1e-12)
    assert torch.all(out[:, :, :6] == 0) and torch.all(torch.isneginf(lse[:, :, :6]))


def test_rows_that_see_no_key_with_sinks():
    """out 0, lse = the sink, no gradient for q; the sink's gradient is the rows' lse gradient."""
    q, k, v = make_qkv(1, 4, 2, 20, 12, 16)
    sinks = make_sinks(4)
    out, lse = tk_ops.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.all(out[:, :, :8] == 0)
    torch.testing.assert_close(lse[:, :, :8], sinks.detach().view(1, 4, 1).expand(1, 4, 8), rtol=0, atol=0)
    lse_weight = torch.zeros_like(lse)
    lse_weight[:, :, :8] = torch.randn(1, 4, 8)
    dq, dsinks = torch.autograd.grad((lse * lse_weight).sum() + out[:, :, :8].sum(), (q, sinks))
    assert torch.all(dq == 0)
    torch.testing.assert_close(dsinks, lse_weight[0, :, :8].sum(-1), rtol=1e-6, atol=1e-6)


def test_lse_includes_the_sink():
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, dtype=torch.float32, requires_grad=False)
    sinks = make_sinks(4, requires_grad=False)
    _, lse = tk_ops.attention(q, k, v, scale=0.3, sinks=sinks, return_lse=True)
    scores = 0.3 * torch.einsum("bhid,bhjd->bhij", q.double(), k.double().repeat_interleave(2, dim=1))
    with_sink = torch.cat([scores, sinks.double().view(1, 4, 1, 1).expand(2, 4, 9, 1)], dim=-1)
    tk_testing.assert_rel_close(lse, torch.logsumexp(with_sink, dim=-1), 1e-6, "lse")


@pytest.mark.parametrize("window", [(5, -1), (-1, 3), (4, 2)])
@pytest.mark.parametrize("q_len, key_len", [(70, 33), (33, 70), (61, 61)])
def test_many_blocks_with_a_window(monkeypatch, window, q_len, key_len):
    """Blocks of 6 query rows, each against the keys its rows can see (some blocks see none)."""
    leaves = make_qkv(1, 4, 2, q_len, key_len, 16) + [make_sinks(4)]
    monkeypatch.setattr(attention_module, "_REFERENCE_BLOCK_BYTES", 6 * 4 * key_len * 8)
    for causal in (False, True):
        options = dict(causal=causal, window=window, softcap=4.0)
        check_against_naive(dense_call(**options), dense_naive(**options), leaves, 1e-12, sinks_tol=1e-6)


def test_sliding_window_blocks_read_only_the_window(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 8, requires_grad=False)
    monkeypatch.setattr(attention_module, "_REFERENCE_BLOCK_BYTES", 8 * 2 * 64 * 8)
    blocks = list(attention_module._query_blocks(q, k, 5, 0))
    assert len(blocks) == 8 and all(stop - start == 8 for start, stop, _, _ in blocks)
    assert all(key_stop - key_start <= 8 + 5 for _, _, key_start, key_stop in blocks)


def test_options_on_strided_views():
    batch, q_len, key_len, head_dim = 2, 23, 19, 16
    q = torch.randn(batch, q_len, 4 * head_dim, dtype=torch.float64).view(batch, q_len, 4, head_dim).transpose(1, 2)
    kv = torch.randn(batch, key_len, 2, 2, head_dim, dtype=torch.float64)
    k, v = (t.transpose(1, 2) for t in kv.unbind(2))
    sinks = torch.randn(8, dtype=torch.float32)[::2]
    options = dict(causal=True, window=(5, -1), softcap=2.0)
    with tk_testing.RecordTkCalls() as recorder:
        tk_ops.attention(q, k, v, sinks=sinks, **options)
    assert [t.stride() for t in recorder.calls["attention"][-1][:3]] == [q.stride(), k.stride(), v.stride()]
    tk_testing.check_matches_contiguous_copies(lambda q, k, v, s: tk_ops.attention(q, k, v, sinks=s, **options),
                                               (q, k, v, sinks))


def test_options_off_still_match_sdpa():
    q, k, v = make_qkv(2, 6, 2, 29, 29, 40)
    out = tk_ops.attention(q, k, v, causal=True, scale=0.2, window=None, softcap=None, sinks=None)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    tk_testing.assert_rel_close(out, expected, 1e-12, "out")


def test_sinks_stay_fp32_under_autocast():
    q, k, v = (torch.randn(1, 4, 9, 32) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tk_ops.attention(q, k, v, causal=True, window=(3, -1), sinks=sinks)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert sinks.grad.dtype == torch.float32 and torch.isfinite(sinks.grad).all()


def test_backward_op_without_sinks_returns_an_empty_sink_gradient():
    q, k, v = make_qkv(1, 2, 2, 5, 5, 8, requires_grad=False)
    out, lse = torch.ops.tk.attention(q, k, v, True, 0.3, False)
    *_, grad_sinks = torch.ops.tk.attention_bwd(torch.randn_like(out), None, q, k, v, out, lse, True, 0.3, False)
    assert grad_sinks.shape == (0,) and grad_sinks.dtype == torch.float32


# ------------------------------------------------------------------------------------------ varlen


def varlen_call(cu_q, cu_k, max_q, max_k, **options):
    def call(q, k, v, sinks=None):
        return tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, sinks=sinks, return_lse=True, **options)

    return call


def varlen_naive(cu_q, cu_k, **options):
    def naive(q, k, v, sinks=None):
        return naive_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), sinks=sinks, **options)

    return naive


VARLEN_LENGTHS = [
    ("equal", [7, 7, 7], [7, 7, 7]),
    ("odd", [5, 1, 13, 8], [5, 1, 13, 8]),
    ("empty-sequences", [0, 6, 0, 9, 3], [0, 6, 0, 9, 3]),
    ("q-shorter", [3, 1, 6], [9, 4, 6]),  # cross-attention-like and decode-like rows
    ("q-longer-and-empty-keys", [9, 4, 5], [3, 0, 5]),  # rows that see no key
    ("one-sequence", [11], [11]),
]


@tk_testing.parametrize_with_ids("q_lengths, k_lengths", VARLEN_LENGTHS)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(causal=True), dict(causal=True, window=(2, -1), softcap=3.0), dict(window=(3, 1)),
     dict(softcap=1.5, with_sinks=True), dict(causal=True, window=(4, -1), with_sinks=True)],
    ids=["full", "causal", "causal-window-softcap", "window", "softcap-sinks", "causal-window-sinks"],
)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_varlen_matches_naive(q_lengths, k_lengths, options, heads):
    options = dict(options)
    with_sinks = options.pop("with_sinks", False)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(q_lengths, k_lengths, *heads, value_dim=12)
    leaves = [q, k, v] + ([make_sinks(heads[0])] if with_sinks else [])
    check_against_naive(varlen_call(cu_q, cu_k, max_q, max_k, scale=0.3, **options),
                        varlen_naive(cu_q, cu_k, scale=0.3, **options), leaves, 1e-12, sinks_tol=1e-6)


def test_varlen_of_equal_lengths_is_dense_attention():
    batch, length = 3, 10
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([length] * batch, [length] * batch, requires_grad=False)
    sinks = make_sinks(4, requires_grad=False)
    options = dict(causal=True, window=(4, -1), softcap=2.0, sinks=sinks)
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **options)
    dense = [t.view(batch, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
    dense_out, dense_lse = tk_ops.attention(*dense, return_lse=True, **options)
    torch.testing.assert_close(out, dense_out.transpose(1, 2).reshape(out.shape), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, dense_lse.transpose(0, 1).reshape(lse.shape), rtol=1e-6, atol=1e-6)


def test_varlen_rows_that_see_no_key():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([4, 3], [0, 2])
    sinks = make_sinks(4)
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    assert torch.all(out[:5] == 0) and torch.all(torch.isneginf(lse[:, :5])) and torch.isfinite(lse[:, 5:]).all()
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, sinks=sinks, return_lse=True)
    assert torch.all(out[:5] == 0)
    torch.testing.assert_close(lse[:, :5], sinks.detach()[:, None].expand(4, 5), rtol=0, atol=0)
    (dq,) = torch.autograd.grad(out.sum() + lse.sum(), (q,))
    assert torch.all(dq[:5] == 0) and torch.isfinite(dq).all()


def test_varlen_all_sequences_empty():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([0, 0], [0, 0])
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([0, 0], [3, 2])
    assert tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k).shape == (0, 4, 16)


def test_varlen_strided_views():
    """q, k, v as views of one packed (total, 3, H, D) projection, sinks a strided view."""
    lengths = [5, 9, 2]
    qkv = torch.randn(sum(lengths), 3, 4, 16, dtype=torch.float64)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    sinks = torch.randn(8)[::2]
    options = dict(causal=True, window=(3, -1), softcap=2.0)
    with tk_testing.RecordTkCalls() as recorder:
        tk_ops.attention_varlen(q, k, v, cu, cu, 9, 9, sinks=sinks, **options)
    assert [t.stride() for t in recorder.calls["attention_varlen"][-1][:3]] == [q.stride(), k.stride(), v.stride()]
    tk_testing.check_matches_contiguous_copies(
        lambda q, k, v, s: tk_ops.attention_varlen(q, k, v, cu, cu, 9, 9, sinks=s, **options), (q, k, v, sinks)
    )


def test_varlen_gradcheck():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([3, 0, 4], [2, 3, 5], head_dim=8)
    sinks = make_sinks(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window=(2, -1),
                                                   softcap=2.0, sinks=s), (q, k, v, sinks), fast_mode=True)


def test_varlen_max_seqlen_may_exceed_the_longest():
    q, k, v, cu_q, cu_k, _, _ = make_varlen([3, 5], [3, 5], requires_grad=False)
    torch.testing.assert_close(tk_ops.attention_varlen(q, k, v, cu_q, cu_k, 100, 100),
                               tk_ops.attention_varlen(q, k, v, cu_q, cu_k, 5, 5), rtol=0, atol=0)


BAD_CONTENTS = [
    ("not-from-zero", [1, 3, 8], ValueError, "cu_seqlens_q must start at 0"),
    ("decreasing", [0, 5, 3, 8], ValueError, "cu_seqlens_q must be non-decreasing"),
    ("short-end", [0, 3, 7], ValueError, "cu_seqlens_q must end at the packed length 8"),
]


@tk_testing.parametrize_with_ids("cu_q, error, match", BAD_CONTENTS)
def test_varlen_contents_are_checked_by_the_op_too(cu_q, error, match):
    """Where the public function does not read cu_seqlens (CUDA, compiled), the reference raises."""
    q, k, v, _, cu_k, _, _ = make_varlen([3, 5], [4, 4], requires_grad=False)
    cu_q = torch.tensor(cu_q, dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 8] if len(cu_q) == 3 else [0, 2, 4, 8], dtype=torch.int32)
    with pytest.raises(error, match=match):
        torch.ops.tk.attention_varlen(q, k, v, cu_q, cu_k, 8, 8, False, 0.25, -1, -1, 0.0, None, False)


def test_varlen_contents_are_checked_under_compile():
    q, k, v, _, _, _, _ = make_varlen([3, 5], [3, 5], requires_grad=False)
    compiled = torch.compile(lambda q, k, v, cu: tk_ops.attention_varlen(q, k, v, cu, cu, 5, 5), fullgraph=True)
    good = torch.tensor([0, 3, 8], dtype=torch.int32)
    torch.testing.assert_close(compiled(q, k, v, good), tk_ops.attention_varlen(q, k, v, good, good, 5, 5))
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(q, k, v, torch.tensor([0, 6, 5], dtype=torch.int32))


def test_varlen_deterministic_follows_torch_switch(monkeypatch):
    seen = []
    forward = attention_module.attention_varlen_op
    monkeypatch.setattr(attention_module, "attention_varlen_op", lambda *args: seen.append(args[-1]) or forward(*args))
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([2, 3], [2, 3], requires_grad=False)
    was_enabled, was_warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        torch.use_deterministic_algorithms(True)
        tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
    assert seen == [False, True, False]


# ---------------------------------------------------------------------------------------- CUDA
#
# The forward and backward kernels take window, softcap and sinks (csrc/kernels/attention/attention_fwd.cu,
# attention_bwd.cu: their options variants); the varlen op runs the references. Each kernel case runs under tk_testing.runs_the_kernels, so a kernel
# that fell back to the reference (whose warning raises there) fails instead of passing on the
# reference's numbers.

# (causal, window): the key-block range narrowed and masked at a left edge only, a right edge only, both,
# the diagonal alone and a causal sliding window wider than one key block (128 keys); and no window.
KERNEL_MASKS = [(False, None), (True, None), (False, (200, -1)), (True, (200, -1)), (False, (-1, 130)),
                (False, (100, 60)), (True, (100, 60)), (False, (0, 0)), (True, (129, -1))]
# (softcap, with_sinks). A softcap of 1.5 against scores of about unit size saturates their tails.
KERNEL_SCORES = [(None, False), (1.5, False), (None, True), (1.5, True)]
# (batch, Hq, Hkv, Nq, Nk): GQA at odd equal lengths; MQA with Nq < Nk (a window leaves whole key
# blocks out on both sides); Nq > Nk, where rows see no key under a causal mask or a window.
KERNEL_SHAPES = [("gqa-333x333", (2, 4, 2, 333, 333)), ("mqa-200x1000", (1, 4, 1, 200, 1000)),
                 ("mha-1000x200", (1, 3, 3, 1000, 200))]


def kernel_sinks(q_heads):
    """Sinks on the GPU: random, one far above every score (the row's out all but 0, lse the sink) and one of -inf
    (no sink)."""
    sinks = make_sinks(q_heads, requires_grad=False, device="cuda")
    sinks[0], sinks[-1] = 60.0, NEG_INF
    return sinks


def mask_id(mask):
    causal, window = mask
    return ("causal" if causal else "full") + ("" if window is None else f"-window{window}".replace(" ", ""))


# The forward kernel's head dims with each dtype: both at 64 and 128, bf16 at the others (their code is the
# same template at another tile plan; fp16 runs the same plans at 64 and 128).
FORWARD_DIMS_AND_DTYPES = [(64, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16), (128, torch.float16),
                           (96, torch.bfloat16), (192, torch.bfloat16), (256, torch.bfloat16)]


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("head_dim, dtype", FORWARD_DIMS_AND_DTYPES,
                         ids=[f"{d}-{'bf16' if t == torch.bfloat16 else 'fp16'}" for d, t in FORWARD_DIMS_AND_DTYPES])
@tk_testing.parametrize_with_ids("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("softcap, with_sinks", KERNEL_SCORES, ids=["plain", "softcap", "sinks", "softcap-sinks"])
@pytest.mark.parametrize("causal, window", KERNEL_MASKS, ids=[mask_id(mask) for mask in KERNEL_MASKS])
def test_kernel_forward_options_against_float64(causal, window, softcap, with_sinks, shape, head_dim, dtype):
    """The forward kernel's out and lse against float64; a row that sees no key gets out 0 and lse -inf, or its
    sink."""
    batch, q_heads, kv_heads, q_len, key_len = shape
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, key_len, head_dim, dtype=dtype, device="cuda",
                       requires_grad=False)
    sinks = kernel_sinks(q_heads) if with_sinks else None
    options = dict(causal=causal, window=window, softcap=softcap)
    with tk_testing.runs_the_kernels("attention"):
        out, lse = tk_ops.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    ref_out, ref_lse = naive_attention(q, k, v, sinks=sinks, **options)
    tol = tk_testing.TOLERANCE[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
    tk_testing.assert_rel_close(out, ref_out, tol, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    tk_testing.assert_rel_close(lse.masked_fill(torch.isinf(lse), 0), ref_lse.masked_fill(torch.isinf(ref_lse), 0),
                                tol, "lse")
    blind = ~visible_keys(q_len, key_len, causal, window, device="cuda").any(-1)
    assert torch.all(out[:, :, blind] == 0), "a row that sees no key must output 0"
    torch.testing.assert_close(lse[:, :, blind], ref_lse[:, :, blind].float(), rtol=1e-6, atol=1e-6)


def check_kernel_backward(shape, head_dim, dtype, method, sinks=None, **options):
    """Forward and backward on the kernels (neither may fall back) with the backward ``method``: the gradients
    of q, k, v (and the sinks), through out and lse, against float64."""
    batch, q_heads, kv_heads, q_len, key_len = shape
    leaves = make_qkv(batch, q_heads, kv_heads, q_len, key_len, head_dim, dtype=dtype, device="cuda")
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_lse = naive_attention(*leaves64[:3], sinks=leaves64[3] if sinks is not None else None, **options)
    out_weight, lse_weight = torch.randn_like(ref_out), lse_loss_weights(ref_lse)
    with backward_method(method), tk_testing.runs_the_kernels("attention", "attention_bwd"):
        out, lse = tk_ops.attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, return_lse=True,
                                    deterministic=method == "deterministic", **options)
        grads = torch.autograd.grad(weighted_loss(out, lse, out_weight, lse_weight), leaves)
    ref_grads = torch.autograd.grad(weighted_loss(ref_out, ref_lse, out_weight, lse_weight), leaves64)
    tol = tk_testing.TOLERANCE[dtype]
    for name, grad, ref_grad, leaf in zip(("dq", "dk", "dv"), grads, ref_grads, leaves):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        tk_testing.assert_rel_close(grad, ref_grad, 2 * tol, name)
    if sinks is not None:
        assert grads[3].dtype == torch.float32 and grads[3].shape == sinks.shape, "dsinks"
        assert_sink_gradient(grads[3], ref_grads[3], leaves[3], out, lse, ref_out, ref_lse, out_weight, lse_weight,
                             2 * tol)


# The backward kernels' head dims: 192 and 256 split the gradient columns between the consumers
# (attention.cuh, column_split), a plan of their own.
BACKWARD_HEAD_DIMS = [64, 128, 192, 256]


@tk_testing.requires_kernel("attention_bwd")
@pytest.mark.parametrize("method", BACKWARD_METHODS)
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
@tk_testing.parametrize_with_ids("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("softcap, with_sinks", KERNEL_SCORES, ids=["plain", "softcap", "sinks", "softcap-sinks"])
@pytest.mark.parametrize("causal, window", KERNEL_MASKS, ids=[mask_id(mask) for mask in KERNEL_MASKS])
def test_kernel_backward_options_against_float64(causal, window, softcap, with_sinks, shape, head_dim, method):
    """The backward kernels with a window (the dK/dV pass visits only the query tiles that see its keys, dQ only
    the key blocks its queries see), a softcap (the slope 1 - t^2 of each capped score) and sinks (their
    gradient from the rows' statistics), by both dq methods: every gradient against float64, rows that see no
    key included (Nq > Nk, windows)."""
    sinks = kernel_sinks(shape[1]) if with_sinks else None
    check_kernel_backward(shape, head_dim, torch.bfloat16, method, sinks=sinks, causal=causal, window=window,
                          softcap=softcap)


@tk_testing.requires_kernel("attention_bwd")
@pytest.mark.parametrize("method", BACKWARD_METHODS)
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
def test_kernel_backward_options_in_fp16(head_dim, method):
    check_kernel_backward((2, 4, 2, 333, 333), head_dim, torch.float16, method, sinks=kernel_sinks(4), causal=True,
                          window=(150, -1), softcap=3.0)


@tk_testing.requires_kernel("attention_bwd")
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
def test_kernel_backward_never_reads_query_tiles_outside_the_window(head_dim):
    """2048 queries against 2048 keys with a causal window of 100: the gradients of the first 128 keys come from
    queries 0..227 only. q, dO and the statistics of every later query set to NaN change nothing there, and
    the first 128 rows of dq (keys 0..127 only) nothing either."""
    q, k, v = make_qkv(1, 2, 2, 2048, 2048, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    grad_out = torch.randn_like(q)
    options = dict(causal=True, window=(100, -1))
    with tk_testing.runs_the_kernels("attention", "attention_bwd"):
        out, lse = tk_ops.attention(q, k, v, return_lse=True, **options)
        grads = torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, True, head_dim**-0.5, False, 100, -1, 0.0,
                                           None)
        q_nan, grad_out_nan = q.clone(), grad_out.clone()
        q_nan[:, :, 256:], grad_out_nan[:, :, 256:] = float("nan"), float("nan")
        grads_nan = torch.ops.tk.attention_bwd(grad_out_nan, None, q_nan, k, v, out, lse, True, head_dim**-0.5, False,
                                               100, -1, 0.0, None)
    torch.testing.assert_close(grads_nan[0][:, :, :128], grads[0][:, :, :128], rtol=0, atol=0)
    for name, i in (("dk", 1), ("dv", 2)):
        torch.testing.assert_close(grads_nan[i][:, :, :128], grads[i][:, :, :128], rtol=0, atol=0, msg=name)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_forward_options_on_strided_views(dtype, head_dim):
    """(B, N, H, D) views of one projection give bitwise what contiguous copies give."""
    batch, q_len, key_len = 2, 301, 517
    q = torch.randn(batch, q_len, 4 * head_dim, dtype=dtype, device="cuda").view(batch, q_len, 4, head_dim)
    kv = torch.randn(batch, key_len, 2, 2, head_dim, dtype=dtype, device="cuda")
    q, (k, v) = q.transpose(1, 2), (t.transpose(1, 2) for t in kv.unbind(2))
    sinks = make_sinks(4, requires_grad=False, device="cuda")
    options = dict(causal=True, window=(140, -1), softcap=2.0, sinks=sinks, return_lse=True)
    with tk_testing.runs_the_kernels("attention"):
        out, lse = tk_ops.attention(q, k, v, **options)
        out_copies, lse_copies = tk_ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), **options)
    torch.testing.assert_close(out, out_copies, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_copies, rtol=0, atol=0)


@tk_testing.requires_kernel("attention")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_forward_never_reads_key_blocks_left_of_the_window(head_dim):
    """128 queries at the end of 2048 keys with window (100, 20) see keys 1820..2047: key blocks of 128 from
    1792 on. Keys and values before 1792 set to NaN change nothing (those blocks are never loaded), and the
    output matches float64."""
    q, k, v = make_qkv(1, 4, 2, 128, 2048, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    options = dict(window=(100, 20), return_lse=True)
    with tk_testing.runs_the_kernels("attention"):
        out, lse = tk_ops.attention(q, k, v, **options)
        k_nan, v_nan = k.clone(), v.clone()
        k_nan[:, :, :1792], v_nan[:, :, :1792] = float("nan"), float("nan")
        out_nan, lse_nan = tk_ops.attention(q, k_nan, v_nan, **options)
    torch.testing.assert_close(out_nan, out, rtol=0, atol=0)
    torch.testing.assert_close(lse_nan, lse, rtol=0, atol=0)
    ref_out, _ = naive_attention(q, k, v, window=(100, 20))
    tk_testing.assert_rel_close(out, ref_out, tk_testing.TOLERANCE[torch.bfloat16], "out")


# Packed sequences on the kernels: one launch of the kernels' packed variant walks every (sequence, head,
# block), reading cu_seqlens on the device. (q lengths, k lengths): odd lengths across block edges, an empty
# query sequence, a sequence with queries but no key, Nq != Nk, a last sequence ending at the tensor's end.
KERNEL_VARLEN_LENGTHS = [
    ("mixed", [129, 0, 300, 1], [200, 5, 300, 130]),
    ("no-keys", [70, 200, 3], [0, 150, 261]),
    ("one", [513], [513]),
]
# (causal, window, softcap, sinks)
KERNEL_VARLEN_OPTIONS = [
    ("plain", False, None, 0.0, False),
    ("causal", True, None, 0.0, False),
    ("causal-window-sinks", True, (60, -1), 0.0, True),
    ("window-softcap", False, (40, 90), 3.0, False),
]


@tk_testing.requires_kernel("attention_varlen")
@pytest.mark.parametrize("method", BACKWARD_METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal, window, softcap, with_sinks", [row[1:] for row in KERNEL_VARLEN_OPTIONS],
                         ids=[row[0] for row in KERNEL_VARLEN_OPTIONS])
@tk_testing.parametrize_with_ids("q_lengths, k_lengths", KERNEL_VARLEN_LENGTHS)
def test_kernel_varlen_against_float64(q_lengths, k_lengths, causal, window, softcap, with_sinks, head_dim, dtype,
                                       method):
    """Forward and backward (through out and lse, by both dq methods) of packed GQA sequences with every
    option on the packed kernels, none falling back, against float64 sequence by sequence."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(q_lengths, k_lengths, q_heads=4, kv_heads=2, head_dim=head_dim,
                                                   dtype=dtype, device="cuda")
    leaves = [q, k, v] + ([make_sinks(4, device="cuda")] if with_sinks else [])
    options = dict(causal=causal, window=window, softcap=softcap)
    with backward_method(method), tk_testing.runs_the_kernels("attention_varlen", "attention_varlen_bwd"):
        check_against_naive(varlen_call(cu_q, cu_k, max_q, max_k, deterministic=method == "deterministic", **options),
                            varlen_naive(cu_q.cpu(), cu_k.cpu(), **options), leaves, tk_testing.TOLERANCE[dtype])


@tk_testing.requires_kernel("attention_varlen")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_varlen_is_the_dense_kernel_on_each_sequence(head_dim):
    """Each sequence's rows of out and lse are bitwise what tk_ops.attention gives on that sequence alone
    (with a window, so that both run the kernels' options variant)."""
    q_lengths, k_lengths = [129, 0, 300], [200, 5, 300]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(q_lengths, k_lengths, head_dim=head_dim, dtype=torch.bfloat16,
                                                   device="cuda", requires_grad=False)
    options = dict(causal=True, window=(150, -1), return_lse=True)
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    for b, (q_start, k_start) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
        if q_lengths[b] == 0:
            continue
        rows = slice(q_start, q_start + q_lengths[b])
        keys = slice(k_start, k_start + k_lengths[b])
        dense_out, dense_lse = tk_ops.attention(*(t.transpose(0, 1)[None] for t in (q[rows], k[keys], v[keys])),
                                                **options)
        torch.testing.assert_close(out[rows], dense_out[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(lse[:, rows], dense_lse[0], rtol=0, atol=0)


@tk_testing.requires_kernel("attention_varlen")
def test_kernel_varlen_reads_strided_views():
    """q, k, v as column slices of one packed qkv projection (row stride 8 heads, not 4) run in place, and
    give what their contiguous copies give, bitwise."""
    qkv = torch.randn(260, 8, 64, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cu = torch.tensor([0, 100, 101, 260], dtype=torch.int32, device="cuda")
    with tk_testing.runs_the_kernels("attention_varlen"):
        out = tk_ops.attention_varlen(q, k, v, cu, cu, 159, 159, causal=True)
        out_copies = tk_ops.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 159, 159,
                                             causal=True)
    torch.testing.assert_close(out, out_copies, rtol=0, atol=0)


@tk_testing.requires_kernel("attention_varlen")
def test_kernel_varlen_bad_lengths_in_a_cuda_graph_replay_neither_fault_nor_write_outside():
    """Lengths that break every rule (out of range, decreasing), copied into the cu_seqlens of a captured forward
    and backward, make a replay neither fault nor touch a canary (their outputs are then unspecified). Replays
    on good new lengths equal eager calls: the attention_varlen graph of tests/op_db.py."""
    inputs = varlen_graph_inputs()
    graph, _ = tk_testing.capture_cuda_graph(lambda: varlen_graph_step(*inputs))
    canary = torch.full((1 << 20,), 7.0, device="cuda")
    cu_q, cu_k = inputs[3:5]
    cu_q.copy_(torch.tensor([5, -100, 1 << 30, 2], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 1 << 30, 3, -7], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(canary == 7.0)


@tk_testing.requires_kernel("attention_varlen")
def test_kernel_varlen_bad_lengths_neither_raise_nor_fault():
    """The CUDA op never reads cu_seqlens on the host (no sync), so it does not reject bad contents as the
    reference does: they are the caller's contract, as with FlashAttention (tk_ops.attention_varlen checks
    CPU tensors). Out-of-range, decreasing and too-long lengths, forward and backward, must not fault: the
    kernels clamp what they read (compute-sanitizer's memcheck runs such a case: bench_attention --check)."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([5, 3, 200], [5, 3, 200], head_dim=64, dtype=torch.bfloat16,
                                                   device="cuda")
    for bad_q, bad_k in (([0, 6, 5, 208], [0, 5, 8, 208]), ([7, -100, 1 << 30, 2], [0, 1 << 30, 3, -7])):
        bad_q, bad_k = (torch.tensor(b, dtype=torch.int32, device="cuda") for b in (bad_q, bad_k))
        with tk_testing.runs_the_kernels("attention_varlen", "attention_varlen_bwd"):
            out = torch.ops.tk.attention_varlen(q, k, v, bad_q, bad_k, 4, max_k, True, 0.3, -1, -1, 0.0, None,
                                                False)[0]
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()


@tk_testing.requires_kernel("attention_varlen")
def test_kernel_varlen_backward_memory_follows_the_packed_rows():
    """400 documents of 16 tokens beside one of 4096: the backward's workspace (per-row statistics and the
    one-pass dq accumulator at D = 64) follows the packed rows (each document padded to 128), not documents x
    the longest (3.4 GB here), and the gradients match a call per document."""
    lengths = [4096] + [16] * 400
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lengths, lengths, q_heads=8, kv_heads=8, head_dim=64,
                                                   dtype=torch.bfloat16, device="cuda")
    out = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with tk_testing.runs_the_kernels("attention_varlen_bwd"):
        grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 512 * 2**20
    for start, length in [(0, 4096), (4096 + 16 * 199, 16)]:
        rows = slice(start, start + length)
        leaves = [t[rows].detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v)]
        alone = tk_ops.attention(*leaves, causal=True)
        want = torch.autograd.grad(alone, leaves, grad[rows].transpose(0, 1)[None])
        for got, expected in zip(grads, want):
            tk_testing.assert_rel_close(got[rows], expected[0].transpose(0, 1), 2 * tk_testing.TOLERANCE[torch.bfloat16])


@tk_testing.requires_kernel("attention_varlen")
def test_kernel_varlen_max_seqlen_may_exceed_the_longest():
    """max_seqlen far past the longest sequence (and past the packed rows) sizes the grid by the packed rows
    at most and changes nothing: forward and backward bitwise equal to the exact maxima."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([300, 5, 129], [300, 7, 200], head_dim=64,
                                                   dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(q.shape[0], 4, 64, dtype=torch.bfloat16, device="cuda")
    results = []
    for max_seqlen_q, max_seqlen_k in ((max_q, max_k), (1 << 20, 1 << 20)):
        with tk_testing.runs_the_kernels("attention_varlen", "attention_varlen_bwd"):
            out = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal=True, deterministic=True)
            results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for exact, large in zip(*results):
        torch.testing.assert_close(large, exact, rtol=0, atol=0)
