"""tk.linear_cross_entropy: the reference against the float64 definition F.cross_entropy(F.linear(...)) at odd
sizes across its tiles (every reduction, ignored rows, label smoothing, softcap, bias, leading batch dims,
strided views, bf16), gradcheck, and its memory: never the (N, V) logits. Then the CUDA kernels (bf16 and
fp16) against the same definition, on NaN-poisoned allocations, across their tiles, and their memory. Its
contract (opcheck, compile, export, bad inputs, CUDA graphs, fallbacks): tests/op_db.py, run by
tests/test_op_contract.py."""

from __future__ import annotations

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import tk_ops
from inputs.linear_cross_entropy import float64_loss, make_inputs
from tk_ops.ops import linear_cross_entropy as linear_cross_entropy_module
from tk_testing import (TOLERANCE, RecordTkCalls, assert_rel_close, check_matches_contiguous_copies,
                        parametrize_with_ids, rel_err, requires_kernel, runs_the_kernels)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

N, H, V = 37, 19, 101  # neither N nor V a multiple of the small tiles below
OPTIONS = [  # id, bias, label_smoothing, softcap
    ("plain", False, 0.0, None),
    ("bias", True, 0.0, None),
    ("smoothing", False, 0.15, None),
    ("softcap", True, 0.0, 2.5),
    ("smoothing-softcap-bias", True, 0.3, 4.0),
    ("full-smoothing", False, 1.0, None),
]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 rows by 16 classes: N = 37 and V = 101 cross several tiles and end in partial ones."""
    monkeypatch.setattr(linear_cross_entropy_module, "ROWS_PER_TILE", 8)
    monkeypatch.setattr(linear_cross_entropy_module, "VOCAB_PER_TILE", 16)


def check_against_float64(x, weight, bias, target, tol, grad_tol=None, **options):
    """Loss and the gradients of x, weight, bias (for one random output gradient) against float64_loss on the
    same values."""
    leaves = [t.detach().requires_grad_() for t in (x, weight) + (() if bias is None else (bias,))]
    # on the CPU: F.cross_entropy's nll_loss has no deterministic CUDA kernel (the poisoned_allocations fixture)
    reference_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    loss = tk_ops.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2] if bias is not None else None,
                                       **options)
    expected = float64_loss(*reference_leaves[:2], target.cpu(), *reference_leaves[2:], **options)
    assert loss.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert_rel_close(loss, expected, tol, "loss")
    grad = torch.randn_like(expected)
    grads = torch.autograd.grad(loss, leaves, grad.to(loss.device, loss.dtype))
    expected_grads = torch.autograd.grad(expected, reference_leaves, grad)
    for name, leaf, got, want in zip(("x", "weight", "bias"), leaves, grads, expected_grads):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert_rel_close(got, want, grad_tol or tol, f"grad_{name}")


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@parametrize_with_ids("with_bias, label_smoothing, softcap", OPTIONS)
def test_matches_float64_definition(dtype, reduction, with_bias, label_smoothing, softcap):
    x, weight, bias, target = make_inputs(N, H, V, dtype=dtype, with_bias=with_bias, ignored=5)
    target[7] = V - 1  # the last class, in the last, partial tile of classes
    check_against_float64(x, weight, bias, target, TOLERANCE[dtype], reduction=reduction,
                          label_smoothing=label_smoothing, softcap=softcap)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_default_tiles_match_float64_definition(reduction):
    """One tile with the default sizes; then more rows and classes than a default tile holds."""
    x, weight, bias, target = make_inputs(N, H, V)
    check_against_float64(x, weight, bias, target, TOLERANCE[torch.float64], reduction=reduction,
                          label_smoothing=0.1, softcap=3.0)
    rows = linear_cross_entropy_module.ROWS_PER_TILE + 3
    vocab = linear_cross_entropy_module.VOCAB_PER_TILE + 5
    x, weight, bias, target = make_inputs(rows, 8, vocab, dtype=torch.float32)
    check_against_float64(x, weight, bias, target, TOLERANCE[torch.float32], reduction=reduction)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_every_row_ignored(reduction, label_smoothing):
    """As PyTorch: "mean" is 0 / 0 = NaN, "sum" 0, "none" zeros; every gradient is 0 (not NaN)."""
    x, weight, bias, target = make_inputs(N, H, V, ignored=N, requires_grad=True)
    loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction=reduction,
                                       label_smoothing=label_smoothing)
    expected = float64_loss(x, weight, target, bias, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, expected.detach(), equal_nan=True, rtol=0, atol=0)
    assert loss.isnan().item() if reduction == "mean" else not loss.any()
    loss.sum().backward()
    assert not (x.grad.any() or weight.grad.any() or bias.grad.any())


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("ignore_index", [0, 50, V - 1])
def test_ignore_index_inside_the_vocabulary(ignore_index):
    """An ignore_index that is a class: rows with that target are left out, the class stays in every softmax."""
    x, weight, bias, target = make_inputs(N, H, V, ignored=0)
    target[::3] = ignore_index
    check_against_float64(x, weight, bias, target, TOLERANCE[torch.float64], ignore_index=ignore_index,
                          label_smoothing=0.1)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_leading_batch_dims_are_rows(reduction):
    """x (B, T, H) with target (B, T): every (b, t) is one row, as F.cross_entropy of the logits reshaped to
    (B T, V); "none" returns target's shape. A single row x (H,) with a 0-dim target, likewise."""
    x, weight, bias, target = make_inputs(3 * 7, H, V)
    check_against_float64(x.view(3, 7, H), weight, bias, target.view(3, 7), TOLERANCE[torch.float64],
                          reduction=reduction, label_smoothing=0.1)
    check_against_float64(x[-1], weight, bias, target[-1], TOLERANCE[torch.float64], reduction=reduction)


@pytest.mark.usefixtures("small_tiles")
def test_bf16_inputs_with_fp32_arithmetic():
    """bf16 x, weight, bias: the loss is fp32, within fp32 rounding of the float64 loss of the same bf16
    values (the logits are not rounded to bf16 first); the gradients are bf16, within bf16 rounding."""
    x, weight, bias, target = make_inputs(N, H, V, dtype=torch.bfloat16)
    for reduction in ("mean", "none"):
        check_against_float64(x, weight, bias, target, TOLERANCE[torch.float32], TOLERANCE[torch.bfloat16],
                              reduction=reduction, label_smoothing=0.1, softcap=3.0)


@pytest.mark.usefixtures("small_tiles")
def test_bf16_within_rounding_of_the_unfused_bf16_computation():
    """The unfused F.cross_entropy(F.linear(x, w).float()) on the same bf16 values rounds the logits to bf16
    first: the two agree to within that rounding."""
    x, weight, _, target = make_inputs(N, H, V, dtype=torch.bfloat16, with_bias=False)
    unfused = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, weight).float(), target)
    assert_rel_close(tk_ops.linear_cross_entropy(x, weight, target), unfused, TOLERANCE[torch.bfloat16])


def test_under_autocast_fp32_inputs_run_in_the_autocast_dtype():
    x, weight, bias, target = make_inputs(N, H, V, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias)
    expected = tk_ops.linear_cross_entropy(x.bfloat16(), weight.bfloat16(), target, bias=bias.bfloat16())
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("reduction, label_smoothing, softcap", [
    ("mean", 0.0, None), ("sum", 0.2, 2.0), ("none", 0.1, None), ("none", 0.0, 1.5),
])
def test_gradcheck(reduction, label_smoothing, softcap):
    x, weight, bias, target = make_inputs(11, 5, 19, ignored=2, requires_grad=True)

    def loss(x, weight, bias):
        return tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction=reduction,
                                           label_smoothing=label_smoothing, softcap=softcap)

    assert torch.autograd.gradcheck(loss, (x, weight, bias))


def test_gradients_only_where_asked():
    """x without grad (a frozen body) and no bias: the weight's gradient alone, as the definition's."""
    x, weight, _, target = make_inputs(N, H, V, with_bias=False)
    weight.requires_grad_()
    tk_ops.linear_cross_entropy(x, weight, target, label_smoothing=0.1).backward()
    reference = weight.detach().clone().requires_grad_()
    float64_loss(x, reference, target, label_smoothing=0.1).backward()
    assert x.grad is None
    assert_rel_close(weight.grad, reference.grad, TOLERANCE[torch.float64], "grad_weight")


@pytest.mark.usefixtures("small_tiles")
def test_strided_views_match_contiguous_copies():
    """x rows of a wider buffer (a unit last stride, read in place), x and weight transposed views (copied)."""
    x, weight, bias, target = make_inputs(N, H, V)
    wide = torch.randn(N, H + 6, dtype=torch.float64)[:, 3 : 3 + H]
    wide.copy_(x)
    transposed_x = x.T.contiguous().T
    transposed_weight = weight.T.contiguous().T
    assert wide.stride(-1) == 1 and not wide.is_contiguous() and transposed_x.stride(-1) != 1

    def loss(x, weight, bias):
        return tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction="none", label_smoothing=0.1)

    for views in ((wide, weight, bias), (transposed_x, transposed_weight, bias[::1])):
        check_matches_contiguous_copies(loss, views)


def test_strided_target():
    x, weight, bias, _ = make_inputs(N, H, V)
    every_other = torch.randint(0, V, (2 * N,))[::2]
    expected = tk_ops.linear_cross_entropy(x, weight, every_other.contiguous(), bias=bias)
    assert torch.equal(tk_ops.linear_cross_entropy(x, weight, every_other, bias=bias), expected)


# ------------------------------------------------------------------------------------------- memory


def allocated_bytes(fn) -> tuple[object, int, int]:
    """fn()'s result, the most CPU memory its allocations held at once, and what they still hold at its end,
    from torch.profiler's allocation events (each allocation and free with its size, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = fn()
    sizes = []

    def collect(events):
        for event in events:
            if event.tag == _EventType.Allocation:
                sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
            collect(event.children)

    collect(profiler.profiler.kineto_results.experimental_event_tree())
    held = peak = 0
    for _, size in sorted(sizes):
        held += size
        peak = max(peak, held)
    return result, peak, held


def test_memory_stays_far_below_the_logits():
    """N V dominates (fp32 logits of 128 MiB against 1 MiB of x and 2 MiB of W): the forward and the backward
    each peak under a quarter of the logits (a default tile is 16 MiB), and what the forward leaves for the
    backward is the lse, N floats."""
    rows, hidden, vocab = 4096, 64, 8192
    x, weight, _, target = make_inputs(rows, hidden, vocab, dtype=torch.float32, with_bias=False,
                                       requires_grad=True)
    logits_bytes = rows * vocab * 4
    loss, forward_peak, kept = allocated_bytes(lambda: tk_ops.linear_cross_entropy(x, weight, target))
    _, backward_peak, _ = allocated_bytes(loss.backward)
    assert forward_peak < logits_bytes / 4, forward_peak
    assert kept <= rows * 4 + 64, kept  # lse, and the loss
    assert backward_peak < logits_bytes / 4, backward_peak


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@parametrize_with_ids("with_bias, label_smoothing, softcap", OPTIONS)
def test_with_grads_op_backward_scales_the_stored_gradients(reduction, with_bias, label_smoothing, softcap):
    """tk.linear_cross_entropy_with_grads (what the public function calls on the kernels' inputs when a backward
    follows): its loss is the forward's, its gradients those of the loss itself, and its autograd backward returns
    them times the output gradient."""
    x, weight, bias, target = make_inputs(N, H, V, with_bias=with_bias, requires_grad=True)
    options = (-100, label_smoothing, softcap, reduction)
    loss, lse, *stored = torch.ops.tk.linear_cross_entropy_with_grads(x, weight, target, bias, *options, [True] * 3)
    plain_loss, plain_lse = torch.ops.tk.linear_cross_entropy(x, weight, target, bias, *options)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=0)
    leaves = [t for t in (x, weight, bias) if t is not None]
    reference_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    expected = float64_loss(*reference_leaves[:2], target, *reference_leaves[2:], reduction=reduction,
                            label_smoothing=label_smoothing, softcap=softcap)
    for name, got, want in zip(("x", "weight", "bias"), stored,
                                 torch.autograd.grad(expected, reference_leaves, retain_graph=True)):
        assert_rel_close(got, want, 1e-12, f"stored grad_{name}")
    grad = torch.tensor(-0.37, dtype=torch.float64)
    grads = torch.autograd.grad(loss, leaves, grad)
    for name, got, want in zip(("x", "weight", "bias"), grads, torch.autograd.grad(expected, reference_leaves, grad)):
        assert_rel_close(got, want, 1e-12, f"grad_{name}")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        torch.ops.tk.linear_cross_entropy_with_grads(x, weight, target, bias, -100, 0.0, None, "none", [True] * 3)


def test_with_grads_op_leaves_out_what_is_not_asked():
    x, weight, bias, target = make_inputs(N, H, V, requires_grad=True)
    _, _, grad_x, grad_weight, grad_bias = torch.ops.tk.linear_cross_entropy_with_grads(
        x, weight, target, bias, -100, 0.0, None, "mean", [False, True, False])
    assert grad_x.shape == (0,) and grad_bias.shape == (0,) and grad_weight.shape == weight.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scaled_rounds_once_with_the_output_gradient_in_fp32(monkeypatch, dtype):
    """g * G for a 16-bit G: g is not rounded to 16 bits first (1/3 is not a bf16 number), and the chunks of
    rows (here of 3 rows) cover G."""
    monkeypatch.setattr(linear_cross_entropy_module, "SCALE_CHUNK_ELEMENTS", 3 * 7)
    gradient = torch.randn(10, 7).to(dtype)
    grad = torch.tensor(1 / 3)
    expected = (gradient.double() * grad.double()).to(dtype)
    torch.testing.assert_close(linear_cross_entropy_module._scaled(gradient, grad), expected, rtol=0, atol=0)


def test_the_public_function_computes_gradients_in_the_forward_only_on_the_kernels_inputs():
    """On the CPU (the reference), without grad, for "none" or without an input that asks for a gradient: the
    forward op alone, its backward recomputing the logits."""
    x, weight, bias, target = make_inputs(N, H, V, requires_grad=True)
    assert linear_cross_entropy_module._gradients_in_the_forward(x, weight, bias, "mean") is None
    with RecordTkCalls() as recorder:
        tk_ops.linear_cross_entropy(x, weight, target, bias=bias).backward()
    assert set(recorder.calls) == {"linear_cross_entropy", "linear_cross_entropy_bwd"}


# ------------------------------------------------------------------------------------------- CUDA kernels

LCE_OPS = ("linear_cross_entropy", "linear_cross_entropy_bwd", "linear_cross_entropy_with_grads")
requires_kernels = requires_kernel("linear_cross_entropy")
KERNEL_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# The kernels' GEMM rounds the logits to x's dtype (as F.linear(x, W).float() does): about 2^-9 |z| a logit in
# bf16, 2^-11 in fp16, against losses of about log V. The gradients are within x's dtype's rounding: in fp16 too,
# since the kernels keep d loss / d logits in fp16's normal range whatever g (a power of two taken out and put
# back exactly: csrc/torch/linear_cross_entropy.cpp, DLOGITS_EXPONENT). Folding g = grad / 316 in left most of them
# subnormal, with errors up to 1.06e-2 on an H200; a float emulation of the kernels' roundings gives at most
# 1.9e-3 with the power of two out (grad_x with label_smoothing 1 and "mean": its fp16 values are themselves
# subnormal, as in the unfused form), 1e-3 elsewhere.
KERNEL_LOSS_TOLERANCE = {torch.bfloat16: 2e-3, torch.float16: 1e-3}
KERNEL_GRAD_TOLERANCE = {torch.bfloat16: TOLERANCE[torch.bfloat16], torch.float16: TOLERANCE[torch.float16]}
# Our fp16 gradients against the unfused fp16 form's, both vs float64: where both round alike ("sum", "none" with
# g near 1) they differ only by summation orders, hence a margin; with "mean" the unfused form's subnormal
# d loss / d logits make its error several times ours.
UNFUSED_ERROR_RATIO = 1.25
UNFUSED_ERROR_SLACK = 1e-4  # a fifth of fp16's unit roundoff, for gradients whose errors are both tiny
GPU_N, GPU_H, GPU_V = 333, 64, 1001  # odd N and V: V's rows are padded to whole 16-byte chunks in the tiles


@requires_kernels
@KERNEL_DTYPES
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@parametrize_with_ids("with_bias, label_smoothing, softcap", OPTIONS)
def test_kernels_match_float64_definition(poisoned_allocations, dtype, reduction, with_bias, label_smoothing,
                                          softcap):
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=dtype, with_bias=with_bias, ignored=17,
                                          device="cuda")
    target[40], target[41] = GPU_V - 1, 0  # the first and last classes (the last in the padded chunk)
    with runs_the_kernels(*LCE_OPS):
        check_against_float64(x, weight, bias, target, KERNEL_LOSS_TOLERANCE[dtype], KERNEL_GRAD_TOLERANCE[dtype],
                              reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)


@requires_kernels
@KERNEL_DTYPES
def test_kernels_lse_matches_float64(poisoned_allocations, dtype):
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=dtype, device="cuda")
    with runs_the_kernels("linear_cross_entropy"):
        _, lse = torch.ops.tk.linear_cross_entropy(x, weight, target, bias, -100, 0.1, 3.0, "none")
    logits = 3.0 * torch.tanh(torch.nn.functional.linear(x.double(), weight.double(), bias.double()) / 3.0)
    assert lse.dtype == torch.float32
    assert_rel_close(lse, logits.logsumexp(-1), KERNEL_LOSS_TOLERANCE[dtype], "lse")


@requires_kernels
def test_kernels_across_their_tiles(poisoned_allocations):
    """2100 rows by V = 65537 classes: two forward tiles of rows (1920 + 180 at 2^27 logits a tile) and two
    backward tiles of classes (63744 + 1793, the last a width that is not a multiple of 8)."""
    vocab = 65537
    x, weight, bias, target = make_inputs(2100, 64, vocab, dtype=torch.bfloat16, ignored=100, device="cuda")
    target[-2:] = torch.tensor([vocab - 1, 63743])  # the last class, the last class of the first backward tile
    with runs_the_kernels(*LCE_OPS):
        check_against_float64(x, weight, bias, target, KERNEL_LOSS_TOLERANCE[torch.bfloat16],
                              TOLERANCE[torch.bfloat16], reduction="none", label_smoothing=0.1, softcap=20.0)


@requires_kernels
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_kernels_every_row_ignored(poisoned_allocations, reduction):
    """As PyTorch: "mean" is NaN, "sum" 0, "none" zeros; every gradient is 0 (the kernels write zeros on ignored
    rows whatever their gradient, here 1 / 0)."""
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.bfloat16, ignored=GPU_N,
                                          requires_grad=True, device="cuda")
    with runs_the_kernels(*LCE_OPS):
        loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction=reduction, label_smoothing=0.2)
        loss.sum().backward()
    assert loss.isnan().item() if reduction == "mean" else not loss.any()
    assert not (x.grad.any() or weight.grad.any() or bias.grad.any())


@requires_kernels
@pytest.mark.parametrize("ignore_index", [0, 500, GPU_V - 1])
def test_kernels_ignore_index_inside_the_vocabulary(poisoned_allocations, ignore_index):
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.bfloat16, ignored=0, device="cuda")
    target[::3] = ignore_index
    with runs_the_kernels(*LCE_OPS):
        check_against_float64(x, weight, bias, target, KERNEL_LOSS_TOLERANCE[torch.bfloat16],
                              TOLERANCE[torch.bfloat16], ignore_index=ignore_index, label_smoothing=0.1)


@requires_kernels
@KERNEL_DTYPES
def test_kernels_match_the_unfused_computation(dtype):
    """F.cross_entropy(F.linear(x, W).float()) also rounds the logits to x's dtype: the two differ only where the
    GEMMs' summation orders round a logit differently."""
    x, weight, _, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=dtype, with_bias=False, requires_grad=True,
                                       device="cuda")
    with runs_the_kernels(*LCE_OPS):
        loss = tk_ops.linear_cross_entropy(x, weight, target)
        grads = torch.autograd.grad(loss, (x, weight))
    unfused = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, weight).float(), target)
    assert_rel_close(loss, unfused, 5e-4, "loss")
    for name, got, want in zip(("x", "weight"), grads, torch.autograd.grad(unfused, (x, weight))):
        assert_rel_close(got, want, KERNEL_GRAD_TOLERANCE[dtype], f"grad_{name}")


@requires_kernels
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@parametrize_with_ids("with_bias, label_smoothing, softcap", OPTIONS)
def test_kernels_fp16_gradients_at_least_as_accurate_as_the_unfused_form(reduction, with_bias, label_smoothing,
                                                                          softcap):
    """Against float64 on the same fp16 values, the kernels' gradients are as close as those of the unfused fp16
    form F.cross_entropy(F.linear(x, W, b).float()) on the GPU, or closer: its d loss / d logits are fp16 with g
    folded in (mostly subnormal for "mean" over hundreds of rows), the kernels' keep a power of two out."""
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.float16, with_bias=with_bias,
                                          ignored=17, device="cuda")
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    leaves = [t for t in (x, weight, bias) if t is not None]
    reference_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    expected = float64_loss(*reference_leaves[:2], target.cpu(), *reference_leaves[2:], softcap=softcap, **options)
    # "mean" and "sum" compute the gradients in the forward and round g G once more in the backward: a power of
    # two (a loss scale) keeps that exact; test_kernels_with_grads_* check other g against float64.
    grad = torch.randn_like(expected) if reduction == "none" else torch.tensor(-2.0, dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, reference_leaves, grad)

    def fused(x, weight, bias=None):
        return tk_ops.linear_cross_entropy(x, weight, target, bias=bias, softcap=softcap, **options)

    def unfused(x, weight, bias=None):
        logits = torch.nn.functional.linear(x, weight, bias).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return torch.nn.functional.cross_entropy(logits, target, **options)

    def gradients(loss):
        inputs = [t.detach().requires_grad_() for t in leaves]
        return torch.autograd.grad(loss(*inputs), inputs, grad.to(x.device, torch.float32))

    with runs_the_kernels(*LCE_OPS):
        ours = gradients(fused)
    theirs = gradients(unfused)
    for name, got, baseline, want in zip(("x", "weight", "bias"), ours, theirs, expected_grads):
        assert got.dtype == torch.float16
        err, baseline_err = rel_err(got, want), rel_err(baseline, want)
        assert baseline_err < 1, f"grad_{name}: the unfused form's relative error {baseline_err:.3e} bounds nothing"
        assert err <= UNFUSED_ERROR_RATIO * baseline_err + UNFUSED_ERROR_SLACK, (
            f"grad_{name}: relative error {err:.3e} against the unfused form's {baseline_err:.3e}")


@requires_kernels
@pytest.mark.parametrize("counted_scale, ignored_grad", [(1024.0, float("inf")), (1.0, 2.0**24)],
                         ids=["inf-under-a-loss-scale", "2^24-times-the-others"])
def test_kernels_fp16_gradients_whatever_the_ignored_rows_gradients(counted_scale, ignored_grad):
    """An ignored row's gradient reaches nothing (its d loss / d logits are zeros, as in PyTorch), so it must not
    set the power of two that keeps the fp16 d loss / d logits in range: an inf one (1 / 0 for a sequence of
    padding only) under a loss scale of 1024 would overflow them to inf, one 2^24 times the others would leave
    most of them subnormal."""
    ignored = 17
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.float16, ignored=ignored, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    reference_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    options = dict(reduction="none", label_smoothing=0.15)
    grad = torch.randn(GPU_N, device="cuda") * counted_scale
    expected = float64_loss(*reference_leaves[:2], target.cpu(), *reference_leaves[2:], **options)
    expected_grads = torch.autograd.grad(expected, reference_leaves, grad.cpu().double())
    grad[:ignored] = ignored_grad
    with runs_the_kernels(*LCE_OPS):
        loss = tk_ops.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], **options)
        grads = torch.autograd.grad(loss, leaves, grad)
    for name, got, want in zip(("x", "weight", "bias"), grads, expected_grads):
        assert_rel_close(got, want, KERNEL_GRAD_TOLERANCE[torch.float16], f"grad_{name}")


@requires_kernels
def test_kernels_give_nan_for_targets_outside_the_vocabulary():
    """The kernels cannot raise without stalling the stream (the reference raises): such a row's loss and its
    grad_x are NaN, the other rows' are those of a valid call."""
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.bfloat16, requires_grad=True,
                                          device="cuda")
    bad = target.clone()
    bad[5], bad[6] = GPU_V, -1
    others = torch.ones(GPU_N, dtype=torch.bool, device="cuda")
    others[5:7] = False
    with runs_the_kernels(*LCE_OPS):
        losses = tk_ops.linear_cross_entropy(x, weight, bad, bias=bias, reduction="none")
        expected = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction="none")
        (grad_x,) = torch.autograd.grad(losses.sum(), x)
    assert losses[5:7].isnan().all() and grad_x[5:7].isnan().all()
    assert torch.equal(losses[others], expected[others]) and grad_x[others].isfinite().all()


@requires_kernels
def test_kernels_read_row_strided_x_in_place():
    """x rows of a wider buffer (16-byte aligned rows): the same bits as on a contiguous copy."""
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.bfloat16, device="cuda")
    wide = torch.full((GPU_N, GPU_H + 8), float("nan"), dtype=torch.bfloat16, device="cuda")[:, :GPU_H]
    wide.copy_(x)

    def loss(x, weight, bias):
        return tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction="none", label_smoothing=0.1)

    with runs_the_kernels(*LCE_OPS):
        check_matches_contiguous_copies(loss, (wide, weight, bias), tol=0)


@requires_kernels
def test_kernels_memory_stays_far_below_the_logits():
    """bf16 logits of 2 GiB (16384 rows by 65536 classes), reduction "none" (the backward recomputes the logits):
    the forward and the backward each peak under a quarter of them (a tile is 256 MiB), and what the forward
    leaves for the backward is the lse and the losses, N floats each."""
    rows, hidden, vocab = 16384, 256, 65536
    x, weight, _, target = make_inputs(rows, hidden, vocab, dtype=torch.bfloat16, with_bias=False,
                                       requires_grad=True, device="cuda")
    logits_bytes = rows * vocab * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with runs_the_kernels(*LCE_OPS):
        loss = tk_ops.linear_cross_entropy(x, weight, target, reduction="none")
        forward_peak = torch.cuda.max_memory_allocated() - before
        kept = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        loss.sum().backward()
    backward_peak = torch.cuda.max_memory_allocated() - before
    assert forward_peak < logits_bytes / 4, forward_peak
    assert kept <= 2 * rows * 4 + 1024, kept  # lse and the losses (the allocator's 512-byte blocks)
    assert backward_peak < logits_bytes / 4, backward_peak


@requires_kernels
def test_kernels_with_grads_memory():
    """The same with "mean": the forward computes the gradients (a tile of 2^28 logits, 512 MiB, and grad_W's fp32
    sum) and leaves them for the backward, grad_x and grad_weight in bf16 ((N + V) H 2 bytes); each peak stays
    under a quarter of the logits plus those gradients."""
    rows, hidden, vocab = 16384, 256, 65536
    x, weight, _, target = make_inputs(rows, hidden, vocab, dtype=torch.bfloat16, with_bias=False,
                                       requires_grad=True, device="cuda")
    logits_bytes = rows * vocab * 2
    gradients_bytes = (rows + vocab) * hidden * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with runs_the_kernels(*LCE_OPS), RecordTkCalls() as recorder:
        loss = tk_ops.linear_cross_entropy(x, weight, target)
        forward_peak = torch.cuda.max_memory_allocated() - before
        kept = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
    backward_peak = torch.cuda.max_memory_allocated() - before
    assert set(recorder.calls) == {"linear_cross_entropy_with_grads"}
    assert forward_peak < logits_bytes / 4 + 3 * gradients_bytes, forward_peak
    assert kept <= gradients_bytes + rows * 4 + 4096, kept  # the gradients, lse, the loss
    assert backward_peak < logits_bytes / 4 + 3 * gradients_bytes, backward_peak


@requires_kernels
def test_kernels_with_grads_only_when_a_backward_follows():
    """The with-grads op for "mean" and "sum" on inputs asking for gradients; the forward op alone without grad
    mode or without such inputs, and for "none" (whose backward recomputes the logits)."""
    x, weight, bias, target = make_inputs(GPU_N, GPU_H, GPU_V, dtype=torch.bfloat16, device="cuda")

    def ops_called(x, weight, reduction="mean", grad=True):
        with RecordTkCalls() as recorder, torch.set_grad_enabled(grad):
            loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, reduction=reduction)
            if loss.requires_grad:
                loss.sum().backward()
        return set(recorder.calls)

    with runs_the_kernels(*LCE_OPS):
        with_grads = {"linear_cross_entropy_with_grads"}
        assert ops_called(x.requires_grad_(), weight) == with_grads
        assert ops_called(x.detach(), weight.requires_grad_(), reduction="sum") == with_grads
        assert ops_called(x.requires_grad_(), weight, reduction="none") == {"linear_cross_entropy",
                                                                             "linear_cross_entropy_bwd"}
        assert ops_called(x.requires_grad_(), weight, grad=False) == {"linear_cross_entropy"}
        assert ops_called(x.detach(), weight.detach()) == {"linear_cross_entropy"}


@requires_kernels
@KERNEL_DTYPES
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@parametrize_with_ids("with_bias, label_smoothing, softcap", [("plain", False, 0.0, None),
                                                              ("smoothing-softcap-bias", True, 0.3, 4.0)])
def test_kernels_with_grads_across_tiles_of_rows(poisoned_allocations, dtype, reduction, with_bias, label_smoothing,
                                                 softcap):
    """V = 2^20 + 5 classes: 128 rows a tile of 2^28 logits, so 300 rows are three tiles (128 + 128 + 44), grad_W
    summed over them by the accumulating GEMM, whose output tiles end past H = 16 columns and past V's last
    5 rows; ignored rows in the first tile and the last; a random output gradient (not a power of two) against
    float64."""
    vocab = (1 << 20) + 5
    x, weight, bias, target = make_inputs(300, 16, vocab, dtype=dtype, with_bias=with_bias, ignored=7, device="cuda")
    target[-5:] = torch.tensor([-100, vocab - 1, 0, 128, -100])
    with runs_the_kernels(*LCE_OPS), RecordTkCalls() as recorder:
        check_against_float64(x, weight, bias, target, KERNEL_LOSS_TOLERANCE[dtype], KERNEL_GRAD_TOLERANCE[dtype],
                              reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)
    assert set(recorder.calls) == {"linear_cross_entropy_with_grads"}
