"""The contract every tk op keeps (docs/API.md), checked op by op over the table of tests/op_db.py:
opcheck on the CPU and, in every dtype the kernels serve, on the GPU; torch.compile(fullgraph=True) with the
tk forward and backward ops in the generated code; torch.export; bad inputs and device mismatches raise
errors that name the argument; CUDA graphs of the kernels replay as they run eagerly; CUDA inputs the kernels
do not take reach the references, which warn. The numerics are in tests/test_<op>.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tk_ops
import tk_testing
from op_db import OP_DB
from tk_ops import _library


def _params(cases):
    """pytest.param per (id, case, marks), the id prefixed with its op family."""
    return [pytest.param(case, id=id, marks=marks) for id, case, marks in cases]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


OPCHECK = _params(
    [(f"{info.name}-cpu-{sample.id}", sample, ()) for info in OP_DB for sample in info.samples]
    + [
        (f"{info.name}-cuda-{_dtype_name(dtype)}-{sample.id}", sample, tk_testing.kernel_marks(sample.op))
        for info in OP_DB
        for dtype in info.kernel_dtypes
        for sample in info.kernel_samples(dtype)
    ]
)
COMPILE = _params([(f"{info.name}-{sample.id}", sample, ()) for info in OP_DB for sample in info.compile])
EXPORT = _params([(f"{info.name}-{sample.id}", sample, ()) for info in OP_DB for sample in info.export])
BAD_INPUTS = _params(
    [
        (f"{info.name}-{case.id}", case, tk_testing.kernel_marks(case.kernel) if case.kernel else ())
        for info in OP_DB
        for case in info.bad_inputs
    ]
)
DEVICE_MISMATCHES = _params(
    [(f"{info.name}-{case.id}", case, tk_testing.CUDA_MARKS) for info in OP_DB for case in info.device_mismatches]
)
GRAPHS = _params(
    [(f"{info.name}-{sample.id}", sample, tk_testing.kernel_marks(*sample.ops)) for info in OP_DB
     for sample in info.graphs]
)
FALLBACKS = _params(
    [(f"{info.name}-{sample.id}", sample, tk_testing.kernel_marks(*sample.ops)) for info in OP_DB
     for sample in info.fallbacks]
)
FUNCTIONS = {name: ops for info in OP_DB for name, ops in info.functions.items()}


@pytest.mark.parametrize("sample", OPCHECK)
def test_opcheck(sample):
    with sample.context():
        torch.library.opcheck(getattr(torch.ops.tk, sample.op).default, sample.make())


@pytest.mark.parametrize("sample", COMPILE)
def test_compile_fullgraph_calls_tk_forward_and_backward_ops(sample):
    with torch._inductor.config.patch(dict(sample.inductor_config)):
        tk_testing.check_compile_fullgraph(
            sample.fn, sample.make_inputs(), sample.ops, loss=sample.loss, tol=sample.tol, seed=sample.seed
        )


@pytest.mark.parametrize("sample", EXPORT)
def test_export_keeps_tk_ops(sample):
    tk_testing.check_export(sample.make_module(), sample.make_args(), sample.ops, tol=sample.tol)


def _check_raises(case):
    with tk_testing.RecordTkCalls() as recorder:
        with pytest.raises(case.error, match=case.match):
            case.call()
    if not case.calls_op:
        assert recorder.calls == {}, "the public function let a bad input reach a tk op"


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(case):
    _check_raises(case)


@pytest.mark.parametrize("case", DEVICE_MISMATCHES)
def test_device_mismatch_raises(case):
    _check_raises(case)


def _outputs(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


@pytest.mark.parametrize("sample", GRAPHS)
def test_cuda_graph_replays_as_eager(sample):
    """A graph captured on the sample's inputs, replayed on new values copied into them, gives what the calls
    give eagerly on those values (op_db.GraphSample)."""
    with sample.context():
        inputs = list(sample.make_inputs())
        first_values = [] if sample.changed == 0 else [t.clone() for t in _outputs(sample.step(*inputs))]
        graph, replayed = tk_testing.capture_cuda_graph(lambda: _outputs(sample.step(*inputs)), sample.warm_up)
        new_values = sample.make_inputs() if sample.new_values is None else sample.new_values(*inputs)
        for static, value in zip(inputs, new_values, strict=True):
            if value is not static:
                static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = _outputs(sample.step(*inputs))
        tolerances = sample.tolerances or (0,) * len(eager)
        for i, (got, want, tol) in enumerate(zip(replayed, eager, tolerances, strict=True)):
            if tol:
                tk_testing.assert_rel_close(got, want, tol, f"output {i}")
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda message: f"output {i}: {message}")
        for i, (got, first) in enumerate(zip(replayed[: sample.changed], first_values)):
            assert not torch.equal(got, first), f"output {i} of the replay is still that of the first values"
        if sample.check is not None:
            sample.check(replayed, *inputs)


@pytest.mark.parametrize("sample", FALLBACKS)
def test_unsupported_cuda_inputs_run_the_reference(sample):
    """CUDA inputs the kernels do not take reach the references, which warn, and give their numbers
    (op_db.FallbackSample)."""
    inputs = sample.make_inputs()
    with tk_testing.runs_the_references(*sample.ops) if sample.checks_warning else contextlib.nullcontext():
        outputs = _outputs(sample.call(*inputs))
    expected = _outputs(sample.expected(*inputs))
    tolerances = sample.tol if isinstance(sample.tol, tuple) else (sample.tol,) * len(expected)
    for i, (got, want, tol) in enumerate(zip(outputs, expected, tolerances, strict=True)):
        tk_testing.assert_rel_close(got, want, tol, f"output {i}")


@pytest.mark.parametrize("public_name", sorted(FUNCTIONS))
def test_every_public_op_is_a_tk_op_with_backward_and_fallback_twin(public_name):
    assert callable(getattr(tk_ops, public_name))
    for op_name in FUNCTIONS[public_name]:
        for name in (op_name, f"{op_name}_ref"):
            op = getattr(torch.ops.tk, name).default
            assert torch.Tag.pt2_compliant_tag in op.tags
        assert op_name in tk_ops.backends()


def test_the_table_covers_every_tk_op():
    """Every op tk_ops defines has opcheck samples on the CPU and, where the kernels serve it, on the GPU; and
    in its family's entry, a CUDA graph that captures its kernel and a fallback sample that reaches its
    reference, or the stated reason there is none."""
    defined = set(_library._DEFINED)
    assert defined == {op for ops in FUNCTIONS.values() for op in ops}
    assert {sample.op for info in OP_DB for sample in info.samples} == defined
    for info in OP_DB:
        own = {op for ops in info.functions.values() for op in ops}
        for dtype in info.kernel_dtypes:
            assert {sample.op for sample in info.kernel_samples(dtype)} == own, (info.name, dtype)
        for column, samples, gaps in (("graphs", info.graphs, info.no_graph),
                                      ("fallbacks", info.fallbacks, info.no_fallback)):
            covered = {op for sample in samples for op in sample.ops}
            where = (info.name, column)
            assert covered <= own, (*where, "not ops of the family", covered - own)
            assert covered.isdisjoint(gaps), (*where, "covered, yet stated as a gap", covered & gaps.keys())
            assert covered | gaps.keys() == own, (*where, "neither covered nor stated as a gap",
                                                  own - covered - gaps.keys())
            assert all(reason.strip() for reason in gaps.values()), (*where, "a gap without a reason")
