"""Norm and RoPE rewrites, as Inductor pattern replacements.

Each rewrite is a pair of eager functions: the pattern (what models write) and the replacement
(the differentiable tk function). Inductor traces both, in a training (joint forward+backward)
and an inference form, and replaces matches; ``_exact`` decides from the matched tensors whether
the replacement computes the same function (dtypes, shapes, the device's kernel).

Patterns are traced lazily per device type, because decompositions differ between devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable, Iterator, Optional

import torch
from torch._inductor import pattern_matcher
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, joint_fwd_bwd, register_replacement
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

import tk_ops
from tk_ops._checks import KERNEL_DTYPES
from tk_ops.inductor.options import RewriteOptions

_PATTERN_EPS = 1e-6  # any value: scalar_workaround turns eps into an argument of the pattern

# The options of the pass being applied (extra checks are called from inside ``apply``).
_active_options: RewriteOptions = RewriteOptions()


@contextlib.contextmanager
def active(options: RewriteOptions) -> Iterator[None]:
    global _active_options
    saved, _active_options = _active_options, options
    try:
        yield
    finally:
        _active_options = saved


# ------------------------------------------------------------------------------------ RMSNorm


def _rms_norm_hf(x, weight, eps):
    """Hugging Face LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _rms_norm_hf_weight_last(x, weight, eps):
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(x.dtype) * weight


def _rms_norm_replacement(x, weight, eps):
    return tk_ops.rms_norm(x, weight, eps)


# ---------------------------------------------------------------------------------- LayerNorm


def _layer_norm_pattern(x, weight, bias, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _layer_norm_replacement(x, weight, bias, eps):
    return tk_ops.layer_norm(x, weight, bias, eps)


def _layer_norm_without_bias_pattern(x, weight, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, None, eps)


def _layer_norm_without_bias_replacement(x, weight, eps):
    return tk_ops.layer_norm(x, weight, None, eps)


def _residual_layer_norm_pattern(x, residual, weight, bias, eps):
    h = x + residual
    return torch.nn.functional.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def _residual_layer_norm_replacement(x, residual, weight, bias, eps):
    return tk_ops.layer_norm(x, weight, bias, eps, residual=residual, return_residual=True)


def _residual_layer_norm_without_bias_pattern(x, residual, weight, eps):
    h = x + residual
    return torch.nn.functional.layer_norm(h, h.shape[-1:], weight, None, eps), h


def _residual_layer_norm_without_bias_replacement(x, residual, weight, eps):
    return tk_ops.layer_norm(x, weight, None, eps, residual=residual, return_residual=True)


def _residual_layer_norm_without_affine_pattern(x, residual, eps):
    h = x + residual
    return torch.nn.functional.layer_norm(h, h.shape[-1:], None, None, eps), h


def _residual_layer_norm_without_affine_replacement(x, residual, eps):
    return tk_ops.layer_norm(x, None, None, eps, residual=residual, return_residual=True)


def _norm_only(residual_function: Callable) -> Callable:
    """The residual pattern or replacement returning only the norm (same signature, for the tracer)."""

    @functools.wraps(residual_function)
    def norm_only(*args):
        return residual_function(*args)[0]

    return norm_only


# ---------------------------------------------------------------------------------------- RoPE


def _rotate_half(x):
    """Written exactly as Hugging Face does: the slice order fixes the order of the backward's adds."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope_pattern(x, cos, sin):
    """The rotate_half form of Hugging Face's apply_rotary_pos_emb, for one tensor."""
    return (x * cos) + (_rotate_half(x) * sin)


def _rope_qk_pattern(q, k, cos, sin):
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _rope_replacement(x, cos, sin):
    return tk_ops.rope(x, cos, sin)


def _rope_qk_replacement(q, k, cos, sin):
    return tk_ops.rope_qk(q, k, cos, sin)


# ---------------------------------------------------------------------------------- exactness


def _val(match: Match, name: str):
    node = match.kwargs[name]
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _norm_exact(op_name: str, tensor_names: tuple[str, ...]) -> Callable[[Match], bool]:
    def check(match: Match) -> bool:
        x = _val(match, "x")
        tensors = [_val(match, name) for name in tensor_names]
        if not isinstance(x, torch.Tensor) or x.dtype not in KERNEL_DTYPES or x.dim() < 1:
            return False
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dtype != x.dtype:
                return False
        if any(t.shape != x.shape for t in tensors if t.dim() == x.dim() and t.dim() > 1):
            return False  # a residual must not broadcast
        return _active_options.serves(x.device, op_name)

    return check


def _rope_exact(op_name: str, tensor_names: tuple[str, ...]) -> Callable[[Match], bool]:
    def check(match: Match) -> bool:
        xs = [_val(match, name) for name in tensor_names]
        cos, sin = _val(match, "cos"), _val(match, "sin")
        for x in xs:
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in KERNEL_DTYPES:
                return False
            if x.shape[-1] % 2:
                return False
        if not all(isinstance(t, torch.Tensor) for t in (cos, sin)) or cos.shape != sin.shape:
            return False
        head_dim, n = xs[0].shape[-1], xs[0].shape[2]
        # cos/sin must broadcast over heads and cover the full head dim: (B or 1, 1, N, D) or (N, D)
        if cos.shape[-1] != head_dim or cos.shape[-2] != n:
            return False
        if cos.dim() == 4 and cos.shape[1] != 1:
            return False
        if any(cos.dim() == 4 and cos.shape[0] not in (1, x.shape[0]) for x in xs):
            return False
        return _active_options.serves(xs[0].device, op_name)

    return check


# ---------------------------------------------------------------------------------- registration


@dataclasses.dataclass(frozen=True)
class _Rule:
    search: Callable
    replacement: Callable
    input_shapes: tuple[tuple[int, ...], ...]
    exact: Callable[[Match], bool]
    scalars: Optional[dict] = None
    constant_inputs: tuple[int, ...] = ()  # inputs that never require grad (RoPE tables)

    def examples(self, device: torch.device, training: bool) -> list[torch.Tensor]:
        return [
            torch.empty(shape, device=device, dtype=torch.bfloat16, requires_grad=training and i not in self.constant_inputs)
            for i, shape in enumerate(self.input_shapes)
        ]


_B, _H, _N, _D = 2, 4, 8, 16
_EPS = {"eps": _PATTERN_EPS}
_RESIDUAL_LAYER_NORM_RULES = (
    _Rule(
        _residual_layer_norm_pattern,
        _residual_layer_norm_replacement,
        ((_B, _N, _D), (_B, _N, _D), (_D,), (_D,)),
        _norm_exact("layer_norm", ("residual", "weight", "bias")),
        _EPS,
    ),
    _Rule(
        _residual_layer_norm_without_bias_pattern,
        _residual_layer_norm_without_bias_replacement,
        ((_B, _N, _D), (_B, _N, _D), (_D,)),
        _norm_exact("layer_norm", ("residual", "weight")),
        _EPS,
    ),
    _Rule(
        _residual_layer_norm_without_affine_pattern,
        _residual_layer_norm_without_affine_replacement,
        ((_B, _N, _D), (_B, _N, _D)),
        _norm_exact("layer_norm", ("residual",)),
        _EPS,
    ),
)
# Larger patterns first, so that a residual add is folded in before the plain norm claims the norm.
# Each residual rule also comes in a norm-only form for an h read by the norm alone (post-LN
# blocks): in a training graph the (out, h) form then fails, h having no gradient of its own.
_RULES = (
    *_RESIDUAL_LAYER_NORM_RULES,
    *(
        dataclasses.replace(rule, search=_norm_only(rule.search), replacement=_norm_only(rule.replacement))
        for rule in _RESIDUAL_LAYER_NORM_RULES
    ),
    _Rule(_layer_norm_pattern, _layer_norm_replacement, ((_B, _N, _D), (_D,), (_D,)), _norm_exact("layer_norm", ("weight", "bias")), _EPS),
    _Rule(
        _layer_norm_without_bias_pattern,
        _layer_norm_without_bias_replacement,
        ((_B, _N, _D), (_D,)),
        _norm_exact("layer_norm", ("weight",)),
        _EPS,
    ),
    _Rule(_rms_norm_hf, _rms_norm_replacement, ((_B, _N, _D), (_D,)), _norm_exact("rms_norm", ("weight",)), _EPS),
    _Rule(_rms_norm_hf_weight_last, _rms_norm_replacement, ((_B, _N, _D), (_D,)), _norm_exact("rms_norm", ("weight",)), _EPS),
    _Rule(
        _rope_qk_pattern,
        _rope_qk_replacement,
        ((_B, _H, _N, _D), (_B, _H // 2, _N, _D), (_B, 1, _N, _D), (_B, 1, _N, _D)),
        _rope_exact("rope_qk", ("q", "k")),
        constant_inputs=(2, 3),
    ),
    _Rule(
        _rope_pattern,
        _rope_replacement,
        ((_B, _H, _N, _D), (_B, 1, _N, _D), (_B, 1, _N, _D)),
        _rope_exact("rope", ("x",)),
        constant_inputs=(1, 2),
    ),
)


@functools.cache
def patterns_for(device_type: str) -> PatternMatcherPass:
    """The compiled rules for one device type, traced on first use."""
    patterns = PatternMatcherPass(pass_name="tk_ops")
    device = torch.device(device_type)
    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
        for rule in _RULES:
            # training form first: otherwise the inference form claims the forward half of a
            # training graph and leaves the decomposed backward behind
            for trace, training in ((joint_fwd_bwd, True), (fwd_only, False)):
                register_replacement(
                    rule.search,
                    rule.replacement,
                    rule.examples(device, training),
                    trace,
                    patterns,
                    extra_check=rule.exact,
                    scalar_workaround=rule.scalars,
                )
    return patterns


def rewrite_patterns(graph: torch.fx.Graph, options: RewriteOptions) -> int:
    device_types = {
        node.meta["val"].device.type
        for node in graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
    }
    replaced = 0
    with active(options), warnings.catch_warnings():
        # Inductor's multi-output replacement erases some matched nodes a second time (seen with
        # the residual LayerNorm rule, whose training form returns one node as both d(x) and
        # d(residual), and with RoPE in HF Llama); torch only warns, and the tests check outputs
        # and gradients of the rewritten graphs against eager.
        warnings.filterwarnings("ignore", message=r"erase_node\(.*\) on an already erased node")
        for device_type in sorted(device_types):
            replaced += patterns_for(device_type).apply(graph)
    if replaced:
        pattern_matcher.stable_topological_sort(graph)
    return replaced
