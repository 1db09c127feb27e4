"""tk.mamba2_ssd forward: the Hopper SSD kernel, its correctness check and its timing.

    python3 -m benchmarks.bench_mamba2_ssd --check    every kernel variant (bf16/fp16, N 64/128, chunk
                                                     64/128/256, gating, D, dt_bias + softplus, initial
                                                     states, odd L) against a float64 sequential
                                                     recurrence; non-zero exit on a wrong result
    python3 -m benchmarks.bench_mamba2_ssd           forward times (ms) of Mamba-2 sized problems
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def inputs(Bt, L, H, G, N, dtype, gated=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, to=dtype):
        return torch.randn(*shape, device="cuda", generator=gen).to(to)

    return dict(
        x=randn(Bt, L, H, 64), dt=randn(Bt, L, H, to=torch.float32) * 0.5 - 1.5,
        A=-0.3 - torch.rand(H, device="cuda", generator=gen), B=randn(Bt, L, G, N), C=randn(Bt, L, G, N),
        D=randn(H, to=torch.float32), z=randn(Bt, L, H, 64) if gated else None,
        dt_bias=randn(H, to=torch.float32) * 0.3, initial_states=randn(Bt, H, 64, N, to=torch.float32),
    )


def recurrence(t):
    """y and the final state, one position at a time in float64 (softplus, dt_bias, D, z), on the CPU:
    hundreds of tiny steps there, not hundreds of launches under compute-sanitizer."""
    t = {name: None if u is None else u.cpu().double() for name, u in t.items()}
    x, B, C = t["x"], t["B"], t["C"]
    dt = F.softplus(t["dt"] + t["dt_bias"])
    A = t["A"]
    H = x.shape[2]
    B, C = (u.repeat_interleave(H // u.shape[2], 2) for u in (B, C))
    state = t["initial_states"]
    ys = []
    for i in range(x.shape[1]):
        step = dt[:, i, :, None, None]
        state = torch.exp(step * A[:, None, None]) * state + step * x[:, i, :, :, None] * B[:, i, :, None, :]
        ys.append((state * C[:, i, :, None, :]).sum(-1))
    y = torch.stack(ys, 1) + x * t["D"][:, None]
    if t["z"] is not None:
        y = y * F.silu(t["z"])
    return y, state


def forward(t, chunk_size):
    return torch.ops.tk.mamba2_ssd.default(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size, t["D"], t["z"], t["dt_bias"], True, t["initial_states"]
    )


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def check() -> int:
    failures = 0
    for dtype in (torch.bfloat16, torch.float16):
        for N in (64, 128):
            for chunk_size in (64, 128, 256):
                for L, gated in ((1, True), (333, True), (700, False)):
                    t = inputs(2, L, 4, 2, N, dtype, gated)
                    y, final, _ = forward(t, chunk_size)
                    want_y, want_final = recurrence(t)
                    errs = rel_err(y, want_y), rel_err(final, want_final)
                    ok = max(errs) <= TOLERANCE[dtype]
                    failures += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {dtype} N={N} chunk={chunk_size} L={L} gated={gated} "
                          f"y {errs[0]:.2e} final {errs[1]:.2e}")
    return 1 if failures else 0


def timing() -> None:
    for Bt, L, H, G, N in ((4, 4096, 32, 1, 128), (8, 2048, 64, 8, 64)):
        t = inputs(Bt, L, H, G, N, torch.bfloat16)
        call = lambda: forward(t, 256)  # noqa: E731
        for _ in range(3):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        torch.cuda.synchronize()
        print(f"Bt={Bt} L={L} H={H} G={G} N={N}: {start.elapsed_time(end) / 20:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="correctness against float64; non-zero exit on failure")
    args = parser.parse_args()
    import tk_ops  # noqa: F401  (registers the ops)

    if args.check:
        sys.exit(check())
    timing()


if __name__ == "__main__":
    main()
