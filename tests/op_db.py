"""The op-contract table, in the spirit of PyTorch's OpInfo: one entry per op family (``tk_ops/ops/<name>.py``)
with its public functions and their tk ops, opcheck samples on the CPU and, for every dtype its CUDA kernels
serve, on the GPU, compile and export samples, bad inputs with the error each raises, CUDA graphs of its kernels
and CUDA inputs its kernels leave to the references (for an op without a graph or a fallback sample, why).

``tests/test_op_contract.py`` runs every check over this table; ``tests/test_<name>.py`` keeps the numerics.
The input builders and references both use are in ``tests/inputs/<name>.py`` (this table imports no test
module). Tensors are built when a case runs (CUDA ones only there), except for bad inputs on the CPU, whose
values do not matter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from unittest import mock

import torch

import tk_ops
import tk_testing
from inputs import attention as attention_inputs
from inputs import attention_with_kvcache as kvcache_inputs
from inputs import based_attention as based_attention_inputs
from inputs import causal_conv1d as causal_conv1d_inputs
from inputs import fftconv as fftconv_inputs
from inputs import gated_delta_rule as gdn_inputs
from inputs import layer_norm as layer_norm_inputs
from inputs import linear_attention as linear_attention_inputs
from inputs import linear_cross_entropy as linear_cross_entropy_inputs
from inputs import mamba2_ssd as mamba2_ssd_inputs
from inputs import matmul as matmul_inputs
from inputs import rms_norm as rms_norm_inputs
from inputs import rope as rope_inputs
from tk_ops.ops import based_attention as based_attention_module
from tk_ops.ops import linear_attention as linear_attention_module
from tk_ops.ops import linear_cross_entropy as linear_cross_entropy_module

KERNEL_16_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Sample:
    """The arguments of one call of ``torch.ops.tk.<op>``, built by ``make()`` inside ``context()``."""

    id: str
    op: str
    make: Callable[[], tuple]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class CompileSample:
    """``torch.compile(fn, fullgraph=True)`` on ``make_inputs()`` calls every tk op of ``ops`` in its forward
    and backward code and matches eager (tk_testing.check_compile_fullgraph's ``loss``, ``tol`` and ``seed``),
    under the Inductor options ``inductor_config``."""

    id: str
    fn: Callable
    make_inputs: Callable[[], list[torch.Tensor]]
    ops: tuple[str, ...]
    loss: Callable | None = None
    tol: float | None = None
    seed: int | None = None
    inductor_config: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class ExportSample:
    """``torch.export`` of ``make_module()`` on ``make_args()`` keeps the tk ops ``ops`` (tk_testing.check_export)."""

    id: str
    make_module: Callable[[], torch.nn.Module]
    make_args: Callable[[], tuple]
    ops: tuple[str, ...]
    tol: float | None = None


@dataclass(frozen=True)
class GraphSample:
    """A CUDA graph replays as its calls run eagerly: ``step(*inputs)`` on the CUDA tensors ``inputs =
    make_inputs()`` is captured (after one warm-up call on a side stream, unless not ``warm_up``); the values
    ``new_values(*inputs)`` (None: ``make_inputs()`` again) are copied into the inputs and the graph replayed;
    its outputs then equal ``step(*inputs)``'s bit for bit (``tolerances``: a relative error per output, 0 for
    bitwise). The first ``changed`` outputs (None: all) must differ from ``step``'s on the first values (the
    replay computed anew); ``check(outputs, *inputs)`` then checks the replay's outputs against float64.
    ``ops``: the tk ops ``step`` calls, whose CUDA kernels are captured; ``context()`` is around it all."""

    id: str
    ops: tuple[str, ...]
    make_inputs: Callable[[], Sequence[torch.Tensor]]
    step: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    new_values: Callable[..., Sequence[torch.Tensor]] | None = None
    warm_up: bool = True
    changed: int | None = None
    tolerances: tuple[float, ...] | None = None
    check: Callable[..., None] | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class FallbackSample:
    """CUDA inputs the kernels do not take: ``call(*inputs)`` on ``inputs = make_inputs()`` reaches the reference
    twin of each op of ``ops``, which warns that it runs the PyTorch reference path (asserted, unless not
    ``checks_warning``), and gives ``expected(*inputs)`` (float64) within the relative error ``tol`` (one per
    output, or one for all)."""

    id: str
    ops: tuple[str, ...]
    make_inputs: Callable[[], Sequence]
    call: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    expected: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    tol: float | tuple[float, ...]
    checks_warning: bool = True


@dataclass(frozen=True)
class BadInput:
    """``call()`` raises ``error`` with a message matching ``match``: in the public function, before any tk op
    runs, unless ``calls_op`` (the case calls a tk op directly). ``kernel``: the case needs that op's CUDA
    kernel (its C++ checks)."""

    id: str
    call: Callable[[], object]
    error: type[Exception] | tuple[type[Exception], ...]
    match: str
    calls_op: bool = False
    kernel: str | None = None


@dataclass(frozen=True)
class OpInfo:
    """One op family. ``functions``: public function -> (forward tk op, backward tk op), or (forward tk op,) for an
    op without a gradient; ``kernel_dtypes``: the
    input dtypes its CUDA kernels serve, each opchecked on the GPU with ``kernel_samples(dtype)``;
    ``device_mismatches``: CUDA calls with one tensor left on the CPU; ``graphs``: CUDA graphs of its kernels,
    ``no_graph``: for each tk op of the family that no graph captures, why; ``fallbacks``: CUDA inputs its
    kernels leave to the references, ``no_fallback``: for each tk op no fallback sample reaches, why (every op
    is in a column or in its gaps)."""

    name: str
    functions: dict[str, tuple[str, ...]]
    samples: tuple[Sample, ...]
    kernel_dtypes: tuple[torch.dtype, ...]
    kernel_samples: Callable[[torch.dtype], tuple[Sample, ...]]
    compile: tuple[CompileSample, ...]
    export: tuple[ExportSample, ...]
    bad_inputs: tuple[BadInput, ...]
    device_mismatches: tuple[BadInput, ...]
    graphs: tuple[GraphSample, ...]
    no_graph: dict[str, str]
    fallbacks: tuple[FallbackSample, ...]
    no_fallback: dict[str, str]


def _bad(*rows: tuple) -> tuple[BadInput, ...]:
    return tuple(BadInput(*row) for row in rows)


def _op_calls(*rows: tuple) -> tuple[BadInput, ...]:
    """Bad inputs that call a tk op directly: rows (id, call, error, match[, kernel])."""
    return tuple(BadInput(*row[:4], calls_op=True, kernel=row[4] if len(row) > 4 else None) for row in rows)


def _device_mismatches(function, make_inputs, first: str, names) -> tuple[BadInput, ...]:
    """``function(**make_inputs())`` on CUDA inputs with one of ``names`` moved to the CPU raises a ValueError
    naming it and ``first`` (the argument whose device the others must share)."""

    def case(name):
        def call():
            inputs = make_inputs()
            return function(**dict(inputs, **{name: inputs[name].cpu()}))

        return BadInput(f"{name}-on-the-cpu", call, ValueError, f"{name} must be on {first}'s device")

    return tuple(case(name) for name in names)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _randn(*shapes, requires_grad=False, **kwargs) -> list[torch.Tensor]:
    return [torch.randn(*s, **kwargs).requires_grad_(requires_grad) for s in shapes]


def _random_projection(*outputs: torch.Tensor) -> torch.Tensor:
    """sum(out * g) over the outputs, g random but the same in every run: a loss with a dense gradient."""
    generator = torch.Generator().manual_seed(0)
    return sum((out * torch.randn(out.shape, generator=generator, dtype=out.dtype)).sum() for out in outputs)


def _grad_leaves(tensors) -> tuple:
    """The tensors detached, floating ones requiring grad (None and non-tensors as they are)."""
    return tuple(
        t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in tensors
    )


NO_GRAPH_YET = "no CUDA-graph check yet"
NO_FALLBACK_YET = "no fallback check yet"
NO_KERNEL = "no kernel yet: the reference serves every device"
TOLERANCE = tk_testing.TOLERANCE


def _without_sample(reason: str, *ops: str) -> dict[str, str]:
    """A column's gap, stated: each of ``ops`` mapped to why no sample of the column covers it."""
    return dict.fromkeys(ops, reason)


# --------------------------------------------------------------------------------------- matmul, linear


def _matmul_samples(dtype=torch.float32, device="cpu", sizes=(5, 7, 3, 4)):
    M, K, N, out_features = sizes

    def operands(requires_grad=True):
        return _randn((M, K), (K, N), requires_grad=requires_grad, dtype=dtype, device=device)

    def linear_args(bias: bool):
        (a, _), weight, b = operands(), *_randn((out_features, K), (out_features,), dtype=dtype, device=device)
        return (a, weight.requires_grad_(), b.requires_grad_() if bias else None)

    def backward_args(mask):
        a, b = operands(requires_grad=False)
        return (torch.randn(M, N, dtype=dtype, device=device), a, b, mask)

    def linear_backward_args():
        a, weight = _randn((M, K), (N, K), dtype=dtype, device=device)
        return (torch.randn(M, N, dtype=dtype, device=device), a, weight, [True, True, True])

    return (
        Sample("matmul", "matmul", operands),
        Sample("matmul-transposed-views", "matmul", lambda: tuple(t.mT for t in reversed(operands()))),
        Sample("linear-bias", "linear", lambda: linear_args(True)),
        Sample("linear-no-bias", "linear", lambda: linear_args(False)),
        Sample("matmul_bwd", "matmul_bwd", lambda: backward_args([True, True])),
        Sample("matmul_bwd-grad-b-only", "matmul_bwd", lambda: backward_args([False, True])),
        Sample("linear_bwd", "linear_bwd", linear_backward_args),
    )


class _LinearThenMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 5))
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x, b):
        return tk_ops.matmul(tk_ops.linear(x, self.weight, self.bias), b)


def _matmul_fallback(id: str, dtype: torch.dtype, make_inputs) -> FallbackSample:
    return FallbackSample(id, ("matmul",), make_inputs, tk_ops.matmul, matmul_inputs.float64_product, TOLERANCE[dtype])


MATMUL_FALLBACKS = (  # strides and a base address TMA cannot describe, and fp32
    _matmul_fallback("K-stride-14-bytes", torch.bfloat16, lambda: (torch.randn(33, 7, device="cuda").bfloat16(),
                                                                   torch.randn(7, 24, device="cuda").bfloat16())),
    _matmul_fallback("misaligned-base", torch.float16, lambda: (torch.randn(16, 48, device="cuda").half()[:, 1:41],
                                                                torch.randn(40, 16, device="cuda").half())),
    _matmul_fallback("N-stride-26-bytes", torch.bfloat16, lambda: (torch.randn(9, 16, device="cuda").bfloat16(),
                                                                   torch.randn(16, 13, device="cuda").bfloat16())),
    _matmul_fallback("fp32", torch.float32, lambda: (torch.randn(9, 16, device="cuda"),
                                                     torch.randn(16, 24, device="cuda"))),
)


MATMUL = OpInfo(
    name="matmul",
    functions={"matmul": ("matmul", "matmul_bwd"), "linear": ("linear", "linear_bwd")},
    samples=_matmul_samples(),
    kernel_dtypes=KERNEL_16_BIT,
    # Sizes the kernel takes: rows of 16-byte multiples, tails in M.
    kernel_samples=lambda dtype: _matmul_samples(dtype, "cuda", sizes=(130, 72, 264, 40)),
    compile=(
        CompileSample(
            "linear-then-matmul",
            lambda x, weight, bias, b: tk_ops.matmul(tk_ops.linear(x, weight, bias), b).square().sum(),
            lambda: _randn((6, 5), (4, 5), (4,), (4, 3), requires_grad=True),
            ("matmul", "matmul_bwd", "linear", "linear_bwd"),
        ),
    ),
    export=(ExportSample("linear-then-matmul", _LinearThenMatmul, lambda: (torch.randn(3, 5), torch.randn(4, 2)),
                         ("linear", "matmul")),),
    bad_inputs=_bad(
        ("matmul-b-not-a-tensor", lambda: tk_ops.matmul(torch.randn(3, 4), [[1.0]]), TypeError,
         "b must be a torch.Tensor"),
        ("matmul-integer", lambda: tk_ops.matmul(torch.randint(0, 3, (3, 4)), torch.randint(0, 3, (4, 2))),
         TypeError, "a must have dtype"),
        ("matmul-dtype-mismatch", lambda: tk_ops.matmul(torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64)),
         TypeError, "b must have a's dtype"),
        ("matmul-a-rank-3", lambda: tk_ops.matmul(torch.randn(3, 4, 1), torch.randn(4, 2)), ValueError,
         "a must have 2 dimensions"),
        ("matmul-b-rank-1", lambda: tk_ops.matmul(torch.randn(3, 4), torch.randn(4)), ValueError,
         "b must have 2 dimensions"),
        ("matmul-inner-size", lambda: tk_ops.matmul(torch.randn(3, 4), torch.randn(5, 2)), ValueError,
         r"b.shape\[0\] must equal a.shape\[1\]"),
        ("matmul-empty-a", lambda: tk_ops.matmul(torch.randn(0, 4), torch.randn(4, 2)), ValueError,
         "a must not be empty"),
        ("matmul-empty-b", lambda: tk_ops.matmul(torch.randn(3, 4), torch.randn(4, 0)), ValueError,
         "b must not be empty"),
        ("linear-in-features", lambda: tk_ops.linear(torch.randn(3, 4), torch.randn(2, 5)), ValueError,
         r"weight.shape\[1\] must equal x.shape\[-1\]"),
        ("linear-weight-rank-3", lambda: tk_ops.linear(torch.randn(3, 4), torch.randn(2, 4, 1)), ValueError,
         "weight must have 2 dimensions"),
        ("linear-bias-size", lambda: tk_ops.linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(3)),
         ValueError, r"bias.shape\[0\] must equal"),
        ("linear-bias-rank-2", lambda: tk_ops.linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(2, 1)),
         ValueError, "bias must have 1 dimensions"),
        ("linear-bias-dtype", lambda: tk_ops.linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(2).half()),
         TypeError, "bias must have x's dtype"),
        ("linear-x-0-dim", lambda: tk_ops.linear(torch.randn(()), torch.randn(2, 4)), ValueError, "x must have"),
    ) + _op_calls(
        ("kernel-inner-size",
         lambda: torch.ops.tk.matmul(torch.randn(3, 4, device="cuda").half(), torch.randn(5, 2, device="cuda").half()),
         ValueError, r"b.shape\[0\] must equal a.shape\[1\]", "matmul"),
    ),
    device_mismatches=_device_mismatches(
        tk_ops.matmul, lambda: dict(a=torch.randn(3, 4, device="cuda"), b=torch.randn(4, 2, device="cuda")), "a", "b"
    ),
    # No side-stream warm-up: the eager call on the first values comes before the capture. Only a changes.
    graphs=(GraphSample("matmul", ("matmul",),
                        lambda: _randn((300, 136), (136, 264), dtype=torch.bfloat16, device="cuda"), tk_ops.matmul,
                        new_values=lambda a, b: (torch.randn_like(a), b), warm_up=False),),
    no_graph=_without_sample(NO_GRAPH_YET, "matmul_bwd", "linear", "linear_bwd"),
    fallbacks=MATMUL_FALLBACKS,
    no_fallback=_without_sample(NO_FALLBACK_YET, "matmul_bwd", "linear", "linear_bwd"),
)


# -------------------------------------------------------------------------------------------- attention


def _attention_forward(shape, causal, **kwargs) -> Sample:
    def make():
        return (*attention_inputs.make_qkv(*shape, **kwargs), causal, 0.25, False)

    return Sample("-".join(("causal" if causal else "full", *map(str, shape))), "attention", make)


def _attention_options(q_heads, device, causal, window_left, window_right, softcap, sinks):
    """The op's last four arguments: window_left, window_right, softcap and (with ``sinks``) (Hq,) fp32 sinks."""
    sink_logits = torch.randn(q_heads, device=device).requires_grad_() if sinks else None
    return (window_left, window_right, softcap, sink_logits)


# (id, causal, window_left, window_right, softcap, sinks): calls with the options switched on
ATTENTION_OPTIONS = (
    ("causal-window-softcap-sinks", True, 5, -1, 2.5, True),
    ("window-both-sides-sinks", False, 3, 2, 0.0, True),
    ("full-softcap", False, -1, -1, 1.5, False),
)


def _attention_option_forward(shape, row, **kwargs) -> Sample:
    name, causal, *options = row

    def make():
        q, k, v = attention_inputs.make_qkv(*shape, **kwargs)
        return (q, k, v, causal, 0.25, False, *_attention_options(shape[1], q.device, causal, *options))

    return Sample(f"{name}-{'-'.join(map(str, shape))}", "attention", make)


def _attention_backward(shape, with_grad_lse, deterministic, options=None, **kwargs) -> Sample:
    causal = True if options is None else options[1]

    def make():
        q, k, v = attention_inputs.make_qkv(*shape, requires_grad=False, **kwargs)
        extra = () if options is None else _attention_options(shape[1], q.device, *options[1:])
        extra = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in extra)
        out, lse = torch.ops.tk.attention(q, k, v, causal, 0.3, deterministic, *extra)
        grad_lse = torch.randn_like(lse) if with_grad_lse else None
        return (torch.randn_like(out), grad_lse, q, k, v, out, lse, causal, 0.3, deterministic, *extra)

    lse = "grad-lse" if with_grad_lse else "no-grad-lse"
    name = f"attention_bwd-{lse}-{'deterministic' if deterministic else 'one-pass'}"
    return Sample(name if options is None else f"{name}-{options[0]}", "attention_bwd", make)


def _attention_backward_samples(shape, **kwargs) -> tuple[Sample, ...]:
    return tuple(_attention_backward(shape, with_grad_lse, deterministic, **kwargs)
                 for deterministic in (False, True) for with_grad_lse in (False, True))


def _attention_option_samples(shape, **kwargs) -> tuple[Sample, ...]:
    return tuple(sample for row in ATTENTION_OPTIONS for sample in (
        _attention_option_forward(shape, row, **kwargs), _attention_backward(shape, True, False, row, **kwargs)))


def _attention_kernel_samples(dtype):
    """On the GPU: the kernels, and calls with options: the forward kernel takes them, the backward's CUDA entry hands
    them to the reference."""
    shape, options = (1, 4, 2, 17, 23, 64), dict(dtype=dtype, device="cuda")
    return (_attention_forward(shape, True, **options), *_attention_backward_samples(shape, **options),
            *_attention_option_samples(shape, **options))


def _attention_inputs(q_shape=(2, 4, 9, 40), k_shape=(2, 2, 11, 40), v_shape=None, dtype=torch.float32):
    v_shape = k_shape if v_shape is None else v_shape
    return [torch.randn(s, dtype=dtype) for s in (q_shape, k_shape, v_shape)]


def _attention_with_fp64_k():
    q, k, v = _attention_inputs()
    return tk_ops.attention(q, k.double(), v)


def _attention_graph(head_dim: int, method: str) -> GraphSample:
    """Forward and backward in one graph, with the backward method ``method``: replays equal eager calls
    bitwise, except the one-pass dq, whose fp32 sums are added in varying order (equal to within a bf16
    rounding of some elements)."""
    deterministic = method == "deterministic"

    def make_inputs():
        q, k, v = attention_inputs.make_qkv(2, 4, 2, 511, 513, head_dim, dtype=torch.bfloat16, device="cuda",
                                            requires_grad=False)
        return q, k, v, torch.randn(2, 4, 511, head_dim, dtype=torch.bfloat16, device="cuda")

    def step(q, k, v, grad_out):
        out, lse = torch.ops.tk.attention(q, k, v, True, 0.1, deterministic)
        grads = torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, True, 0.1, deterministic)
        return (out, lse, *grads)

    return GraphSample(
        f"forward-backward-D{head_dim}-{method}", ("attention", "attention_bwd"), make_inputs, step,
        new_values=lambda *inputs: [torch.randn_like(t) for t in inputs], changed=0,
        tolerances=None if deterministic else (0, 0, attention_inputs.BF16_ROUNDING, 0, 0, 0),  # out, lse, dq, dk, dv, sinks
        context=lambda: attention_inputs.backward_method(method),
    )


def _attention_options_graph(head_dim: int) -> GraphSample:
    """The forward kernel with a causal sliding window, a softcap and sinks (an input the replay reads anew)."""

    def make_inputs():
        q, k, v = attention_inputs.make_qkv(2, 4, 2, 511, 513, head_dim, dtype=torch.bfloat16, device="cuda",
                                            requires_grad=False)
        return q, k, v, torch.randn(4, device="cuda")

    def step(q, k, v, sinks):
        return torch.ops.tk.attention(q, k, v, True, 0.1, False, 100, -1, 2.0, sinks)

    return GraphSample(f"forward-options-D{head_dim}", ("attention",), make_inputs, step)


def _attention_options_beyond_the_kernels(head_dim: int, ops: tuple[str, ...]) -> FallbackSample:
    """Gradients with a window, a softcap and sinks on CUDA at a head dim the kernels of ``ops`` do not take
    (D = 80: neither direction): those ops run their references (the backward's recomputes the probabilities
    from q, k, v and the sinks)."""
    options = dict(causal=True, window=(20, -1), softcap=2.0)

    def make_inputs():
        q, k, v = attention_inputs.make_qkv(1, 4, 2, 65, 77, head_dim, dtype=torch.bfloat16, device="cuda")
        return q, k, v, torch.randn(4, device="cuda", requires_grad=True), torch.randn_like(q)

    def gradients(q, k, v, sinks, grad_out):
        return torch.autograd.grad(tk_ops.attention(q, k, v, sinks=sinks, **options), (q, k, v, sinks), grad_out)

    def float64_gradients(q, k, v, sinks, grad_out):
        leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, sinks)]
        out = tk_ops.attention(*leaves[:3], sinks=leaves[3], **options)
        return torch.autograd.grad(out, leaves, grad_out.cpu().double())

    return FallbackSample(f"options-at-D{head_dim}", ops, make_inputs, gradients, float64_gradients,
                          2 * TOLERANCE[torch.bfloat16])


class _CausalAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return tk_ops.attention(q, k, v, causal=True)


class _SlidingWindowAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(4))

    def forward(self, q, k, v):
        return tk_ops.attention(q, k, v, causal=True, window=(4, -1), softcap=3.0, sinks=self.sinks)


def _attend_with_options_and_lse(q, k, v, sinks):
    out, lse = tk_ops.attention(q, k, v, window=(3, 2), softcap=2.0, sinks=sinks, return_lse=True)
    return out.double().square().sum() + lse.double().sum()


def _attend_with_lse(q, k, v):
    out, lse = tk_ops.attention(q, k, v, causal=True, return_lse=True)
    # Summed in float64: compiled and eager sum these ~10^4 terms in different orders (Inductor's own
    # loop, chosen by thread count and vector width, vs ATen's), and in float32 the two differ by up
    # to ~2e-6 (one intra-op thread), beyond float32's rtol. In float64 that rounding is ~1e-13, so the
    # loss and the gradients (2 out and 1, exact either way) are compared at the default tolerances.
    return out.double().square().sum() + lse.double().sum()


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


def _attention_option_bad_inputs(function, make):
    """Bad window, softcap and sinks for ``function(*inputs, **options)``, ``make() -> (inputs, Hq)``."""

    def call(**options):
        def run():
            inputs, _ = make()
            return function(*inputs, **options)

        return run

    def sinks(shape=None, dtype=torch.float32):
        def run():
            inputs, q_heads = make()
            return function(*inputs, sinks=torch.randn(shape or (q_heads,), dtype=dtype))

        return run

    return (
        ("window-not-a-pair", call(window=3), TypeError, "window must be None or a pair of ints"),
        ("window-three-entries", call(window=(1, 2, 3)), TypeError, "window must be None or a pair of ints"),
        ("window-float", call(window=(1.5, 0)), TypeError, "window must be None or a pair of ints"),
        ("window-bool", call(window=(True, 0)), TypeError, "window must be None or a pair of ints"),
        ("window-below-minus-one", call(window=(-2, 0)), ValueError, "window entries must be >= -1"),
        ("negative-softcap", call(softcap=-1.0), ValueError, "softcap must be > 0"),
        ("nan-softcap", call(softcap=float("nan")), ValueError, "softcap must be > 0"),
        ("inf-softcap", call(softcap=float("inf")), ValueError, "softcap must be > 0"),
        ("softcap-string", call(softcap="1"), TypeError, "softcap must be None or a number"),
        ("sinks-not-a-tensor", call(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
        ("sinks-shape", sinks((3,)), ValueError, r"sinks.shape\[0\] must equal q's head count Hq"),
        ("sinks-rank", sinks((4, 1)), ValueError, "sinks must have 1 dimensions"),
        ("sinks-bf16", sinks(dtype=torch.bfloat16), TypeError, r"sinks must have dtype in \(float32\)"),
        ("sinks-fp64-beside-fp32", sinks(dtype=torch.float64), TypeError, r"sinks must have dtype in \(float32\)"),
    )


ATTENTION = OpInfo(
    name="attention",
    functions={"attention": ("attention", "attention_bwd")},
    samples=(
        _attention_forward((2, 4, 2, 17, 23, 40), False),  # GQA
        _attention_forward((1, 2, 1, 19, 7, 24), True),  # MQA, rows that see no key
        _attention_forward((1, 3, 3, 9, 9, 16), True),
        *_attention_backward_samples((1, 4, 2, 15, 11, 24)),
        *_attention_option_samples((1, 4, 2, 15, 11, 24)),
        *_attention_option_samples((2, 2, 1, 9, 9, 16), dtype=torch.float32),
    ),
    kernel_dtypes=KERNEL_16_BIT,
    kernel_samples=_attention_kernel_samples,
    compile=(
        CompileSample("causal-lse", _attend_with_lse,
                      lambda: attention_inputs.make_qkv(2, 4, 2, 19, 21, 64, dtype=torch.float32),
                      ("attention", "attention_bwd")),
        CompileSample("window-softcap-sinks-lse", _attend_with_options_and_lse,
                      lambda: [*attention_inputs.make_qkv(2, 4, 2, 19, 21, 32, dtype=torch.float32),
                               torch.randn(4, requires_grad=True)],
                      ("attention", "attention_bwd"), tol=1e-5),
    ),
    export=(
        ExportSample("causal", _CausalAttention,
                     lambda: tuple(attention_inputs.make_qkv(1, 4, 2, 11, 13, 40, dtype=torch.float32,
                                                             requires_grad=False)),
                     ("attention",)),
        ExportSample("sliding-window-softcap-sinks", _SlidingWindowAttention,
                     lambda: tuple(attention_inputs.make_qkv(1, 4, 2, 11, 13, 40, dtype=torch.float32,
                                                           requires_grad=False)),
                     ("attention",)),
    ),
    bad_inputs=_bad(
        ("int-dtype", lambda: tk_ops.attention(torch.ones(2, 4, 9, 40, dtype=torch.int32), *_attention_inputs()[1:]),
         TypeError, "q"),
        ("not-a-tensor", lambda: tk_ops.attention([[1.0]], *_attention_inputs()[1:]), TypeError, "q"),
        ("dtype-mismatch", _attention_with_fp64_k, TypeError, "k"),
        ("rank", lambda: tk_ops.attention(_attention_inputs()[0][0], *_attention_inputs()[1:]), ValueError, "q"),
        ("v-rank", lambda: tk_ops.attention(*_attention_inputs(v_shape=(2, 2, 11))), ValueError, "v"),
        ("batch", lambda: tk_ops.attention(*_attention_inputs(k_shape=(3, 2, 11, 40))), ValueError, "k"),
        ("head-dim", lambda: tk_ops.attention(*_attention_inputs(k_shape=(2, 2, 11, 32), v_shape=(2, 2, 11, 40))),
         ValueError, "k"),
        ("kv-length", lambda: tk_ops.attention(*_attention_inputs(v_shape=(2, 2, 12, 40))), ValueError, "v"),
        ("kv-heads", lambda: tk_ops.attention(*_attention_inputs(v_shape=(2, 1, 11, 40))), ValueError, "v"),
        ("group", lambda: tk_ops.attention(*_attention_inputs(k_shape=(2, 3, 11, 40))), ValueError, "Hq .*Hkv"),
        ("empty-q", lambda: tk_ops.attention(*_attention_inputs(q_shape=(2, 4, 0, 40))), ValueError, "q"),
        ("empty-k", lambda: tk_ops.attention(*_attention_inputs(k_shape=(2, 2, 0, 40))), ValueError, "k"),
        ("nan-scale", lambda: tk_ops.attention(*_attention_inputs(), scale=float("nan")), ValueError, "scale"),
        ("inf-scale", lambda: tk_ops.attention(*_attention_inputs(), scale=float("inf")), ValueError, "scale"),
        *_attention_option_bad_inputs(tk_ops.attention, lambda: (_attention_inputs(), 4)),
    ),
    device_mismatches=_device_mismatches(
        tk_ops.attention, lambda: dict(zip("qkv", (t.cuda() for t in _attention_inputs())), sinks=torch.randn(4).cuda()),
        "q", ("k", "sinks")
    ),
    graphs=(*(_attention_graph(head_dim, method) for head_dim in (64, 128, 256)
              for method in attention_inputs.BACKWARD_METHODS),
            *(_attention_options_graph(head_dim) for head_dim in (64, 128))),
    no_graph={},
    fallbacks=(_attention_options_beyond_the_kernels(80, ("attention", "attention_bwd")),),
    no_fallback={},
)


# ------------------------------------------------------------------------------------- attention_varlen


def _varlen_inputs(q_lengths=(5, 0, 8), k_lengths=(6, 3, 8), requires_grad=True, **kwargs):
    """q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k (inputs.attention.make_varlen)."""
    return attention_inputs.make_varlen(list(q_lengths), list(k_lengths), requires_grad=requires_grad, **kwargs)


# (id, causal, window_left, window_right, softcap, sinks)
VARLEN_OPTIONS = (
    ("plain", False, -1, -1, 0.0, False),
    ("causal-window-softcap-sinks", True, 3, -1, 2.0, True),
    ("window-both-sides", False, 2, 1, 0.0, False),
)


def _varlen_graph() -> GraphSample:
    """Forward and backward in one graph (inputs.attention.varlen_graph_step), replayed on new lengths of the
    same count: the kernels read cu_seqlens on the device."""

    def new_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, grad_out):
        cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32, device="cuda") for cu in ([0, 250, 300, 380],
                                                                                    [0, 250, 280, 400]))
        return (q, k, v, cu_q, cu_k, grad_out)

    return GraphSample("forward-backward-new-lengths", ("attention_varlen", "attention_varlen_bwd"),
                       attention_inputs.varlen_graph_inputs, attention_inputs.varlen_graph_step,
                       new_values=new_lengths)


def _varlen_forward(row, dtype=torch.float64, device="cpu", head_dim=16) -> Sample:
    name, causal, window_left, window_right, softcap, sinks = row

    def make():
        q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(dtype=dtype, device=device, head_dim=head_dim)
        sink_logits = torch.randn(4, device=device, requires_grad=True) if sinks else None
        return (q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.3, window_left, window_right, softcap, sink_logits, False)

    return Sample(f"{name}-{str(dtype).removeprefix('torch.')}", "attention_varlen", make)


def _varlen_backward(row, with_grad_lse, dtype=torch.float64, device="cpu", head_dim=16) -> Sample:
    name, causal, window_left, window_right, softcap, sinks = row

    def make():
        q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(requires_grad=False, dtype=dtype, device=device,
                                                           head_dim=head_dim)
        options = (causal, 0.3, window_left, window_right, softcap, torch.randn(4, device=device) if sinks else None,
                   False)
        out, lse = torch.ops.tk.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *options)
        grad_lse = torch.randn_like(lse) if with_grad_lse else None
        return (torch.randn_like(out), grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *options)

    return Sample(f"attention_varlen_bwd-{name}-{'grad-lse' if with_grad_lse else 'no-grad-lse'}",
                  "attention_varlen_bwd", make)


def _attend_varlen_with_lse(q, k, v, sinks):
    cu_q, cu_k = torch.tensor([0, 5, 5, 13], dtype=torch.int32), torch.tensor([0, 6, 9, 17], dtype=torch.int32)
    out, lse = tk_ops.attention_varlen(q, k, v, cu_q, cu_k, 8, 8, causal=True, window=(3, -1), softcap=2.0,
                                       sinks=sinks, return_lse=True)
    return out.double().square().sum() + lse.double().sum()


class _PackedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(4))

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        return tk_ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 8, 8, causal=True, window=(3, -1),
                                       softcap=2.0, sinks=self.sinks)


def _varlen_call(**changes):
    """tk_ops.attention_varlen on _varlen_inputs() (fp32) with some arguments replaced."""

    def call():
        q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(requires_grad=False, dtype=torch.float32)
        arguments = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        arguments.update({name: change(arguments[name]) if callable(change) else change
                          for name, change in changes.items() if name in arguments})
        options = {name: change for name, change in changes.items() if name not in arguments}
        return tk_ops.attention_varlen(**arguments, **options)

    return call


ATTENTION_VARLEN = OpInfo(
    name="attention_varlen",
    functions={"attention_varlen": ("attention_varlen", "attention_varlen_bwd")},
    samples=(
        *(_varlen_forward(row) for row in VARLEN_OPTIONS),
        _varlen_forward(VARLEN_OPTIONS[1], torch.float32),
        *(_varlen_backward(row, with_grad_lse) for row in VARLEN_OPTIONS for with_grad_lse in (False, True)),
    ),
    # On the GPU each sequence runs the attention kernels (csrc/torch/attention.cpp), at D = 64 here.
    kernel_dtypes=KERNEL_16_BIT,
    kernel_samples=lambda dtype: (
        *(_varlen_forward(row, dtype, "cuda", 64) for row in VARLEN_OPTIONS),
        *(_varlen_backward(row, with_grad_lse, dtype, "cuda", 64) for row in VARLEN_OPTIONS
          for with_grad_lse in (False, True)),
    ),
    compile=(
        CompileSample("causal-window-softcap-sinks-lse", _attend_varlen_with_lse,
                      lambda: [*_varlen_inputs(dtype=torch.float32)[:3], torch.randn(4, requires_grad=True)],
                      ("attention_varlen", "attention_varlen_bwd"), tol=1e-5),
    ),
    export=(
        ExportSample("packed", _PackedAttention,
                     lambda: tuple(_varlen_inputs(requires_grad=False, dtype=torch.float32)[:5]),
                     ("attention_varlen",)),
    ),
    bad_inputs=_bad(
        ("q-rank", _varlen_call(q=lambda q: q[None]), ValueError, "q must have 3 dimensions"),
        ("int-dtype", _varlen_call(q=lambda q: q.int()), TypeError, "q must have dtype"),
        ("dtype-mismatch", _varlen_call(k=lambda k: k.double()), TypeError, "k must have q's dtype"),
        ("head-dim", _varlen_call(k=lambda k: k[..., :8]), ValueError, r"k.shape\[2\] must equal q.shape\[2\]"),
        ("kv-length", _varlen_call(v=lambda v: v[:-1]), ValueError, r"v.shape\[0\] must equal k.shape\[0\]"),
        ("kv-heads", _varlen_call(v=lambda v: v[:, :1]), ValueError, r"v.shape\[1\] must equal k.shape\[1\]"),
        ("group", _varlen_call(k=lambda k: torch.randn(k.shape[0], 3, k.shape[2]),
                               v=lambda v: torch.randn(v.shape[0], 3, v.shape[2])), ValueError, "Hq .*Hkv"),
        ("no-heads", _varlen_call(q=lambda q: q[:, :0]), ValueError, "q's heads and head dim must not be empty"),
        ("cu-int64", _varlen_call(cu_seqlens_q=lambda cu: cu.long()), TypeError, "cu_seqlens_q must have dtype"),
        ("cu-float", _varlen_call(cu_seqlens_k=lambda cu: cu.float()), TypeError, "cu_seqlens_k must have dtype"),
        ("cu-rank", _varlen_call(cu_seqlens_q=lambda cu: cu[None]), ValueError, "cu_seqlens_q must have 1 dimensions"),
        ("cu-one-entry", _varlen_call(cu_seqlens_q=_int32([0]), cu_seqlens_k=_int32([0])), ValueError,
         r"cu_seqlens_q must be \(B \+ 1,\) with B >= 1"),
        ("cu-lengths-differ", _varlen_call(cu_seqlens_k=_int32([0, 17])), ValueError,
         "cu_seqlens_k must have cu_seqlens_q's length 4"),
        ("cu-not-a-tensor", _varlen_call(cu_seqlens_q=[0, 5, 5, 13]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        ("cu-not-from-zero", _varlen_call(cu_seqlens_q=_int32([1, 5, 5, 13])), ValueError,
         "cu_seqlens_q must start at 0"),
        ("cu-decreasing", _varlen_call(cu_seqlens_k=_int32([0, 6, 5, 17])), ValueError,
         "cu_seqlens_k must be non-decreasing"),
        ("cu-end", _varlen_call(cu_seqlens_q=_int32([0, 5, 5, 12])), ValueError,
         "cu_seqlens_q must end at the packed length 13"),
        ("max-seqlen-too-small", _varlen_call(max_seqlen_k=7), ValueError,
         r"max_seqlen_k \(7\) must be at least the longest sequence of cu_seqlens_k \(8\)"),
        ("max-seqlen-zero", _varlen_call(max_seqlen_q=0), ValueError, "max_seqlen_q must be >= 1"),
        ("max-seqlen-float", _varlen_call(max_seqlen_q=8.0), TypeError, "max_seqlen_q must be a Python int"),
        ("max-seqlen-bool", _varlen_call(max_seqlen_k=True), TypeError, "max_seqlen_k must be a Python int"),
        ("nan-scale", _varlen_call(scale=float("nan")), ValueError, "scale"),
        *_attention_option_bad_inputs(tk_ops.attention_varlen,
                                      lambda: (_varlen_inputs(requires_grad=False, dtype=torch.float32), 4)),
    ) + _op_calls(
        ("op-checks-cu-contents",
         lambda: torch.ops.tk.attention_varlen(*_varlen_inputs(requires_grad=False)[:3], _int32([0, 5, 3, 13]),
                                               _int32([0, 6, 9, 17]), 8, 8, False, 0.3, -1, -1, 0.0, None, False),
         ValueError, "cu_seqlens_q must be non-decreasing"),
    ),
    device_mismatches=_device_mismatches(
        tk_ops.attention_varlen,
        lambda: dict(zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
                         _varlen_inputs(requires_grad=False, dtype=torch.float32, device="cuda")),
                     sinks=torch.randn(4, device="cuda")),
        "q", ("k", "cu_seqlens_q", "cu_seqlens_k", "sinks"),
    ),
    graphs=(_varlen_graph(),),
    no_graph={},
    fallbacks=(),
    no_fallback=_without_sample("falls back per sequence through tk.attention / tk.attention_bwd (their samples)",
                                "attention_varlen", "attention_varlen_bwd"),
)


# ------------------------------------------------------------------------------- attention_with_kvcache

KVCACHE_LENGTHS = [3, 0, 6]  # cached tokens of the three sequences (one empty) of the samples below


def _kvcache_case(block_size=4, new_len=2, dtype=torch.float32, device="cpu", reserve=0, head_dim=16):
    """Three sequences, 2 queries, caches of 9 positions, NaN in every unused slot (inputs/attention_with_kvcache)."""
    return kvcache_inputs.make_case(KVCACHE_LENGTHS, 2, new_len, capacity=9, block_size=block_size, dtype=dtype,
                                    device=device, reserve=reserve, head_dim=head_dim)


def _kvcache_kernel_sample(dtype) -> Sample:
    """A dense cache on the GPU at a kernel head dim: the attention kernel's packed variant serves it."""
    def make():
        case = _kvcache_case(None, 2, dtype, "cuda", head_dim=64)
        return case.op_arguments(True, 0.125, 3, -1, 1.5, sinks=torch.randn(case.q.shape[2], device="cuda"))

    return Sample(f"dense-window-softcap-sinks-{_dtype_name(dtype)}", "attention_with_kvcache", make)


def _kvcache_graph() -> GraphSample:
    """A decode step on a dense cache, captured: the append (the same tokens at the same positions, so an
    eager call after the replay writes what it wrote) and the attention, for new q, k, v and caches."""
    def make_inputs():
        case = _kvcache_case(None, 1, torch.bfloat16, "cuda", head_dim=128)
        return [case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens]

    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        return tk_ops.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, window=(4, -1),
                                             return_lse=True)

    return GraphSample("dense-decode-step", ("attention_with_kvcache",), make_inputs, step)


def _kvcache_paged_fallback() -> FallbackSample:
    """A paged cache on the GPU: the reference serves it (the kernel takes dense caches)."""
    def make_inputs():
        return _kvcache_case(4, 2, torch.bfloat16, "cuda", head_dim=64).op_arguments()

    def expected(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, *options):
        cpu = [t.cpu().double() for t in (q, k_cache, v_cache, k, v)]
        case = kvcache_inputs.KVCacheCase(*cpu, cache_seqlens.cpu(), block_table.cpu())
        return kvcache_inputs.float64_definition(case, causal=causal, scale=scale)

    return FallbackSample("paged-bf16", ("attention_with_kvcache",), make_inputs,
                          lambda *arguments: torch.ops.tk.attention_with_kvcache(*arguments), expected,
                          TOLERANCE[torch.bfloat16])


def _kvcache_sample(id, block_size, new_len=2, options=(), with_sinks=False, q_requires_grad=False,
                    dtype=torch.float64) -> Sample:
    def make():
        case = _kvcache_case(block_size, new_len, dtype)
        case.q.requires_grad_(q_requires_grad)
        sinks = torch.randn(case.q.shape[2]) if with_sinks else None
        return case.op_arguments(*options, sinks=sinks)

    return Sample(id, "attention_with_kvcache", make)


def _attend_to_cache_copies(q, k_cache, v_cache, k, v, cache_seqlens, block_table, sinks):
    """A decode step on copies of the caches (the inputs stay as they are), returning the written copies."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = tk_ops.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                             block_table=block_table, window=(4, -1), softcap=2.0, sinks=sinks,
                                             return_lse=True)
    return out, lse, k_cache, v_cache


def _kvcache_compile_inputs():
    case = _kvcache_case()
    caches = [t.nan_to_num(0.0) for t in (case.k_cache, case.v_cache)]  # the outputs compare without NaN
    return [case.q, *caches, case.k, case.v, case.cache_seqlens, case.block_table, torch.randn(case.q.shape[2])]


class _PagedDecodeStep(torch.nn.Module):
    """One decode step against a paged cache held in buffers (which the step writes)."""

    def __init__(self):
        super().__init__()
        case = _kvcache_case(new_len=0, reserve=1)
        self.register_buffer("k_cache", case.k_cache.nan_to_num(0.0))
        self.register_buffer("v_cache", case.v_cache.nan_to_num(0.0))
        self.register_buffer("block_table", case.block_table)

    def forward(self, q, k, v, cache_seqlens):
        return tk_ops.attention_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=cache_seqlens,
                                             block_table=self.block_table)


def _kvcache_export_args():
    case = _kvcache_case(new_len=1)
    return case.q[:, :1], case.k, case.v, case.cache_seqlens


def _kvcache_call(block_size=4, **changes):
    """tk_ops.attention_with_kvcache on _kvcache_case(block_size) with some arguments replaced (a callable
    change maps the argument's value) or options added."""

    def call():
        arguments = _kvcache_case(block_size).arguments()
        arguments.update({name: change(arguments[name]) if callable(change) else change
                          for name, change in changes.items() if name in arguments})
        options = {name: change for name, change in changes.items() if name not in arguments}
        return tk_ops.attention_with_kvcache(**arguments, **options)

    return call


def _kvcache_positional(q, k_cache, v_cache, k, v, cache_seqlens, block_table, **options):
    return tk_ops.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                         block_table=block_table, **options)


def _kvcache_op_call(**changes):
    """torch.ops.tk.attention_with_kvcache (below the public function's checks) with arguments replaced."""

    def call():
        case = _kvcache_case()
        for name, value in changes.items():
            setattr(case, name, value)
        return torch.ops.tk.attention_with_kvcache(*case.op_arguments())

    return call


def _with_block(entry, value):
    """The block table with its entry ``entry`` (row, column) set to ``value``."""

    def change(table):
        table = table.clone()
        table[entry] = value
        return table

    return change


ATTENTION_WITH_KVCACHE = OpInfo(
    name="attention_with_kvcache",
    functions={"attention_with_kvcache": ("attention_with_kvcache",)},
    samples=(
        _kvcache_sample("dense-append", None),
        _kvcache_sample("paged-append", 4),
        _kvcache_sample("paged-no-append", 4, new_len=0),
        _kvcache_sample("dense-window-softcap-sinks-fp32", None, options=(True, 0.3, 3, -1, 1.5), with_sinks=True,
                        dtype=torch.float32),
        _kvcache_sample("paged-not-causal-window-q-requires-grad", 2, options=(False, 0.3, 2, 1, 0.0),
                        q_requires_grad=True),
    ),
    kernel_dtypes=(torch.bfloat16, torch.float16),
    kernel_samples=lambda dtype: (_kvcache_kernel_sample(dtype),),
    compile=(
        CompileSample("paged-window-softcap-sinks-lse", _attend_to_cache_copies, _kvcache_compile_inputs,
                      ("attention_with_kvcache",)),
    ),
    export=(ExportSample("paged-decode-step-on-buffers", _PagedDecodeStep, _kvcache_export_args,
                         ("attention_with_kvcache",)),),
    bad_inputs=_bad(
        ("q-rank", _kvcache_call(q=lambda q: q[0]), ValueError, "q must have 4 dimensions"),
        ("int-q", _kvcache_call(q=lambda q: q.int()), TypeError, "q must have dtype"),
        ("q-not-a-tensor", _kvcache_call(q=lambda q: q.tolist()), TypeError, "q must be a torch.Tensor"),
        ("k-cache-rank", _kvcache_call(k_cache=lambda c: c[0]), ValueError, "k_cache must have 4 dimensions"),
        ("cache-dtype", _kvcache_call(k_cache=lambda c: c.double()), TypeError, "k_cache must have q's dtype"),
        ("k-dtype", _kvcache_call(k=lambda k: k.half()), TypeError, "k must have q's dtype"),
        ("k-without-v", _kvcache_call(v=None), ValueError, "k and v are appended together: k was given without v"),
        ("v-without-k", _kvcache_call(k=None), ValueError, "k and v are appended together: v was given without k"),
        ("v-cache-slots", _kvcache_call(v_cache=lambda c: c[:, :2]), ValueError,
         r"v_cache.shape\[1\] must equal k_cache.shape\[1\]"),
        ("v-cache-heads", _kvcache_call(v_cache=lambda c: c[:, :, :1]), ValueError,
         r"v_cache.shape\[2\] must equal k_cache.shape\[2\] \(Hkv\)"),
        ("cache-head-dim", _kvcache_call(k_cache=lambda c: c[..., :8]), ValueError,
         r"k_cache.shape\[3\] must equal q.shape\[3\] \(head dim D\)"),
        ("cache-last-stride", _kvcache_call(k_cache=lambda c: c.repeat_interleave(2, dim=-1)[..., ::2]), ValueError,
         "k_cache must have a unit last stride"),
        ("group", _kvcache_call(q=lambda q: q[:, :, :3]), ValueError, "Hq .*Hkv"),
        ("k-batch", _kvcache_call(k=lambda k: k[:2]), ValueError, r"k.shape\[0\] must equal q.shape\[0\]"),
        ("k-heads", _kvcache_call(k=lambda k: k[:, :, :1]), ValueError, r"k.shape\[2\] must equal k_cache.shape\[2\]"),
        ("k-head-dim", _kvcache_call(k=lambda k: k[..., :8]), ValueError, r"k.shape\[3\] must equal q.shape\[3\]"),
        ("v-length", _kvcache_call(v=lambda v: v[:, :1]), ValueError, r"v.shape\[1\] must equal k.shape\[1\]"),
        ("v-head-dim", _kvcache_call(v=lambda v: v[..., :8]), ValueError,
         r"v.shape\[3\] must equal v_cache.shape\[3\] \(value head dim Dv\)"),
        ("empty-k", _kvcache_call(k=lambda k: k[:, :0], v=lambda v: v[:, :0]), ValueError, "k must not be empty"),
        ("dense-cache-rows", _kvcache_call(None, k_cache=lambda c: c[:2], v_cache=lambda c: c[:2]), ValueError,
         r"k_cache.shape\[0\] \(B_cache\) must be at least q's batch 3"),
        ("block-table-int64", _kvcache_call(block_table=lambda t: t.long()), TypeError, "block_table must have dtype"),
        ("block-table-rank", _kvcache_call(block_table=lambda t: t[0]), ValueError,
         "block_table must have 2 dimensions"),
        ("block-table-batch", _kvcache_call(block_table=lambda t: t[:2]), ValueError,
         r"block_table.shape\[0\] must equal q.shape\[0\]"),
        ("cache-seqlens-int64", _kvcache_call(cache_seqlens=lambda s: s.long()), TypeError,
         "cache_seqlens must have dtype"),
        ("cache-seqlens-length", _kvcache_call(cache_seqlens=lambda s: s[:2]), ValueError,
         r"cache_seqlens.shape\[0\] must equal q.shape\[0\]"),
        ("cache-seqlens-float", _kvcache_call(cache_seqlens=3.0), TypeError,
         r"cache_seqlens must be a \(B,\) int32 tensor or a Python int"),
        ("cache-seqlens-bool", _kvcache_call(cache_seqlens=True), TypeError,
         r"cache_seqlens must be a \(B,\) int32 tensor or a Python int"),
        ("paged-capacity", _kvcache_call(cache_seqlens=_int32([3, 0, 11])), ValueError,
         r"cache_seqlens\[2\] \+ Nnew \(11 \+ 2\) must be at most the cache's capacity "
         r"\(max_blocks \* block_size = 3 \* 4 = 12\)"),
        ("dense-capacity", _kvcache_call(None, cache_seqlens=_int32([3, 0, 8])), ValueError,
         r"cache_seqlens\[2\] \+ Nnew \(8 \+ 2\) must be at most the cache's capacity "
         r"\(Nmax = k_cache.shape\[1\] = 9\)"),
        ("int-capacity", _kvcache_call(cache_seqlens=11), ValueError,
         r"cache_seqlens\[0\] \+ Nnew \(11 \+ 2\) must be at most the cache's capacity"),
        ("negative-cache-seqlens", _kvcache_call(cache_seqlens=_int32([3, -1, 6])), ValueError,
         r"cache_seqlens\[1\] must be >= 0, got -1"),
        ("negative-int-cache-seqlens", _kvcache_call(cache_seqlens=-1), ValueError, r"cache_seqlens\[0\] must be >= 0"),
        ("block-past-the-pool", _kvcache_call(block_table=_with_block((2, 1), 11)), ValueError,
         r"block_table\[2, 1\] must be a block index in \[0, num_blocks = 11\) \(sequence 2 uses its first 2 blocks\), "
         "got 11"),
        ("negative-block", _kvcache_call(block_table=_with_block((0, 0), -1)), ValueError,
         r"block_table\[0, 0\] must be a block index"),
        ("nan-scale", _kvcache_call(scale=float("nan")), ValueError, "scale"),
        *_attention_option_bad_inputs(_kvcache_positional, lambda: (list(_kvcache_case().arguments().values()), 4)),
    ) + _op_calls(
        ("op-checks-capacity", _kvcache_op_call(cache_seqlens=_int32([3, 0, 11])), ValueError,
         r"cache_seqlens\[2\] \+ Nnew \(11 \+ 2\) must be at most"),
        ("op-checks-blocks", _kvcache_op_call(block_table=_int32([[0, 1, 2], [3, -1, -1], [6, 99, -1]])), ValueError,
         r"block_table\[2, 1\] must be a block index"),
    ),
    device_mismatches=_device_mismatches(
        tk_ops.attention_with_kvcache,
        lambda: dict(_kvcache_case(device="cuda").arguments(), sinks=torch.randn(4, device="cuda")),
        "q", ("k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "sinks"),
    ),
    graphs=(_kvcache_graph(),),
    no_graph={},
    fallbacks=(_kvcache_paged_fallback(),),
    no_fallback={},
)


# -------------------------------------------------------------------------------------------- layer_norm

LAYER_NORM_EPS = layer_norm_inputs.EPS


def _layer_norm_args(case: str, dtype=torch.bfloat16, device="cpu"):
    """Arguments of tk::layer_norm for a case: leading dims odd, hidden 37, x a transposed view."""
    x = torch.randn(7, 3, 37, device=device).transpose(0, 1).requires_grad_()
    weight, bias = _randn((37,), (37,), requires_grad=True, device=device)
    if case == "bare":
        return (x, None, None, None, None, LAYER_NORM_EPS, 0.0)
    residual = torch.randn(3, 7, 37, requires_grad=True, device=device)
    if case == "residual":
        return (x, weight, bias, residual, None, LAYER_NORM_EPS, 0.0)
    seed = torch.tensor(0x1234_5678_9ABC, dtype=torch.int64, device=device)
    return (x.detach().to(dtype).requires_grad_(), weight, None, residual, seed, LAYER_NORM_EPS, 0.25)


def _layer_norm_backward_args(case: str, all_gradients: bool, **kwargs):
    x, weight, bias, residual, seed, eps, dropout_p = [
        a.detach() if isinstance(a, torch.Tensor) else a for a in _layer_norm_args(case, **kwargs)
    ]
    _, h, mean, rstd = torch.ops.tk.layer_norm(x, weight, bias, residual, seed, eps, dropout_p)
    h = h if h.numel() else x
    saved = (h, weight, bias, mean, rstd, seed, dropout_p)
    if not all_gradients:
        return (torch.randn_like(x), None, *saved, [False] * 4)
    grad_h = torch.randn_like(h) if residual is not None else None
    return (torch.randn_like(x), grad_h, *saved, [True, residual is not None, weight is not None, bias is not None])


def _norm_samples(op: str, cases: tuple[str, ...], forward_args, backward_args) -> dict:
    """OpInfo's samples of a norm: forward opchecks per case, backward opchecks per case with every gradient and
    with none; on the GPU, the last case (16-bit x, fp32 residual) forward and backward in each kernel dtype."""
    forward = tuple(Sample(case, op, lambda case=case: forward_args(case)) for case in cases)
    backward = tuple(
        Sample(f"{op}_bwd-{case}-{'all' if every else 'no'}-gradients", f"{op}_bwd",
               lambda case=case, every=every: backward_args(case, every))
        for case in cases
        for every in (True, False)
    )

    def kernel_samples(dtype):
        case = cases[-1]
        return (
            Sample(case, op, lambda: _grad_leaves(forward_args(case, dtype=dtype, device="cuda"))),
            Sample(f"{op}_bwd-{case}", f"{op}_bwd", lambda: backward_args(case, True, dtype=dtype, device="cuda")),
        )

    return dict(samples=forward + backward, kernel_dtypes=KERNEL_16_BIT, kernel_samples=kernel_samples)


def _norm_bad_inputs(norm) -> tuple[BadInput, ...]:
    """The checks both norms make, on ``norm(x, weight, **kwargs)`` with x (4, 16) fp32 by default."""

    def call(x=None, weight=None, **kwargs):
        return lambda: norm(torch.randn(4, 16) if x is None else x, weight, **kwargs)

    bf16, fp16 = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.float16)
    return _bad(
        ("x-not-a-tensor", call([[1.0]]), TypeError, "x must be a torch.Tensor"),
        ("x-int32", call(torch.ones(4, 16, dtype=torch.int32)), TypeError, "x must have dtype"),
        ("x-int64", call(torch.ones(4, 16, dtype=torch.int64)), TypeError, "x must have dtype"),
        ("x-0-dim", call(torch.tensor(1.0)), ValueError, "x must have at least 1 dimension"),
        ("x-no-rows", call(torch.randn(0, 16)), ValueError, "x must not be empty"),
        ("x-hidden-0", call(torch.randn(4, 0)), ValueError, "x must not be empty"),
        ("weight-size", call(weight=torch.randn(15)), ValueError, r"weight.shape\[0\] must equal x.shape\[-1\]"),
        ("weight-rank-2-1x16", call(weight=torch.randn(1, 16)), ValueError, "weight must have 1 dimensions"),
        ("weight-rank-2-16x1", call(weight=torch.randn(16, 1)), ValueError, "weight must have 1 dimensions"),
        ("weight-fp16-for-bf16-x", call(bf16, torch.randn(16, dtype=torch.float16)), TypeError,
         "weight must have dtype"),
        ("weight-bf16-for-fp16-x", call(fp16, torch.randn(16, dtype=torch.bfloat16)), TypeError,
         "weight must have dtype"),
        ("residual-shape-3x16", call(residual=torch.randn(3, 16)), ValueError, "residual must have x's shape"),
        ("residual-shape-4x1x16", call(residual=torch.randn(4, 1, 16)), ValueError, "residual must have x's shape"),
        ("residual-fp16-for-bf16-x", call(bf16, residual=torch.randn(4, 16).half()), TypeError,
         "residual must have dtype"),
        ("residual-fp64-for-fp16-x", call(fp16, residual=torch.randn(4, 16, dtype=torch.float64)), TypeError,
         "residual must have dtype"),
        ("eps-zero", call(eps=0.0), ValueError, "eps must be > 0"),
        ("eps-negative", call(eps=-1e-6), ValueError, "eps must be > 0"),
        ("eps-string", call(eps="1e-5"), TypeError, "eps must be a float"),
        ("eps-None", call(eps=None), TypeError, "eps must be a float"),
    )


class _PostLayerNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(37))
        self.bias = torch.nn.Parameter(torch.randn(37))

    def forward(self, x, residual):
        return tk_ops.layer_norm(x, self.weight, self.bias, residual=residual)


def _layer_norm(**kwargs):
    return tk_ops.layer_norm(torch.randn(4, 16), None, None, **kwargs)


def _norm_on_the_gpu():
    return dict(zip(("x", "weight", "residual"), _randn((4, 16), (16,), (4, 16), device="cuda")))


def _norm_loss(out, h):
    return (out * out).sum() + (h * out).sum()


LAYER_NORM = OpInfo(
    name="layer_norm",
    functions={"layer_norm": ("layer_norm", "layer_norm_bwd")},
    **_norm_samples("layer_norm", ("bare", "residual", "dropout-fp32-residual"), _layer_norm_args,
                    _layer_norm_backward_args),
    compile=(
        CompileSample(
            "residual-dropout",
            lambda x, weight, bias, residual: tk_ops.layer_norm(x, weight, bias, residual=residual, dropout_p=0.2,
                                                                return_residual=True),
            lambda: list(layer_norm_inputs.make_inputs((2, 9, 40), torch.float32, residual_dtype=torch.float32,
                                                       requires_grad=True)),
            ("layer_norm", "layer_norm_bwd"),
            loss=_norm_loss,
            # The compiled seed draw uses torch's generator, as eager does.
            seed=11,
            inductor_config=(("fallback_random", True),),
        ),
    ),
    # tol=0 (here and for rms_norm and rope): the exported graph is the one tk op the module calls,
    # run on the same arguments in the same process, so its bits are the module's on any machine.
    export=(ExportSample("residual", _PostLayerNorm, lambda: (torch.randn(5, 37), torch.randn(5, 37)),
                         ("layer_norm",), tol=0),),
    bad_inputs=_norm_bad_inputs(lambda x, weight, **kwargs: tk_ops.layer_norm(x, weight, None, **kwargs)) + _bad(
        ("bias-size", lambda: tk_ops.layer_norm(torch.randn(4, 16), None, torch.randn(17)), ValueError,
         r"bias.shape\[0\] must equal"),
        ("dropout_p-one", lambda: _layer_norm(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        ("dropout_p-negative", lambda: _layer_norm(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
        ("dropout_p-not-a-number", lambda: _layer_norm(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    ) + _op_calls(
        ("op-without-seed",
         lambda: torch.ops.tk.layer_norm(torch.randn(4, 16), None, None, None, None, LAYER_NORM_EPS, 0.5),
         (ValueError, RuntimeError), "dropout_seed"),
    ),
    device_mismatches=_device_mismatches(
        lambda x, weight, residual: tk_ops.layer_norm(x, weight, None, residual=residual), _norm_on_the_gpu, "x",
        ("weight", "residual"),
    ),
    graphs=(),
    no_graph={
        "layer_norm": "no capture-and-replay check yet: test_layer_norm.py's "
                      "test_kernel_cuda_graph_draws_fresh_masks_per_replay captures it with dropout, whose "
                      "replays draw fresh masks (so they replay no eager call)",
        "layer_norm_bwd": NO_GRAPH_YET,
    },
    fallbacks=(),
    no_fallback=_without_sample(NO_FALLBACK_YET, "layer_norm", "layer_norm_bwd"),
)


# ---------------------------------------------------------------------------------------------- rms_norm

RMS_NORM_EPS = rms_norm_inputs.EPS


def _rms_norm_args(case: str, dtype=torch.bfloat16, device="cpu"):
    """Arguments of tk::rms_norm for a case: leading dims odd, hidden 37, x a transposed view."""
    x = torch.randn(7, 3, 37, device=device).transpose(0, 1).requires_grad_()
    if case == "bare":
        return (x, None, None, RMS_NORM_EPS)
    weight, residual = _randn((37,), (3, 7, 37), requires_grad=True, device=device)
    if case == "residual":
        return (x, weight, residual, RMS_NORM_EPS)
    return (x.detach().to(dtype).requires_grad_(), weight, residual, RMS_NORM_EPS)


def _rms_norm_backward_args(case: str, all_gradients: bool, **kwargs):
    x, weight, residual, eps = [a.detach() if isinstance(a, torch.Tensor) else a
                                for a in _rms_norm_args(case, **kwargs)]
    _, h, rstd = torch.ops.tk.rms_norm(x, weight, residual, eps)
    h = h if h.numel() else x
    if not all_gradients:
        return (torch.randn_like(x), None, h, weight, rstd, [False] * 3)
    grad_h = torch.randn_like(h) if residual is not None else None
    return (torch.randn_like(x), grad_h, h, weight, rstd, [True, residual is not None, weight is not None])


class _PreRMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(37))

    def forward(self, x, residual):
        return tk_ops.rms_norm(x, self.weight, residual=residual, return_residual=True)


RMS_NORM = OpInfo(
    name="rms_norm",
    functions={"rms_norm": ("rms_norm", "rms_norm_bwd")},
    **_norm_samples("rms_norm", ("bare", "residual", "bf16-fp32-residual"), _rms_norm_args, _rms_norm_backward_args),
    compile=(
        CompileSample(
            "residual",
            lambda x, weight, residual: tk_ops.rms_norm(x, weight, residual=residual, return_residual=True),
            lambda: list(rms_norm_inputs.make_inputs((2, 9, 40), torch.float32, residual_dtype=torch.float32,
                                                     requires_grad=True)),
            ("rms_norm", "rms_norm_bwd"),
            loss=_norm_loss,
        ),
    ),
    export=(ExportSample("residual", _PreRMSNorm, lambda: (torch.randn(5, 37), torch.randn(5, 37)), ("rms_norm",),
                         tol=0),),
    bad_inputs=_norm_bad_inputs(tk_ops.rms_norm),
    device_mismatches=_device_mismatches(
        lambda x, weight, residual: tk_ops.rms_norm(x, weight, residual=residual), _norm_on_the_gpu, "x",
        ("weight", "residual"),
    ),
    graphs=(),
    no_graph=_without_sample(NO_GRAPH_YET, "rms_norm", "rms_norm_bwd"),
    fallbacks=(),
    no_fallback=_without_sample(NO_FALLBACK_YET, "rms_norm", "rms_norm_bwd"),
)


# -------------------------------------------------------------------------------------------------- rope


def _rope_args(dtype=torch.float32, device="cpu", requires_grad=True, sizes=(2, 3, 1, 5, 24, 16)):
    """q (B, H, N, D) a transposed (B, N, H, D) tensor, k (B, Hk, N, D), fp32 tables (B, N, R/2)."""
    B, H, Hk, N, D, R = sizes
    q = torch.randn(B, N, H, D, dtype=dtype, device=device).transpose(1, 2).requires_grad_(requires_grad)
    k = torch.randn(B, Hk, N, D, dtype=dtype, device=device, requires_grad=requires_grad)
    cos, sin = rope_inputs.tables(rope_inputs.random_angles(B, N, R, device=device), torch.float32)
    return q, k, cos, sin


def _rope_samples(**kwargs) -> tuple[Sample, ...]:
    def rope(interleaved):
        q, _, cos, sin = _rope_args(**kwargs)
        return (q, cos, sin, interleaved)

    def rope_qk(interleaved):
        return (*_rope_args(**kwargs), interleaved)

    def rope_bwd():
        q, _, cos, sin = _rope_args(requires_grad=False, **kwargs)
        return (q, cos[:1], sin[:1], True)

    forward = []
    for interleaved, form in ((False, "neox"), (True, "gptj")):
        forward.append(Sample(f"rope-{form}", "rope", lambda interleaved=interleaved: rope(interleaved)))
        forward.append(Sample(f"rope_qk-{form}", "rope_qk", lambda interleaved=interleaved: rope_qk(interleaved)))
    return (
        *forward,
        Sample("rope_bwd-gptj-shared-tables", "rope_bwd", rope_bwd),
        Sample("rope_qk_bwd-gptj", "rope_qk_bwd", lambda: (*_rope_args(requires_grad=False, **kwargs), True)),
    )


def _rope_compile_inputs():
    """(B, N, H, D) q viewed as (B, H, N, D), GQA k and v, and (1, N, D/2) tables (not differentiated)."""
    B, Hq, Hk, N, D = 2, 3, 1, 7, 32
    q = torch.randn(B, N, Hq, D).transpose(1, 2).requires_grad_()
    k, v = _randn((B, Hk, N, D), (B, Hk, N, D), requires_grad=True)
    return [q, k, v, *rope_inputs.tables(rope_inputs.random_angles(1, N, D), torch.float32)]


def _rope_qk_then_rope(q, k, v, cos, sin):
    """rope_qk with HF-form (duplicated) tables, then an interleaved rope with the half form."""
    hf_cos, hf_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    q_out, k_out = tk_ops.rope_qk(q, k, hf_cos, hf_sin)
    v_out = tk_ops.rope(v, cos[0], sin[0], interleaved=True)
    return (q_out.sum(1, keepdim=True) * k_out * v_out).sum()


class _Rotate(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        q_out, k_out = tk_ops.rope_qk(q, k, cos, sin)
        return q_out, k_out, tk_ops.rope(q, cos, sin, interleaved=True)


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _tables(*shape, dtype=torch.float32, requiring_grad=None):
    tables = {"cos": _x(*shape, dtype=dtype), "sin": _x(*shape, dtype=dtype)}
    if requiring_grad is not None:
        tables[requiring_grad].requires_grad_()
    return tables["cos"], tables["sin"]


def _rope_qk_graph_inputs():
    """bf16 q (2, 4, 100, 128), GQA k, and fp32 (100, 64) tables, on the GPU."""
    B, Hq, Hk, N, D = 2, 4, 2, 100, 128
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hk, N, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_inputs.tables(rope_inputs.random_angles(1, N, D, device="cuda")[0], torch.float32)
    return q, k, cos, sin


def _rope_fp64_inputs():
    """fp64 x (2, 3, 7, 16) and angles (1, 7, 8) on the GPU."""
    B, H, N, D = 2, 3, 7, 16
    x = torch.randn(B, H, N, D, device="cuda", dtype=torch.float64)
    return x, rope_inputs.random_angles(1, N, D, device="cuda")


def _rope_on_the_gpu(*names):
    """(2, 3, 5, 16) tensors by name and (5, 8) tables, on the GPU."""
    tensors = dict(zip(names, _randn(*[(2, 3, 5, 16)] * len(names), device="cuda")))
    return dict(tensors, **dict(zip(("cos", "sin"), _randn((5, 8), (5, 8), device="cuda"))))


def _rope_kernel_call(call):
    """``call(x, cos, sin)`` on bf16 x (2, 3, 5, 16) and fp32 (1, 5, 8) tables on the GPU, below the public checks."""

    def run():
        cos, sin = torch.randn(2, 1, 5, 8, device="cuda").unbind(0)
        return call(torch.randn(2, 3, 5, 16, device="cuda", dtype=torch.bfloat16), cos, sin)

    return run


def _tables_requiring_grad_rejected():
    rows = []
    for name in ("cos", "sin"):
        rows.append((f"rope-{name}-requires-grad", lambda name=name: tk_ops.rope(
            _x(2, 3, 5, 16), *_tables(5, 8, requiring_grad=name)), ValueError, f"{name} must not require grad"))
        rows.append((f"rope_qk-{name}-requires-grad", lambda name=name: tk_ops.rope_qk(
            *[_x(2, 3, 5, 16)] * 2, *_tables(5, 8, requiring_grad=name)), ValueError, f"{name} must not require grad"))
    return _bad(*rows)


ROPE = OpInfo(
    name="rope",
    functions={"rope": ("rope", "rope_bwd"), "rope_qk": ("rope_qk", "rope_qk_bwd")},
    samples=_rope_samples(),
    kernel_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    kernel_samples=lambda dtype: _rope_samples(dtype=dtype, device="cuda", sizes=(2, 3, 1, 5, 64, 64)),
    compile=(CompileSample("rope_qk-hf-tables-then-rope-gptj", _rope_qk_then_rope, _rope_compile_inputs,
                           ("rope_qk", "rope_qk_bwd", "rope", "rope_bwd")),),
    export=(ExportSample("rope_qk-and-rope", _Rotate, lambda: _rope_args(requires_grad=False), ("rope_qk", "rope"),
                         tol=0),),
    bad_inputs=_bad(
        ("x-not-a-tensor", lambda: tk_ops.rope([[1.0]], *_tables(5, 8)), TypeError, "x must be a torch.Tensor"),
        ("x-rank-3", lambda: tk_ops.rope(_x(3, 5, 16), *_tables(5, 8)), ValueError, "x must have 4 dimensions"),
        ("x-integer", lambda: tk_ops.rope(torch.ones(2, 3, 5, 16, dtype=torch.int32), *_tables(5, 8)), TypeError,
         "x must have dtype"),
        ("x-empty", lambda: tk_ops.rope(_x(0, 3, 5, 16), *_tables(5, 8)), ValueError, "x must not be empty"),
        ("cos-not-a-tensor", lambda: tk_ops.rope(_x(2, 3, 5, 16), None, _x(5, 8)), TypeError,
         "cos must be a torch.Tensor"),
        ("cos-rank-1", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(8)), ValueError,
         "cos must have 2 or 3 or 4 dimensions"),
        ("cos-rank-5", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(1, 1, 1, 5, 8)), ValueError,
         "cos must have 2 or 3 or 4"),
        ("cos-empty", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(5, 0)), ValueError, "cos must not be empty"),
        ("cos-fp16-for-bf16-x", lambda: tk_ops.rope(_x(2, 3, 5, 16, dtype=torch.bfloat16),
                                                    *_tables(5, 8, dtype=torch.float16)), TypeError,
         r"cos must have dtype in \(bfloat16, float32\)"),
        ("cos-fp64-for-fp32-x", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(5, 8, dtype=torch.float64)),
         TypeError, r"cos must have dtype in \(float32\)"),
        ("sin-shape", lambda: tk_ops.rope(_x(2, 3, 5, 16), _x(5, 8), _x(5, 6)), ValueError,
         "sin must have cos's shape"),
        ("sin-dtype", lambda: tk_ops.rope(_x(2, 3, 5, 16, dtype=torch.bfloat16), _x(5, 8),
                                          _x(5, 8, dtype=torch.bfloat16)), TypeError, "sin must have cos's dtype"),
        ("cos-N", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(6, 8)), ValueError,
         r"cos.shape\[-2\] must equal x.shape\[2\] \(N\)"),
        ("cos-batch", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(3, 5, 8)), ValueError,
         r"cos.shape\[0\] must be 1 or x.shape\[0\]"),
        ("cos-per-head", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(2, 3, 5, 8)), ValueError,
         r"cos.shape\[1\] must be 1"),
        ("cos-last-dim", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(5, 9)), ValueError,
         r"cos.shape\[-1\] must be R/2"),
        ("cos-last-dim-2D", lambda: tk_ops.rope(_x(2, 3, 5, 16), *_tables(5, 32)), ValueError,
         r"cos.shape\[-1\] must be R/2"),
        ("hf-form-odd-D", lambda: tk_ops.rope(_x(2, 3, 5, 15), *_tables(5, 15)), ValueError,
         r"cos.shape\[-1\] must be R/2"),
        ("rope_qk-k-rank-3", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(3, 5, 16), *_tables(5, 8)), ValueError,
         "k must have 4 dimensions"),
        ("rope_qk-k-batch", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(1, 3, 5, 16), *_tables(5, 8)), ValueError,
         r"k.shape\[0\] must equal q.shape\[0\] \(B\)"),
        ("rope_qk-k-seq-len", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(2, 1, 4, 16), *_tables(5, 8)), ValueError,
         r"k.shape\[2\] must equal q.shape\[2\] \(N\)"),
        ("rope_qk-k-head-dim", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(2, 1, 5, 32), *_tables(5, 8)),
         ValueError, r"k.shape\[3\] must equal q.shape\[3\] \(D\)"),
        ("rope_qk-k-dtype", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(2, 1, 5, 16, dtype=torch.bfloat16),
                                                   *_tables(5, 8)), TypeError, "k must have q's dtype"),
        ("rope_qk-k-empty", lambda: tk_ops.rope_qk(_x(2, 3, 5, 16), _x(2, 0, 5, 16), *_tables(5, 8)), ValueError,
         "k must not be empty"),
    ) + _tables_requiring_grad_rejected() + _op_calls(
        ("kernel-rope-table-length", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope(
            x, cos[:, :4], sin[:, :4], False)), ValueError, r"cos.shape\[1\] must equal N", "rope"),
        ("kernel-rope-table-rank", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope(
            x, cos[0], sin[0], False)), ValueError, "cos must be 3-D", "rope"),
        ("kernel-rope_bwd-sin-shape", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope_bwd(
            x, cos, sin[..., :4], False)), ValueError, "sin must have cos's shape", "rope_bwd"),
        ("kernel-rope-rotary-dim", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope(
            x, cos.repeat(1, 1, 3), sin.repeat(1, 1, 3), True)), ValueError, r"cos.shape\[2\] must be R/2", "rope"),
        ("kernel-rope_qk-k-shape", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope_qk(
            x, x[..., :8], cos, sin, False)), ValueError, "k must be", "rope_qk"),
        ("kernel-rope_qk-table-dtype", _rope_kernel_call(lambda x, cos, sin: torch.ops.tk.rope_qk(
            x, x, cos.half(), sin.half(), False)), TypeError, "cos and sin must have q's dtype", "rope_qk"),
    ),
    device_mismatches=_device_mismatches(tk_ops.rope, lambda: _rope_on_the_gpu("x"), "x", ("cos", "sin"))
    + _device_mismatches(tk_ops.rope_qk, lambda: _rope_on_the_gpu("q", "k"), "q", "k"),
    # New q and k, the same tables.
    graphs=(GraphSample("rope_qk", ("rope_qk",), _rope_qk_graph_inputs, tk_ops.rope_qk,
                        new_values=lambda q, k, cos, sin: (torch.randn_like(q), torch.randn_like(k), cos, sin),
                        changed=0),),
    no_graph=_without_sample(NO_GRAPH_YET, "rope", "rope_bwd", "rope_qk_bwd"),
    fallbacks=(FallbackSample("fp64", ("rope",), _rope_fp64_inputs,
                              lambda x, theta: tk_ops.rope(x, *rope_inputs.tables(theta[0], torch.float64)),
                              lambda x, theta: rope_inputs.reference_rope(x, theta, False), TOLERANCE[torch.float64],
                              checks_warning=False),),
    no_fallback=_without_sample(NO_FALLBACK_YET, "rope_bwd", "rope_qk", "rope_qk_bwd"),
)


# ----------------------------------------------------------------------- linear_attention, based_attention


def _small_chunks(module):
    """Chunks of 16 positions in the op's reference, so that short sequences cross several chunk boundaries."""
    return lambda: mock.patch.object(module, "CHUNK_SIZE", 16)


def _causal_linear_samples(op: str, make_inputs, context=contextlib.nullcontext, **kwargs) -> tuple[Sample, ...]:
    """Forward and backward opchecks of tk.<op>(q, k, v, eps, normalize), normalised and not, on N = 37;
    ``make_inputs(n, normalize, **kwargs)`` gives q, k, v."""

    def forward(normalize):
        return (*make_inputs(37, normalize, requires_grad=True, **kwargs), 1e-6, normalize)

    def backward(normalize):
        q, k, v = make_inputs(37, normalize, **kwargs)
        out, denominator = getattr(torch.ops.tk, op)(q, k, v, 1e-6, normalize)
        return (torch.randn_like(out), q, k, v, out, denominator, 1e-6, normalize)

    return tuple(
        Sample(f"{name}-{'normalized' if normalize else 'unnormalized'}", name,
               lambda make=make, normalize=normalize: make(normalize), context)
        for name, make in ((op, forward), (f"{op}_bwd", backward))
        for normalize in (False, True)
    )


def _linear_attention_inputs(n, normalize, **kwargs):
    return linear_attention_inputs.make_inputs(n, normalize=normalize, **kwargs)


def _based_attention_inputs(n, normalize, **kwargs):
    return based_attention_inputs.make_inputs(n, **kwargs)


class _CausalLinearMixer(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, q, k, v):
        return self.function(q, k, v, normalize=True, eps=1e-6)


def _causal_linear_bad_inputs(function, make_inputs, B, H, F, DV) -> tuple[BadInput, ...]:
    """``function`` on valid fp32 (B, H, 9, F) q, k and (B, H, 9, DV) v (eps = 1e-12), one argument replaced."""
    q, k, v = make_inputs(9, False, dtype=torch.float32)

    def call(**changes):
        return lambda: function(**(dict(q=q, k=k, v=v, eps=1e-12) | changes))

    return _bad(
        ("q-not-a-tensor", call(q=[[1.0]]), TypeError, "q"),
        ("k-None", call(k=None), TypeError, "k"),
        ("q-int32", call(q=torch.ones(B, H, 9, F, dtype=torch.int32)), TypeError, "q"),
        ("q-int64", call(q=torch.ones(B, H, 9, F, dtype=torch.int64)), TypeError, "q"),
        ("k-fp64", call(k=torch.randn(B, H, 9, F, dtype=torch.float64)), TypeError, "k"),
        ("k-fp16", call(k=torch.randn(B, H, 9, F, dtype=torch.float16)), TypeError, "k"),
        ("v-bf16", call(v=torch.randn(B, H, 9, DV, dtype=torch.bfloat16)), TypeError, "v"),
        ("v-fp64", call(v=torch.randn(B, H, 9, DV, dtype=torch.float64)), TypeError, "v"),
        ("q-rank-3-heads", call(q=torch.randn(H, 9, F)), ValueError, "q"),
        ("q-rank-3-batch-heads", call(q=torch.randn(B * H, 9, F)), ValueError, "q"),
        ("k-rank-5", call(k=torch.randn(1, B, H, 9, F)), ValueError, "k"),
        ("v-rank-5", call(v=torch.randn(1, B, H, 9, DV)), ValueError, "v"),
        ("k-feature-dim-plus-1", call(k=torch.randn(B, H, 9, F + 1)), ValueError, r"k.*feature dim"),
        ("k-feature-dim-minus-1", call(k=torch.randn(B, H, 9, F - 1)), ValueError, r"k.*feature dim"),
        ("k-batch", call(k=torch.randn(B + 1, H, 9, F)), ValueError, r"k.*batch"),
        ("v-batch", call(v=torch.randn(B + 1, H, 9, DV)), ValueError, r"v.*batch"),
        ("k-heads", call(k=torch.randn(B, H + 2, 9, F)), ValueError, r"k.*heads"),
        ("v-heads", call(v=torch.randn(B, H + 1, 9, DV)), ValueError, r"v.*heads"),
        ("k-sequence-length", call(k=torch.randn(B, H, 8, F)), ValueError, r"k.*sequence length"),
        ("v-sequence-length", call(v=torch.randn(B, H, 10, DV)), ValueError, r"v.*sequence length"),
        ("empty-sequence", call(q=torch.randn(B, H, 0, F), k=torch.randn(B, H, 0, F), v=torch.randn(B, H, 0, DV)),
         ValueError, "q"),
        ("empty-batch", call(q=torch.randn(0, H, 9, F), k=torch.randn(0, H, 9, F), v=torch.randn(0, H, 9, DV)),
         ValueError, "q"),
        ("v-empty-value-dim", call(v=torch.randn(B, H, 9, 0)), ValueError, "v"),
        ("eps-negative", call(eps=-1e-6), ValueError, "eps"),
        ("eps-minus-one", call(eps=-1.0), ValueError, "eps"),
        ("eps-nan", call(eps=float("nan")), ValueError, "eps"),
        ("eps-inf", call(eps=float("inf")), ValueError, "eps"),
        ("eps-tensor", call(eps=torch.tensor(1e-6)), TypeError, "eps"),
        ("eps-string", call(eps="1e-6"), TypeError, "eps"),
    )


def _causal_linear_graphs(name, function, reference_module, graph_inputs, B, H) -> tuple[GraphSample, ...]:
    """The forward (through the public function) in one graph, forward and backward (the ops, normalised) in
    another; ``graph_inputs()`` gives bf16 q, k, v of N = 500, Dv = 64 on the GPU."""
    forward_op, backward_op = getattr(reference_module, f"{name}_op"), getattr(reference_module, f"{name}_bwd_op")

    def forward_backward(q, k, v, grad_out):
        out, denominator = forward_op(q, k, v, 1e-12, True)
        return backward_op(grad_out, q, k, v, out, denominator, 1e-12, True)

    return (
        GraphSample("forward", (name,), graph_inputs, lambda q, k, v: function(q, k, v, normalize=True)),
        GraphSample("forward-backward", (name, f"{name}_bwd"),
                    lambda: (*graph_inputs(), torch.randn(B, H, 500, 64, dtype=torch.bfloat16, device="cuda")),
                    forward_backward),
    )


def _causal_linear_fallbacks(function, make_inputs, naive, B, H, cases, checks_forward_warning):
    """Normalised q, k, v of N = 77 in each (dtype, F, Dv) of ``cases``, which the kernels do not take: the
    forward against ``naive(q, k, v, normalize, eps)`` (its reference warning checked where
    ``checks_forward_warning``), and its gradients through autograd (the backward falls back too)."""
    name = function.__name__

    def forward_sample(dtype, f, dv):
        return FallbackSample(
            f"forward-{_dtype_name(dtype)}-F{f}-Dv{dv}", (name,),
            lambda: make_inputs(77, True, f=f, dv=dv, dtype=dtype, device="cuda"),
            lambda q, k, v: function(q, k, v, normalize=True), lambda q, k, v: naive(q, k, v, True, 1e-12),
            TOLERANCE[dtype], checks_warning=checks_forward_warning,
        )

    def backward_sample(dtype, f, dv):
        def inputs_and_output_gradient():
            q, k, v = make_inputs(77, True, f=f, dv=dv, dtype=dtype, device="cuda", requires_grad=True)
            return q, k, v, torch.randn(B, H, 77, dv, dtype=dtype, device="cuda")

        def gradients(q, k, v, grad_out):
            return torch.autograd.grad(function(q, k, v, normalize=True), (q, k, v), grad_out)

        def float64_gradients(q, k, v, grad_out):
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            return torch.autograd.grad(naive(*leaves, True, 1e-12), leaves, grad_out.double())

        return FallbackSample(f"backward-{_dtype_name(dtype)}-F{f}-Dv{dv}", (name, f"{name}_bwd"),
                              inputs_and_output_gradient, gradients, float64_gradients, 3 * TOLERANCE[dtype],
                              checks_warning=False)

    return tuple(forward_sample(*case) for case in cases) + tuple(backward_sample(*case) for case in cases)


def _linear_attention_rows_tma_cannot_describe():
    """bf16 q and k of rows F + 1 = 17 elements apart (not a multiple of 16 bytes), normalised."""
    B, H = linear_attention_inputs.B, linear_attention_inputs.H
    q_rows, k_rows = (torch.rand(B, H, 77, 17, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v = torch.randn(B, H, 77, 64, dtype=torch.bfloat16, device="cuda")
    return q_rows[..., :16], k_rows[..., :16], v


def _causal_linear_info(function, make_inputs, inputs_module, reference_module, graph_inputs, fallbacks) -> OpInfo:
    """linear_attention and based_attention: one engine behind two ops, one contract. ``make_inputs(n, normalize,
    **kwargs)`` gives q, k, v; the kernels take F = 16, Dv = 64; ``graph_inputs()``: _causal_linear_graphs'."""
    name = function.__name__
    on_the_gpu = dict(f=16, dv=64, device="cuda")
    return OpInfo(
        name=name,
        functions={name: (name, f"{name}_bwd")},
        samples=_causal_linear_samples(name, make_inputs, dtype=torch.float32, context=_small_chunks(reference_module)),
        kernel_dtypes=KERNEL_16_BIT,
        kernel_samples=lambda dtype: _causal_linear_samples(name, make_inputs, dtype=dtype, **on_the_gpu),
        compile=tuple(
            CompileSample("normalized" if normalize else "unnormalized",
                          lambda q, k, v, normalize=normalize: function(q, k, v, normalize=normalize),
                          lambda normalize=normalize: list(make_inputs(29, normalize, dtype=torch.float32,
                                                                       requires_grad=True)),
                          (name, f"{name}_bwd"), loss=_random_projection)
            for normalize in (False, True)
        ),
        export=(ExportSample("normalized", lambda: _CausalLinearMixer(function),
                             lambda: make_inputs(19, True, dtype=torch.float32), (name,)),),
        bad_inputs=_causal_linear_bad_inputs(function, make_inputs, inputs_module.B, inputs_module.H,
                                             inputs_module.F, inputs_module.DV),
        device_mismatches=_device_mismatches(
            function, lambda: dict(zip("qkv", make_inputs(9, True, dtype=torch.bfloat16, **on_the_gpu))), "q", "kv"
        ),
        graphs=_causal_linear_graphs(name, function, reference_module, graph_inputs, inputs_module.B, inputs_module.H),
        no_graph={},
        fallbacks=fallbacks,
        no_fallback={},
    )


LINEAR_ATTENTION = _causal_linear_info(
    tk_ops.linear_attention, _linear_attention_inputs, linear_attention_inputs, linear_attention_module,
    lambda: linear_attention_inputs.scaled_inputs(500, normalize=True, f=64, dv=64, dtype=torch.bfloat16),
    _causal_linear_fallbacks(
        tk_ops.linear_attention, _linear_attention_inputs, linear_attention_inputs.naive_linear_attention,
        linear_attention_inputs.B, linear_attention_inputs.H,
        [(torch.float32, 16, 64), (torch.bfloat16, 8, 64), (torch.bfloat16, 48, 64), (torch.bfloat16, 16, 40)],
        checks_forward_warning=True,
    ) + (
        FallbackSample("forward-rows-tma-cannot-describe", ("linear_attention",),
                       _linear_attention_rows_tma_cannot_describe,
                       lambda q, k, v: tk_ops.linear_attention(q, k, v, normalize=True),
                       lambda q, k, v: linear_attention_inputs.naive_linear_attention(q, k, v, True, 1e-12),
                       TOLERANCE[torch.bfloat16]),
    ),
)
BASED_ATTENTION = _causal_linear_info(
    tk_ops.based_attention, _based_attention_inputs, based_attention_inputs, based_attention_module,
    lambda: based_attention_inputs.make_inputs(500, f=16, dv=64, dtype=torch.bfloat16, device="cuda"),
    _causal_linear_fallbacks(
        tk_ops.based_attention, _based_attention_inputs, based_attention_inputs.naive_based_attention,
        based_attention_inputs.B, based_attention_inputs.H,
        [(torch.float32, 16, 64), (torch.bfloat16, 8, 64), (torch.bfloat16, 16, 48)],
        checks_forward_warning=False,
    ),
)


# ------------------------------------------------------------------------------------------- mamba2_ssd

SSD_NAMES = mamba2_ssd_inputs.NAMES
SSD_CASES = mamba2_ssd_inputs.CASES


def _ssd_args(config, dtype, param_dtype, device="cpu"):
    """tk.mamba2_ssd's arguments (x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states)."""
    inputs, softplus = mamba2_ssd_inputs.make_inputs(**config, dtype=dtype, param_dtype=param_dtype, device=device)
    x, dt, A, B, C, D, z, dt_bias, initial = (None if inputs[n] is None else inputs[n].requires_grad_()
                                              for n in SSD_NAMES)
    return (x, dt, A, B, C, config["chunk_size"], D, z, dt_bias, softplus, initial)


def _ssd_backward_args(config, dtype, param_dtype, with_final_grad, device="cpu"):
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                 for a in _ssd_args(config, dtype, param_dtype, device))
    y, final, chunk_states = torch.ops.tk.mamba2_ssd(*args)
    grad_final = torch.randn_like(final) if with_final_grad else None
    return (torch.randn_like(y), grad_final, *args, chunk_states)


def _ssd_samples(id, config, dtype, param_dtype, with_final_grad, device="cpu"):
    return (
        Sample(id, "mamba2_ssd", lambda: _ssd_args(config, dtype, param_dtype, device)),
        Sample(f"mamba2_ssd_bwd-{id}", "mamba2_ssd_bwd",
               lambda: _ssd_backward_args(config, dtype, param_dtype, with_final_grad, device)),
    )


def _ssd_returning_final_states(*tensors):
    y, final = mamba2_ssd_inputs.ssd(dict(zip(SSD_NAMES, tensors)), True, 16)
    return y * 2.0, final


def _ssd_compile_inputs():
    inputs, softplus = mamba2_ssd_inputs.make_inputs(**SSD_CASES["all options"], dtype=torch.float32)
    assert softplus
    return [inputs[name].requires_grad_() for name in SSD_NAMES]


class _SSDMixer(torch.nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.rand(heads))
        self.D = torch.nn.Parameter(torch.randn(heads))
        self.dt_bias = torch.nn.Parameter(torch.randn(heads) * 0.3)

    def forward(self, x, dt, B, C, z):
        return tk_ops.mamba2_ssd(
            x, dt, -torch.exp(self.A_log), B, C, chunk_size=8, D=self.D, z=z, dt_bias=self.dt_bias, dt_softplus=True
        )


def _ssd_export_args():
    inputs, _ = mamba2_ssd_inputs.make_inputs(2, 21, 4, 5, 2, 3, z=True, dt_softplus=True, dtype=torch.float32)
    return tuple(inputs[name] for name in ("x", "dt", "B", "C", "z"))


def _ssd_bad_inputs():
    inputs, _ = mamba2_ssd_inputs.make_inputs(2, 10, 4, 3, 2, 5, dtype=torch.float32, D="H", z=True, dt_bias=True,
                                              initial=True)
    x, dt, A, B, C = (inputs[name] for name in ("x", "dt", "A", "B", "C"))

    def call(**changes):
        args = dict(inputs, **changes)
        chunk_size = args.pop("chunk_size", 4)
        return lambda: tk_ops.mamba2_ssd(
            args["x"], args["dt"], args["A"], args["B"], args["C"], chunk_size=chunk_size, D=args["D"],
            z=args["z"], dt_bias=args["dt_bias"], initial_states=args["initial_states"],
        )

    return _bad(
        ("x-not-a-tensor", call(x=x.tolist()), TypeError, "x"),
        ("x-rank-3", call(x=x[0]), ValueError, "x"),
        ("dt-rank-2", call(dt=dt[0]), ValueError, "dt"),
        ("A-rank-2", call(A=A[None]), ValueError, "A"),
        ("B-rank-3", call(B=B[0]), ValueError, "B"),
        ("C-rank-5", call(C=C[None]), ValueError, "C"),
        ("D-rank-3", call(D=torch.randn(4, 3, 1)), ValueError, "D"),
        ("integer-x", call(x=x.to(torch.int32)), TypeError, "x"),
        ("integer-dt", call(dt=dt.to(torch.int64)), TypeError, "dt"),
        ("bf16-B-with-fp32-x", call(B=B.bfloat16()), TypeError, "B"),
        ("fp64-C-with-fp32-x", call(C=C.double()), TypeError, "C"),
        ("fp16-z-with-fp32-x", call(z=inputs["z"].half()), TypeError, "z"),
        ("dt-batch", call(dt=dt[:1]), ValueError, r"dt\.shape\[0\]"),
        ("dt-seqlen", call(dt=dt[:, :9]), ValueError, r"dt\.shape\[1\]"),
        ("dt-heads", call(dt=dt[..., :3]), ValueError, r"dt\.shape\[2\]"),
        ("A-heads", call(A=A[:3]), ValueError, r"A\.shape\[0\]"),
        ("B-seqlen", call(B=B[:, :9]), ValueError, r"B\.shape\[1\]"),
        ("H-not-a-multiple-of-G", call(B=torch.randn(2, 10, 3, 5), C=torch.randn(2, 10, 3, 5)), ValueError,
         r"H = x\.shape\[2\] \(4\) must be a multiple of the number of groups G = B\.shape\[2\] \(3\)"),
        ("C-state-size", call(C=C[..., :4]), ValueError, "C must have B's shape"),
        ("z-shape", call(z=inputs["z"][..., :2]), ValueError, "z must have x's shape"),
        ("D-shape", call(D=torch.randn(4, 2)), ValueError, r"D must have shape \(4,\) or \(4, 3\)"),
        ("dt_bias-heads", call(dt_bias=torch.randn(3)), ValueError, r"dt_bias\.shape\[0\]"),
        ("initial_states-shape", call(initial_states=torch.randn(2, 4, 5, 3)), ValueError, "initial_states"),
        ("chunk_size-0", call(chunk_size=0), ValueError, "chunk_size"),
        ("chunk_size-float", call(chunk_size=8.0), TypeError, "chunk_size"),
        ("chunk_size-bool", call(chunk_size=True), TypeError, "chunk_size"),
        ("empty-seqlen", call(x=x[:, :0], dt=dt[:, :0], B=B[:, :0], C=C[:, :0]), ValueError, "x"),
        ("empty-head-dim", call(x=x[..., :0], z=None, D=None, initial_states=None), ValueError, "x"),
        ("empty-state", call(B=B[..., :0], C=C[..., :0], initial_states=None), ValueError, "B"),
        ("empty-initial_states", call(initial_states=torch.randn(2, 4, 3, 0)), ValueError, "initial_states"),
    )


def _ssd_on_the_gpu():
    return mamba2_ssd_inputs.make_inputs(2, 10, 4, 64, 2, 64, dtype=torch.bfloat16, D="H", initial=True,
                                         device="cuda")[0]


def _ssd_graph_inputs() -> list[torch.Tensor]:
    """Every option, D per channel, N = 128, L = 500: bf16 x, B, C, z and fp32 parameters on the GPU, by SSD_NAMES."""
    inputs, _ = mamba2_ssd_inputs.make_inputs(2, 500, 4, 64, 2, 128, D="HP", z=True, dt_bias=True, dt_softplus=True,
                                              initial=True, dtype=torch.bfloat16, param_dtype=torch.float32,
                                              device="cuda")
    return [inputs[name] for name in SSD_NAMES]


def _ssd_graph_forward(*tensors):
    return mamba2_ssd_inputs.forward_op(dict(zip(SSD_NAMES, tensors)), True, 128)


def _ssd_graph_forward_inputs_and_gradients() -> list[torch.Tensor]:
    """_ssd_graph_inputs, then the gradients of y and of the final states."""
    tensors = _ssd_graph_inputs()
    return [*tensors, torch.randn_like(tensors[0]), torch.randn(2, 4, 64, 128, device="cuda")]


def _ssd_graph_forward_backward(*tensors):
    inputs, (grad_y, grad_final) = dict(zip(SSD_NAMES, tensors)), tensors[len(SSD_NAMES):]
    y, final, chunk_states = mamba2_ssd_inputs.forward_op(inputs, True, 128)
    return (y, final, *mamba2_ssd_inputs.backward_op(inputs, True, 128, grad_y, grad_final, chunk_states).values())


def _ssd_graph_forward_check(outputs, *tensors):
    mamba2_ssd_inputs.check_kernel_outputs(dict(zip(SSD_NAMES, tensors)), True, 128, torch.bfloat16,
                                           outputs=outputs)


def _ssd_graph_backward_check(outputs, *tensors):
    """The kernels' gradients on the replay's inputs (their own output gradients) against float64."""
    errors = mamba2_ssd_inputs.backward_errors(dict(zip(SSD_NAMES, tensors)), True, 128, True)
    assert max(errors.values()) <= mamba2_ssd_inputs.BACKWARD_TOLERANCE[torch.bfloat16], errors


def _ssd_unsupported_sizes():
    """P = 24, N = 40 (the kernels take P = 64, N in {64, 128}), bf16 parameters, D per channel."""
    return mamba2_ssd_inputs.make_inputs(2, 77, 4, 24, 2, 40, D="HP", dtype=torch.bfloat16, device="cuda")


def _ssd_unsupported_head_dim():
    """P = 32 (the kernels take P = 64), fp32 parameters, no options."""
    return mamba2_ssd_inputs.make_inputs(1, 40, 2, 32, 1, 64, dtype=torch.bfloat16, param_dtype=torch.float32,
                                         device="cuda")


def _ssd_unsupported_backward_inputs():
    """P = 32 with D (H,): the inputs, dt_softplus, an output gradient and the forward's chunk states."""
    inputs, softplus = mamba2_ssd_inputs.make_inputs(1, 40, 2, 32, 1, 64, D="H", dtype=torch.bfloat16,
                                                     param_dtype=torch.float32, device="cuda")
    _, final, chunk_states = mamba2_ssd_inputs.forward_op(inputs, softplus, 64)
    return inputs, softplus, torch.randn_like(inputs["x"]), chunk_states


SSD_FALLBACK_GRADIENTS = ("x", "dt", "A", "B", "C", "D")  # of the inputs _ssd_unsupported_backward_inputs gives


def _ssd_backward_op(inputs, softplus, grad_y, chunk_states):
    grads = mamba2_ssd_inputs.backward_op(inputs, softplus, 64, grad_y, None, chunk_states)
    return tuple(grads[name] for name in SSD_FALLBACK_GRADIENTS)


def _ssd_reference_gradients(inputs, softplus, grad_y, chunk_states):
    grads = mamba2_ssd_inputs.reference_gradients(inputs, softplus, 64, grad_y, None, "cuda")
    return tuple(grads[name] for name in SSD_FALLBACK_GRADIENTS)


MAMBA2_SSD_FALLBACKS = (
    FallbackSample("forward-unsupported-sizes", ("mamba2_ssd",), _ssd_unsupported_sizes,
                   lambda inputs, softplus: mamba2_ssd_inputs.ssd(inputs, softplus, 32),
                   mamba2_ssd_inputs.recurrence,
                   (TOLERANCE[torch.bfloat16], mamba2_ssd_inputs.KERNEL_TOLERANCE[torch.bfloat16]),  # y, final
                   checks_warning=False),
    FallbackSample("forward-P32", ("mamba2_ssd",), _ssd_unsupported_head_dim,
                   lambda inputs, softplus: mamba2_ssd_inputs.ssd(inputs, softplus, 64)[0],
                   lambda inputs, softplus: mamba2_ssd_inputs.recurrence(inputs, softplus)[0],
                   TOLERANCE[torch.bfloat16]),
    FallbackSample("backward-P32", ("mamba2_ssd_bwd",), _ssd_unsupported_backward_inputs, _ssd_backward_op,
                   _ssd_reference_gradients, mamba2_ssd_inputs.BACKWARD_TOLERANCE[torch.bfloat16]),
)


MAMBA2_SSD = OpInfo(
    name="mamba2_ssd",
    functions={"mamba2_ssd": ("mamba2_ssd", "mamba2_ssd_bwd")},
    samples=(
        *_ssd_samples("fp64-all-options", dict(SSD_CASES["all options"], L=11, chunk_size=4), torch.float64,
                      torch.float64, with_final_grad=True),
        *_ssd_samples("bf16-fp32-parameters-no-options", dict(SSD_CASES["plain"], L=9, chunk_size=4),
                      torch.bfloat16, torch.float32, with_final_grad=False),
    ),
    kernel_dtypes=KERNEL_16_BIT,
    kernel_samples=lambda dtype: _ssd_samples(
        "all-options", dict(Bt=2, L=150, H=4, P=64, G=2, N=64, chunk_size=64, D="H", z=True, dt_bias=True,
                            dt_softplus=True, initial=True),
        dtype, torch.float32, with_final_grad=True, device="cuda",
    ),
    compile=(CompileSample("all-options", _ssd_returning_final_states, _ssd_compile_inputs,
                           ("mamba2_ssd", "mamba2_ssd_bwd"), loss=_random_projection, tol=1e-6),),
    export=(ExportSample("mixer", _SSDMixer, _ssd_export_args, ("mamba2_ssd",), tol=1e-6),),
    bad_inputs=_ssd_bad_inputs(),
    device_mismatches=_device_mismatches(lambda **inputs: mamba2_ssd_inputs.ssd(inputs, False, 64),
                                         _ssd_on_the_gpu, "x", ("dt", "A", "B", "D", "initial_states")),
    graphs=(
        GraphSample("forward", ("mamba2_ssd",), _ssd_graph_inputs, _ssd_graph_forward, changed=1,
                    check=_ssd_graph_forward_check),
        GraphSample("forward-backward", ("mamba2_ssd", "mamba2_ssd_bwd"), _ssd_graph_forward_inputs_and_gradients,
                    _ssd_graph_forward_backward, changed=0, check=_ssd_graph_backward_check),
    ),
    no_graph={},
    fallbacks=MAMBA2_SSD_FALLBACKS,
    no_fallback={},
)


# ---------------------------------------------------------------------------------------- causal_conv1d


def _conv1d_inputs(dtype, param_dtype=None, with_bias=True, channel_last=False, shape=(2, 3, 23, 4), device="cpu"):
    x, weight, bias = causal_conv1d_inputs.make_inputs(*shape, dtype=dtype, param_dtype=param_dtype,
                                                       with_bias=with_bias, device=device)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x, weight, bias


def _conv1d_samples(id, dtype, param_dtype=None, with_bias=True, silu=True, channel_last=False, **kwargs):
    def forward():
        x, weight, bias = _conv1d_inputs(dtype, param_dtype, with_bias, channel_last, **kwargs)
        return (*(None if t is None else t.requires_grad_() for t in (x, weight, bias)), silu)

    def backward():
        x, weight, bias = _conv1d_inputs(dtype, param_dtype, with_bias, channel_last, **kwargs)
        return (torch.randn_like(x), x, weight, bias, silu)

    return (Sample(id, "causal_conv1d", forward), Sample(f"causal_conv1d_bwd-{id}", "causal_conv1d_bwd", backward))


def _conv1d_kernel_samples(dtype):
    options = dict(shape=(2, 256, 1000, 4), device="cuda")
    return (
        *_conv1d_samples("bias-silu", dtype, **options),
        _conv1d_samples("channel-last", dtype, channel_last=True, **options)[1],
    )


class _ShortConv(torch.nn.Module):
    def __init__(self, dim=6, width=4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, width) / width**0.5)
        self.bias = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):  # x (B, L, D), as a mixer has it
        return tk_ops.causal_conv1d(x.transpose(1, 2), self.weight, self.bias, activation="silu").transpose(1, 2)


def _conv1d_bad_inputs():
    x, weight, bias = causal_conv1d_inputs.make_inputs(2, 3, 16, 4, dtype=torch.float32)
    conv = tk_ops.causal_conv1d
    return _bad(
        ("x-not-a-tensor", lambda: conv(x.tolist(), weight), TypeError, "x"),
        ("x-rank-2", lambda: conv(x[0], weight), ValueError, "x must have 3"),
        ("x-rank-4", lambda: conv(x[None], weight), ValueError, "x must have 3"),
        ("integer-x", lambda: conv(x.to(torch.int32), weight), TypeError, "x"),
        ("weight-not-a-tensor", lambda: conv(x, weight.tolist()), TypeError, "weight"),
        ("weight-rank-1", lambda: conv(x, weight[0]), ValueError, "weight must have 2"),
        ("conv1d-weight-D-1-W", lambda: conv(x, weight[:, None]), ValueError, r"squeeze\(1\)"),
        ("W-0", lambda: conv(x, weight[:, :0]), ValueError, r"kernel width W\) must be >= 1"),
        ("weight-channels-not-D", lambda: conv(x, torch.randn(4, 4)), ValueError, r"weight\.shape\[0\].*D"),
        ("bias-rank-2", lambda: conv(x, weight, bias[None]), ValueError, "bias must have 1"),
        ("bias-length-not-D", lambda: conv(x, weight, torch.randn(4)), ValueError, r"bias\.shape\[0\]"),
        ("fp64-weight-with-fp32-x", lambda: conv(x, weight.double()), TypeError, "weight"),
        ("bf16-weight-with-fp32-x", lambda: conv(x, weight.bfloat16()), TypeError, "weight"),
        ("fp16-weight-with-bf16-x", lambda: conv(x.bfloat16(), weight.half()), TypeError, "weight"),
        ("fp16-bias-with-bf16-x", lambda: conv(x.bfloat16(), weight, bias.half()), TypeError, "bias"),
        ("integer-weight", lambda: conv(x, weight.to(torch.int32)), TypeError, "weight"),
        ("activation-relu", lambda: conv(x, weight, activation="relu"), ValueError, "activation"),
        ("activation-True", lambda: conv(x, weight, activation=True), ValueError, "activation"),
        ("activation-SiLU", lambda: conv(x, weight, activation="SiLU"), ValueError, "activation"),
        ("empty-batch", lambda: conv(x[:0], weight), ValueError, "x must not be empty"),
        ("empty-L", lambda: conv(x[..., :0], weight), ValueError, "x must not be empty"),
    )


def _conv1d_graph(layout: str) -> GraphSample:
    """Forward and backward in one graph: bf16 x (2, 96, 777) and its gradient in ``layout``, fp32 weight (W = 4)
    and bias, NaN past their ends (test_causal_conv1d's kernel_case)."""

    def make_inputs():
        gpu, _ = causal_conv1d_inputs.kernel_case(2, 96, 777, 4, torch.bfloat16, torch.float32, layout)
        return gpu

    def step(x, weight, bias, grad):
        return (torch.ops.tk.causal_conv1d(x, weight, bias, True),
                *torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, True))

    return GraphSample(f"forward-backward-{layout}", ("causal_conv1d", "causal_conv1d_bwd"), make_inputs, step)


def _conv1d_fallback(id: str, dtype: torch.dtype, make) -> FallbackSample:
    """x, weight, bias = ``make()`` on the GPU, outside the kernels' scope: the ops called directly (below the
    public function's copy of an x with no unit stride) reach their references, forward and backward."""

    def make_inputs():
        x, weight, bias = make()
        return x, weight, bias, torch.randn_like(x)

    def forward_backward(x, weight, bias, grad):
        return (torch.ops.tk.causal_conv1d(x, weight, bias, True),
                *torch.ops.tk.causal_conv1d_bwd(grad, x, weight, bias, True))

    def expected(x, weight, bias, grad):
        return causal_conv1d_inputs.reference_out_and_grads(x.cpu().double(), weight.cpu().double(),
                                                            bias.cpu().double(), True, grad.cpu().double())

    tol = TOLERANCE[dtype]
    return FallbackSample(id, ("causal_conv1d", "causal_conv1d_bwd"), make_inputs, forward_backward, expected,
                          (tol, 2 * tol, 2 * tol, 2 * tol))  # out, then the gradients of x, weight, bias


def _conv1d_with_no_unit_stride():
    x, weight, bias = causal_conv1d_inputs.make_inputs(2, 24, 2 * 77, 4, dtype=torch.bfloat16, device="cuda")
    return x[..., ::2], weight, bias  # stride 2 along L, D's stride is not 1 either


CAUSAL_CONV1D_FALLBACKS = (
    _conv1d_fallback("fp64", torch.float64, lambda: causal_conv1d_inputs.make_inputs(2, 24, 77, 4, device="cuda")),
    _conv1d_fallback("W-1", torch.bfloat16, lambda: causal_conv1d_inputs.make_inputs(2, 24, 77, 1,
                                                                                     dtype=torch.bfloat16,
                                                                                     device="cuda")),
    _conv1d_fallback("W-5", torch.bfloat16, lambda: causal_conv1d_inputs.make_inputs(2, 24, 77, 5,
                                                                                     dtype=torch.bfloat16,
                                                                                     device="cuda")),
    _conv1d_fallback("no-unit-stride", torch.bfloat16, _conv1d_with_no_unit_stride),
)


CAUSAL_CONV1D = OpInfo(
    name="causal_conv1d",
    functions={"causal_conv1d": ("causal_conv1d", "causal_conv1d_bwd")},
    samples=(
        *_conv1d_samples("fp64-bias-silu", torch.float64),
        *_conv1d_samples("fp32-no-bias", torch.float32, with_bias=False, silu=False),
        *_conv1d_samples("bf16-fp32-params-silu", torch.bfloat16, torch.float32),
        *_conv1d_samples("fp64-channel-last", torch.float64, channel_last=True),
    ),
    kernel_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    kernel_samples=_conv1d_kernel_samples,
    compile=tuple(
        CompileSample(
            "channel-last" if channel_last else "channel-first",
            lambda x, weight, bias: tk_ops.causal_conv1d(x, weight, bias, activation="silu") * 2.0,
            lambda channel_last=channel_last: [
                t.requires_grad_() for t in _conv1d_inputs(torch.float32, channel_last=channel_last,
                                                           shape=(2, 6, 45, 4))
            ],
            ("causal_conv1d", "causal_conv1d_bwd"), loss=_random_projection, tol=1e-6,
        )
        for channel_last in (False, True)
    ),
    export=(ExportSample("mixer-layout", _ShortConv, lambda: (torch.randn(2, 50, 6),), ("causal_conv1d",),
                         tol=1e-6),),
    bad_inputs=_conv1d_bad_inputs(),
    device_mismatches=_device_mismatches(
        tk_ops.causal_conv1d,
        lambda: dict(zip(("x", "weight", "bias"),
                         causal_conv1d_inputs.make_inputs(2, 3, 16, 4, dtype=torch.bfloat16, device="cuda"))),
        "x", ("weight", "bias"),
    ),
    graphs=tuple(_conv1d_graph(layout) for layout in ("bdl", "bld")),
    no_graph={},
    fallbacks=CAUSAL_CONV1D_FALLBACKS,
    no_fallback={},
)


# ---------------------------------------------------------------------------------------------- fftconv


def _fftconv_samples(dtype, param_dtype=None, with_D=True, shape=(2, 3, 23, 9), device="cpu", forward=True,
                     backward=True):
    def inputs():
        return fftconv_inputs.make_inputs(*shape, dtype=dtype, param_dtype=param_dtype, with_D=with_D, device=device)

    def forward_args():
        return tuple(None if t is None else t.requires_grad_() for t in inputs())

    def backward_args():
        u, k, D = inputs()
        return (torch.randn_like(u), u, k, D)

    id = f"{str(dtype)[6:]}-{str(param_dtype or dtype)[6:]}-{'D' if with_D else 'no-D'}"
    return (Sample(id, "fftconv", forward_args),) * forward + (
        Sample(f"fftconv_bwd-{id}", "fftconv_bwd", backward_args),) * backward


class _LongConv(torch.nn.Module):
    def __init__(self, heads=3, filter_len=21):
        super().__init__()
        self.k = torch.nn.Parameter(torch.randn(heads, filter_len) / filter_len**0.5)
        self.D = torch.nn.Parameter(torch.randn(heads))

    def forward(self, u):
        return tk_ops.fftconv(u, self.k, D=self.D)


def _fftconv_bad_inputs():
    u, k, D = fftconv_inputs.make_inputs(2, 3, 16, 5, dtype=torch.float32)
    fftconv = tk_ops.fftconv
    return _bad(
        ("u-not-a-tensor", lambda: fftconv(u.tolist(), k), TypeError, "u"),
        ("u-rank-2", lambda: fftconv(u[0], k), ValueError, "u"),
        ("k-rank-1", lambda: fftconv(u, k[0]), ValueError, "k"),
        ("k-rank-3", lambda: fftconv(u, k[None]), ValueError, "k"),
        ("D-rank-2", lambda: fftconv(u, k, D=D[None]), ValueError, "D"),
        ("integer-u", lambda: fftconv(u.to(torch.int32), k), TypeError, "u"),
        ("fp16-k-with-bf16-u", lambda: fftconv(u.bfloat16(), k.half()), TypeError, "k"),
        ("fp32-k-with-fp64-u", lambda: fftconv(u.double(), k), TypeError, "k"),
        ("bf16-k-with-fp32-u", lambda: fftconv(u, k.bfloat16()), TypeError, "k"),
        ("fp16-D-with-bf16-u", lambda: fftconv(u.bfloat16(), k, D=D.half()), TypeError, "D"),
        ("k-heads-not-H", lambda: fftconv(u, torch.randn(4, 5)), ValueError, r"k\.shape\[0\].*H"),
        ("L-above-N", lambda: fftconv(u, torch.randn(3, 17)), ValueError, r"k\.shape\[1\].*N = 16"),
        ("D-length-not-H", lambda: fftconv(u, k, D=torch.randn(4)), ValueError, r"D\.shape\[0\]"),
        ("empty-u", lambda: fftconv(u[:0], k), ValueError, "u"),
        ("empty-k", lambda: fftconv(u, k[:, :0]), ValueError, "k"),
        ("empty-N", lambda: fftconv(u[..., :0], k[:, :0]), ValueError, "u"),
    )


def _fftconv_kernel_call(grad):
    """tk.fftconv_bwd straight to the kernel, with ``grad(u)`` as the output gradient of bf16 u (2, 3, 256)."""

    def call():
        u, k, D = fftconv_inputs.make_inputs(2, 3, 256, 17, dtype=torch.bfloat16, param_dtype=torch.float32,
                                             device="cuda")
        return torch.ops.tk.fftconv_bwd.default(grad(u), u, k, D)

    return call


def _fftconv_graph_inputs():
    """bf16 u (3, 4, 4096), fp32 filters of length 1500 and D, on the GPU."""
    return fftconv_inputs.make_inputs(3, 4, 4096, 1500, dtype=torch.bfloat16, param_dtype=torch.float32,
                                      device="cuda")


def _fftconv_graph_backward_inputs():
    """The output gradient, then _fftconv_graph_inputs."""
    u, k, D = _fftconv_graph_inputs()
    return torch.randn_like(u), u, k, D


def _fftconv_fallback_inputs(dtype, N):
    """u (2, 3, N) of ``dtype``, filters of length 17 and D, on the GPU."""
    return fftconv_inputs.make_inputs(2, 3, N, 17, dtype=dtype, device="cuda")


def _fftconv_fallback_backward_inputs(dtype, N):
    """The output gradient, then _fftconv_fallback_inputs."""
    u, k, D = _fftconv_fallback_inputs(dtype, N)
    return torch.randn_like(u), u, k, D


def _fftconv_fallback_tolerance(dtype):
    return fftconv_inputs.KERNEL_TOLERANCE.get(dtype, TOLERANCE[torch.float64])


# N past the kernels' 16384 (fp32: 8192), not one they pad to, and fp64.
FFTCONV_FALLBACKS = tuple(
    FallbackSample(f"forward-{_dtype_name(dtype)}-N{N}", ("fftconv",),
                   lambda dtype=dtype, N=N: _fftconv_fallback_inputs(dtype, N),
                   lambda u, k, D: tk_ops.fftconv(u, k, D=D), fftconv_inputs.float64_reference,
                   _fftconv_fallback_tolerance(dtype))
    for dtype, N in ((torch.float32, 16384), (torch.float32, 9000), (torch.float64, 1024), (torch.bfloat16, 16385))
) + tuple(
    FallbackSample(f"backward-{_dtype_name(dtype)}-N{N}", ("fftconv_bwd",),
                   lambda dtype=dtype, N=N: _fftconv_fallback_backward_inputs(dtype, N),
                   torch.ops.tk.fftconv_bwd.default, fftconv_inputs.float64_backward,
                   _fftconv_fallback_tolerance(dtype))
    for dtype, N in ((torch.float32, 16384), (torch.float64, 1024), (torch.bfloat16, 16385))
)


FFTCONV = OpInfo(
    name="fftconv",
    functions={"fftconv": ("fftconv", "fftconv_bwd")},
    samples=(
        *_fftconv_samples(torch.float64, backward=False),
        *_fftconv_samples(torch.float32, with_D=False, backward=False),
        *_fftconv_samples(torch.bfloat16, torch.float32, backward=False),
        *_fftconv_samples(torch.float64, with_D=False, forward=False),
        *_fftconv_samples(torch.float64, forward=False),
    ),
    kernel_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    kernel_samples=lambda dtype: _fftconv_samples(dtype, torch.float32, shape=(2, 3, 1024, 333), device="cuda"),
    compile=(CompileSample("D", lambda u, k, D: tk_ops.fftconv(u, k, D=D) * 2.0,
                           lambda: [t.requires_grad_() for t in fftconv_inputs.make_inputs(2, 3, 45, 17,
                                                                                           dtype=torch.float32)],
                           ("fftconv", "fftconv_bwd"), loss=_random_projection, tol=1e-6),),
    export=(ExportSample("long-conv", _LongConv, lambda: (torch.randn(2, 3, 50),), ("fftconv",), tol=1e-6),),
    bad_inputs=_fftconv_bad_inputs() + _op_calls(
        ("kernel-grad-shape", _fftconv_kernel_call(lambda u: torch.randn(2, 3, 255, device="cuda").bfloat16()),
         ValueError, "grad must have u's shape", "fftconv_bwd"),
        ("kernel-grad-dtype", _fftconv_kernel_call(lambda u: torch.randn_like(u).half()), TypeError,
         "grad must have u's dtype", "fftconv_bwd"),
    ),
    device_mismatches=_device_mismatches(
        tk_ops.fftconv,
        lambda: dict(zip("ukD", fftconv_inputs.make_inputs(2, 3, 16, 5, dtype=torch.bfloat16, device="cuda"))),
        "u", "kD",
    ),
    graphs=(
        GraphSample("forward", ("fftconv",), _fftconv_graph_inputs, lambda u, k, D: tk_ops.fftconv(u, k, D=D),
                    check=lambda outputs, u, k, D: tk_testing.assert_rel_close(
                        outputs[0], fftconv_inputs.float64_reference(u, k, D),
                        fftconv_inputs.KERNEL_TOLERANCE[torch.bfloat16])),
        GraphSample("backward", ("fftconv_bwd",), _fftconv_graph_backward_inputs, torch.ops.tk.fftconv_bwd.default,
                    check=lambda outputs, grad, u, k, D: fftconv_inputs.check_backward(outputs, grad, u, k, D,
                                                                                       torch.bfloat16)),
    ),
    no_graph={},
    fallbacks=FFTCONV_FALLBACKS,
    no_fallback={},
)


# ------------------------------------------------------------------------------------------ gated_delta_rule

GDN_NAMES = gdn_inputs.NAMES
GDN_LENGTHS = (3, 0, 1, 66)  # packed: an empty sequence, one of length 1, one of two chunks (CHUNK_SIZE 64)


def _gdn_cu_seqlens(lengths=GDN_LENGTHS) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _gdn_inputs(dtype=torch.float64, gate_dtype=None, initial=True, packed=False, device="cpu"):
    """Inputs by name (tests/inputs/gated_delta_rule.py) and cu_seqlens: T = 70 (two chunks), Hk = 1, Hv = 2,
    K = 5, V = 3; batch 2, or GDN_LENGTHS packed."""
    states = len(GDN_LENGTHS) if packed else None
    inputs = gdn_inputs.make_inputs(1 if packed else 2, 70, 1, 2, 5, 3, initial=initial, states=states, dtype=dtype,
                                    gate_dtype=gate_dtype, device=device)
    return inputs, (_gdn_cu_seqlens().to(device) if packed else None)


def _gdn_args(dtype=torch.float64, gate_dtype=None, initial=True, packed=False, l2norm=True, requires_grad=True):
    """tk.gated_delta_rule's arguments (q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)."""
    inputs, cu_seqlens = _gdn_inputs(dtype, gate_dtype, initial, packed)
    q, k, v, g, beta, initial_state = (None if inputs[name] is None else inputs[name].requires_grad_(requires_grad)
                                       for name in GDN_NAMES)
    return (q, k, v, g, beta, 0.4, initial_state, cu_seqlens, l2norm)


def _gdn_backward_args(with_final_grad, **options):
    args = _gdn_args(requires_grad=False, **options)
    o, final_state = torch.ops.tk.gated_delta_rule(*args)
    return (torch.randn_like(o), torch.randn_like(final_state) if with_final_grad else None, *args)


def _gdn_samples(id, with_final_grad, **options):
    return (
        Sample(id, "gated_delta_rule", lambda: _gdn_args(**options)),
        Sample(f"gated_delta_rule_bwd-{id}", "gated_delta_rule_bwd",
               lambda: _gdn_backward_args(with_final_grad, **options)),
    )


def _gdn_compile_inputs(packed: bool):
    inputs, _ = _gdn_inputs(torch.float32, packed=packed)
    return [inputs[name].requires_grad_() for name in GDN_NAMES]


def _gdn_with_final_state(packed: bool):
    cu_seqlens = _gdn_cu_seqlens() if packed else None

    def run(q, k, v, g, beta, initial_state):
        o, final_state = tk_ops.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                 output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
        return o * 2.0, final_state

    return run


class _GatedDeltaMixer(torch.nn.Module):
    """Qwen3-Next's gates around the op: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""

    def __init__(self, heads=2):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.rand(heads))
        self.dt_bias = torch.nn.Parameter(torch.randn(heads))

    def forward(self, q, k, v, a, b):
        g = -torch.exp(self.A_log) * torch.nn.functional.softplus(a + self.dt_bias)
        return tk_ops.gated_delta_rule(q, k, v, g, torch.sigmoid(b), use_qk_l2norm=True)[0]


def _gdn_export_args():
    inputs, _ = _gdn_inputs(torch.float32, initial=False)
    return (inputs["q"], inputs["k"], inputs["v"], torch.randn(2, 70, 2), torch.randn(2, 70, 2))


def _gdn_call(packed=False, **changes):
    """tk_ops.gated_delta_rule on fp32 inputs (T = 13, Hk = 2, Hv = 4, K = 5, V = 3; batch 2, or packed as
    lengths 4, 0, 9) with some arguments replaced: a callable change gets the original value."""
    inputs = gdn_inputs.make_inputs(1 if packed else 2, 13, 2, 4, 5, 3, initial=True, states=3 if packed else None,
                                    dtype=torch.float32)
    arguments = dict(inputs, scale=None, cu_seqlens=_gdn_cu_seqlens((4, 0, 9)) if packed else None)
    arguments.update({name: change(arguments[name]) if callable(change) else change
                      for name, change in changes.items()})
    positional = [arguments.pop(name) for name in GDN_NAMES[:5]]
    return lambda: tk_ops.gated_delta_rule(*positional, **arguments)


def _gdn_bad_inputs():
    call = _gdn_call
    return _bad(
        ("q-not-a-tensor", call(q=lambda q: q.tolist()), TypeError, "q must be a torch.Tensor"),
        ("g-not-a-tensor", call(g=0.5), TypeError, "g must be a torch.Tensor"),
        ("q-rank-3", call(q=lambda q: q[0]), ValueError, "q must have 4 dimensions"),
        ("v-rank-5", call(v=lambda v: v[None]), ValueError, "v must have 4 dimensions"),
        ("integer-v", call(v=lambda v: v.to(torch.int32)), TypeError, "v must have dtype"),
        ("k-dtype", call(k=lambda k: k.double()), TypeError, "k must have q's dtype"),
        ("v-dtype", call(v=lambda v: v.bfloat16()), TypeError, "v must have q's dtype"),
        ("k-head-dim", call(k=lambda k: k[..., :4]), ValueError, "k must have q's shape"),
        ("v-batch", call(v=lambda v: v[:1]), ValueError, r"v\.shape\[0\] must equal q\.shape\[0\] \(B\)"),
        ("v-length", call(v=lambda v: v[:, :12]), ValueError, r"v\.shape\[1\] must equal q\.shape\[1\] \(T\)"),
        ("Hv-not-a-multiple-of-Hk", call(v=lambda v: v[:, :, :3], g=lambda g: g[..., :3], beta=lambda b: b[..., :3]),
         ValueError, r"Hv = v\.shape\[2\] \(3\) must be a multiple of the key heads Hk = q\.shape\[2\] \(2\)"),
        ("g-rank-4", call(g=lambda g: g[..., None]), ValueError, "g must have 3 dimensions"),
        ("g-length", call(g=lambda g: g[:, :12]), ValueError, r"g must have shape \(2, 13, 4\) \(B, T, Hv\)"),
        ("beta-heads", call(beta=lambda b: b[..., :2]), ValueError, r"beta must have shape \(2, 13, 4\)"),
        ("fp64-g-with-fp32-v", call(g=lambda g: g.double()), TypeError, "g must have dtype float32 .v is"),
        ("fp16-beta-with-bf16-inputs",
         call(q=lambda q: q.bfloat16(), k=lambda k: k.bfloat16(), v=lambda v: v.bfloat16(), g=lambda g: g.bfloat16(),
              beta=lambda b: b.half()),
         TypeError, "beta must have dtype bfloat16 or float32"),
        ("integer-beta", call(beta=lambda b: b.to(torch.int64)), TypeError, "beta must have dtype"),
        ("scale-nan", call(scale=float("nan")), ValueError, "scale must be None or a finite number"),
        ("scale-string", call(scale="0.5"), ValueError, "scale must be None or a finite number"),
        ("scale-bool", call(scale=True), ValueError, "scale must be None or a finite number"),
        ("initial_state-shape", call(initial_state=lambda s: s.mT), ValueError,
         r"initial_state must have shape \(2, 4, 5, 3\) \(B, Hv, K, V\)"),
        ("initial_state-rank-3", call(initial_state=lambda s: s[0]), ValueError, "initial_state must have 4"),
        ("bf16-initial_state", call(initial_state=lambda s: s.bfloat16()), TypeError,
         "initial_state must have dtype float32"),
        ("fp32-initial_state-with-fp64-inputs",
         call(q=lambda q: q.double(), k=lambda k: k.double(), v=lambda v: v.double(), g=lambda g: g.double(),
              beta=lambda b: b.double()),
         TypeError, "initial_state must have dtype float64"),
        ("empty-T", call(q=lambda q: q[:, :0]), ValueError, "q must not be empty"),
        ("empty-V", call(v=lambda v: v[..., :0]), ValueError, "v must not be empty"),
        ("cu_seqlens-not-a-tensor", call(True, cu_seqlens=[0, 4, 4, 13]), TypeError,
         "cu_seqlens must be a torch.Tensor"),
        ("cu_seqlens-int64", call(True, cu_seqlens=lambda cu: cu.long()), TypeError, "cu_seqlens must have dtype"),
        ("cu_seqlens-rank-2", call(True, cu_seqlens=lambda cu: cu[None]), ValueError,
         "cu_seqlens must have 1 dimensions"),
        ("cu_seqlens-one-entry", call(True, cu_seqlens=torch.zeros(1, dtype=torch.int32)), ValueError,
         r"cu_seqlens must be \(N \+ 1,\) with N >= 1"),
        ("cu_seqlens-with-batch-2", call(cu_seqlens=_gdn_cu_seqlens((13,)), initial_state=None), ValueError,
         r"q\.shape\[0\] \(B\) must be 1"),
        ("cu_seqlens-not-from-zero", call(True, cu_seqlens=torch.tensor([1, 4, 4, 13], dtype=torch.int32)),
         ValueError, "cu_seqlens must start at 0"),
        ("cu_seqlens-decreasing", call(True, cu_seqlens=torch.tensor([0, 4, 3, 13], dtype=torch.int32)),
         ValueError, "cu_seqlens must be non-decreasing"),
        ("cu_seqlens-end", call(True, cu_seqlens=torch.tensor([0, 4, 4, 12], dtype=torch.int32)), ValueError,
         r"cu_seqlens must end at T = q\.shape\[1\] \(13\)"),
        ("initial_state-per-batch-row-with-cu_seqlens", call(True, initial_state=lambda s: s[:1]), ValueError,
         r"initial_state must have shape \(3, 4, 5, 3\) \(N = len\(cu_seqlens\) - 1, Hv, K, V\)"),
    ) + _op_calls(
        ("op-checks-cu_seqlens-contents",
         lambda: torch.ops.tk.gated_delta_rule(*_gdn_args(torch.float32, packed=True, requires_grad=False)[:7],
                                               torch.tensor([0, 5, 3, 70], dtype=torch.int32), True),
         ValueError, "cu_seqlens must be non-decreasing"),
    )


# The kernels' case (csrc/torch/gated_delta_rule.cpp): 16-bit q, k, v with K = V = 128, fp32 gates and state.
GDN_KERNEL_DIM = 128
GDN_SCALE = 0.1


def _gdn_kernel_inputs(dtype, packed=False, requires_grad=True):
    """The kernels' inputs on the GPU (T = 70: two chunks; Hk = 1, Hv = 2; batch 2, or GDN_LENGTHS packed)."""
    states = len(GDN_LENGTHS) if packed else None
    inputs = gdn_inputs.make_inputs(1 if packed else 2, 70, 1, 2, GDN_KERNEL_DIM, GDN_KERNEL_DIM, initial=True,
                                    states=states, dtype=dtype, gate_dtype=torch.float32, device="cuda")
    return [inputs[name].requires_grad_(requires_grad) for name in GDN_NAMES]


def _gdn_kernel_args(dtype, packed=False, requires_grad=True):
    cu_seqlens = _gdn_cu_seqlens().cuda() if packed else None
    return (*_gdn_kernel_inputs(dtype, packed, requires_grad), cu_seqlens, True)


def _gdn_positional(q, k, v, g, beta, initial_state, cu_seqlens=None, l2norm=True):
    return (q, k, v, g, beta, GDN_SCALE, initial_state, cu_seqlens, l2norm)


def _gdn_kernel_samples(dtype):
    def backward_args(packed):
        args = _gdn_positional(*_gdn_kernel_args(dtype, packed, requires_grad=False))
        o, final_state = torch.ops.tk.gated_delta_rule(*args)
        return (torch.randn_like(o), torch.randn_like(final_state), *args)

    return tuple(
        sample
        for packed in (False, True)
        for sample in (
            Sample(f"kernels{'-packed' if packed else ''}", "gated_delta_rule",
                   lambda packed=packed: _gdn_positional(*_gdn_kernel_args(dtype, packed))),
            Sample(f"gated_delta_rule_bwd-kernels{'-packed' if packed else ''}", "gated_delta_rule_bwd",
                   lambda packed=packed: backward_args(packed)),
        )
    )


def _gdn_kernel_step(q, k, v, g, beta, initial_state):
    return torch.ops.tk.gated_delta_rule(*_gdn_positional(q, k, v, g, beta, initial_state))


def _gdn_fallback(id, dtype, make_inputs) -> FallbackSample:
    """CUDA inputs of the kernels' shape they leave to the reference, against itself in float64 on the CPU."""
    def expected(*inputs):
        return torch.ops.tk.gated_delta_rule(*_gdn_positional(*(t.detach().cpu().double() for t in inputs)))

    return FallbackSample(id, ("gated_delta_rule",), make_inputs, _gdn_kernel_step, expected, TOLERANCE[dtype])


def _gdn_misaligned_initial_state():
    """bf16 kernel inputs with the initial state in a view 4 bytes past an 8-byte boundary (contiguous, so not
    copied; the scan loads S in fp32 pairs)."""
    *inputs, state = _gdn_kernel_inputs(torch.bfloat16, requires_grad=False)
    return [*inputs, torch.empty(state.numel() + 1, device="cuda")[1:].view_as(state).copy_(state)]


GDN_FALLBACKS = (
    _gdn_fallback("fp32", torch.float32, lambda: _gdn_kernel_inputs(torch.float32, requires_grad=False)),
    _gdn_fallback("bf16-misaligned-initial-state", torch.bfloat16, _gdn_misaligned_initial_state),
)


def _gdn_on_the_gpu():
    inputs, cu_seqlens = _gdn_inputs(torch.bfloat16, torch.float32, packed=True, device="cuda")
    return dict(inputs, cu_seqlens=cu_seqlens)


def _gdn_by_name(q, k, v, g, beta, initial_state, cu_seqlens):
    return tk_ops.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)


GATED_DELTA_RULE = OpInfo(
    name="gated_delta_rule",
    functions={"gated_delta_rule": ("gated_delta_rule", "gated_delta_rule_bwd")},
    samples=(
        *_gdn_samples("fp64-all-options", with_final_grad=True),
        *_gdn_samples("fp32-no-options", with_final_grad=False, dtype=torch.float32, initial=False, l2norm=False),
        *_gdn_samples("bf16-fp32-gates", with_final_grad=True, dtype=torch.bfloat16, gate_dtype=torch.float32),
        *_gdn_samples("fp64-packed", with_final_grad=True, packed=True),
    ),
    kernel_dtypes=KERNEL_16_BIT,
    kernel_samples=_gdn_kernel_samples,
    compile=tuple(
        CompileSample("packed" if packed else "batch", _gdn_with_final_state(packed),
                      lambda packed=packed: _gdn_compile_inputs(packed), ("gated_delta_rule", "gated_delta_rule_bwd"),
                      loss=_random_projection, tol=1e-6)
        for packed in (False, True)
    ),
    export=(ExportSample("qwen3-next-gates", _GatedDeltaMixer, _gdn_export_args, ("gated_delta_rule",), tol=1e-6),),
    bad_inputs=_gdn_bad_inputs(),
    device_mismatches=_device_mismatches(_gdn_by_name, _gdn_on_the_gpu, "q",
                                         ("k", "v", "g", "beta", "initial_state", "cu_seqlens")),
    # new inputs into the captured ones (the batch form: packed calls read cu_seqlens on the host)
    graphs=(GraphSample("kernels", ("gated_delta_rule",),
                        lambda: _gdn_kernel_inputs(torch.bfloat16, requires_grad=False), _gdn_kernel_step),),
    no_graph=_without_sample("no backward kernel yet: its reference serves every device", "gated_delta_rule_bwd"),
    fallbacks=GDN_FALLBACKS,
    no_fallback=_without_sample("no backward kernel yet: its reference serves every device", "gated_delta_rule_bwd"),
)


# ------------------------------------------------------------------------------------ linear_cross_entropy

LCE_IGNORE_INDEX = linear_cross_entropy_inputs.IGNORE_INDEX


def _small_tiles():
    """Tiles of 4 rows by 8 classes in the op's reference, so that the samples' 13 rows and 23 classes cross
    several tile boundaries, neither a multiple of its tile."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(linear_cross_entropy_module, "ROWS_PER_TILE", 4))
    stack.enter_context(mock.patch.object(linear_cross_entropy_module, "VOCAB_PER_TILE", 8))
    return stack


# (N, H, V) of the samples: H = 9 on the CPU; H = 16 on the GPU, a multiple of 8 as the kernels take it.
LCE_SIZES = {"cpu": (13, 9, 23), "cuda": (13, 16, 23)}


def _lce_args(dtype, with_bias, options, requires_grad=True, device="cpu"):
    """tk.linear_cross_entropy's arguments on x (13, H), weight (23, H), 3 rows ignored; ``options``
    (label_smoothing, softcap, reduction)."""
    x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(
        *LCE_SIZES[device], dtype=dtype, with_bias=with_bias, requires_grad=requires_grad, device=device)
    return (x, weight, target, bias, LCE_IGNORE_INDEX, *options)


def _lce_samples(id, dtype, with_bias, options, masks=((True, True, True),), device="cpu"):
    """The forward opcheck and one backward opcheck per output mask."""

    def backward(mask):
        x, weight, target, bias, *rest = _lce_args(dtype, with_bias, options, requires_grad=False, device=device)
        loss, lse = torch.ops.tk.linear_cross_entropy(x, weight, target, bias, *rest)
        return (torch.randn_like(loss), x, weight, target, bias, lse, *rest, list(mask))

    return (Sample(id, "linear_cross_entropy", lambda: _lce_args(dtype, with_bias, options, device=device),
                   _small_tiles),) + tuple(
        Sample(f"linear_cross_entropy_bwd-{id}-{''.join('1' if m else '0' for m in mask)}",
               "linear_cross_entropy_bwd", lambda mask=mask: backward(mask), _small_tiles)
        for mask in masks
    )


def _lce_with_grads_samples(id, dtype, with_bias, options, masks=((True, True, True),), device="cpu"):
    """tk.linear_cross_entropy_with_grads (the forward that computes the gradients; "mean" or "sum"), one opcheck
    per output mask."""
    return tuple(
        Sample(f"linear_cross_entropy_with_grads-{id}-{''.join('1' if m else '0' for m in mask)}",
               "linear_cross_entropy_with_grads",
               lambda mask=mask: (*_lce_args(dtype, with_bias, options, device=device), list(mask)), _small_tiles)
        for mask in masks
    )


def _lce_kernel_samples(dtype):
    return (*_lce_samples("bias-smoothing-softcap-mean", dtype, True, (0.1, 5.0, "mean"),
                          masks=((True, True, True), (False, True, False), (True, False, True)), device="cuda"),
            *_lce_samples("none", dtype, False, (0.0, None, "none"), device="cuda"),
            *_lce_with_grads_samples("bias-smoothing-softcap-mean", dtype, True, (0.1, 5.0, "mean"),
                                     masks=((True, True, True), (False, True, False), (True, False, True)),
                                     device="cuda"),
            *_lce_with_grads_samples("sum", dtype, False, (0.0, None, "sum"), device="cuda"))


def _lce_graph() -> GraphSample:
    """The forward and the backward kernels (GEMMs, row passes, the fp32 sums) in one graph; every input read
    anew on replay."""

    def make_inputs():
        x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(300, 64, 1001, dtype=torch.bfloat16,
                                                                          device="cuda")
        return x, weight, bias, target, torch.randn((), device="cuda")

    def step(x, weight, bias, target, grad):
        options = (LCE_IGNORE_INDEX, 0.1, 4.0, "mean")
        loss, lse = torch.ops.tk.linear_cross_entropy(x, weight, target, bias, *options)
        grads = torch.ops.tk.linear_cross_entropy_bwd(grad, x, weight, target, bias, lse, *options, [True] * 3)
        return (loss, lse, *grads)

    def new_values(x, weight, bias, target, grad):
        return (torch.randn_like(x), torch.randn_like(weight) / 8, torch.randn_like(bias),
                torch.randint_like(target, 0, weight.shape[0]), torch.randn_like(grad))

    return GraphSample("forward-backward", ("linear_cross_entropy", "linear_cross_entropy_bwd"), make_inputs, step,
                       new_values=new_values)


def _lce_with_grads_graph() -> GraphSample:
    """The forward that computes the gradients (GEMMs, the accumulating one among them, row passes, sums) in one
    graph; every input read anew on replay, over 3 tiles of rows (V = 2^20 + 5: 128 rows a tile)."""

    def make_inputs():
        x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(300, 16, (1 << 20) + 5,
                                                                          dtype=torch.bfloat16, device="cuda")
        return x, weight, bias, target

    def step(x, weight, bias, target):
        return torch.ops.tk.linear_cross_entropy_with_grads(x, weight, target, bias, LCE_IGNORE_INDEX, 0.1, 4.0,
                                                            "mean", [True] * 3)

    def new_values(x, weight, bias, target):
        return (torch.randn_like(x), torch.randn_like(weight) / 4, torch.randn_like(bias),
                torch.randint_like(target, 0, weight.shape[0]))

    return GraphSample("with-grads", ("linear_cross_entropy_with_grads",), make_inputs, step, new_values=new_values)


def _lce_fallback(id, dtype, hidden) -> FallbackSample:
    """Loss and gradients on CUDA inputs the kernels leave to the reference (fp32; H not a multiple of 8)."""
    options = dict(label_smoothing=0.1, softcap=4.0, reduction="sum")

    def make_inputs():
        return linear_cross_entropy_inputs.make_inputs(37, hidden, 101, dtype=dtype, device="cuda",
                                                       requires_grad=True)

    def loss_and_gradients(x, weight, bias, target):
        loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, **options)
        return (loss, *torch.autograd.grad(loss, (x, weight, bias)))

    def float64(x, weight, bias, target):
        leaves = [t.detach().cpu().double().requires_grad_() for t in (x, weight, bias)]
        loss = linear_cross_entropy_inputs.float64_loss(leaves[0], leaves[1], target.cpu(), leaves[2], **options)
        return (loss, *torch.autograd.grad(loss, leaves))

    return FallbackSample(id, ("linear_cross_entropy", "linear_cross_entropy_bwd"), make_inputs, loss_and_gradients,
                          float64, TOLERANCE[dtype])


def _lce_with_grads_fallback() -> FallbackSample:
    """tk.linear_cross_entropy_with_grads called on fp32 CUDA inputs (the public function takes it for inputs the
    kernels serve only): its reference twin, the loss and the gradients of the loss against float64."""
    options = dict(label_smoothing=0.1, softcap=4.0, reduction="mean")

    def make_inputs():
        return linear_cross_entropy_inputs.make_inputs(37, 16, 101, dtype=torch.float32, device="cuda")

    def call(x, weight, bias, target):
        loss, _, *grads = torch.ops.tk.linear_cross_entropy_with_grads(
            x, weight, target, bias, LCE_IGNORE_INDEX, options["label_smoothing"], options["softcap"],
            options["reduction"], [True] * 3)
        return (loss, *grads)

    def float64(x, weight, bias, target):
        leaves = [t.detach().cpu().double().requires_grad_() for t in (x, weight, bias)]
        loss = linear_cross_entropy_inputs.float64_loss(leaves[0], leaves[1], target.cpu(), leaves[2], **options)
        return (loss, *torch.autograd.grad(loss, leaves))

    return FallbackSample("with-grads-fp32", ("linear_cross_entropy_with_grads",), make_inputs, call, float64,
                          TOLERANCE[torch.float32])


class _LMHeadLoss(torch.nn.Module):
    def __init__(self, hidden=9, vocab=23):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden) / hidden**0.5)

    def forward(self, x, target):  # x (B, T, H), target (B, T): an LM's hidden states and next tokens
        return tk_ops.linear_cross_entropy(x, self.weight, target, label_smoothing=0.1)


def _lce_compile_inputs(batch_shape=(13,)):
    x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(
        math.prod(batch_shape), 9, 23, dtype=torch.float32, requires_grad=True)
    return [x.detach().view(*batch_shape, 9).requires_grad_(), weight, bias, target.view(batch_shape)]


def _lce_bad_inputs():
    x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(5, 8, 11, dtype=torch.float32)

    def call(**changes):
        arguments = dict(x=x, weight=weight, target=target, bias=bias) | changes
        return lambda: tk_ops.linear_cross_entropy(**arguments)

    return _bad(
        ("x-not-a-tensor", call(x=x.tolist()), TypeError, "x must be a torch.Tensor"),
        ("x-integer", call(x=x.to(torch.int32)), TypeError, "x must have dtype"),
        ("x-0-dim", call(x=x[0, 0]), ValueError, "x must have"),
        ("x-no-rows", call(x=x[:0], target=target[:0]), ValueError, "x must not be empty"),
        ("x-H-0", call(x=x[:, :0], weight=weight[:, :0]), ValueError, "x must not be empty"),
        ("weight-not-a-tensor", call(weight=None), TypeError, "weight must be a torch.Tensor"),
        ("weight-rank-1", call(weight=weight[0]), ValueError, "weight must have 2 dimensions"),
        ("weight-rank-3", call(weight=weight[None]), ValueError, "weight must have 2 dimensions"),
        ("weight-V-0", call(weight=weight[:0], bias=None), ValueError, "weight must not be empty"),
        ("weight-H", call(weight=torch.randn(11, 7)), ValueError, r"weight.shape\[1\] must equal x.shape\[-1\] \(H\)"),
        ("weight-fp64-with-fp32-x", call(weight=weight.double()), TypeError, "weight must have x's dtype"),
        ("weight-bf16-with-fp32-x", call(weight=weight.bfloat16()), TypeError, "weight must have x's dtype"),
        ("bias-rank-2", call(bias=bias[None]), ValueError, "bias must have 1 dimensions"),
        ("bias-size", call(bias=bias[:10]), ValueError, r"bias.shape\[0\] must equal weight.shape\[0\] \(V\)"),
        ("bias-dtype", call(bias=bias.half()), TypeError, "bias must have x's dtype"),
        ("target-not-a-tensor", call(target=target.tolist()), TypeError, "target must be a torch.Tensor"),
        ("target-int32", call(target=target.int()), TypeError, r"target must have dtype in \(int64\)"),
        ("target-float", call(target=target.float()), TypeError, r"target must have dtype in \(int64\)"),
        ("target-length", call(target=target[:4]), ValueError, r"target must have x's shape without its last dim"),
        ("target-flat-for-batched-x", call(x=x.view(5, 1, 8)), ValueError, r"target must have x's shape"),
        ("target-one-hot", call(target=torch.zeros(5, 11, dtype=torch.int64)), ValueError, "target must have"),
        ("reduction-avg", call(reduction="avg"), ValueError, "reduction must be one of 'mean', 'sum', 'none'"),
        ("reduction-None", call(reduction=None), ValueError, "reduction must be one of"),
        ("label_smoothing-negative", call(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("label_smoothing-above-1", call(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("label_smoothing-nan", call(label_smoothing=float("nan")), ValueError, "label_smoothing must be in"),
        ("label_smoothing-string", call(label_smoothing="0.1"), TypeError, "label_smoothing must be a float"),
        ("softcap-0", call(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
        ("softcap-negative", call(softcap=-30.0), ValueError, "softcap must be a finite number > 0"),
        ("softcap-inf", call(softcap=float("inf")), ValueError, "softcap must be a finite number > 0"),
        ("softcap-True", call(softcap=True), TypeError, "softcap must be None or a float"),
        ("softcap-tensor", call(softcap=torch.tensor(30.0)), TypeError, "softcap must be None or a float"),
        ("ignore_index-float", call(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        ("ignore_index-True", call(ignore_index=True), TypeError, "ignore_index must be an int"),
    ) + _op_calls(
        ("target-out-of-range", lambda: torch.ops.tk.linear_cross_entropy(x, weight, torch.full((5,), 11), bias, -100,
                                                                          0.0, None, "mean"),
         ValueError, r"target values must be ignore_index \(-100\) or in \[0, 11\), got 11"),
        ("target-negative", lambda: tk_ops.linear_cross_entropy(x, weight, torch.full((5,), -1)), ValueError,
         r"target values must be ignore_index \(-100\) or in \[0, 11\), got -1"),
        ("kernel-weight-H", lambda: torch.ops.tk.linear_cross_entropy(*_lce_on_the_gpu_args(weight=lambda w: w[:, :8])),
         ValueError, r"tk::linear_cross_entropy: weight must be \(V, H\) with H = 16", "linear_cross_entropy"),
        ("kernel-reduction", lambda: torch.ops.tk.linear_cross_entropy(*_lce_on_the_gpu_args(reduction="avg")),
         ValueError, "tk::linear_cross_entropy: reduction must be 'mean', 'sum' or 'none'", "linear_cross_entropy"),
        ("kernel-bwd-grad-shape", lambda: torch.ops.tk.linear_cross_entropy_bwd(
            torch.ones(3, device="cuda"), *_lce_on_the_gpu_args(lse=True), [True] * 3),
         ValueError, r"tk::linear_cross_entropy_bwd: grad must have the loss's shape", "linear_cross_entropy_bwd"),
    )


def _lce_on_the_gpu_args(weight=lambda w: w, reduction="mean", lse=False):
    """The op's arguments on bf16 CUDA inputs the kernels take (x (5, 16)), the weight changed by ``weight``; with
    ``lse``, the backward's (x, weight, target, bias, lse, options)."""
    x, w, bias, target = linear_cross_entropy_inputs.make_inputs(5, 16, 11, dtype=torch.bfloat16, device="cuda")
    options = (LCE_IGNORE_INDEX, 0.0, None, reduction)
    if lse:
        return (x, w, target, bias, torch.zeros(5, device="cuda"), *options)
    return (x, weight(w), target, bias, *options)


def _lce_on_the_gpu():
    x, weight, bias, target = linear_cross_entropy_inputs.make_inputs(5, 8, 11, dtype=torch.bfloat16, device="cuda")
    return dict(x=x, weight=weight, target=target, bias=bias)


LINEAR_CROSS_ENTROPY = OpInfo(
    name="linear_cross_entropy",
    functions={"linear_cross_entropy": ("linear_cross_entropy", "linear_cross_entropy_bwd",
                                        "linear_cross_entropy_with_grads")},
    samples=(
        *_lce_samples("fp64-bias-smoothing-softcap-mean", torch.float64, True, (0.1, 5.0, "mean"),
                      masks=((True, True, True), (False, True, False), (True, False, True))),
        *_lce_samples("fp32-sum", torch.float32, False, (0.0, None, "sum")),
        *_lce_samples("bf16-bias-smoothing-none", torch.bfloat16, True, (0.2, None, "none")),
        *_lce_with_grads_samples("fp64-bias-smoothing-softcap-mean", torch.float64, True, (0.1, 5.0, "mean"),
                                 masks=((True, True, True), (False, True, False), (True, False, True))),
        *_lce_with_grads_samples("fp32-sum", torch.float32, False, (0.0, None, "sum")),
        *_lce_with_grads_samples("bf16-bias-smoothing-sum", torch.bfloat16, True, (0.2, None, "sum")),
    ),
    kernel_dtypes=KERNEL_16_BIT,
    kernel_samples=_lce_kernel_samples,
    compile=(
        CompileSample("bias-smoothing-softcap-mean",
                      lambda x, weight, bias, target: tk_ops.linear_cross_entropy(
                          x, weight, target, bias=bias, label_smoothing=0.1, softcap=4.0),
                      _lce_compile_inputs, ("linear_cross_entropy", "linear_cross_entropy_bwd")),
        CompileSample("batch-dims-none",
                      lambda x, weight, bias, target: tk_ops.linear_cross_entropy(
                          x, weight, target, bias=bias, reduction="none"),
                      lambda: _lce_compile_inputs((3, 5)), ("linear_cross_entropy", "linear_cross_entropy_bwd"),
                      loss=_random_projection),
        # the op the public function takes on the kernels' inputs (CUDA only), called directly: its autograd
        # (the stored gradients times the output gradient, 16-bit ones through fp32 chunks) under AOTAutograd
        CompileSample("with-grads-bf16-sum",
                      lambda x, weight, bias, target: 0.3 * torch.ops.tk.linear_cross_entropy_with_grads(
                          x, weight, target, bias, LCE_IGNORE_INDEX, 0.1, 4.0, "sum", [True] * 3)[0],
                      lambda: list(_lce_args(torch.bfloat16, True, ())[i] for i in (0, 1, 3, 2)),
                      ("linear_cross_entropy_with_grads",), tol=1e-2),
    ),
    export=(ExportSample("lm-head", _LMHeadLoss,
                         lambda: (torch.randn(2, 5, 9), torch.randint(0, 23, (2, 5))), ("linear_cross_entropy",)),),
    bad_inputs=_lce_bad_inputs(),
    device_mismatches=_device_mismatches(tk_ops.linear_cross_entropy, _lce_on_the_gpu, "x",
                                         ("weight", "target", "bias")),
    graphs=(_lce_graph(), _lce_with_grads_graph()),
    no_graph={},
    fallbacks=(_lce_fallback("fp32", torch.float32, 16), _lce_fallback("bf16-H-20", torch.bfloat16, 20),
               _lce_with_grads_fallback()),
    no_fallback={},
)

OP_DB = (MATMUL, ATTENTION, ATTENTION_VARLEN, ATTENTION_WITH_KVCACHE, LAYER_NORM, RMS_NORM, ROPE, LINEAR_ATTENTION,
         BASED_ATTENTION, MAMBA2_SSD, CAUSAL_CONV1D, FFTCONV, GATED_DELTA_RULE, LINEAR_CROSS_ENTROPY)
