"""tk_ops.nn.ImplicitLongFilter, LongConvolution and GatedLongConvolution against float64 math written here.

The convolution reference is a direct loop over the filter taps in the modules' (B, N, H) layout
(not tk.fftconv's FFT reference); the implicit filter is rebuilt from its parameters with the
formulas of its docstring.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import tk_testing
from tk_ops import _library
from tk_ops.nn import GatedLongConvolution, ImplicitLongFilter, LongConvolution
from tk_testing import assert_gradients_close, assert_rel_close, requires_cuda, requires_kernel

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HIDDEN, MAX_LEN = 6, 40
SMALL_FILTER = dict(num_frequencies=3, width=16, depth=2)


def direct_causal_conv(x: torch.Tensor, k: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y[b, t, h] = sum_{s <= t, s < L} k[h, s] x[b, t - s, h] + D[h] x[b, t, h], one tap at a time."""
    seq_len = x.shape[1]
    y = D * x
    for s in range(min(k.shape[1], seq_len)):
        y[:, s:] = y[:, s:] + k[:, s] * x[:, : seq_len - s]
    return y


def implicit_filter_from_definition(module: ImplicitLongFilter, filter_len: int, decay_times) -> torch.Tensor:
    """The docstring's k[h, l] from the module's parameters and the decay times tau_h, in float64."""
    t = torch.arange(filter_len, dtype=torch.float64) / module.max_len
    columns = [t]
    for f in range(1, module.num_frequencies + 1):
        columns.append(torch.cos(2 * math.pi * f * t))
    for f in range(1, module.num_frequencies + 1):
        columns.append(torch.sin(2 * math.pi * f * t))
    a = torch.stack(columns, dim=-1)
    layers = list(module.mlp)
    for linear, sine in zip(layers[:-1:2], layers[1::2]):
        a = torch.sin(sine.frequency * (a @ linear.weight.T + linear.bias))
    shapes = a @ layers[-1].weight.T
    if layers[-1].bias is not None:
        shapes = shapes + layers[-1].bias
    rates = math.log(100.0) / decay_times  # decay_target = 1e-2
    return shapes.T * torch.exp(-rates[:, None] * t)


def geometric_decay_times(num_channels: int, fastest: float = 0.3, slowest: float = 1.5) -> torch.Tensor:
    return fastest * (slowest / fastest) ** (torch.arange(num_channels, dtype=torch.float64) / (num_channels - 1))


@torch.no_grad()
def randomize(module: torch.nn.Module) -> None:
    """Parameters of a realistic scale, D away from its initial ones."""
    for name, p in module.named_parameters():
        if name.endswith("frequency"):
            p.uniform_(0.5, 2.0)
        elif name == "D" or name.endswith(".D"):
            p.normal_(0, 1)


# ------------------------------------------------------------------------------ the filter


@pytest.mark.parametrize("bias", [False, True])
def test_implicit_filter_is_its_definition(bias):
    module = ImplicitLongFilter(HIDDEN, MAX_LEN, bias=bias, **SMALL_FILTER).double()
    randomize(module)
    for filter_len in (1, 17, MAX_LEN):
        k = module(filter_len)
        assert k.shape == (HIDDEN, filter_len) and k.dtype == torch.float64
        expected = implicit_filter_from_definition(module, filter_len, geometric_decay_times(HIDDEN))
        assert_rel_close(k, expected, 1e-12, f"filter of {filter_len} taps")
    # A tap has the same value whatever the filter's length, up to rounding: the MLP's matmuls run on
    # 17 rows or on MAX_LEN, and the BLAS may sum a row in another order for another row count (its
    # blocking, the CPU's vector width), so bit-equality holds on some machines only. The error of
    # either is a few eps of the output layer's terms, whose sum bound[h] bounds |k[h, l]| (hidden
    # activations are sines, the window is <= 1): 32 eps * bound[h] covers the 16 + 1 terms of the
    # output layer and the hidden layers' rounding passed through sines of frequency <= 2 (seen:
    # < 1 eps * bound over 150 seeds, 1-4 threads, ATEN_CPU_CAPABILITY and MKL_CBWR variants).
    # A tap that moved with the length (e.g. t = l / filter_len) is off by ~1e-2.
    output_layer = module.mlp[-1]
    bound = output_layer.weight.abs().sum(1) + (output_layer.bias.abs() if bias else 0)
    short, long = module(17), module(MAX_LEN)[:, :17]
    gap = ((short - long).abs() / bound[:, None]).max().item() / torch.finfo(torch.float64).eps
    assert gap <= 32, f"taps of a 17-tap filter differ from the first 17 of {MAX_LEN} by {gap:.3g} eps * bound"


def test_decay_window_bounds_the_filter():
    module = ImplicitLongFilter(HIDDEN, 256, bias=True, **SMALL_FILTER).double()
    randomize(module)
    window = module.decay_window(256)
    rates = module.decay_rates()
    assert bool((rates[:-1] > rates[1:]).all()), "channel 0 decays fastest, channel H - 1 slowest"
    # Channel h falls to 1e-2 of its start at t = tau_h.
    torch.testing.assert_close(torch.exp(-rates * geometric_decay_times(HIDDEN)), torch.full((HIDDEN,), 1e-2,
                               dtype=torch.float64))
    k = module(256)
    output_layer = module.mlp[-1]
    bound = output_layer.weight.abs().sum(1) + output_layer.bias.abs()
    assert bool((k.abs() <= bound[:, None] * window * (1 + 1e-12)).all())
    # The fastest channel is negligible over the second half (exp(-ln(100) / 0.3 * 0.5) < 5e-4).
    assert k[0, 128:].abs().max() < 5e-4 * bound[0]
    assert k[0, :8].abs().max() > 10 * k[0, 128:].abs().max()


def test_filter_is_computed_in_fp32_under_autocast():
    module = ImplicitLongFilter(HIDDEN, MAX_LEN, **SMALL_FILTER)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k = module(MAX_LEN)
    assert k.dtype == torch.float32
    torch.testing.assert_close(k, module(MAX_LEN))


# -------------------------------------------------------------------------- LongConvolution

# (id, seq_len): shorter than the filter, equal, longer (the filter keeps max_len taps), one step.
SEQ_LENS = [("N<max_len", 23), ("N=max_len", MAX_LEN), ("N>max_len", 71), ("N=1", 1)]


def make_long_conv(implicit: bool, dtype=torch.float64) -> LongConvolution:
    options = SMALL_FILTER if implicit else {}
    module = LongConvolution(HIDDEN, MAX_LEN, implicit=implicit, **options).to(dtype)
    randomize(module)
    return module


@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
@tk_testing.parametrize_with_ids("seq_len", SEQ_LENS)
def test_long_conv_matches_direct_convolution(implicit, seq_len):
    module = make_long_conv(implicit)
    x = torch.randn(3, seq_len, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = module(x)
    assert out.shape == x.shape and out.dtype == torch.float64
    k = module.filter(min(seq_len, MAX_LEN))
    expected = direct_causal_conv(x, k, module.D)
    assert_rel_close(out, expected, 1e-12)
    parameters = [p for _, p in module.named_parameters()]
    assert_gradients_close(out, [x, *parameters], expected, [x, *parameters], 1e-10,
                           ["x", *(name for name, _ in module.named_parameters())])


def test_prefix_of_a_sequence_gets_the_prefix_of_the_output():
    module = make_long_conv(implicit=True)
    x = torch.randn(2, 71, HIDDEN, dtype=torch.float64)
    full = module(x)
    for n in (1, 23, MAX_LEN):
        assert_rel_close(module(x[:, :n]), full[:, :n], 1e-12, f"prefix of {n}")


def test_calls_fftconv_once_on_the_transposed_input():
    module = make_long_conv(implicit=True, dtype=torch.float32)
    x = torch.randn(2, 29, HIDDEN, requires_grad=True)
    with tk_testing.RecordTkCalls() as calls:
        module(x).sum().backward()
    assert len(calls.calls["fftconv"]) == 1 and len(calls.calls["fftconv_bwd"]) == 1
    u, k, D = calls.calls["fftconv"][0]
    assert u.shape == (2, HIDDEN, 29) and k.shape == (HIDDEN, 29) and D.shape == (HIDDEN,)


@pytest.mark.parametrize(
    "dtype, parameter_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float32)],
)
def test_dtypes_handed_to_fftconv(dtype, parameter_dtype):
    """16-bit activations get fp32 filters and D; otherwise the activations' dtype. Output in x's dtype."""
    module = make_long_conv(implicit=True, dtype=parameter_dtype)
    x = torch.randn(2, 33, HIDDEN).to(dtype)
    with tk_testing.RecordTkCalls() as calls:
        out = module(x)
    assert out.dtype == dtype and out.shape == x.shape
    u, k, D = calls.calls["fftconv"][0]
    expected = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    assert u.dtype == dtype and k.dtype == expected and D.dtype == expected
    reference = direct_causal_conv(x.double(), module.filter(33).double(), module.D.double())
    assert_rel_close(out, reference, tk_testing.TOLERANCE[dtype])


@pytest.mark.parametrize(
    "arguments, match",
    [
        (dict(hidden_size=0, max_len=8), "hidden_size"),
        (dict(hidden_size=4, max_len=0), "max_len"),
        (dict(hidden_size=4, max_len=8, width=8), "implicit=True"),
        (dict(hidden_size=4, max_len=8, implicit=True, fastest_decay=2.0), "fastest_decay"),
        (dict(hidden_size=4, max_len=8, implicit=True, decay_target=1.0), "decay_target"),
        (dict(hidden_size=4, max_len=8, implicit=True, depth=0), "depth"),
    ],
)
def test_bad_arguments(arguments, match):
    with pytest.raises(ValueError, match=match):
        LongConvolution(**arguments)


@pytest.mark.parametrize("x", [torch.randn(5, HIDDEN), torch.randn(2, 5, HIDDEN + 1), None])
def test_bad_hidden_states(x):
    for module in (make_long_conv(implicit=False, dtype=torch.float32), GatedLongConvolution(HIDDEN, MAX_LEN)):
        with pytest.raises(ValueError, match="hidden_states"):
            module(x)


@pytest.mark.parametrize("filter_len", [0, MAX_LEN + 1])
def test_filter_length_out_of_range(filter_len):
    for implicit in (False, True):
        with pytest.raises(ValueError, match="filter_len"):
            make_long_conv(implicit).filter(filter_len)


# --------------------------------------------------------------------- GatedLongConvolution


def gated_from_definition(module: GatedLongConvolution, x: torch.Tensor) -> torch.Tensor:
    """The docstring's operator in float64 with torch's own layers: nn.Conv1d for the short convolution."""
    projected = torch.nn.functional.linear(x, module.in_proj.weight, module.in_proj.bias)
    short = module.short_conv(projected.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
    output_gate, input_gate, value = short.split(HIDDEN, dim=-1)
    long_conv = module.long_conv
    mixed = direct_causal_conv(input_gate * value, long_conv.filter(min(x.shape[1], MAX_LEN)), long_conv.D)
    return torch.nn.functional.linear(output_gate * mixed, module.out_proj.weight, module.out_proj.bias)


def make_gated(dtype=torch.float64, **options) -> GatedLongConvolution:
    module = GatedLongConvolution(HIDDEN, MAX_LEN, **SMALL_FILTER, **options).to(dtype)
    randomize(module)
    return module


@pytest.mark.parametrize("short_conv_width", [2, 3, 4])
@tk_testing.parametrize_with_ids("seq_len", SEQ_LENS)
def test_gated_matches_definition(short_conv_width, seq_len):
    module = make_gated(short_conv_width=short_conv_width)
    x = torch.randn(2, seq_len, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = module(x)
    assert out.shape == x.shape and out.dtype == torch.float64
    expected = gated_from_definition(module, x)
    assert_rel_close(out, expected, 1e-12)
    names, parameters = zip(*module.named_parameters())
    assert_gradients_close(out, [x, *parameters], expected, [x, *parameters], 1e-10, ["x", *names])


def test_gradients_of_every_parameter_pass_gradcheck():
    """Finite differences in float64: every parameter gets its exact gradient, none is cut off."""
    module = GatedLongConvolution(3, 12, num_frequencies=2, width=4, depth=2, bias=True).double()
    randomize(module)
    names, parameters = zip(*module.named_parameters())
    assert len(names) == 15  # in/out_proj (4), short_conv (2), D, filter: 2 hidden linears (4), 2 sines, output (2)
    x = torch.randn(2, 9, 3, dtype=torch.float64)

    def run(x, *params):
        return torch.func.functional_call(module, dict(zip(names, params)), (x,))

    leaves = [x.requires_grad_(), *(p.detach().requires_grad_() for p in parameters)]
    assert torch.autograd.gradcheck(run, leaves)
    grads = torch.autograd.grad(run(*leaves).square().sum(), leaves[1:])
    for name, grad in zip(names, grads):
        assert grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_autocast_bf16():
    """fp32 parameters under bf16 autocast: the projections hand bf16 to the convolutions, the filter stays fp32."""
    module = make_gated(dtype=torch.float32)
    x = torch.randn(2, 37, HIDDEN)
    with tk_testing.RecordTkCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    (conv_call,) = calls.calls["causal_conv1d"]
    assert conv_call[0].dtype == torch.bfloat16 and conv_call[1].dtype == torch.float32
    u, k, D = calls.calls["fftconv"][0]
    assert u.dtype == torch.bfloat16 and k.dtype == torch.float32 and D.dtype == torch.float32
    assert_rel_close(out, gated_from_definition(copy.deepcopy(module).double(), x.double()), 3e-2)


def test_state_dict_round_trip():
    for make in (lambda: make_long_conv(False), lambda: make_long_conv(True), make_gated):
        source, target = make(), make()
        x = torch.randn(2, 19, HIDDEN, dtype=torch.float64)
        assert not torch.equal(source(x), target(x))
        target.load_state_dict(source.state_dict(), strict=True)
        assert torch.equal(source(x), target(x))
    assert set(make_long_conv(False).state_dict()) == {"weight", "D"}
    assert set(make_long_conv(True).state_dict()) == {
        "D", "implicit_filter.mlp.0.weight", "implicit_filter.mlp.0.bias",
        "implicit_filter.mlp.1.frequency", "implicit_filter.mlp.2.weight", "implicit_filter.mlp.2.bias",
        "implicit_filter.mlp.3.frequency", "implicit_filter.mlp.4.weight",
    }
    gated_keys = set(make_gated().state_dict())
    assert {"in_proj.weight", "in_proj.bias", "short_conv.weight", "short_conv.bias", "long_conv.D",
            "out_proj.weight", "out_proj.bias"} <= gated_keys


@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
def test_training_learns_a_target_convolution(implicit):
    """Adam on x -> (k* conv x + D* x) with a smooth decaying k*: the loss falls well below its start."""
    torch.manual_seed(0)
    heads, max_len, seq_len = 4, 32, 48
    lags = torch.arange(max_len, dtype=torch.float32)
    target_k = torch.exp(-lags / torch.tensor([2.0, 4.0, 8.0, 16.0])[:, None]) * torch.cos(0.3 * lags)
    target_D = torch.tensor([0.5, -1.0, 0.0, 2.0])
    options = dict(num_frequencies=4, width=32, depth=2) if implicit else {}
    module = LongConvolution(heads, max_len, implicit=implicit, **options)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        x = torch.randn(8, seq_len, heads)
        with torch.no_grad():
            target = direct_causal_conv(x, target_k, target_D)
        loss = (module(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.01 * first, f"loss {first:.4f} -> {last:.4f}"
    # Tap 0 and D both multiply x[t]: only their sum is determined.
    learned, wanted = module.filter(max_len).detach().clone(), target_k.clone()
    learned[:, 0] += module.D.detach()
    wanted[:, 0] += target_D
    assert_rel_close(learned, wanted, 0.1, "learned filter")


@pytest.mark.parametrize("kind", ["long_conv", "gated"])
def test_compile_fullgraph(kind):
    if kind == "long_conv":
        module, ops = make_long_conv(implicit=True, dtype=torch.float32), ["fftconv", "fftconv_bwd"]
    else:
        module, ops = make_gated(dtype=torch.float32), ["fftconv", "fftconv_bwd", "causal_conv1d", "causal_conv1d_bwd"]
    tk_testing.check_compile_fullgraph(
        module, [torch.randn(2, 29, HIDDEN, requires_grad=True)], ops, loss=lambda out: out.square().sum(), tol=1e-5
    )


# ---------------------------------------------------------------------------------- on a GPU


@requires_cuda
@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
def test_gpu_fp32_matches_cpu_float64(implicit):
    module = make_long_conv(implicit)
    x = torch.randn(2, 300, HIDDEN, dtype=torch.float64)
    expected = module(x)
    gpu_module = copy.deepcopy(module).float().cuda()
    out = gpu_module(x.float().cuda())
    assert out.device.type == "cuda" and out.dtype == torch.float32
    assert_rel_close(out, expected, 1e-5)


@requires_kernel("fftconv")
@pytest.mark.parametrize("seq_len", [256, 1000, 4096])
def test_gpu_gated_autocast_bf16_runs_the_fftconv_kernel(seq_len):
    """bf16 autocast on Hopper: the forward's long convolution is the kernel's (no reference warning),
    outputs and gradients within bf16 budgets of the CPU float64 module."""
    module = GatedLongConvolution(64, 4096, **SMALL_FILTER).double()
    randomize(module)
    x = torch.randn(2, seq_len, 64, dtype=torch.float64, requires_grad=True)
    expected = module(x)
    gpu_module = copy.deepcopy(module).float().cuda()
    x_gpu = x.detach().float().cuda().requires_grad_()
    _library._REFERENCE_WARNED.discard("fftconv")
    with warnings.catch_warnings(), torch.autocast("cuda", dtype=torch.bfloat16):
        warnings.filterwarnings("error", message="tk_ops: tk.fftconv has no")
        out = gpu_module(x_gpu)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, expected, 3e-2)
    grad = torch.randn_like(expected)
    (grad_x,) = torch.autograd.grad(out, x_gpu, grad.to(out.device, out.dtype))
    (expected_grad_x,) = torch.autograd.grad(expected, x, grad)
    assert_rel_close(grad_x, expected_grad_x, 3e-2, "grad_x")
