"""The public functions' fast check (_checks.uniform_floats and each op's shape test) changes nothing:
for every combination of good and bad arguments below, a call returns the same values, or raises the
same error with the same message, as the same call with the fast check switched off (every call then
runs the detailed checks). A fast check that accepted what the detailed checks reject would show up
here as a missing error."""

from __future__ import annotations

import itertools

import pytest
import torch

import tk_ops
from tk_ops import _checks
from tk_ops.ops import layer_norm as layer_norm_module


def _outcome(call):
    torch.manual_seed(0)  # the same dropout seed with and without the fast check
    try:
        out = call()
    except Exception as error:  # noqa: BLE001 - the outcome under test is the exception itself
        return ("raised", type(error), str(error))
    outs = out if isinstance(out, tuple) else (out,)
    return ("returned", tuple((o.dtype, tuple(o.shape), o.detach().clone()) for o in outs))


def _same_outcome(call, monkeypatch):
    fast = _outcome(call)
    with monkeypatch.context() as patch:
        patch.setattr(_checks, "uniform_floats", lambda *args, **kwargs: False)
        patch.setattr(layer_norm_module, "_plain_norm_arguments", lambda *args, **kwargs: False)  # both norms'
        detailed = _outcome(call)
    assert fast[0] == detailed[0], f"fast check: {fast[:3]}, detailed checks: {detailed[:3]}"
    if fast[0] == "raised":
        assert fast[1:] == detailed[1:]
    else:
        for (dtype, shape, value), (want_dtype, want_shape, want) in zip(fast[1], detailed[1], strict=True):
            assert (dtype, shape) == (want_dtype, want_shape)
            assert value.device.type == "meta" or torch.equal(value, want)  # the same op, only the checks differ


def _tensors(shapes, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.int32), device="cpu"):
    made = []
    for shape, dtype in itertools.product(shapes, dtypes):
        integer = dtype == torch.int32
        made.append(torch.ones(shape, dtype=dtype, device=device) if integer else torch.randn(shape, device=device).to(dtype))
    return made


MATRICES = _tensors([(3, 4), (4, 5), (0, 4), (4,)]) + [torch.randn(4, 5, device="meta"), "not a tensor"]


@pytest.mark.parametrize("autocast", [False, True])
def test_matmul_and_linear(autocast, monkeypatch):
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        for a, b in itertools.product(MATRICES, MATRICES):
            _same_outcome(lambda: tk_ops.matmul(a, b), monkeypatch)
        for x, weight, bias in itertools.product(MATRICES[::2], MATRICES[::3], [None, torch.randn(5), torch.randn(3).double()]):
            _same_outcome(lambda: tk_ops.linear(x, weight, bias), monkeypatch)
        x3, weight, bias = torch.randn(2, 3, 5), torch.randn(4, 5), torch.randn(4)
        _same_outcome(lambda: tk_ops.linear(x3, weight, bias), monkeypatch)


def test_attention(monkeypatch):
    heads = [torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 3, 7, 8), torch.randn(2, 2, 7, 8),
             torch.randn(1, 2, 7, 6), torch.randn(1, 2, 7, 8).double(), torch.randn(1, 2, 0, 8), torch.randn(2, 7, 8)]
    for q, k, v in itertools.product(heads[:4], heads, heads[1::2]):
        for scale in (None, 0.5, float("inf")):
            _same_outcome(lambda: tk_ops.attention(q, k, v, scale=scale, causal=True), monkeypatch)


def test_norms(monkeypatch):
    xs = [torch.randn(3, 8), torch.randn(3, 8).bfloat16(), torch.randn(0, 8), torch.randn(()), torch.ones(3, 8, dtype=torch.int32)]
    parameters = [None, torch.randn(8), torch.randn(8).bfloat16(), torch.randn(7), torch.randn(2, 8), torch.randn(8).double()]
    residuals = [None, torch.randn(3, 8), torch.randn(3, 8).bfloat16(), torch.randn(2, 8)]
    for x, weight, residual in itertools.product(xs, parameters, residuals):
        for eps in (1e-5, 0, 1, True, "x"):
            _same_outcome(lambda: tk_ops.rms_norm(x, weight, eps, residual=residual), monkeypatch)
        for bias in parameters[:4]:
            _same_outcome(lambda: tk_ops.layer_norm(x, weight, bias, 1e-5, residual=residual), monkeypatch)
        for dropout_p in (0, 0.25, 1.0, float("nan"), True, "x"):
            _same_outcome(lambda: tk_ops.layer_norm(x, weight, None, 1e-5, residual=residual, dropout_p=dropout_p),
                          monkeypatch)


def test_unit_last_stride_copies_only_what_a_kernel_would_misread():
    x = torch.randn(4, 6)
    assert _checks.unit_last_stride(None) is None
    assert _checks.unit_last_stride(x) is x  # contiguous
    rows = x[::2]  # not contiguous, unit last stride: read in place
    assert _checks.unit_last_stride(rows) is rows
    columns = x.t()  # last stride 6: copied
    copied = _checks.unit_last_stride(columns)
    assert copied is not columns and copied.stride(-1) == 1 and torch.equal(copied, columns)
