"""Opt-in switches that run unchanged Hugging Face transformers models through tk ops.

``enable_attention()`` registers ``"tk_ops"`` (``ATTENTION_IMPLEMENTATION``) with transformers'
``AttentionInterface``, so ``from_pretrained(..., attn_implementation="tk_ops")`` or
``model.set_attn_implementation("tk_ops")`` runs every attention layer of a model through
``tk_ops.attention`` / ``tk_ops.attention_varlen`` (``tk_attention_forward`` below says how).

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

``apply_tk_kernels_to_qwen3_next(model=None)`` does the same for transformers' ``Qwen3NextGatedDeltaNet``
(``transformers.models.qwen3_next.modeling_qwen3_next``, the linear-attention mixer of ``Qwen3NextModel``
and ``Qwen3NextForCausalLM``; the full-attention layers are left alone): its forward becomes
``tk_ops.nn.gated_deltanet.gated_deltanet_forward`` (in_proj_qkvz and in_proj_ba, ``tk.causal_conv1d`` +
SiLU, the gates, ``tk.gated_delta_rule`` with the l2norm of q and k, the gated RMSNorm on ``tk.rms_norm``,
out_proj), with ``undo_tk_kernels_for_qwen3_next`` and ``is_tk_kernels_applied_to_qwen3_next`` in the same
scopes; flash-linear-attention is not needed. What runs where is as for Mamba-2 (the prefill writes the conv
state and the final recurrent state), and HF's own forward also takes packed sequences (a ``cu_seq_lens_q``
keyword, which HF hands to the hub's fla kernels when they are installed) and a conv activation other than
SiLU. The mixer is the same in every release of the range except for the cache argument and the cache
questions, read as for Mamba-2 (5.17 groups q and k to the value heads in the mixer before the delta rule,
5.24 inside it: the same function). ``tk.gated_delta_rule`` runs its forward kernel on Hopper at
K = V = 128 (bf16/fp16; slower than flash-linear-attention's) and its reference for the backward and
everything else.

Supported transformers: ``SUPPORTED_TRANSFORMERS`` (>=5.17.0,<6, the range of pyproject.toml's
``test`` extra; CI tests 5.17.0 and the newest release). The switches raise ImportError on another
version. (Older releases are untested: 5.10 and before write the mixer's
cache differently, and 4.x and 5.0 through their own Mamba2Cache.) What differs inside the range,
and how it is read (for Mamba-2):
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

import importlib
import types
from typing import Optional

import torch

import tk_ops
from tk_ops import _checks
from tk_ops.nn.gated_deltanet import SILU_NAMES, gated_deltanet_forward
from tk_ops.nn.mamba2 import mamba2_mixer_forward

# The transformers releases the switch supports (pyproject.toml's test extra declares the same range).
SUPPORTED_TRANSFORMERS = ">=5.17.0,<6"

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


# ------------------------------------------------------------------------------ attention interface

# The name models select with attn_implementation=... once enable_attention() has run.
ATTENTION_IMPLEMENTATION = "tk_ops"


def _sliding_window(sliding_window, causal: bool):
    """HF's ``sliding_window`` W as tk's window, as HF's eager masks define it: causal, key j is seen from
    query i iff i - W < j <= i, i.e. (W - 1, 0); bidirectional, iff |i - j| <= W, i.e. (W, W)."""
    if sliding_window is None:
        return None
    return (int(sliding_window) - 1, 0) if causal else (int(sliding_window), int(sliding_window))


def _sinks_for(query: torch.Tensor, sinks):
    """HF's sinks (GPT-OSS's ``s_aux``, a parameter in the model's dtype) as the op takes them: fp32, or fp64
    beside fp64 activations (exact in the fp64 reference). The cast is differentiable."""
    if sinks is None:
        return None
    return sinks.to(_checks.compute_dtype(query.dtype))


def _to_int(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _packed_starts(position_ids: Optional[torch.Tensor], batch: int, q_len: int) -> Optional[torch.Tensor]:
    """The first row of every sequence of a padding-free packed batch (DataCollatorWithFlattening), or None.

    A batch is packed when it is one row (batch 1) of position_ids that restart: a sequence starts
    wherever a position is not the previous one plus 1, which is how transformers' masks split a packed
    row (flash_attention_2 splits where the position equals its minimum; for the collator's ids, which
    restart at 0, the two agree). Reading the ids is a device sync, as in the flash integration.
    """
    if position_ids is None or batch != 1 or q_len < 2:
        return None
    ids = position_ids.reshape(-1)[-q_len:]
    breaks = torch.nonzero(ids[1:] - ids[:-1] != 1).reshape(-1) + 1
    if breaks.numel() == 0:
        return None
    return torch.cat([breaks.new_zeros(1), breaks])


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """HF's (B, H, N, D) as rows (B * N, H, D), a view where the layout allows (HF's q, k, v are
    (B, N, H, D) projections transposed, so it does)."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], t.shape[3])


def tk_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
):
    """transformers' attention function signature on tk ops; returns (out (B, Nq, Hq, Dv), None).

    query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv) as the attention layers hand them
    over (GQA read in place, no repeat_kv). What the layer passes is read as follows:
    - ``scaling`` is the scale; ``is_causal`` (else ``module.is_causal``, else causal);
    - ``sliding_window`` W: window (W - 1, 0) when causal, (W, W) when not, as HF's eager masks;
    - ``softcap``: Gemma 2's logit softcap; ``s_aux`` (or ``sinks``): GPT-OSS's sinks, cast to fp32;
    - ``attention_mask``: what the mask function registered with it gives (transformers' own mask for
      flash attention): None, or the 2D padding mask (B, Nk) of booleans, which unpads q, k and v into
      ``tk_ops.attention_varlen`` (queries are the last Nq positions of the mask, as with left padding
      in generation; a query row of padding gets out 0). Any other mask (a 4D custom mask) raises;
    - ``cu_seq_lens_q/k`` and ``max_length_q/k`` (DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
      the packed row goes to ``tk_ops.attention_varlen`` as given;
    - else packed ``position_ids`` (batch 1, positions that restart: DataCollatorWithFlattening) are
      split into sequences for ``tk_ops.attention_varlen``;
    - otherwise ``tk_ops.attention`` on the dense tensors (causal bottom-right aligned: queries are the
      last Nq of the Nk positions, as with a cache).
    ``dropout`` > 0 raises (tk attention has no dropout); ``output_attentions`` gets no weights (None).
    """
    if dropout:
        raise ValueError(
            f"tk_ops attention has no dropout; got dropout={dropout} (set the config's attention_dropout to 0, "
            "or use another attn_implementation for training with attention dropout)"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    options = dict(
        causal=causal,
        scale=scaling,
        window=_sliding_window(sliding_window, causal),
        softcap=softcap,
        sinks=_sinks_for(query, sinks),
    )
    batch, q_heads, q_len, _ = query.shape
    value_dim = value.shape[-1]

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                "tk_ops attention takes a 2D padding mask (batch, keys) or none, got a mask of shape "
                f"{tuple(attention_mask.shape)} (a custom 4D mask needs another attn_implementation)"
            )
        mask = attention_mask.bool()
        key, value = key[:, :, : mask.shape[1]], value[:, :, : mask.shape[1]]  # a static cache's unused slots
        key_lengths = mask.sum(-1, dtype=torch.int32)
        key_rows = torch.nonzero(mask.reshape(-1)).reshape(-1)
        query_mask = mask[:, -q_len:]
        query_lengths = query_mask.sum(-1, dtype=torch.int32)
        query_rows = torch.nonzero(query_mask.reshape(-1)).reshape(-1)
        out = tk_ops.attention_varlen(
            _rows(query).index_select(0, query_rows),
            _rows(key).index_select(0, key_rows),
            _rows(value).index_select(0, key_rows),
            _cu_seqlens(query_lengths),
            _cu_seqlens(key_lengths),
            max(1, _to_int(query_lengths.max())),
            max(1, _to_int(key_lengths.max())),
            **options,
        )
        padded = out.new_zeros((batch * q_len, q_heads, value_dim)).index_copy(0, query_rows, out)
        return padded.view(batch, q_len, q_heads, value_dim), None

    cu_seqlens_q, cu_seqlens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_length_q, max_length_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if not all(x is not None for x in (cu_seqlens_q, cu_seqlens_k, max_length_q, max_length_k)):
        cu_seqlens_q = cu_seqlens_k = None
        starts = _packed_starts(kwargs.get("position_ids"), batch, q_len)
        if starts is not None:
            if key.shape[2] != q_len:
                raise ValueError(
                    "tk_ops attention: packed position_ids (several sequences in one row) with a cache that holds "
                    f"earlier keys ({key.shape[2]} keys for {q_len} queries) are not supported"
                )
            cu_seqlens_q = cu_seqlens_k = torch.cat([starts, starts.new_full((1,), q_len)]).to(torch.int32)
            max_length_q = max_length_k = _to_int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if cu_seqlens_q is not None:
        out = tk_ops.attention_varlen(
            _rows(query), _rows(key), _rows(value), cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
            _to_int(max_length_q), _to_int(max_length_k), **options,
        )
        return out.view(batch, q_len, q_heads, value_dim), None

    out = tk_ops.attention(query, key, value, **options)
    return out.transpose(1, 2), None


def enable_attention() -> None:
    """Register ``"tk_ops"`` with transformers' ``AttentionInterface`` (and, for its masks, with
    ``AttentionMaskInterface``: the mask function of flash attention, which hands over the 2D padding
    mask or None). Idempotent. Then ``attn_implementation="tk_ops"`` selects ``tk_attention_forward``."""
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, tk_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


# ------------------------------------------------------------------------------------------ mixer switches


class _ForwardSwitch:
    """Replaces the ``forward`` of one HF mixer class by ``tk_forward``: on the class (saving HF's), or on the
    mixers inside a model (instance attributes, which take precedence over the class)."""

    def __init__(self, module: str, class_name: str, tk_forward):
        self.module, self.class_name, self.tk_forward = module, class_name, tk_forward
        self.original_forward = None  # HF's, while the class is patched

    def mixer_class(self):
        return getattr(importlib.import_module(self.module), self.class_name)

    def hf_forward(self):
        """HF's own forward, whether or not the class is patched now."""
        return self.original_forward if self.original_forward is not None else self.mixer_class().forward

    def is_tk_forward(self, forward) -> bool:
        return getattr(forward, "__func__", forward) is self.tk_forward

    def mixers(self, model: torch.nn.Module) -> list:
        mixer_class = self.mixer_class()
        mixers = [module for module in model.modules() if isinstance(module, mixer_class)]
        if not mixers:
            raise ValueError(f"{type(model).__name__} contains no transformers {self.class_name}")
        return mixers

    def apply(self, model: Optional[torch.nn.Module]) -> None:
        check_transformers_version()
        if model is not None:
            for mixer in self.mixers(model):
                mixer.forward = types.MethodType(self.tk_forward, mixer)
            return
        if self.original_forward is None:
            mixer_class = self.mixer_class()
            self.original_forward = mixer_class.forward
            mixer_class.forward = self.tk_forward

    def undo(self, model: Optional[torch.nn.Module]) -> None:
        if model is not None:
            for mixer in self.mixers(model):
                if self.is_tk_forward(mixer.__dict__.get("forward")):
                    del mixer.forward
            return
        if self.original_forward is not None:
            self.mixer_class().forward = self.original_forward
            self.original_forward = None

    def is_applied(self, model: Optional[torch.nn.Module]) -> bool:
        if model is None:
            return self.original_forward is not None
        return all(self.is_tk_forward(mixer.forward) for mixer in self.mixers(model))


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


def _with_accelerate_hooks(forward):
    """``forward`` firing accelerate's hooks of the mixer's conv1d (offloading), as HF's forward does: the tk
    forwards read its weight directly."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except (ImportError, AttributeError):  # transformers missing, or a version without the decorator
        return forward
    return force_accelerate_hooks("conv1d")(forward)


# ---------------------------------------------------------------------------------------------- Mamba-2


def _tk_mamba2_mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, cache=None, **kwargs):
    """Mamba2Mixer.forward on tk ops; HF's own forward for decode steps (see the module docstring).

    transformers 5.24 renamed the mixer's ``cache_params`` argument to ``cache``; both are accepted,
    and HF's forward gets the cache by position (second in every version)."""
    cache = cache if cache is not None else cache_params
    if cache is not None and _cache_holds_state(cache, self.layer_idx):
        return _MAMBA2.hf_forward()(self, hidden_states, cache, attention_mask=attention_mask, **kwargs)
    return mamba2_mixer_forward(self, hidden_states, attention_mask=attention_mask, cache_params=cache)


_tk_mamba2_mixer_forward = _with_accelerate_hooks(_tk_mamba2_mixer_forward)
_MAMBA2 = _ForwardSwitch("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer", _tk_mamba2_mixer_forward)


def apply_tk_kernels_to_mamba2(model: Optional[torch.nn.Module] = None) -> None:
    """Run transformers' Mamba2Mixer through tk ops: the class (``model=None``) or the mixers of ``model``."""
    _MAMBA2.apply(model)


def undo_tk_kernels_for_mamba2(model: Optional[torch.nn.Module] = None) -> None:
    """Undo ``apply_tk_kernels_to_mamba2`` in the same scope: the class, or the mixers of ``model``
    (a model's mixers then follow the class again, patched or not)."""
    _MAMBA2.undo(model)


def is_tk_kernels_applied_to_mamba2(model: Optional[torch.nn.Module] = None) -> bool:
    """Whether the class (``model=None``) or every mixer of ``model`` runs the tk forward."""
    return _MAMBA2.is_applied(model)


# ------------------------------------------------------------------------------------------ Qwen3-Next


def _tk_qwen3_next_gated_deltanet_forward(self, hidden_states, cache_params=None, attention_mask=None, cache=None,
                                          **kwargs):
    """Qwen3NextGatedDeltaNet.forward on tk ops; HF's own forward for decode steps, packed sequences and a conv
    activation other than SiLU (see the module docstring). The cache is accepted under both of HF's names, as
    for Mamba-2."""
    cache = cache if cache is not None else cache_params
    if (
        (cache is not None and _cache_holds_state(cache, self.layer_idx))
        or kwargs.get("cu_seq_lens_q") is not None
        or self.activation not in SILU_NAMES
    ):
        return _QWEN3_NEXT.hf_forward()(self, hidden_states, cache, attention_mask=attention_mask, **kwargs)
    return gated_deltanet_forward(self, hidden_states, attention_mask=attention_mask, cache=cache)


_tk_qwen3_next_gated_deltanet_forward = _with_accelerate_hooks(_tk_qwen3_next_gated_deltanet_forward)
_QWEN3_NEXT = _ForwardSwitch("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet",
                             _tk_qwen3_next_gated_deltanet_forward)


def apply_tk_kernels_to_qwen3_next(model: Optional[torch.nn.Module] = None) -> None:
    """Run transformers' Qwen3NextGatedDeltaNet through tk ops: the class (``model=None``) or the mixers of
    ``model``. The full-attention layers are left alone."""
    _QWEN3_NEXT.apply(model)


def undo_tk_kernels_for_qwen3_next(model: Optional[torch.nn.Module] = None) -> None:
    """Undo ``apply_tk_kernels_to_qwen3_next`` in the same scope: the class, or the mixers of ``model``."""
    _QWEN3_NEXT.undo(model)


def is_tk_kernels_applied_to_qwen3_next(model: Optional[torch.nn.Module] = None) -> bool:
    """Whether the class (``model=None``) or every Gated DeltaNet mixer of ``model`` runs the tk forward."""
    return _QWEN3_NEXT.is_applied(model)


__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "apply_tk_kernels_to_mamba2",
    "apply_tk_kernels_to_qwen3_next",
    "check_transformers_version",
    "enable_attention",
    "is_tk_kernels_applied_to_mamba2",
    "is_tk_kernels_applied_to_qwen3_next",
    "tk_attention_forward",
    "undo_tk_kernels_for_mamba2",
    "undo_tk_kernels_for_qwen3_next",
]
