"""The C++ autograd (csrc/torch/autograd.cpp) against the Python one it replaces on CUDA: two
interpreters of each op's table (tk_ops/_library.py, register_derivatives).

For every case, the op is called twice on identical leaves: through the dispatcher (the C++ kernel
where one is registered for the device) and through the Python autograd kernel of tk_ops/_library.py
called directly. Outputs, which outputs require grad, and every input gradient (which are None
included) must be equal bit for bit: both paths run the same forward and backward ops with the same
arguments, so any difference is a difference in how the two read the table (saved tensors,
non-differentiable outputs, materialised gradients, needs_input_grad, output masks).

On the GPU the extension registers the kernels at AutogradCUDA. Without a GPU, test_cpu_build builds
the same source for AutogradCPU (a g++ build through torch.utils.cpp_extension, cached) and runs this
module's `child` tests, plus opcheck and torch.compile through the C++ kernels, in a child process
(the registration cannot be undone, so it stays out of the test process).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import tk_ops
import tk_testing
from tk_ops import _library
from tk_testing import check_compile_fullgraph, requires_kernel

LIBRARY_VARIABLE = "TK_OPS_TEST_LIBRARY"  # tests/conftest.py loads this library after tk_ops
IN_CHILD = bool(os.environ.get(LIBRARY_VARIABLE))


@dataclass
class Case:
    name: str
    op: str
    make: Callable  # (device, dtype) -> (args, loss weights: one per output, None where the output is unused)


def _t(shape, device, dtype, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def _matmul(grad_a, grad_b, transposed=False):
    def make(device, dtype):
        a = _t((6, 5), device, dtype, grad_a)
        b = _t((3, 5), device, dtype).mT.detach().requires_grad_(grad_b) if transposed else _t((5, 3), device, dtype, grad_b)
        return (a, b), (1,)

    return make


def _linear(grads, bias):
    def make(device, dtype):
        x, w = _t((7, 5), device, dtype, grads[0]), _t((4, 5), device, dtype, grads[1])
        return (x, w, _t((4,), device, dtype, grads[2]) if bias else None), (1,)

    return make


def _attention(causal, used, hkv=2, grads=(True, True, True), options=None):
    """options: (window_left, window_right, softcap, sinks_requires_grad or None for no sinks), the op's
    last four arguments; None calls the op with its first six."""

    def make(device, dtype):
        q = _t((2, 4, 9, 64), device, dtype, grads[0])
        k, v = _t((2, hkv, 11, 64), device, dtype, grads[1]), _t((2, hkv, 11, 64), device, dtype, grads[2])
        if options is None:
            return (q, k, v, causal, 0.125, True), used
        window_left, window_right, softcap, sinks_grad = options
        sinks = None if sinks_grad is None else _t((4,), device, torch.float32, sinks_grad)
        return (q, k, v, causal, 0.125, True, window_left, window_right, softcap, sinks), used

    return make


def _layer_norm(weight, bias, residual, dropout_p, used, residual_dtype=None, grads=(True, True, True, True)):
    def make(device, dtype):
        hidden = 64
        x = _t((3, 5, hidden), device, dtype, grads[0])
        w = _t((hidden,), device, dtype, grads[1]) if weight else None
        b = _t((hidden,), device, dtype, grads[2]) if bias else None
        r = _t((3, 5, hidden), device, residual_dtype or dtype, grads[3]) if residual else None
        seed = torch.randint(0, 2**62, (), device=device, dtype=torch.int64) if dropout_p > 0 else None
        return (x, w, b, r, seed, 1e-5, dropout_p), used

    return make


def _rms_norm(weight, residual, used, grads=(True, True, True)):
    def make(device, dtype):
        hidden = 64
        x = _t((3, 5, hidden), device, dtype, grads[0])
        w = _t((hidden,), device, dtype, grads[1]) if weight else None
        r = _t((3, 5, hidden), device, dtype, grads[2]) if residual else None
        return (x, w, r, 1e-6), used

    return make


def _tables(device, dtype, seq_len, width):
    angles = torch.rand(1, seq_len, width, device=device, dtype=torch.float32) * 6
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope(interleaved):
    def make(device, dtype):
        x = _t((2, 3, 7, 64), device, dtype, True)
        return (x, *_tables(device, dtype, 7, 32), interleaved), (1,)

    return make


def _rope_qk(grad_q, grad_k, used=(1, 1)):
    def make(device, dtype):
        q, k = _t((2, 4, 7, 64), device, dtype, grad_q), _t((2, 2, 7, 64), device, dtype, grad_k)
        return (q, k, *_tables(device, dtype, 7, 16), False), used

    return make


def _causal_linear(f, dv, normalize, positive):
    def make(device, dtype):
        draw = torch.rand if positive else torch.randn  # positive features: denominators away from 0
        q, k = (draw(2, 2, 9, f, device=device, dtype=dtype).requires_grad_() for _ in range(2))
        return (q, k, _t((2, 2, 9, dv), device, dtype, True), 1e-6, normalize), (1, None)

    return make


def _causal_conv1d(bias, silu, channel_last):
    def make(device, dtype):
        x = _t((2, 17, 64), device, dtype).transpose(1, 2) if channel_last else _t((2, 64, 17), device, dtype)
        return (x.requires_grad_(), _t((64, 4), device, dtype, True), _t((64,), device, dtype, True) if bias else None,
                silu), (1,)

    return make


def _fftconv(with_d):
    def make(device, dtype):
        u, k = _t((2, 3, 256), device, dtype, True), _t((3, 100), device, dtype, True)
        return (u, k, _t((3,), device, dtype, True) if with_d else None), (1,)

    return make


def _mamba2(full, used, grads=True):
    def make(device, dtype):
        batch, seqlen, heads, head_dim, state = 1, 70, 4, 64, 64
        x = _t((batch, seqlen, heads, head_dim), device, dtype, grads)
        dt = (torch.rand(batch, seqlen, heads, device=device) * 0.1).to(dtype).requires_grad_()
        A = (-torch.rand(heads, device=device) - 0.5).to(dtype).requires_grad_()
        B, C = (_t((batch, seqlen, 1, state), device, dtype, True) for _ in range(2))
        optional = (
            _t((heads,), device, dtype, True),
            _t((batch, seqlen, heads, head_dim), device, dtype, True),
            _t((heads,), device, dtype, True),
        ) if full else (None, None, None)
        initial = _t((batch, heads, head_dim, state), device, dtype, True) if full else None
        return (x, dt, A, B, C, 64, *optional, full, initial), used

    return make


CASES = [
    Case("matmul", "matmul", _matmul(True, True)),
    Case("matmul_a_only", "matmul", _matmul(True, False)),
    Case("matmul_b_only_transposed", "matmul", _matmul(False, True, transposed=True)),
    Case("linear_bias", "linear", _linear((True, True, True), bias=True)),
    Case("linear_no_bias", "linear", _linear((True, True, False), bias=False)),
    Case("linear_weight_only", "linear", _linear((False, True, False), bias=True)),
    Case("attention", "attention", _attention(False, (1, None))),
    Case("attention_causal_gqa_lse", "attention", _attention(True, (1, 1), hkv=1)),
    Case("attention_lse_only", "attention", _attention(True, (None, 1))),
    Case("attention_k_frozen", "attention", _attention(False, (1, None), grads=(True, False, True))),
    Case("attention_window_softcap_sinks", "attention", _attention(True, (1, 1), options=(3, -1, 2.5, True))),
    Case("attention_frozen_sinks_lse_only", "attention", _attention(False, (None, 1), options=(2, 1, 0.0, False))),
    Case("attention_sinks_only", "attention", _attention(False, (1, None), grads=(False, False, False),
                                                         options=(-1, -1, 0.0, True))),
    Case("layer_norm", "layer_norm", _layer_norm(True, True, False, 0.0, (1, None, None, None))),
    Case("layer_norm_bare", "layer_norm", _layer_norm(False, False, False, 0.0, (1, None, None, None))),
    Case("layer_norm_residual_h", "layer_norm", _layer_norm(True, True, True, 0.0, (1, 1, None, None))),
    Case("layer_norm_h_only", "layer_norm", _layer_norm(True, True, True, 0.0, (None, 1, None, None))),
    Case("layer_norm_dropout", "layer_norm", _layer_norm(True, False, True, 0.25, (1, 1, None, None))),
    Case("layer_norm_fp32_residual", "layer_norm",
         _layer_norm(True, True, True, 0.0, (1, 1, None, None), residual_dtype=torch.float32)),
    Case("layer_norm_frozen_params", "layer_norm",
         _layer_norm(True, True, True, 0.0, (1, 1, None, None), grads=(True, False, False, True))),
    Case("rms_norm", "rms_norm", _rms_norm(True, False, (1, None, None))),
    Case("rms_norm_residual_h", "rms_norm", _rms_norm(True, True, (1, 1, None))),
    Case("rms_norm_h_only", "rms_norm", _rms_norm(True, True, (None, 1, None))),
    Case("rms_norm_x_only", "rms_norm", _rms_norm(True, True, (1, 1, None), grads=(True, False, False))),
    Case("rope", "rope", _rope(False)),
    Case("rope_interleaved", "rope", _rope(True)),
    Case("rope_qk", "rope_qk", _rope_qk(True, True)),
    Case("rope_qk_q_only", "rope_qk", _rope_qk(True, False)),
    Case("rope_qk_k_only_q_unused", "rope_qk", _rope_qk(False, True, used=(None, 1))),
    Case("linear_attention", "linear_attention", _causal_linear(16, 32, normalize=False, positive=False)),
    Case("linear_attention_normalized", "linear_attention", _causal_linear(32, 64, normalize=True, positive=True)),
    Case("based_attention", "based_attention", _causal_linear(16, 64, normalize=True, positive=False)),
    Case("based_attention_unnormalized", "based_attention", _causal_linear(16, 32, normalize=False, positive=False)),
    Case("causal_conv1d", "causal_conv1d", _causal_conv1d(bias=True, silu=True, channel_last=False)),
    Case("causal_conv1d_channel_last_no_bias", "causal_conv1d", _causal_conv1d(bias=False, silu=False, channel_last=True)),
    Case("fftconv", "fftconv", _fftconv(with_d=True)),
    Case("fftconv_no_d", "fftconv", _fftconv(with_d=False)),
    Case("mamba2_ssd", "mamba2_ssd", _mamba2(full=False, used=(1, None, None))),
    Case("mamba2_ssd_full_final_states", "mamba2_ssd", _mamba2(full=True, used=(1, 1, None))),
    Case("mamba2_ssd_final_states_only", "mamba2_ssd", _mamba2(full=True, used=(None, 1, None), grads=False)),
]


def _run(call, args, used, seed):
    """Outputs and input gradients of call(*args) for the loss sum(w_i * out_i) over the used outputs
    (w_i random, from ``seed``); fresh leaves, so the two paths share nothing."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    outputs = call(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator(device=outputs[0].device).manual_seed(seed)
    loss = sum(
        (out.float() * torch.randn(out.shape, device=out.device, generator=generator)).sum()
        for out, weight in zip(outputs, used)
        if weight is not None
    )
    loss.backward()
    grads = [leaf.grad if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    return outputs, grads


def check_parity(case: Case, device: str, dtype: torch.dtype, dispatch_key: str) -> None:
    assert _library.has_cpp_autograd(case.op, dispatch_key), f"no C++ autograd kernel for tk.{case.op} at {dispatch_key}"
    args, used = case.make(device, dtype)
    op = getattr(torch.ops.tk, case.op).default
    ours, our_grads = _run(op, args, used, seed=7)
    python, python_grads = _run(_library.python_autograd(case.op), args, used, seed=7)
    assert ours[0].grad_fn.name() == f"torch::autograd::CppNode<tk::autograd::{case.op}_autograd>"
    assert python[0].grad_fn.name() == f"{case.op}_autogradBackward"
    for i, (got, want) in enumerate(zip(ours, python, strict=True)):
        assert got.requires_grad == want.requires_grad, f"output {i}: requires_grad {got.requires_grad}"
        assert got.dtype == want.dtype and got.stride() == want.stride(), f"output {i}: dtype or strides"
        assert torch.equal(got.detach(), want.detach()), f"output {i} differs"
    for i, (got, want) in enumerate(zip(our_grads, python_grads, strict=True)):
        assert (got is None) == (want is None), f"gradient of input {i}: {got is None=} but {want is None=}"
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want), f"gradient of input {i} differs"


def _no_grad_call_skips_autograd(case: Case, device: str, dtype: torch.dtype) -> None:
    args, _ = case.make(device, dtype)
    with torch.no_grad():
        outputs = getattr(torch.ops.tk, case.op).default(*args)
    assert all(out.grad_fn is None and not out.requires_grad for out in (outputs if isinstance(outputs, tuple) else (outputs,)))


# ------------------------------------------------------------------------------------- GPU


@requires_kernel("matmul")
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_cuda_autograd_is_cpp_and_matches_python(case):
    check_parity(case, "cuda", torch.bfloat16, "AutogradCUDA")
    _no_grad_call_skips_autograd(case, "cuda", torch.bfloat16)


@requires_kernel("matmul")
def test_public_functions_build_cpp_nodes_on_cuda():
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    nodes = {
        "matmul": tk_ops.matmul(a, a),
        "layer_norm": tk_ops.layer_norm(a, None, None),
        "attention": tk_ops.attention(q, q, q, causal=True),
    }
    for op, out in nodes.items():
        assert out.grad_fn.name() == f"torch::autograd::CppNode<tk::autograd::{op}_autograd>"


# ------------------------------------------------------------------ CPU, through a child process


@pytest.mark.skipif(not IN_CHILD, reason=f"runs in test_cpu_build's child process ({LIBRARY_VARIABLE} set)")
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_child_cpu_autograd_matches_python(case):
    check_parity(case, "cpu", torch.float64, "AutogradCPU")
    _no_grad_call_skips_autograd(case, "cpu", torch.float64)


@pytest.mark.skipif(not IN_CHILD, reason=f"runs in test_cpu_build's child process ({LIBRARY_VARIABLE} set)")
@pytest.mark.parametrize("case", CASES[::3], ids=[case.name for case in CASES[::3]])
def test_child_opcheck_through_cpp_autograd(case):
    args, _ = case.make("cpu", torch.float32)
    torch.library.opcheck(getattr(torch.ops.tk, case.op).default, args)


@pytest.mark.skipif(not IN_CHILD, reason=f"runs in test_cpu_build's child process ({LIBRARY_VARIABLE} set)")
def test_child_compile_through_cpp_autograd():
    x = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    gamma = torch.randn(32, requires_grad=True)

    def block(x, w, gamma):
        return tk_ops.rms_norm(tk_ops.matmul(tk_ops.layer_norm(x, gamma, None), w), gamma)

    ops = ["layer_norm", "layer_norm_bwd", "matmul", "matmul_bwd", "rms_norm", "rms_norm_bwd"]
    check_compile_fullgraph(block, (x, w, gamma), ops, loss=lambda out: out.square().sum(), tol=1e-6)


@pytest.mark.skipif(not IN_CHILD, reason=f"runs in test_cpu_build's child process ({LIBRARY_VARIABLE} set)")
def test_child_compiled_autograd_takes_the_cpp_nodes():
    x, w = torch.randn(6, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    gamma, residual = torch.randn(32, requires_grad=True), torch.randn(6, 32, requires_grad=True)
    q = torch.randn(1, 2, 5, 64, requires_grad=True)

    def step():
        out, h = tk_ops.layer_norm(tk_ops.linear(x, w), gamma, None, residual=residual, return_residual=True)
        normed = tk_ops.rms_norm(h, gamma)
        attended = tk_ops.attention(q, q, q, causal=True)
        (out.square().sum() + normed.sum() + attended.sum()).backward()
        leaves = (x, w, gamma, residual, q)
        grads = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return grads

    eager = step()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
        compiled = step()
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(IN_CHILD, reason="the child runs the checks")
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None, reason="needs g++ and ninja")
def test_cpu_build():
    library = tk_testing.build_cpu_variant("tk_ops_autograd_cpu", ["torch/autograd.cpp"],
                                           "TK_OPS_AUTOGRAD_KEY=AutogradCPU", python_module=False)
    tk_testing.run_tests_in_child(__file__, "child", LIBRARY_VARIABLE, library)