"""Where the host time of one eager tk op call goes, layer by layer, on the CPU (reference path).

Run from the repository root on any machine: python3 -m benchmarks.overhead_layers [--calls N] [--library SO]
[--device cuda]. Every op runs on tiny tensors, so each call costs what the layers around the math
cost plus a tiny computation (on the CPU the reference; with --device cuda the kernels, bf16). Per op, microseconds per call (best of several rounds):

  public      tk_ops.<op>(...), inputs without requires_grad
  op_call     torch.ops.tk.<op>.default on the arguments the public function hands it (no grad)
  below       the same under _AutoDispatchBelowAutograd: dispatcher + the CPU kernel (the
              Python reference, behind torch.library's wrappers)
  reference   the reference function itself, called from Python
  public_grad / op_call_grad   as public / op_call with inputs that require grad (builds the autograd node)
  fwd_bwd     public_grad plus out.sum().backward()
  torch / torch_fwd_bwd   the torch counterpart (matmul, F.linear, SDPA, F.layer_norm, F.rms_norm,
              the rotate_half RoPE formula in eager)

The differences name the layers: public - op_call = the public function's checks, autocast and
views; op_call - below = the autograd kernel when nothing needs grad; op_call_grad - below = the autograd kernel
building the node; below - reference = dispatcher and kernel wrappers. On CUDA the reference is
replaced by the C++ kernel, the rest is the same code.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

import tk_ops
from tk_ops.ops import attention as attention_mod
from tk_ops.ops import layer_norm as layer_norm_mod
from tk_ops.ops import matmul as matmul_mod
from tk_ops.ops import rms_norm as rms_norm_mod
from tk_ops.ops import rope as rope_mod

DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn: Callable[[], object], calls: int, device: str, rounds: int = 7) -> float:
    """Best of ``rounds`` averages over ``calls`` calls, in microseconds (the machine is shared)."""
    for _ in range(max(10, calls // 20)):
        fn()
    _synchronize(device)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _rotate_half_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def cases(device: str):
    """(name, public(*inputs), op(*inputs) with the public function's normalised arguments,
    the op, the reference, torch's counterpart, inputs); the first inputs are the differentiable ones.
    Sizes the kernels take (so that CUDA runs them) and as small as that allows."""

    def t(*shape):
        return torch.randn(*shape, dtype=DTYPES[device], device=device)

    a, b = t(8, 8), t(8, 8)
    x, weight, bias = t(4, 16), t(16), t(16)
    w_linear, b_linear = t(8, 16), t(8)
    q, k, v = t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 64)
    cos, sin = t(8, 32), t(8, 32)
    cos3, sin3 = cos.unsqueeze(0), sin.unsqueeze(0)
    cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    scale = 0.125
    return [
        ("matmul", tk_ops.matmul, matmul_mod.matmul_op, (), matmul_mod._matmul_reference, torch.matmul, (a, b)),
        ("linear", tk_ops.linear, matmul_mod.linear_op, (), matmul_mod._linear_reference, F.linear,
         (x, w_linear, b_linear)),
        ("attention", lambda q, k, v: tk_ops.attention(q, k, v, causal=True), attention_mod.attention_op,
         (True, scale, False), attention_mod._attention_reference,
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        ("layer_norm", lambda x, w, b: tk_ops.layer_norm(x, w, b), layer_norm_mod.layer_norm_op,
         (None, None, 1e-5, 0.0), layer_norm_mod._layer_norm_reference,
         lambda x, w, b: F.layer_norm(x, (16,), w, b), (x, weight, bias)),
        ("rms_norm", lambda x, w: tk_ops.rms_norm(x, w), rms_norm_mod.rms_norm_op, (None, 1e-6),
         rms_norm_mod._rms_norm_reference, lambda x, w: F.rms_norm(x, (16,), w, 1e-6), (x, weight)),
        ("rope", lambda x: tk_ops.rope(x, cos, sin), rope_mod.rope_op, (cos3, sin3, False),
         rope_mod._rope_reference, lambda x: _rotate_half_rope(x, cos_full, sin_full), (q,)),
        ("rope_qk", lambda q, k: tk_ops.rope_qk(q, k, cos, sin), rope_mod.rope_qk_op, (cos3, sin3, False),
         rope_mod._rope_qk_reference,
         lambda q, k: (_rotate_half_rope(q, cos_full, sin_full), _rotate_half_rope(k, cos_full, sin_full)), (q, k)),
    ]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def measure(calls: int, device: str) -> list[dict]:
    rows = []
    for name, public, op, extra, reference, theirs, inputs in cases(device):
        plain = tuple(i.detach() for i in inputs)
        grads = tuple(i.detach().requires_grad_() for i in inputs)
        op_args = plain + extra
        op_grad_args = grads + extra

        def below():
            with torch._C._AutoDispatchBelowAutograd():
                return op(*op_args)

        def fwd_bwd(fn):
            return lambda: _first(fn(*grads)).sum().backward()

        row = {
            "op": name,
            "public": per_call_us(lambda: public(*plain), calls, device),
            "op_call": per_call_us(lambda: op(*op_args), calls, device),
            "below": per_call_us(below, calls, device),
            "reference": per_call_us(lambda: reference(*op_args), calls, device) if device == "cpu" else float("nan"),
            "public_grad": per_call_us(lambda: public(*grads), calls, device),
            "op_call_grad": per_call_us(lambda: op(*op_grad_args), calls, device),
            "fwd_bwd": per_call_us(fwd_bwd(public), calls // 2, device),
            "torch": per_call_us(lambda: theirs(*plain), calls, device),
            "torch_fwd_bwd": per_call_us(fwd_bwd(theirs), calls // 2, device),
        }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu", choices=sorted(DTYPES), help="cuda: the kernels, bf16 (no reference column)")
    parser.add_argument(
        "--library",
        help="load this shared library first, e.g. csrc/torch/autograd.cpp built for AutogradCPU "
        "(tests/test_cpp_autograd.py builds one), to time the C++ autograd kernels on the CPU",
    )
    args = parser.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
        tk_ops._library.register_cpp_autograd()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(f"tk_ops extension: {tk_ops.extension_status()}; torch {torch.__version__}; {args.device}; us per call, best of 7")
    columns = ("public", "op_call", "below", "reference", "public_grad", "op_call_grad", "fwd_bwd", "torch", "torch_fwd_bwd")
    print(f"{'op':11}" + "".join(f"{c:>14}" for c in columns))
    for row in measure(args.calls, args.device):
        print(f"{row['op']:11}" + "".join(f"{row[c]:14.1f}" for c in columns))


if __name__ == "__main__":
    main()
