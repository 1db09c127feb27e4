"""What the Hugging Face drop-in mixers (Mamba2Mixer, GatedDeltaNet) share: construction from a transformers
config, whose field names their constructors take, and the refusal of HF's cache arguments (they compute full
sequences; their transformers switches keep HF's module for cached generation)."""

from __future__ import annotations

import inspect

# Constructor arguments that are not config fields.
_NOT_CONFIG_FIELDS = ("layer_idx", "device", "dtype")


def config_arguments(cls, config) -> dict:
    """``cls``'s constructor arguments (but layer_idx, device and dtype) that ``config`` has a field of the same
    name for, with their values; the others keep their defaults."""
    names = [name for name in inspect.signature(cls).parameters if name not in _NOT_CONFIG_FIELDS]
    return {name: getattr(config, name) for name in names if hasattr(config, name)}


def from_hf_config(cls, config, layer_idx, device, dtype):
    """``cls`` built from a transformers config (config_arguments) and the other three arguments."""
    return cls(**config_arguments(cls, config), layer_idx=layer_idx, device=device, dtype=dtype)


def refuse_cache(module, cache_params, cache, hf_module: str, switch: str) -> None:
    """Raise NotImplementedError if a cache came under either of HF's names (``cache_params``; ``cache`` from
    transformers 5.24), saying what to use instead."""
    if cache_params is not None or cache is not None:
        raise NotImplementedError(
            f"tk_ops.nn.{type(module).__name__} computes full sequences only (no cache prefill, no single-step "
            f"decode); pass use_cache=False, or keep HF's {hf_module} and call tk_ops.transformers.{switch}(), "
            "which handles caches"
        )
