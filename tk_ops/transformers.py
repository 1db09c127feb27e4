"""Opt-in switches that run unchanged Hugging Face transformers models through tk ops.

``apply_tk_kernels_to_mamba2(model=None)`` replaces the ``forward`` of transformers'
``Mamba2Mixer`` (``transformers.models.mamba2.modeling_mamba2``, the mixer of ``Mamba2Model`` and
``Mamba2ForCausalLM``) by ``tk_ops.nn.mamba2.mamba2_mixer_forward``: in_proj, ``tk.causal_conv1d``
(+ SiLU), ``tk.mamba2_ssd``, the gated RMSNorm on ``tk.rms_norm``, out_proj, on the mixer's own
parameters (nothing is copied or re-registered). Without ``model`` the class is patched (every
Mamba2Mixer, existing or built later); with ``model`` only the mixers inside it, as instance
attributes. ``undo_tk_kernels_for_mamba2(model=None)`` restores HF's forward in the same scope.
Both are idempotent. Neither mamba_ssm nor causal_conv1d needs to be installed.

Only that class is patched: Bamba, Zamba2, FalconH1, NemotronH and GraniteMoeHybrid have their
own copies of the mixer (generated from the same modular code) and are left alone.

What runs where:
- no cache (training, ``use_cache=False``): the tk path, with the 2D padding mask zeroing padded
  positions as HF's torch path does;
- a cache with no state yet for the layer (the prefill of ``generate``, or an eval-mode forward
  with the default ``use_cache=True``): the tk path, which also writes the conv state and the final
  SSM state into the cache as HF does;
- a cache that already holds the layer's state (single-step decode, continuing a cache) or that
  records the past: HF's original forward (no tk op serves the decode step yet).
Extra keyword arguments (``seq_idx`` and the like, which only mamba_ssm's kernels read) are
ignored, as HF's torch path ignores them. HF's fused training shortcut
(``mamba_split_conv1d_scan_combined``, taken only when mamba_ssm is installed) is bypassed.

``tk.causal_conv1d`` runs its CUDA kernels on Hopper, reading the mixer's (B, L, D) activations in
place; ``tk.mamba2_ssd``'s docstring says what serves it.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from tk_ops.nn.mamba2 import mamba2_mixer_forward

# HF's Mamba2Mixer.forward, saved when the class is patched.
_ORIGINAL_FORWARD = None


def _mixer_class():
    from transformers.models.mamba2 import modeling_mamba2

    return modeling_mamba2.Mamba2Mixer


def _hf_forward():
    """HF's own forward, whether or not the class is patched now."""
    return _ORIGINAL_FORWARD if _ORIGINAL_FORWARD is not None else _mixer_class().forward


def _cache_holds_state(cache, layer_idx) -> bool:
    return (
        cache.get_conv_state(layer_idx) is not None
        or cache.get_recurrent_state(layer_idx) is not None
        or cache.is_recording_past(layer_idx)
    )


def _tk_mamba2_mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, cache=None, **kwargs):
    """Mamba2Mixer.forward on tk ops; HF's own forward for decode steps (see the module docstring).

    transformers 5.24 renamed the mixer's ``cache_params`` argument to ``cache``; both are accepted,
    and HF's forward gets the cache by position (second in every version)."""
    cache = cache if cache is not None else cache_params
    if cache is not None and _cache_holds_state(cache, self.layer_idx):
        return _hf_forward()(self, hidden_states, cache, attention_mask=attention_mask, **kwargs)
    return mamba2_mixer_forward(self, hidden_states, attention_mask=attention_mask, cache_params=cache)


try:  # fire accelerate's hooks of conv1d (offloading), as HF's forward does: its weight is read directly
    from transformers.integrations.accelerate import force_accelerate_hooks

    _tk_mamba2_mixer_forward = force_accelerate_hooks("conv1d")(_tk_mamba2_mixer_forward)
except (ImportError, AttributeError):  # transformers missing, or a version without the decorator
    pass


def _is_tk_forward(forward) -> bool:
    return getattr(forward, "__func__", forward) is _tk_mamba2_mixer_forward


def _mixers(model: torch.nn.Module) -> list:
    mixer_class = _mixer_class()
    mixers = [module for module in model.modules() if isinstance(module, mixer_class)]
    if not mixers:
        raise ValueError(f"{type(model).__name__} contains no transformers Mamba2Mixer")
    return mixers


def apply_tk_kernels_to_mamba2(model: Optional[torch.nn.Module] = None) -> None:
    """Run transformers' Mamba2Mixer through tk ops: the class (``model=None``) or the mixers of ``model``."""
    global _ORIGINAL_FORWARD
    if model is not None:
        for mixer in _mixers(model):
            mixer.forward = types.MethodType(_tk_mamba2_mixer_forward, mixer)
        return
    mixer_class = _mixer_class()
    if _ORIGINAL_FORWARD is None:
        _ORIGINAL_FORWARD = mixer_class.forward
        mixer_class.forward = _tk_mamba2_mixer_forward


def undo_tk_kernels_for_mamba2(model: Optional[torch.nn.Module] = None) -> None:
    """Undo ``apply_tk_kernels_to_mamba2`` in the same scope: the class, or the mixers of ``model``
    (a model's mixers then follow the class again, patched or not)."""
    global _ORIGINAL_FORWARD
    if model is not None:
        for mixer in _mixers(model):
            if _is_tk_forward(mixer.__dict__.get("forward")):
                del mixer.forward
        return
    if _ORIGINAL_FORWARD is not None:
        _mixer_class().forward = _ORIGINAL_FORWARD
        _ORIGINAL_FORWARD = None


def is_tk_kernels_applied_to_mamba2(model: Optional[torch.nn.Module] = None) -> bool:
    """Whether the class (``model=None``) or every mixer of ``model`` runs the tk forward."""
    if model is None:
        return _ORIGINAL_FORWARD is not None
    return all(_is_tk_forward(mixer.forward) for mixer in _mixers(model))


__all__ = ["apply_tk_kernels_to_mamba2", "is_tk_kernels_applied_to_mamba2", "undo_tk_kernels_for_mamba2"]
