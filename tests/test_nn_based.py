"""tk_ops.nn.BasedLinearAttention as a drop-in for flash-linear-attention's ``fla.layers.BasedLinearAttention``.

Always: against the forward of fla 0.6.0's layer written out here in float64 from its math (its
projections, parallel_based's Taylor scores with scale F**-0.5 and epsilon 1e-6, the linear_attn
normaliser's 1e-10 in the chunk modes, its PyTorch reference with the layer's eps without
causality). Where fla imports (it needs triton and einops, which CI does not install), also against
fla's layer itself on the CPU: its state_dict, its feature map, and its forward with fla's own
PyTorch stand-ins for the Triton kernels (``naive_parallel_based``, ``forward_reference``).
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

import tk_ops
import tk_testing
from tk_ops.nn import based as based_module
from tk_ops.ops import based_attention as based_attention_module
from test_nn_normalization import assert_same_forward_and_backward
from tk_testing import TOLERANCE, assert_rel_close

HIDDEN, HEADS, FEATURES = 48, 3, 16  # value head dim 16
FLA_INIT_DEFAULTS = {"feature_dim": 16, "num_key_value_heads": 12, "num_heads": 12, "feature_name": "taylor_exp",
                     "eps": 1e-12, "causal": True, "mode": "parallel"}
CAUSAL_EPS = {"parallel": 1e-6, "chunk": 1e-10, "fused_chunk": 1e-10}


def make_layer(mode="parallel", causal=True, dtype=torch.float64, **overrides):
    """A layer with random weights that make q . k / sqrt(F) of order 1 (so the s^2 term matters)."""
    arguments = dict(hidden_size=HIDDEN, feature_dim=FEATURES, num_heads=HEADS, num_key_value_heads=HEADS,
                     mode=mode, causal=causal, **overrides)
    layer = tk_ops.nn.BasedLinearAttention(**arguments).to(dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, parameter.shape[1] ** -0.5)
    return layer


def fla_math_forward(layer, x, eps):
    """fla's layer in float64 from its definition: full T x T Taylor scores, causal unless the layer is not."""
    batch, seq_len, _ = x.shape
    x = x.double()
    q, k, v = (torch.nn.functional.linear(x, proj.weight.double()).view(batch, seq_len, layer.num_heads, -1)
               for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    s = torch.einsum("bihf,bjhf->bhij", q, k) / math.sqrt(layer.feature_dim)
    scores = 1 + s + s**2 / 2
    if layer.causal:
        scores = scores.tril()
    o = torch.einsum("bhij,bjhd->bihd", scores, v) / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return torch.nn.functional.linear(o.flatten(-2), layer.o_proj.weight.double())


class Reference(torch.nn.Module):
    """``forward`` as a module whose parameters are those of ``weights`` (in their order), for
    assert_same_forward_and_backward: fla's math on a copy of our layer, or fla's forward_reference."""

    def __init__(self, weights: torch.nn.Module, forward) -> None:
        super().__init__()
        self.weights, self.reference = weights, forward

    def forward(self, x):
        return self.reference(x)


def assert_matches_fla_math(layer, x, eps, tol=1e-10):
    twin = copy.deepcopy(layer)
    assert_same_forward_and_backward(layer, Reference(twin, lambda x: fla_math_forward(twin, x, eps)), x, tol)


# --------------------------------------------------------------------------------- the fla contract


def test_constructor_arguments_and_defaults_are_flas():
    parameters = inspect.signature(tk_ops.nn.BasedLinearAttention.__init__).parameters
    assert list(parameters) == ["self", "hidden_size", *FLA_INIT_DEFAULTS]
    assert {name: parameters[name].default for name in FLA_INIT_DEFAULTS} == FLA_INIT_DEFAULTS


def test_submodules_attributes_and_state_dict_keys():
    layer = tk_ops.nn.BasedLinearAttention(64, num_heads=4, num_key_value_heads=4)
    assert [name for name, _ in layer.named_children()] == ["feature_map", "q_proj", "k_proj", "v_proj", "o_proj", "dropout"]
    shapes = {key: tuple(value.shape) for key, value in layer.state_dict().items()}
    assert shapes == {"q_proj.weight": (64, 64), "k_proj.weight": (64, 64), "v_proj.weight": (64, 64),
                      "o_proj.weight": (64, 64)}
    assert all(isinstance(layer.get_submodule(n), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert isinstance(layer.dropout, torch.nn.Identity)
    expected = dict(mode="parallel", hidden_size=64, feature_name="taylor_exp", feature_dim=16, num_heads=4,
                    num_key_value_heads=4, head_k_dim=16, head_v_dim=16, head_dim=16, causal=True, eps=1e-12)
    assert {name: getattr(layer, name) for name in expected} == expected


def test_value_head_dim_rounds_down_like_flas():
    layer = tk_ops.nn.BasedLinearAttention(50, feature_dim=8, num_heads=4, num_key_value_heads=4)
    assert layer.head_v_dim == 12 and layer.v_proj.weight.shape == (48, 50) and layer.o_proj.weight.shape == (50, 48)
    x = torch.randn(2, 9, 50)
    assert layer(x).shape == (2, 9, 50)


def test_feature_map_gives_the_taylor_scores_in_flas_order():
    feature_map = based_module.TaylorFeatureMap(head_dim=5)
    x, y = torch.randn(2, 7, 5, dtype=torch.float64), torch.randn(2, 7, 5, dtype=torch.float64)
    phi_x = feature_map(x)
    assert phi_x.shape == (2, 7, 1 + 5 + 15)
    s = (x * y).sum(-1) / math.sqrt(5)
    torch.testing.assert_close((phi_x * feature_map(y)).sum(-1), 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)
    # [1, x / F**0.25, diagonal squares / sqrt(2F), then x_0 x_1, x_0 x_2, ...: the upper triangle row by row]
    torch.testing.assert_close(phi_x[..., 1:6], x / 5**0.25)
    torch.testing.assert_close(phi_x[..., 6:11], x * x / math.sqrt(10))
    torch.testing.assert_close(phi_x[..., 11:13], x[..., 0:1] * x[..., 1:3] / math.sqrt(5))


# ------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("seq_len", [3, 37, 77])
@pytest.mark.parametrize("mode", ["parallel", "chunk", "fused_chunk"])
def test_causal_matches_flas_math_with_its_kernel_eps(monkeypatch, mode, seq_len):
    monkeypatch.setattr(based_attention_module, "CHUNK_SIZE", 16)  # several chunks at these lengths
    layer = make_layer(mode)
    x = torch.randn(2, seq_len, HIDDEN, dtype=torch.float64)
    assert_matches_fla_math(layer, x, CAUSAL_EPS[mode])


@pytest.mark.parametrize("mode", ["parallel", "chunk"])
def test_causal_eps_is_the_kernels_not_the_layers(mode):
    """The constructor's eps does not reach the causal path (fla's kernels use their own): only the
    kernel's epsilon reproduces the output at float64 precision."""
    x = torch.randn(2, 21, HIDDEN, dtype=torch.float64)
    layer = make_layer(mode, eps=1e-3)
    out = layer(x)
    assert_rel_close(out, fla_math_forward(layer, x, CAUSAL_EPS[mode]), 1e-12)
    assert tk_testing.rel_err(out, fla_math_forward(layer, x, 1e-3)) > 1e-6


@pytest.mark.parametrize("seq_len", [3, 37])
def test_noncausal_matches_flas_reference_with_the_layers_eps(seq_len):
    layer = make_layer(causal=False, eps=1e-3)
    x = torch.randn(2, seq_len, HIDDEN, dtype=torch.float64)
    assert_matches_fla_math(layer, x, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_on_reference(dtype):
    layer = make_layer(dtype=dtype)
    x = torch.randn(2, 45, HIDDEN, dtype=dtype)
    out = layer(x)
    assert out.dtype == dtype
    assert_rel_close(out, fla_math_forward(layer, x, 1e-6), 4 * TOLERANCE[dtype])


def test_runs_tk_ops():
    layer = make_layer(dtype=torch.float32)
    x = torch.randn(2, 19, HIDDEN, requires_grad=True)
    with tk_testing.RecordTkCalls() as calls:
        layer(x).sum().backward()
    assert len(calls.calls["based_attention"]) == 1 and len(calls.calls["based_attention_bwd"]) == 1
    q, k, v, eps, normalize = calls.calls["based_attention"][0]
    assert q.shape == (2, HEADS, 19, FEATURES) and v.shape == (2, HEADS, 19, HIDDEN // HEADS)
    assert (eps, normalize) == (1e-6, True)
    assert len(calls.calls["linear"]) == 4


def test_compile_fullgraph_forward_and_backward():
    layer = make_layer(dtype=torch.float32)
    tk_testing.check_compile_fullgraph(
        layer, [torch.randn(2, 29, HIDDEN, requires_grad=True)], ["based_attention", "based_attention_bwd"],
        loss=lambda out: out.square().sum(), tol=1e-5,
    )


def test_export():
    layer = make_layer(dtype=torch.float32)
    tk_testing.check_export(layer, (torch.randn(2, 23, HIDDEN),), ["based_attention", "linear"], tol=1e-6)


@pytest.mark.parametrize(
    "arguments, match",
    [
        (dict(mode="recurrent"), "mode"),
        (dict(feature_name="hedgehog"), "feature_name"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(hidden_size=2), "hidden_size"),
        (dict(feature_dim=0), "feature_dim"),
        (dict(num_heads=1.5, num_key_value_heads=1.5), "num_heads"),
    ],
)
def test_bad_arguments(arguments, match):
    with pytest.raises(ValueError, match=match):
        tk_ops.nn.BasedLinearAttention(**{"hidden_size": HIDDEN, "num_heads": HEADS, "num_key_value_heads": HEADS,
                                          **arguments})


@pytest.mark.parametrize("x", [torch.randn(5, HIDDEN), torch.randn(2, 5, HIDDEN + 1), None])
def test_bad_hidden_states(x):
    with pytest.raises(ValueError, match="hidden_states"):
        make_layer(dtype=torch.float32)(x)


# --------------------------------------------------------------------- fla's own layer, if it imports


@pytest.fixture
def fla_based():
    """fla.layers.based (flash-linear-attention 0.6.0); skips where fla, triton or einops is missing."""
    module = pytest.importorskip("fla.layers.based", exc_type=ImportError)
    if "hidden_size" not in inspect.signature(module.BasedLinearAttention.__init__).parameters:
        pytest.skip("an fla version without 0.6.0's BasedLinearAttention constructor")
    return module


def fla_and_ours(fla_based, mode, causal):
    theirs = fla_based.BasedLinearAttention(HIDDEN, feature_dim=FEATURES, num_key_value_heads=HEADS,
                                            num_heads=HEADS, mode=mode, causal=causal).double()
    ours = make_layer(mode, causal)
    theirs.load_state_dict(ours.state_dict())
    return theirs, ours


def test_signature_and_state_dict_load_both_ways(fla_based):
    theirs_signature = inspect.signature(fla_based.BasedLinearAttention.__init__).parameters
    ours_signature = inspect.signature(tk_ops.nn.BasedLinearAttention.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in theirs_signature.values()] == \
        [(p.name, p.kind, p.default) for p in ours_signature.values()]
    theirs = fla_based.BasedLinearAttention(64, num_key_value_heads=4, num_heads=4)
    ours = tk_ops.nn.BasedLinearAttention(64, num_key_value_heads=4, num_heads=4)
    assert [n for n, _ in theirs.named_modules()] == [n for n, _ in ours.named_modules()]
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    names = ("mode", "hidden_size", "feature_name", "feature_dim", "num_heads", "num_key_value_heads",
             "head_k_dim", "head_v_dim", "head_dim", "causal", "eps")
    assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}


def test_feature_map_equals_flas(fla_based):
    x = torch.randn(3, 11, HEADS, FEATURES, dtype=torch.float64)
    theirs, ours = fla_and_ours(fla_based, "parallel", True)
    # Elementwise products and scalings only (no reduction, no BLAS): bit-equal on any machine.
    assert torch.equal(ours.feature_map(x), theirs.feature_map(x))


@pytest.mark.parametrize("seq_len", [3, 77])
def test_parallel_mode_matches_flas_forward(monkeypatch, fla_based, seq_len):
    """fla's forward as written, its Triton parallel_based replaced by fla's naive_parallel_based (same math,
    PyTorch, (B, H, T, F) layout)."""
    from fla.ops.based.naive import naive_parallel_based

    def parallel_based(q, k, v, scale, use_norm):
        out = naive_parallel_based(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, use_norm)
        return out.transpose(1, 2)

    monkeypatch.setattr(fla_based, "parallel_based", parallel_based)
    theirs, ours = fla_and_ours(fla_based, "parallel", True)
    x = torch.randn(2, seq_len, HIDDEN, dtype=torch.float64)
    assert_same_forward_and_backward(ours, theirs, x, 1e-10)


@pytest.mark.parametrize("mode, causal", [("parallel", True), ("chunk", True), ("fused_chunk", True),
                                          ("parallel", False)])
def test_matches_flas_reference_forward(fla_based, mode, causal):
    """fla's PyTorch forward_reference, with the epsilon of the kernel fla's forward would run when causal
    (without causality fla's forward is forward_reference with the layer's eps)."""
    theirs, ours = fla_and_ours(fla_based, mode, causal)
    if causal:
        theirs.eps = CAUSAL_EPS[mode]
    x = torch.randn(2, 37, HIDDEN, dtype=torch.float64)
    assert_same_forward_and_backward(ours, Reference(theirs, theirs.forward_reference) if causal else theirs, x, 1e-10)
