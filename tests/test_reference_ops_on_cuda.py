"""The ops that run their PyTorch reference on CUDA tensors (attention_with_kvcache, gated_delta_rule, and
linear_cross_entropy and attention_varlen at a hidden size or head dim their kernels do not take), called as a user
would: bf16 or fp32 inputs on the GPU against the same op on the CPU in float64, the outputs and the gradients, and
the caches the KV-cache op writes.
What they compute is checked against their definitions in their own test files; this checks that the CUDA
dispatch reaches a reference that runs there (no CPU-only call, no device mix-up, autocast off)."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from inputs import attention as attention_inputs
from inputs import attention_with_kvcache as kvcache_inputs
from inputs import gated_delta_rule as gdn_inputs
from inputs import linear_cross_entropy as lce_inputs
from tk_testing import assert_rel_close, requires_cuda

DTYPES = {"fp32": (torch.float32, 2e-5), "bf16": (torch.bfloat16, 3e-2)}


def on_cuda(tensors, dtype):
    """Leaf copies on the GPU: floating tensors in ``dtype`` needing a gradient, the rest as they are."""
    return [t if t is None else (t.detach().to("cuda", dtype).requires_grad_() if t.is_floating_point()
                                 else t.to("cuda")) for t in tensors]


def assert_gradients_match(outputs, inputs, expected_outputs, expected_inputs, tol):
    grads = [torch.randn_like(o, dtype=torch.float64) for o in expected_outputs]
    got = torch.autograd.grad(outputs, inputs, [g.to(o.device, o.dtype) for g, o in zip(grads, outputs)])
    expected = torch.autograd.grad(expected_outputs, expected_inputs, grads)
    for g, e in zip(got, expected):
        assert g.device.type == "cuda"
        assert_rel_close(g.double().cpu(), e, tol)


@requires_cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_attention_varlen_on_cuda(dtype_name):
    dtype, tol = DTYPES[dtype_name]
    q, k, v, cu_q, cu_k, max_q, max_k = attention_inputs.make_varlen([5, 1, 37], [9, 1, 37], head_dim=32)
    options = dict(causal=True, window=(20, -1), softcap=5.0)
    expected = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    leaves = on_cuda([q, k, v], dtype)
    out = tk_ops.attention_varlen(*leaves, cu_q.cuda(), cu_k.cuda(), max_q, max_k, **options)
    assert out.device.type == "cuda" and out.dtype == dtype
    assert_rel_close(out.double().cpu(), expected, tol)
    assert_gradients_match([out], leaves, [expected], [q, k, v], tol)


@requires_cuda
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_attention_with_kvcache_on_cuda(dtype_name, paged):
    dtype, tol = DTYPES[dtype_name]
    case = kvcache_inputs.make_case([3, 0, 17], 2, 2, block_size=4 if paged else None)
    expected_case = case.clone()
    expected = tk_ops.attention_with_kvcache(**expected_case.arguments(), window=(8, -1))
    gpu_case = kvcache_inputs.KVCacheCase(*(None if t is None else t.to("cuda", dtype if t.is_floating_point() else t.dtype)
                                            for t in (case.q, case.k_cache, case.v_cache, case.k, case.v,
                                                      case.cache_seqlens, case.block_table)))
    out = tk_ops.attention_with_kvcache(**gpu_case.arguments(), window=(8, -1))
    assert out.device.type == "cuda"
    assert_rel_close(out.double().cpu(), expected, tol)
    for written, expected_cache in ((gpu_case.k_cache, expected_case.k_cache), (gpu_case.v_cache, expected_case.v_cache)):
        # the appended slots hold the new keys and values; the rest (NaN where unused) unchanged
        assert torch.equal(written.double().cpu().isnan(), expected_cache.isnan())
        assert_rel_close(written.double().cpu().nan_to_num(), expected_cache.nan_to_num(), tol)


@requires_cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_gated_delta_rule_on_cuda(dtype_name):
    dtype, tol = DTYPES[dtype_name]
    inputs = gdn_inputs.make_inputs(2, 70, 2, 4, 16, 8, initial=True)
    names = [name for name in gdn_inputs.NAMES if inputs[name] is not None]
    leaves = {name: inputs[name].detach().requires_grad_() for name in names}
    expected = gdn_inputs.call(leaves, use_qk_l2norm=True)
    # the state stays fp32, as fla keeps it
    gpu = {name: t.detach().to("cuda", torch.float32 if name == "initial_state" else dtype).requires_grad_()
           for name, t in leaves.items()}
    got = gdn_inputs.call(gpu, use_qk_l2norm=True)
    assert all(t.device.type == "cuda" for t in got)
    for g, e in zip(got, expected):
        assert_rel_close(g.double().cpu(), e, tol)
    assert_gradients_match(list(got), list(gpu.values()), list(expected), list(leaves.values()), tol)


@requires_cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_linear_cross_entropy_on_cuda(dtype_name):
    dtype, tol = DTYPES[dtype_name]
    x, weight, bias, target = lce_inputs.make_inputs(37, 20, 1000, requires_grad=True)  # H = 20: not the kernels
    options = dict(label_smoothing=0.1, softcap=20.0)
    expected = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, **options)
    leaves = on_cuda([x, weight, bias], dtype)
    loss = tk_ops.linear_cross_entropy(leaves[0], leaves[1], target.cuda(), bias=leaves[2], **options)
    assert loss.device.type == "cuda" and loss.dtype == torch.float32  # the compute dtype
    assert_rel_close(loss.double().cpu(), expected, tol)
    assert_gradients_match([loss], leaves, [expected], [x, weight, bias], tol)
