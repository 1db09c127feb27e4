"""Host time per eager call: each kernel-backed tk op against its torch counterpart, on inputs so
small that the GPU is idle and the call costs what the host spends on it (the Python op layer,
argument checks, tensor-map encoding, the launch).

Run from the repository root on the GPU machine: python3 -m benchmarks.bench_overhead [--out DIR]
Rows: op, pass (fwd, or fwd_bwd through autograd), tk_ops_ms / torch_ms: milliseconds of host time
per call (the table prints microseconds).
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16


def _rotate_half_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def cases():
    """(op, ours, torch's, inputs); tensors that take gradients are marked with requires_grad."""

    def t(*shape, grad=True):
        return torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=grad)

    a, b = t(64, 64), t(64, 64)
    q, k, v = t(1, 2, 64, 64), t(1, 2, 64, 64), t(1, 2, 64, 64)
    x, w, bias = t(64, 256), t(256), t(256)
    positions = 64
    cos = torch.randn(positions, 32, device="cuda", dtype=DTYPE)
    sin = torch.randn(positions, 32, device="cuda", dtype=DTYPE)
    cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return [
        ("matmul", tk_ops.matmul, torch.matmul, (a, b)),
        ("linear", tk_ops.linear, F.linear, (x, t(128, 256), t(128))),
        ("attention", lambda *i: tk_ops.attention(*i, causal=True),
         lambda *i: F.scaled_dot_product_attention(*i, is_causal=True), (q, k, v)),
        ("layer_norm", lambda x, w, b: tk_ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (256,), w, b),
         (x, w, bias)),
        ("rms_norm", lambda x, w: tk_ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (256,), w, 1e-6), (x, w)),
        ("rope", lambda x: tk_ops.rope(x, cos, sin), lambda x: _rotate_half_rope(x, cos_full, sin_full), (q,)),
    ]


def fwd_bwd(fn):
    def run(*inputs):
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results into this folder")
    args = parser.parse_args()
    rows = []
    print(f"{'op':12} {'pass':8} {'tk_ops us':>10} {'torch us':>10} {'extra us':>9}")
    for op, ours, theirs, inputs in cases():
        for pass_name, wrap in (("fwd", lambda f: f), ("fwd_bwd", fwd_bwd)):
            ours_us = common.host_us_per_call(wrap(ours), inputs)
            torch_us = common.host_us_per_call(wrap(theirs), inputs)
            rows.append({"op": op, "pass": pass_name, "tk_ops_ms": ours_us / 1e3, "torch_ms": torch_us / 1e3})
            print(f"{op:12} {pass_name:8} {ours_us:10.1f} {torch_us:10.1f} {ours_us - torch_us:9.1f}")
    common.write_results("overhead", rows, [args.out] if args.out else [common.RESULTS])


if __name__ == "__main__":
    main()
