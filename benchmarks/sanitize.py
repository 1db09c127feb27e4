"""Small runs of each kernel for compute-sanitizer (memcheck, racecheck, synccheck).

Usage, from the repository root:
  compute-sanitizer --tool memcheck --kernel-name kns=producer_consumer python3 -m benchmarks.sanitize gemm

Each op runs a few awkward shapes (tails in M, N and K, a single row, several tiles per block)
and checks its result against float64, so a sanitizer run is also a correctness run.
"""

from __future__ import annotations

import argparse

import torch

import tk_ops

# (M, K, N) with tails everywhere and K = 1; the last has several tiles per dimension.
GEMM_SHAPES = [(1, 8, 8), (97, 1, 136), (131, 72, 264), (200, 136, 520), (520, 64, 1040)]


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.mT.contiguous().mT


def check(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    err = ((out.double() - expected).norm() / expected.norm()).item()
    status = "ok" if err < 1e-2 else "WRONG"
    print(f"{name:50} rel err {err:.2e} {status}")
    if status != "ok":
        raise SystemExit(f"{name}: relative error {err:.2e}")


def sanitize_gemm() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for M, K, N in GEMM_SHAPES:
            a = torch.randn(M, K, device="cuda", dtype=dtype)
            b = torch.randn(K, N, device="cuda", dtype=dtype)
            for layout, (x, y) in {
                "nn": (a, b), "nt": (a, column_major(b)), "tn": (column_major(a), b), "tt": (column_major(a), column_major(b))
            }.items():
                check(f"matmul {M}x{K}x{N} {layout} {dtype}", tk_ops.matmul(x, y), a.double() @ b.double())
            weight = torch.randn(N, K, device="cuda", dtype=dtype)
            bias = torch.randn(N, device="cuda", dtype=dtype)
            check(f"linear+bias {M}x{K}x{N} {dtype}", tk_ops.linear(a, weight, bias),
                  a.double() @ weight.double().T + bias.double())
            grad = torch.randn(M, N, device="cuda", dtype=dtype)
            grad_x, grad_w, _ = torch.ops.tk.linear_bwd(grad, a, weight, [True, True, True])
            check(f"linear_bwd dx {M}x{K}x{N} {dtype}", grad_x, grad.double() @ weight.double())
            check(f"linear_bwd dw {M}x{K}x{N} {dtype}", grad_w, grad.double().T @ a.double())
    torch.cuda.synchronize()


SANITIZERS = {"gemm": sanitize_gemm}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="+", choices=sorted(SANITIZERS))
    args = parser.parse_args()
    assert tk_ops.backends()["matmul"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    for op in args.ops:
        SANITIZERS[op]()
