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

Supported transformers: ``SUPPORTED_TRANSFORMERS`` (>=5.17.0,<6, the range of pyproject.toml's
``test`` extra; CI tests 5.17.0 and the newest release). ``apply_tk_kernels_to_mamba2`` raises
ImportError on another version. (Older releases are untested: 5.10 and before write the mixer's
cache differently, and 4.x and 5.0 through their own Mamba2Cache.) What differs inside the range,
and how it is read:
- the gated norm: HF's ``MambaRMSNormGated`` has a ``group_size`` (intermediate_size // n_groups)
  from 5.23 and normalises over all intermediate channels before (no ``group_size``);
  ``tk_ops.nn.mamba2.gated_norm_group_size`` reads the norm's own grouping, so the switch computes
  what the installed version's torch path computes (for n_groups > 1 releases before 5.23 compute
  another function than later ones and mamba_ssm). Its eps is ``variance_epsilon`` in every version;
- the mixer's cache argument: ``cache_params`` up to 5.23, ``cache`` from 5.24 (whose
  ``deprecate_kwarg`` maps ``cache_params`` to it, announced until 5.40); both are accepted;
- whether the cache holds the layer's state: from 5.21 HF's forward asks ``get_conv_state`` /
  ``get_recurrent_state`` / ``is_recording_past``; before, ``has_previous_state(layer_idx)`` and the
  cache layer's ``record_past``; the switch asks what the installed version's forward asks. The
  prefill writes the states with ``update_conv_state`` / ``update_recurrent_state``, the same in
  every version of the range.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from tk_ops.nn.mamba2 import mamba2_mixer_forward

# The transformers releases the switch supports (pyproject.toml's test extra declares the same range).
SUPPORTED_TRANSFORMERS = ">=5.17.0,<6"

# HF's Mamba2Mixer.forward, saved when the class is patched.
_ORIGINAL_FORWARD = None


def _installed_transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_transformers_version() -> str:
    """The installed transformers' version, if ``SUPPORTED_TRANSFORMERS`` contains it; ImportError otherwise."""
    hint = (
        f"tk_ops.transformers supports transformers{SUPPORTED_TRANSFORMERS}: "
        f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
    )
    try:
        version = _installed_transformers_version()
    except ImportError as error:
        raise ImportError(f"transformers is not installed; {hint}") from error
    from packaging.specifiers import SpecifierSet  # a dependency of transformers

    if not SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version, prereleases=True):
        raise ImportError(f"transformers {version} is installed; {hint}")
    return version


def _mixer_class():
    from transformers.models.mamba2 import modeling_mamba2

    return modeling_mamba2.Mamba2Mixer


def _hf_forward():
    """HF's own forward, whether or not the class is patched now."""
    return _ORIGINAL_FORWARD if _ORIGINAL_FORWARD is not None else _mixer_class().forward


def _cache_holds_state(cache, layer_idx) -> bool:
    """Whether HF's forward would read the layer's state from ``cache`` (a decode step, a continued
    cache) or the cache records the past: asked as the installed version's forward asks it."""
    if hasattr(cache, "get_conv_state"):  # transformers >= 5.21
        return (
            cache.get_conv_state(layer_idx) is not None
            or cache.get_recurrent_state(layer_idx) is not None
            or cache.is_recording_past(layer_idx)
        )
    if cache.has_previous_state(layer_idx):  # 5.17 - 5.20 (False for a layer not created yet)
        return True
    return layer_idx < len(cache.layers) and bool(getattr(cache.layers[layer_idx], "record_past", False))


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
    check_transformers_version()
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


__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "apply_tk_kernels_to_mamba2",
    "check_transformers_version",
    "is_tk_kernels_applied_to_mamba2",
    "undo_tk_kernels_for_mamba2",
]
