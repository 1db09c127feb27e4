"""Make ``torch.compile`` (Inductor) run standard PyTorch code on tk ops.

    import tk_ops.inductor
    tk_ops.inductor.enable()          # from now on torch.compile rewrites exact patterns
    model = torch.compile(model)

Rewritten, in inference and training graphs, only where exact (dtypes, shapes, masks, scales):
  * ``F.scaled_dot_product_attention`` (no mask, causal with Nq == Nk, or a constant mask proven
    all-true, causal, or, with ``any_device`` only until the window kernels are measured against SDPA's masked call, a causal sliding
    window; dropout 0; bf16/fp16; head dim 64/128; GQA via ``enable_gqa`` or
    ``repeat_kv``-expanded K/V, read unexpanded) -> ``tk.attention`` / ``tk.attention_bwd``, and
    only where tk measured at least as fast as the SDPA backend the node lowered to (the table in
    ``tk_ops/inductor/attention.py``: flash yes, cuDNN only for a constant causal mask in training
    at any head dim and in inference at head dim 128; ``enable(always_rewrite_attention=True)``
    rewrites every exact node, for benchmarking);
  * ``F.layer_norm`` over the last dim (with or without bias), alone or after a residual add
    (then also without weight), and ``F.dropout(x) + residual`` into it -> ``tk.layer_norm`` /
    ``tk.layer_norm_bwd`` (the dropout on tk's hash RNG: same keep probability, one mask);
  * Hugging Face's RMSNorm (fp32 normalisation, cast, times a weight of x's dtype) -> ``tk.rms_norm``;
  * the ``rotate_half`` RoPE ``q * cos + rotate_half(q) * sin`` (q and k together or alone) ->
    ``tk.rope_qk`` / ``tk.rope``;
  * an LM head and its loss, ``F.cross_entropy(F.linear(x, w, b).float(), t)`` (also with the logits
    reshaped to (-1, V), any ignore_index, label_smoothing and reduction; bf16/fp16 logits; no class
    weights; logits read by nothing else) -> ``tk.linear_cross_entropy`` / ``tk.linear_cross_entropy_bwd``,
    on Dynamo's graph before autograd (``tk_ops/inductor/linear_cross_entropy.py``);
  * with ``enable(matmul=True)``: ``mm`` / ``addmm`` -> ``tk.matmul`` / ``tk.linear``.
``enable`` is idempotent, chains with the passes the user already installed in
``torch._inductor.config.joint_custom_post_pass`` and ``pre_grad_custom_pass`` (theirs run first), and
``disable`` restores them.
By default rewrites fire only for tensors on devices where a tk kernel serves them (an sm_90 GPU
with ``tk_ops._C`` built); ``enable(any_device=True)`` rewrites everywhere, which the CPU test
suite uses to exercise the rewrites against the reference paths.
"""

from __future__ import annotations

from tk_ops.inductor.graph_pass import TkGraphPass, TkPreGradPass
from tk_ops.inductor.options import RewriteOptions

_PASS_SLOTS = {"joint_custom_post_pass": TkGraphPass, "pre_grad_custom_pass": TkPreGradPass}


def _config():
    from torch._inductor import config

    return config


def enable(*, any_device: bool = False, matmul: bool = False, always_rewrite_attention: bool = False) -> None:
    """Install the tk rewrites (again with new options if already installed)."""
    config = _config()
    options = RewriteOptions(any_device=any_device, matmul=matmul, always_rewrite_attention=always_rewrite_attention)
    for slot, pass_type in _PASS_SLOTS.items():
        current = getattr(config, slot)
        previous = current.previous if isinstance(current, pass_type) else current
        setattr(config, slot, pass_type(options, previous))


def disable() -> None:
    """Remove the tk rewrites, restoring the passes that were installed before ``enable``."""
    config = _config()
    for slot, pass_type in _PASS_SLOTS.items():
        current = getattr(config, slot)
        if isinstance(current, pass_type):
            setattr(config, slot, current.previous)


def is_enabled() -> bool:
    config = _config()
    return all(isinstance(getattr(config, slot), pass_type) for slot, pass_type in _PASS_SLOTS.items())


__all__ = ["disable", "enable", "is_enabled"]
