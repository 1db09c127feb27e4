"""Long-convolution mixers on ``tk.fftconv``: ``ImplicitLongFilter``, ``LongConvolution``, ``GatedLongConvolution``.

``LongConvolution`` is a sequence mixer: hidden_states (B, N, H), like the other mixers of
tk_ops.nn, go through one causal convolution per channel,

    y[b, t, h] = sum_{s = 0 .. min(t, L - 1)} k[h, s] * x[b, t - s, h] + D[h] * x[b, t, h],

computed by ``tk.fftconv`` on the transposed (B, H, N) view. The filter k has L = min(N, max_len)
taps: the first L of either an explicit parameter ``weight`` (H, max_len) or of an
``ImplicitLongFilter`` (Hyena's filter, generated from the tap positions by a small MLP). A
sequence shorter than max_len therefore meets the start of the same filter, so a prefix of a
sequence gets the prefix of its output.

``GatedLongConvolution`` is Hyena's order-2 operator around it (Poli et al. 2023, "Hyena
Hierarchy"): an input projection to three streams, a short causal depthwise convolution on each
(``tk.causal_conv1d``), one gate before and one after the long convolution, and an output
projection.

Precision: the filter is built in its parameters' dtype with autocast off (it is (H, L), small
next to the activations, and every output sums all L of its taps). ``tk.fftconv`` then gets the
filter and D in fp32 when the activations are fp16/bf16 (the op's mixed-precision form), in the
activations' dtype otherwise. Under ``torch.autocast`` the projections of ``GatedLongConvolution``
(``tk_ops.nn.Linear``) hand 16-bit activations to the convolutions; ``LongConvolution`` itself
computes in its input's dtype.
"""

from __future__ import annotations

import math

import torch

from tk_ops.nn.linear import Linear
from tk_ops.ops.causal_conv1d import causal_conv1d
from tk_ops.ops.fftconv import fftconv

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_hidden_states(hidden_states, hidden_size: int) -> None:
    is_tensor = isinstance(hidden_states, torch.Tensor)
    if not is_tensor or hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        shape = tuple(hidden_states.shape) if is_tensor else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be (batch, seq_len, hidden_size={hidden_size}), got {shape}")


class SineActivation(torch.nn.Module):
    """``sin(frequency * x)`` with one learnable frequency per unit (Hyena's filter activation)."""

    def __init__(self, width: int, initial_frequency: float = 1.0, device=None, dtype=None) -> None:
        super().__init__()
        self.frequency = torch.nn.Parameter(torch.full((width,), float(initial_frequency), device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.frequency * x)


class ImplicitLongFilter(torch.nn.Module):
    """Hyena's implicit long filter: forward(L) -> k (H, L), a function of the tap positions.

    Tap l of a filter of at most ``max_len`` taps sits at t = l / max_len in [0, 1); the same tap
    has the same value for every L. With F = ``num_frequencies`` and ``depth`` hidden layers of
    ``width`` units:

        z(t)    = [t, cos(2 pi f t), sin(2 pi f t) for f = 1 .. F]          1 + 2F features
        a_0     = z(t),   a_i = sin(w_i * (W_i a_{i-1} + b_i))   i = 1 .. depth
        g_h(t)  = (W_out a_depth)_h (+ c_h when bias=True)
        k[h, l] = exp(-r_h t_l) * g_h(t_l)

    w_i are learnable per-unit frequencies (initially ``activation_frequency``), W_i, b_i, W_out
    (and c) learnable linear maps with nn.Linear's initialisation. The decay window exp(-r_h t)
    is fixed (not a parameter, not in the state_dict): channel h falls to ``decay_target`` of its
    start at t = tau_h, i.e. r_h = ln(1 / decay_target) / tau_h, with tau_h spaced geometrically
    from ``fastest_decay`` (channel 0, a short filter) to ``slowest_decay`` (channel H - 1, a
    filter that reaches across the whole sequence), so that the channels cover time scales at
    equal ratios. Since
    |sin| <= 1, |k[h, l]| <= (||W_out[h]||_1 + |c_h|) exp(-r_h t_l): the window bounds the filter.
    The optional bias c gives each channel a learnable multiple of its bare window, a decaying
    exponential (an SSM-like component).

    The filter is computed in the parameters' dtype with autocast disabled.
    """

    def __init__(
        self,
        num_channels: int,
        max_len: int,
        *,
        num_frequencies: int = 4,
        width: int = 64,
        depth: int = 2,
        activation_frequency: float = 1.0,
        fastest_decay: float = 0.3,
        slowest_decay: float = 1.5,
        decay_target: float = 1e-2,
        bias: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("num_channels", num_channels), ("max_len", max_len),
                            ("num_frequencies", num_frequencies), ("width", width), ("depth", depth)):
            _check_positive_int(name, value)
        if not 0 < fastest_decay <= slowest_decay:
            raise ValueError(
                "need 0 < fastest_decay <= slowest_decay, "
                f"got fastest_decay={fastest_decay}, slowest_decay={slowest_decay}"
            )
        if not 0 < decay_target < 1:
            raise ValueError(f"decay_target must lie in (0, 1), got {decay_target}")
        factory = {"device": device, "dtype": dtype}
        self.num_channels = num_channels
        self.max_len = max_len
        self.num_frequencies = num_frequencies

        layers: list[torch.nn.Module] = []
        in_features = 1 + 2 * num_frequencies
        for _ in range(depth):
            layers.append(torch.nn.Linear(in_features, width, **factory))
            layers.append(SineActivation(width, activation_frequency, **factory))
            in_features = width
        layers.append(torch.nn.Linear(width, num_channels, bias=bias, **factory))
        self.mlp = torch.nn.Sequential(*layers)

        self.fastest_decay = fastest_decay
        self.slowest_decay = slowest_decay
        self.decay_target = decay_target

    def _like_parameters(self) -> dict:
        weight = self.mlp[0].weight
        return {"device": weight.device, "dtype": weight.dtype}

    def decay_rates(self) -> torch.Tensor:
        """r_h = ln(1 / decay_target) / tau_h, tau_h geometric from fastest_decay to slowest_decay: (H,).
        Computed on each call in the parameters' dtype (no buffer to round when the module changes dtype)."""
        decay_times = torch.logspace(
            math.log10(self.fastest_decay), math.log10(self.slowest_decay), self.num_channels, **self._like_parameters()
        )
        return math.log(1 / self.decay_target) / decay_times

    def positions(self, filter_len: int) -> torch.Tensor:
        """t_l = l / max_len for l < filter_len, in the parameters' dtype and device: (L,)."""
        if isinstance(filter_len, bool) or not isinstance(filter_len, int) or not 1 <= filter_len <= self.max_len:
            raise ValueError(f"filter_len must be an integer in [1, max_len={self.max_len}], got {filter_len!r}")
        return torch.arange(filter_len, **self._like_parameters()) / self.max_len

    def decay_window(self, filter_len: int) -> torch.Tensor:
        """exp(-r_h t_l): (H, L)."""
        return torch.exp(-self.decay_rates()[:, None] * self.positions(filter_len))

    def forward(self, filter_len: int) -> torch.Tensor:
        """The filter's first ``filter_len`` taps, k (H, L), in the parameters' dtype."""
        t = self.positions(filter_len)
        angles = 2 * math.pi * t[:, None] * torch.arange(1, self.num_frequencies + 1, device=t.device, dtype=t.dtype)
        features = torch.cat([t[:, None], torch.cos(angles), torch.sin(angles)], dim=-1)  # (L, 1 + 2F)
        with torch.autocast(t.device.type, enabled=False):
            shapes = self.mlp(features).transpose(0, 1)  # (H, L)
        return shapes * self.decay_window(filter_len)

    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}, max_len={self.max_len}, num_frequencies={self.num_frequencies}"


def _for_fftconv(parameter: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 next to 16-bit activations (tk.fftconv's mixed-precision form), u's dtype otherwise."""
    return parameter.to(torch.float32 if u.dtype in _LOW_PRECISION else u.dtype)


class LongConvolution(torch.nn.Module):
    """Causal long convolution per channel plus a skip term: (B, N, H) -> (B, N, H) on ``tk.fftconv``.

    ``y[b, t, h] = sum_{s < min(t + 1, L)} k[h, s] x[b, t - s, h] + D[h] x[b, t, h]``, L = min(N, max_len).
    The input is in the (batch, seq_len, hidden) layout of the other mixers; the module hands
    tk.fftconv its (B, H, N) transpose (the op copies it to a unit stride along N) and returns
    the op's (B, H, N) output transposed back, a (B, N, H) view that is not contiguous.

    The filter k: ``implicit=False`` (default) an explicit parameter ``weight`` (H, max_len),
    initialised N(0, 1 / max_len) so that the convolution by a full-length filter has about the
    input's variance; ``implicit=True`` an ``ImplicitLongFilter(hidden_size, max_len, **filter_options)``
    as the submodule ``implicit_filter``. ``D`` (H,) is initialised to ones. ``filter(L)`` returns
    the first L taps.
    """

    def __init__(
        self, hidden_size: int, max_len: int, *, implicit: bool = False, device=None, dtype=None, **filter_options
    ) -> None:
        super().__init__()
        _check_positive_int("hidden_size", hidden_size)
        _check_positive_int("max_len", max_len)
        if filter_options and not implicit:
            raise ValueError(f"filter options {sorted(filter_options)} need implicit=True (an ImplicitLongFilter)")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.max_len = max_len
        self.implicit = implicit
        if implicit:
            self.implicit_filter = ImplicitLongFilter(hidden_size, max_len, **filter_options, **factory)
        else:
            self.weight = torch.nn.Parameter(torch.randn(hidden_size, max_len, **factory) / math.sqrt(max_len))
        self.D = torch.nn.Parameter(torch.ones(hidden_size, **factory))

    def filter(self, filter_len: int) -> torch.Tensor:
        """The first ``filter_len`` (<= max_len) taps of the filter: (H, L)."""
        if self.implicit:
            return self.implicit_filter(filter_len)
        if not 1 <= filter_len <= self.max_len:
            raise ValueError(f"filter_len must be in [1, max_len={self.max_len}], got {filter_len}")
        return self.weight[:, :filter_len]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _check_hidden_states(hidden_states, self.hidden_size)
        u = hidden_states.transpose(1, 2)
        k = self.filter(min(u.shape[-1], self.max_len))
        y = fftconv(u, _for_fftconv(k, u), D=_for_fftconv(self.D, u))
        return y.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, max_len={self.max_len}, implicit={self.implicit}"


class GatedLongConvolution(torch.nn.Module):
    """Hyena's order-2 operator: (B, N, hidden) -> (B, N, hidden), on tk.causal_conv1d and tk.fftconv.

        [g_out, g_in, v] = short_conv(in_proj(x))          in_proj to 3 hidden, split into thirds
        out              = out_proj(g_out * long_conv(g_in * v))

    ``short_conv`` is a causal depthwise convolution of ``short_conv_width`` taps with a bias over
    the 3 hidden projected channels (tk.causal_conv1d on the (B, N, 3 hidden) projection seen as
    (B, 3 hidden, N), no activation; its parameters live in an nn.Conv1d, weight (3 hidden, 1, W),
    as Hyena's and Mamba's do). ``long_conv`` is a ``LongConvolution(hidden, max_len,
    implicit=True, **filter_options)``; in_proj and out_proj are ``tk_ops.nn.Linear`` with a bias.
    """

    def __init__(
        self, hidden_size: int, max_len: int, *, short_conv_width: int = 3, device=None, dtype=None, **filter_options
    ) -> None:
        super().__init__()
        _check_positive_int("hidden_size", hidden_size)
        _check_positive_int("short_conv_width", short_conv_width)
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        projected = 3 * hidden_size
        self.in_proj = Linear(hidden_size, projected, **factory)
        self.short_conv = torch.nn.Conv1d(
            projected, projected, short_conv_width, groups=projected, padding=short_conv_width - 1, **factory
        )
        self.long_conv = LongConvolution(hidden_size, max_len, implicit=True, **factory, **filter_options)
        self.out_proj = Linear(hidden_size, hidden_size, **factory)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _check_hidden_states(hidden_states, self.hidden_size)
        projected = self.in_proj(hidden_states).transpose(1, 2)  # (B, 3 hidden, N), channel-last: read in place
        mixed = causal_conv1d(projected, self.short_conv.weight.squeeze(1), self.short_conv.bias).transpose(1, 2)
        output_gate, input_gate, value = mixed.split(self.hidden_size, dim=-1)
        return self.out_proj(output_gate * self.long_conv(input_gate * value))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"
