"""Host time per eager call: each kernel-backed tk op against its torch counterpart, on inputs so
small that the GPU is idle and a call costs what the host spends on it (the public function, the
dispatcher, autograd, the C++ checks, tensor-map encoding, the launch).

Run from the repository root on the GPU machine: python3 -m benchmarks.bench_overhead [--out DIR]
Counterparts: torch.matmul, F.linear, F.scaled_dot_product_attention, F.layer_norm, F.rms_norm, and
for rope / rope_qk the rotate_half formula compiled with torch.compile (as Hugging Face models run
it compiled). Inputs require grad in both passes (a training step's calls): fwd is the forward call
alone, fwd_bwd the forward and out.sum().backward().

Rows: op, pass; per provider (tk_ops, torch) the median over rounds of milliseconds per call, twice:
  <provider>_ms        wall clock (perf_counter) around `calls` back-to-back calls and a synchronize
  <provider>_event_ms  CUDA events recorded before the first and after the last call: the GPU's view,
                       which equals the host's time per call whenever the host is the bottleneck
The table prints microseconds and ours - torch's.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
CALLS = 200
ROUNDS = 7


def _rotate_half_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_compiled_rope = torch.compile(_rotate_half_rope, fullgraph=True, dynamic=False)


def cases():
    """(op, ours, torch's, inputs); the inputs require grad."""

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
        ("rope", lambda x: tk_ops.rope(x, cos, sin), lambda x: _compiled_rope(x, cos_full, sin_full), (q,)),
        ("rope_qk", lambda q, k: tk_ops.rope_qk(q, k, cos, sin),
         lambda q, k: (_compiled_rope(q, cos_full, sin_full), _compiled_rope(k, cos_full, sin_full)), (q, k)),
    ]


def fwd_bwd(fn):
    def run(*inputs):
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(out.sum() for out in outs).backward()

    return run


def per_call_ms(fn, inputs: tuple) -> tuple[float, float]:
    """(wall clock, CUDA events) milliseconds per call, medians over ROUNDS rounds of CALLS calls."""
    for _ in range(20):
        fn(*inputs)
    torch.cuda.synchronize()
    wall, events = [], []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(CALLS):
            fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - began) * 1e3 / CALLS)
        events.append(start.elapsed_time(end) / CALLS)
    return statistics.median(wall), statistics.median(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results into this folder")
    args = parser.parse_args()
    rows = []
    print(f"{'op':11} {'pass':8} {'tk_ops us':>10} {'torch us':>9} {'extra us':>9}   "
          f"{'events: tk_ops':>14} {'torch':>7} {'extra':>7}")
    for op, ours, theirs, inputs in cases():
        for pass_name, wrap in (("fwd", lambda f: f), ("fwd_bwd", fwd_bwd)):
            ours_wall, ours_events = per_call_ms(wrap(ours), inputs)
            torch_wall, torch_events = per_call_ms(wrap(theirs), inputs)
            rows.append({"op": op, "pass": pass_name, "tk_ops_ms": round(ours_wall, 6), "torch_ms": round(torch_wall, 6),
                         "tk_ops_event_ms": round(ours_events, 6), "torch_event_ms": round(torch_events, 6)})
            print(f"{op:11} {pass_name:8} {ours_wall * 1e3:10.1f} {torch_wall * 1e3:9.1f} "
                  f"{(ours_wall - torch_wall) * 1e3:9.1f}   {ours_events * 1e3:14.1f} {torch_events * 1e3:7.1f} "
                  f"{(ours_events - torch_events) * 1e3:7.1f}")
    common.write_results("overhead", rows, [args.out] if args.out else [common.RESULTS],
                         calls_per_round=CALLS, rounds=ROUNDS, dtype=str(DTYPE).replace("torch.", ""))


if __name__ == "__main__":
    main()
