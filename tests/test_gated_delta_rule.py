"""tk.gated_delta_rule's numerics: the chunked reference (forward and its hand-written backward) against the
float64 token-by-token recurrence of tests/inputs/gated_delta_rule.py, on odd lengths, grouped heads, packed
sequences, states, the l2norm, strided views and bf16 inputs. The op contract (opcheck, compile, export, bad
inputs, a CUDA graph, the inputs the kernels leave to the reference) is tests/op_db.py's. The CPU cases run the
reference; the GPU cases at the end run the CUDA forward (bf16/fp16: the chunked kernels at K = V = 128, the
recurrent one for sequences of at most 16 positions at K = V in {64, 128}) against the float64 recurrence,
its backward staying the reference."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from inputs import gated_delta_rule as gdn_inputs
from tk_ops.ops import gated_delta_rule as gdn_module
import tk_testing
from tk_testing import TOLERANCE, assert_rel_close, check_matches_contiguous_copies, parametrize_with_ids

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# (id, B, T, Hk, Hv, K, V, initial, l2norm); T is never a multiple of the chunk (64, or 8 where patched).
CASES = [
    ("T1", 2, 1, 2, 2, 5, 3, False, False),
    ("T37-Hv-over-Hk-2-initial", 2, 37, 2, 4, 5, 7, True, False),
    ("T37-Hv-over-Hk-4-l2norm", 1, 37, 1, 4, 6, 4, False, True),
    ("T150-three-chunks-all-options", 2, 150, 2, 4, 8, 5, True, True),
]
CASE_ARGS = "B, T, Hk, Hv, K, V, initial, l2norm"


def _leaves(inputs):
    return {name: None if t is None else t.detach().requires_grad_() for name, t in inputs.items()}


def _gradients(outputs, inputs, grads):
    """The gradients of the inputs (by name, those present) for the output gradients ``grads`` (zeros for an
    input the outputs do not depend on: q, for the final state alone)."""
    names = [name for name in gdn_inputs.NAMES if inputs[name] is not None]
    values = torch.autograd.grad(outputs, [inputs[name] for name in names], grads, materialize_grads=True)
    return dict(zip(names, values))


def _check_against_recurrence(inputs, tol, grad_tol, **options):
    """Output, final states and every gradient (through a random output and final-state gradient) of
    tk_ops.gated_delta_rule against the float64 recurrence on the same values."""
    ours, exact = _leaves(inputs), _leaves({name: None if t is None else t.double() for name, t in inputs.items()})
    o, final = gdn_inputs.call(ours, **options)
    o_exact, final_exact = gdn_inputs.recurrence(exact, **options)
    assert o.dtype == inputs["v"].dtype and o.shape == inputs["v"].shape
    assert final.dtype == (torch.float64 if inputs["v"].dtype == torch.float64 else torch.float32)
    assert_rel_close(o, o_exact, tol, "o")
    assert_rel_close(final, final_exact, tol, "final state")
    grad_o, grad_final = torch.randn_like(o_exact), torch.randn_like(final_exact)
    got = _gradients((o, final), ours, (grad_o.to(o.dtype), grad_final.to(final.dtype)))
    want = _gradients((o_exact, final_exact), exact, (grad_o, grad_final))
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert grad.dtype == inputs[name].dtype, name
        assert_rel_close(grad, want[name], grad_tol, f"grad of {name}")


@pytest.mark.parametrize("chunk_size", [64, 8])
@parametrize_with_ids(CASE_ARGS, CASES)
def test_matches_recurrence_float64(monkeypatch, chunk_size, B, T, Hk, Hv, K, V, initial, l2norm):
    monkeypatch.setattr(gdn_module, "CHUNK_SIZE", chunk_size)
    inputs = gdn_inputs.make_inputs(B, T, Hk, Hv, K, V, initial=initial)
    _check_against_recurrence(inputs, 1e-12, 1e-11, use_qk_l2norm=l2norm)


def test_scale():
    inputs = gdn_inputs.make_inputs(1, 21, 2, 2, 4, 3, initial=True)
    o, final = gdn_inputs.call(inputs, scale=0.3)
    o_exact, final_exact = gdn_inputs.recurrence(inputs, scale=0.3)
    assert_rel_close(o, o_exact, 1e-12)
    assert_rel_close(final, final_exact, 1e-12)
    assert_rel_close(gdn_inputs.call(inputs)[0], gdn_inputs.recurrence(inputs)[0], 1e-12, "default 1 / sqrt(K)")


@pytest.mark.parametrize("chunk_size", [64, 4])
@pytest.mark.parametrize("lengths", [(3, 0, 1, 30, 1), (0, 17), (1,)], ids=["mixed", "first-empty", "one"])
def test_packed_sequences(monkeypatch, chunk_size, lengths):
    """cu_seqlens with empty and length-1 sequences: each sequence from its own initial state (an empty one
    keeps it), as the recurrence does sequence by sequence."""
    monkeypatch.setattr(gdn_module, "CHUNK_SIZE", chunk_size)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = gdn_inputs.make_inputs(1, sum(lengths), 2, 4, 5, 3, initial=True, states=len(lengths))
    _check_against_recurrence(inputs, 1e-12, 1e-11, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
    _, final = gdn_inputs.call(inputs, cu_seqlens=cu_seqlens)
    for n, length in enumerate(lengths):
        if length == 0:
            torch.testing.assert_close(final[n], inputs["initial_state"][n], rtol=0, atol=0)


def test_packed_equals_separate_calls():
    lengths = (11, 70, 2)
    cu_seqlens = torch.tensor([0, 11, 81, 83], dtype=torch.int32)
    inputs = gdn_inputs.make_inputs(1, 83, 1, 2, 4, 6, initial=True, states=3)
    o, final = gdn_inputs.call(inputs, cu_seqlens=cu_seqlens)
    for n, (start, length) in enumerate(zip(cu_seqlens.tolist(), lengths)):
        piece = {name: t[:, start : start + length] for name, t in inputs.items() if name != "initial_state"}
        piece["initial_state"] = inputs["initial_state"][n : n + 1]
        o_n, final_n = gdn_inputs.call(piece)
        assert_rel_close(o[:, start : start + length], o_n, 1e-13, f"o of sequence {n}")
        assert_rel_close(final[n : n + 1], final_n, 1e-13, f"final state of sequence {n}")


def test_chunk_size_changes_only_the_order_of_arithmetic(monkeypatch):
    inputs = gdn_inputs.make_inputs(2, 45, 2, 4, 6, 5, initial=True)
    expected = gdn_inputs.call(inputs, use_qk_l2norm=True)
    for chunk_size in (1, 5, 45, 128):
        monkeypatch.setattr(gdn_module, "CHUNK_SIZE", chunk_size)
        for got, want in zip(gdn_inputs.call(inputs, use_qk_l2norm=True), expected):
            assert_rel_close(got, want, 1e-12, f"chunk size {chunk_size}")


def test_final_state_only_when_asked():
    inputs = gdn_inputs.make_inputs(1, 9, 1, 1, 4, 4)
    o, final = tk_ops.gated_delta_rule(*(inputs[name] for name in gdn_inputs.NAMES[:5]))
    assert final is None
    assert_rel_close(o, gdn_inputs.recurrence(inputs)[0], 1e-12)


@pytest.mark.parametrize("used", ["o", "final_state"])
def test_gradient_through_one_output(used):
    """Only o, or only the final state, reaches the loss: the other output's gradient arrives as None."""
    inputs = gdn_inputs.make_inputs(1, 19, 2, 2, 4, 3, initial=True)
    ours, exact = _leaves(inputs), _leaves(inputs)
    index = 0 if used == "o" else 1
    out, out_exact = gdn_inputs.call(ours)[index], gdn_inputs.recurrence(exact)[index]
    grad = torch.randn_like(out)
    got, want = _gradients(out, ours, grad), _gradients(out_exact, exact, grad)
    for name, value in got.items():
        assert_rel_close(value, want[name], 1e-11, f"grad of {name}")


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "l2norm"])
def test_gradcheck(monkeypatch, packed, l2norm):
    """Every input, the initial state included, through o and the final state, on tiny float64 shapes with
    chunks of 3 (several chunks and a partial one)."""
    monkeypatch.setattr(gdn_module, "CHUNK_SIZE", 3)
    cu_seqlens = torch.tensor([0, 4, 4, 5, 8], dtype=torch.int32) if packed else None
    inputs = gdn_inputs.make_inputs(1 if packed else 2, 8, 1, 2, 3, 2, initial=True, states=4 if packed else None)
    leaves = _leaves(inputs)

    def function(*tensors):
        return gdn_inputs.call(dict(zip(gdn_inputs.NAMES, tensors)), cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm)

    assert torch.autograd.gradcheck(function, [leaves[name] for name in gdn_inputs.NAMES])


def _fused_projection_views(B, T, Hk, Hv, K, V):
    """q, k, v as column slices of one (B, T, 2 Hk K + Hv V) projection, g and beta as columns of one (B, T, 2 Hv)
    tensor and the initial state as a transposed (B, Hv, V, K) tensor: none of them contiguous."""
    projection = torch.randn(B, T, 2 * Hk * K + Hv * V, dtype=torch.float64)
    projection[..., Hk * K : 2 * Hk * K] /= K**0.5
    q, k, v = projection.split([Hk * K, Hk * K, Hv * V], dim=-1)
    gates = torch.cat([-0.5 * torch.rand(B, T, Hv), 0.05 + 0.9 * torch.rand(B, T, Hv)], dim=-1).double()
    initial = torch.randn(B, Hv, V, K, dtype=torch.float64).transpose(2, 3)
    return (q.unflatten(-1, (Hk, K)), k.unflatten(-1, (Hk, K)), v.unflatten(-1, (Hv, V)), gates[..., :Hv],
            gates[..., Hv:], initial)


def test_strided_views_match_contiguous_copies():
    views = _fused_projection_views(2, 23, 2, 4, 5, 3)
    assert not any(t.is_contiguous() for t in views)

    def function(q, k, v, g, beta, initial_state):
        o, final = tk_ops.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                           use_qk_l2norm=True)
        return torch.cat([o.flatten(), final.flatten()])

    check_matches_contiguous_copies(function, views)
    o, final = function(*views).split([2 * 23 * 4 * 3, 2 * 4 * 5 * 3])
    expected = gdn_inputs.recurrence(dict(zip(gdn_inputs.NAMES, views)), use_qk_l2norm=True)
    assert_rel_close(o, expected[0].flatten(), 1e-12)
    assert_rel_close(final, expected[1].flatten(), 1e-12)


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16-gates", "fp32-gates"])
def test_bf16_inputs(gate_dtype):
    """bf16 q, k, v (g and beta in bf16 or fp32, as Qwen3-Next's g): computed in fp32, so against the float64
    recurrence of the same rounded values only the bf16 output rounding (and the gradients') remains."""
    inputs = gdn_inputs.make_inputs(2, 70, 2, 4, 16, 8, initial=True, dtype=torch.bfloat16, gate_dtype=gate_dtype)
    _check_against_recurrence(inputs, TOLERANCE[torch.bfloat16], TOLERANCE[torch.bfloat16], use_qk_l2norm=True)


def test_fp32_inputs():
    inputs = gdn_inputs.make_inputs(1, 100, 2, 2, 16, 16, initial=True, dtype=torch.float32)
    _check_against_recurrence(inputs, TOLERANCE[torch.float32], 10 * TOLERANCE[torch.float32], use_qk_l2norm=True)


def test_op_rejects_bad_cu_seqlens_contents():
    """The op itself (under torch.compile, or on a GPU, the public function leaves cu_seqlens' contents to it)
    raises on lengths that do not add up."""
    inputs = gdn_inputs.make_inputs(1, 10, 1, 1, 4, 4, dtype=torch.float32)
    args = [inputs[name] for name in gdn_inputs.NAMES[:5]]
    for values, message in (([0, 6, 4, 10], "non-decreasing"), ([1, 10], "start at 0"), ([0, 9], "end at T")):
        cu_seqlens = torch.tensor(values, dtype=torch.int32)
        with pytest.raises(ValueError, match=message):
            torch.ops.tk.gated_delta_rule(*args, 0.5, None, cu_seqlens, False)


def test_packed_sequences_are_isolated():
    """A non-finite value in one packed sequence leaves the others' outputs and states untouched, also where
    a shorter sequence's padding is laid out over its rows (sequence 0 over rows 3 to 8 of sequence 1)."""
    inputs = gdn_inputs.make_inputs(1, 12, 1, 2, 4, 3, initial=True, states=2)
    cu_seqlens = torch.tensor([0, 3, 12], dtype=torch.int32)
    clean_o, clean_final = gdn_inputs.call(inputs, cu_seqlens=cu_seqlens)
    inputs["v"][0, 5] = float("nan")
    inputs["g"][0, 6] = float("inf")
    o, final = gdn_inputs.call(inputs, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(o[:, :3], clean_o[:, :3], rtol=0, atol=0)
    torch.testing.assert_close(final[0], clean_final[0], rtol=0, atol=0)
    assert not torch.isfinite(o[:, 5]).all()


# ------------------------------------------------------------------------------------------ CUDA forward

# The kernels round every mma operand to the inputs' dtype (q, k after the l2norm, W, U0, V' and the
# state's copy, as fla does), so their error is a few roundings of the inputs' dtype: a CPU emulation of
# the kernels' chunk algorithm with those roundings gave at most 3.7e-3 (bf16) and 4.6e-4 (fp16) on these
# cases, and a budget near that still catches a wrong decay or a lost tail row.
KERNEL_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
KERNEL_DIM = 128  # K = V: Qwen3-Next's head dim, the one the kernels take

# (id, B, T, Hk, Hv, initial, l2norm): T odd or not a multiple of the 64-position chunk, Hv / Hk = 1, 2, 4.
KERNEL_CASES = [
    ("T1", 2, 1, 2, 2, False, False),
    ("T37-Hv-over-Hk-2-initial", 2, 37, 2, 4, True, False),
    ("T64-one-whole-chunk-l2norm", 1, 64, 1, 1, False, True),
    ("T201-Hv-over-Hk-4-all-options", 2, 201, 1, 4, True, True),
    ("T1000-l2norm-initial", 1, 1000, 2, 4, True, True),
]


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs a kernel forgets to write stay NaN."""
    torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")


def _kernel_inputs(B, T, Hk, Hv, initial, dtype, states=None):
    return gdn_inputs.make_inputs(B, T, Hk, Hv, KERNEL_DIM, KERNEL_DIM, initial=initial, states=states, dtype=dtype,
                                  gate_dtype=torch.float32, device="cuda")


def _check_kernel_forward(inputs, dtype, *, cu_seqlens=None, use_qk_l2norm=False, tolerances=None):
    """o and the final states against the float64 recurrence, within ``tolerances`` (of o, of the final
    states; default KERNEL_TOLERANCE[dtype] for both)."""
    o_tolerance, state_tolerance = tolerances or (KERNEL_TOLERANCE[dtype],) * 2
    _poison_allocator(4 * inputs["v"].numel() * 4)
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        o, final = gdn_inputs.call(inputs, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    exact = {name: None if t is None else t.double() for name, t in inputs.items()}
    o_exact, final_exact = gdn_inputs.recurrence(exact, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert_rel_close(o, o_exact, o_tolerance, "o")
    assert_rel_close(final, final_exact, state_tolerance, "final state")


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@parametrize_with_ids("B, T, Hk, Hv, initial, l2norm", KERNEL_CASES)
def test_kernel_forward_matches_recurrence(dtype, B, T, Hk, Hv, initial, l2norm):
    torch.manual_seed(0)
    _check_kernel_forward(_kernel_inputs(B, T, Hk, Hv, initial, dtype), dtype, use_qk_l2norm=l2norm)


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_kernel_forward_packed_sequences(initial):
    """cu_seqlens with empty sequences (first, inner, last), one of length 1, one shorter than a chunk and ones
    across chunk boundaries."""
    torch.manual_seed(0)
    lengths = [0, 70, 0, 1, 5, 130, 64, 0]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    inputs = _kernel_inputs(1, sum(lengths), 2, 4, initial, torch.bfloat16, states=len(lengths))
    _check_kernel_forward(inputs, torch.bfloat16, cu_seqlens=cu_seqlens, use_qk_l2norm=True)


@tk_testing.requires_kernel("gated_delta_rule")
def test_kernel_forward_strided_views():
    """q, k, v as views into one fused projection (B, T, 2 Hk K + Hv V), g and beta strided too: the kernel
    reads them in place and matches contiguous copies."""
    torch.manual_seed(0)
    B, T, Hk, Hv, D = 2, 77, 2, 4, KERNEL_DIM
    fused = torch.randn(B, T, 2 * Hk * D + Hv * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = fused.split([Hk * D, Hk * D, Hv * D], dim=-1)
    q, k, v = q.unflatten(-1, (Hk, D)), k.unflatten(-1, (Hk, D)), v.unflatten(-1, (Hv, D))  # views (l2norm)
    gates = torch.rand(B, T, Hv, 2, device="cuda")
    g, beta = -0.5 * gates[..., 0], 0.05 + 0.9 * gates[..., 1]
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        o, final = tk_ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
        o_copy, final_copy = tk_ops.gated_delta_rule(*(t.contiguous() for t in (q, k, v, g, beta)),
                                                     output_final_state=True, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_copy, rtol=0, atol=0)
    torch.testing.assert_close(final, final_copy, rtol=0, atol=0)


@tk_testing.requires_kernel("gated_delta_rule")
def test_kernel_forward_more_sequences_than_a_grid_dimension_holds():
    """B = 70000 > 65535 (the limit of a grid's y and z) of length 1 from a zero state: S = beta k v^T and
    o = scale beta (k . q) v, in float64."""
    torch.manual_seed(0)
    inputs = _kernel_inputs(70000, 1, 1, 1, False, torch.bfloat16)
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        o, final = gdn_inputs.call(inputs)
    q, k, v, beta = (inputs[name].double() for name in ("q", "k", "v", "beta"))
    weight = KERNEL_DIM**-0.5 * beta[..., None] * (k * q).sum(-1, keepdim=True)
    assert_rel_close(o, weight * v, KERNEL_TOLERANCE[torch.bfloat16], "o")
    rows = [*range(65530, 65545), 69999]  # the states (4.6 GB in all) around the old limit and the last
    assert_rel_close(final[rows], beta[rows, 0, :, None, None] * k[rows, 0, :, :, None] * v[rows, 0, :, None, :],
                     KERNEL_TOLERANCE[torch.bfloat16], "final state")


@tk_testing.requires_kernel("gated_delta_rule")
def test_kernel_forward_backward_runs_the_reference():
    """The backward (the reference, recomputing from the inputs) works after the kernel's forward."""
    torch.manual_seed(0)
    inputs = _kernel_inputs(1, 70, 1, 2, True, torch.bfloat16)
    leaves = _leaves(inputs)
    o, final = gdn_inputs.call(leaves, use_qk_l2norm=True)
    (o.float().square().sum() + final.sum()).backward()
    for name, t in leaves.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name


# ------------------------------------------------------------------------------ CUDA forward, recurrent path

# Sequences of at most RECURRENT_MAX_T positions (csrc/kernels/gated_delta_rule/gated_delta_rule.h) run the
# recurrent kernel, all in fp32 with o rounded once: o's error is the rounding of its dtype (relative
# 2^-8 for bf16, 2^-11 for fp16, at most per element, ~0.6 of that in norm), the state's that of fp32
# arithmetic with the fast exp and rsqrt (~1e-6 over 16 steps).
RECURRENT_MAX_T = 16
RECURRENT_TOLERANCE = {torch.bfloat16: (5e-3, 1e-4), torch.float16: (1e-3, 1e-4)}  # (o, final state)
RECURRENT_DIMS = [64, 128]  # K = V

# (id, Hk, Hv, initial, l2norm)
RECURRENT_HEADS = [("Hv-over-Hk-1", 2, 2, False, False), ("Hv-over-Hk-2-initial-l2norm", 1, 2, True, True)]


def _recurrent_inputs(B, T, Hk, Hv, D, initial, dtype, states=None):
    return gdn_inputs.make_inputs(B, T, Hk, Hv, D, D, initial=initial, states=states, dtype=dtype,
                                  gate_dtype=torch.float32, device="cuda")


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", RECURRENT_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("T", [1, 2, 7, RECURRENT_MAX_T], ids=lambda t: f"T{t}")
@parametrize_with_ids("Hk, Hv, initial, l2norm", RECURRENT_HEADS)
def test_kernel_recurrent_matches_recurrence(dtype, D, T, Hk, Hv, initial, l2norm):
    torch.manual_seed(0)
    _check_kernel_forward(_recurrent_inputs(3, T, Hk, Hv, D, initial, dtype), dtype, use_qk_l2norm=l2norm,
                          tolerances=RECURRENT_TOLERANCE[dtype])


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("D", RECURRENT_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_kernel_recurrent_packed_sequences(D, initial):
    """cu_seqlens with sequences of 0 (first and last: the state passes through), 1, 5 and 16 positions."""
    torch.manual_seed(0)
    lengths = [0, 5, 1, RECURRENT_MAX_T, 0]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    inputs = _recurrent_inputs(1, sum(lengths), 2, 4, D, initial, torch.bfloat16, states=len(lengths))
    _check_kernel_forward(inputs, torch.bfloat16, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                          tolerances=RECURRENT_TOLERANCE[torch.bfloat16])


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("D", RECURRENT_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("T", [1, 7])
def test_kernel_recurrent_strided_views(D, T):
    """q, k, v as views into one fused projection (B, T, 2 Hk D + Hv D), g and beta strided, the initial state
    a transposed view: the kernel reads them in place, matching contiguous copies bit for bit and the
    float64 recurrence."""
    torch.manual_seed(0)
    B, Hk, Hv = 2, 2, 4
    fused = torch.randn(B, T, 2 * Hk * D + Hv * D, device="cuda", dtype=torch.float16)
    q, k, v = fused.split([Hk * D, Hk * D, Hv * D], dim=-1)
    q, k, v = q.unflatten(-1, (Hk, D)), k.unflatten(-1, (Hk, D)), v.unflatten(-1, (Hv, D))
    gates = torch.stack([-0.5 * torch.rand(B, T, Hv, device="cuda"), 0.05 + 0.9 * torch.rand(B, T, Hv, device="cuda")],
                        dim=-1)
    g, beta = gates[..., 0], gates[..., 1]  # views, every other element
    initial = torch.randn(B, Hv, D, D, device="cuda").transpose(2, 3)
    views = (q, k, v, g, beta, initial)
    assert not any(t.is_contiguous() for t in views)
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        o, final = gdn_inputs.call(dict(zip(gdn_inputs.NAMES, views)), use_qk_l2norm=True)
        o_copy, final_copy = gdn_inputs.call(dict(zip(gdn_inputs.NAMES, (t.contiguous() for t in views))),
                                             use_qk_l2norm=True)
    torch.testing.assert_close(o, o_copy, rtol=0, atol=0)
    torch.testing.assert_close(final, final_copy, rtol=0, atol=0)
    exact = {name: t.double() for name, t in zip(gdn_inputs.NAMES, views)}
    o_exact, final_exact = gdn_inputs.recurrence(exact, use_qk_l2norm=True)
    o_tolerance, state_tolerance = RECURRENT_TOLERANCE[torch.float16]
    assert_rel_close(o, o_exact, o_tolerance, "o")
    assert_rel_close(final, final_exact, state_tolerance, "final state")


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_recurrent_and_chunked_paths_agree(dtype):
    """17 positions (the chunked kernels) against 16 (the recurrent one) then a decode step of 1 from its final
    state (the recurrent one again): the same outputs and final state, within the chunked kernels' budget."""
    torch.manual_seed(0)
    T = RECURRENT_MAX_T + 1
    inputs = _recurrent_inputs(2, T, 1, 2, KERNEL_DIM, True, dtype)
    prefix = {name: t if name == "initial_state" else t[:, : T - 1] for name, t in inputs.items()}
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        o_chunked, final_chunked = gdn_inputs.call(inputs, use_qk_l2norm=True)
        o_prefix, state = gdn_inputs.call(prefix, use_qk_l2norm=True)
        step = {name: state if name == "initial_state" else t[:, T - 1 :] for name, t in inputs.items()}
        o_step, final_step = gdn_inputs.call(step, use_qk_l2norm=True)
    assert_rel_close(torch.cat([o_prefix, o_step], dim=1), o_chunked, KERNEL_TOLERANCE[dtype], "o")
    assert_rel_close(final_step, final_chunked, KERNEL_TOLERANCE[dtype], "final state")


@tk_testing.requires_kernel("gated_delta_rule")
def test_kernel_recurrent_head_dim_64_only_up_to_its_length():
    """K = V = 64 runs a kernel (the recurrent one) while no sequence is longer than 16, the reference beyond
    (the chunked kernels take K = V = 128 only), also when one packed sequence is 17 long."""
    torch.manual_seed(0)
    with tk_testing.runs_the_kernels("gated_delta_rule"):
        gdn_inputs.call(_recurrent_inputs(1, RECURRENT_MAX_T, 1, 1, 64, False, torch.bfloat16))
    with tk_testing.runs_the_references("gated_delta_rule"):
        gdn_inputs.call(_recurrent_inputs(1, RECURRENT_MAX_T + 1, 1, 1, 64, False, torch.bfloat16))
    lengths = [1, RECURRENT_MAX_T + 1]
    cu_seqlens = torch.tensor([0, 1, sum(lengths)], dtype=torch.int32, device="cuda")
    with tk_testing.runs_the_references("gated_delta_rule"):
        gdn_inputs.call(_recurrent_inputs(1, sum(lengths), 1, 1, 64, False, torch.bfloat16), cu_seqlens=cu_seqlens)


@tk_testing.requires_kernel("gated_delta_rule")
@pytest.mark.parametrize("D", RECURRENT_DIMS, ids=lambda d: f"D{d}")
def test_kernel_recurrent_state_8_but_not_16_byte_aligned(D):
    """An initial_state view 8 bytes past a 16-byte boundary (the recurrent kernel loads S in float4): at
    K = V = 128 the chunked kernels take it (8-byte aligned pairs), at 64 the reference; both match the
    float64 recurrence."""
    torch.manual_seed(0)
    inputs = _recurrent_inputs(2, 1, 1, 2, D, True, torch.bfloat16)
    state = inputs["initial_state"]
    shifted = torch.empty(state.numel() + 2, device="cuda")[2:].view_as(state).copy_(state)
    assert shifted.data_ptr() % 16 == 8
    path = tk_testing.runs_the_kernels if D == KERNEL_DIM else tk_testing.runs_the_references
    with path("gated_delta_rule"):
        o, final = gdn_inputs.call(dict(inputs, initial_state=shifted), use_qk_l2norm=True)
    o_exact, final_exact = gdn_inputs.recurrence({name: t.double() for name, t in inputs.items()},
                                                 use_qk_l2norm=True)
    assert_rel_close(o, o_exact, KERNEL_TOLERANCE[torch.bfloat16], "o")
    assert_rel_close(final, final_exact, KERNEL_TOLERANCE[torch.bfloat16], "final state")


@tk_testing.requires_kernel("gated_delta_rule")
def test_kernel_recurrent_decode_steps_replay_in_a_cuda_graph():
    """A captured decode step (T = 1, the state carried from step to step) replayed with new q, k, v, g and
    beta gives, step after step, the outputs and states of eager calls, bit for bit."""
    torch.manual_seed(0)
    B, Hk, Hv, D = 4, 2, 4, KERNEL_DIM
    live = _recurrent_inputs(B, 1, Hk, Hv, D, True, torch.bfloat16)
    eager = {name: t.clone() for name, t in live.items()}

    def step(inputs):
        return gdn_inputs.call(inputs, use_qk_l2norm=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step({name: t.clone() for name, t in live.items()})  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_captured, final_captured = step(live)
    for _ in range(3):
        fresh = _recurrent_inputs(B, 1, Hk, Hv, D, False, torch.bfloat16)
        for name in gdn_inputs.NAMES[:5]:
            live[name].copy_(fresh[name])
            eager[name].copy_(fresh[name])
        graph.replay()
        o_eager, final_eager = step(eager)
        torch.testing.assert_close(o_captured, o_eager, rtol=0, atol=0)
        torch.testing.assert_close(final_captured, final_eager, rtol=0, atol=0)
        live["initial_state"].copy_(final_captured)
        eager["initial_state"].copy_(final_eager)
