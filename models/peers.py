"""The peer libraries' ops that the linear-time models can run their mixers on (``config.peer=True``).

A peer model is the third implementation of a model, beside tk_ops and the pure-PyTorch reference,
with the same parameters and state_dict: the reference model (``F.linear``, the PyTorch RMSNorm,
SDPA in Based's attention blocks) whose mixer takes its sequence op from the library a user would
reach for without tk_ops (peers.md, section 7):

    based   fla-core's ``parallel_based(q, k, v, scale=F**-0.5, use_norm=True)`` on (B, N, H, .)
            tensors: 1 + s + s^2/2 with s = (q F**-0.5) . k, divided by its causal row sum + 1e-6,
            the epsilon the models' Based mixers use (``CAUSAL_EPS["parallel"]``). fla's layer calls
            it so in its default 'parallel' mode; it was faster than ``fused_chunk_based`` at every
            N of linear_attention.json (1k..16k: 1.3-2.4x forward, 1.6-3.6x forward + backward).
    mamba2  mamba_ssm's Triton SSD, ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D,
            dt_bias=dt_bias, dt_softplus=True, dt_limit=time_step_limit)``, after ``F.conv1d`` + SiLU:
            mamba_ssm's ``Mamba2`` layer without its causal_conv1d package (its fused path needs it).
            The gated RMSNorm stays the reference's, in fp32.
    hyena   ``torch.fft`` (real FFTs of size 2N, in fp32): the reference path's long convolution
            already, so a Hyena peer model computes exactly what its reference model does.

(Llama's peer is its reference path too: SDPA, which picks cuDNN or FlashAttention-2 on the H100.)

fla and mamba_ssm are not dependencies of tk_ops: they are imported when a peer mixer is built, and
one that does not import raises ``PeerUnavailable``, which names the package, why the import failed
and where the GPU machine gets it (the carried ``.baselines``: benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

# --model -> the peer op its mixers run with peer=True
PEER_OPS = {
    "based": "fla-core parallel_based",
    "mamba2": "mamba_ssm mamba_chunk_scan_combined (Triton SSD) + F.conv1d",
    "hyena": "torch.fft (the reference path's long convolution)",
}
# models whose peer model is their reference model (nothing to import, nothing to time twice)
PEER_IS_REFERENCE = ("hyena",)


class PeerUnavailable(ImportError):
    """A peer model was asked for where its peer library does not import."""


def check_flags(reference: bool, peer: bool) -> None:
    """A config's ``peer`` needs ``reference``: the peer model is the reference model with the peer's mixer op."""
    if peer and not reference:
        raise ValueError(
            "peer=True needs reference=True: a peer model is the reference model (plain PyTorch layers) "
            "with its mixer's sequence op from the peer library"
        )


def _load(module: str, name: str, package: str, model: str) -> Callable:
    """The peer op, hidden from torch.compile: compiled peer models compile everything around it and
    run the op as its library ships it (Inductor re-compiling fla 0.6.0's Triton backward fails on
    the H100's torch 2.11: a CompilationError in Triton's dot, benchmarks/results/training.md)."""
    try:
        return torch.compiler.disable(getattr(importlib.import_module(module), name))
    except Exception as error:  # not installed, or one of its own imports (triton, a GPU) fails
        raise PeerUnavailable(
            f"{model} with peer=True runs {module}.{name} from {package}, which does not import here "
            f"({type(error).__name__}: {error}). Install {package} (on the GPU machine: carry .baselines, "
            "see benchmarks/gpu_session.sh), or use the tk_ops path or the reference path"
        ) from error


def fla_parallel_based() -> Callable:
    """``fla.ops.based.parallel_based(q, k, v, scale=None, use_norm=True)``, q, k (B, N, H, F), v (B, N, H, Dv)."""
    return _load("fla.ops.based", "parallel_based", "fla-core (0.6.0)", "models.based")


def mamba_chunk_scan_combined() -> Callable:
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None,
    ..., dt_bias=None, ..., dt_softplus=False, dt_limit=(0.0, inf), ...)``, x (B, L, H, P), dt (B, L, H),
    A (H,), B and C (B, L, G, N)."""
    return _load(
        "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba-ssm (2.3.2)", "models.mamba2"
    )


def versions() -> dict[str, Optional[str]]:
    """The version of each peer package that imports here (None: it does not), for results files."""
    found = {}
    for package in ("fla", "mamba_ssm"):
        try:
            found[package] = getattr(importlib.import_module(package), "__version__", "unknown version")
        except Exception:  # absent or broken: the rows of its peer models say why
            found[package] = None
    return found
