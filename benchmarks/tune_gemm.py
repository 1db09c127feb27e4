"""Compare candidate GEMM tile plans (benchmarks/tune/gemm_plans.cu) on the shapes that decide them.

Builds the candidates with torch.utils.cpp_extension, then times each candidate and cuBLAS on
bf16 problems, eagerly (CUDA events over back-to-back calls) and, for the short problems where
launch overhead hides the kernel, as CUDA-graph replays. Run from the repository root:
python3 -m benchmarks.tune_gemm
"""

from __future__ import annotations

import pathlib
import statistics

import torch

from benchmarks import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
PASSES = 3

# (M, N, K, layout): A then B, n = row-major, t = column-major view.
SHAPES = [
    (2048, 2048, 2048, "nn"),
    (4096, 4096, 4096, "nn"),
    (4096, 4096, 4096, "nt"),
    (8192, 8192, 8192, "nn"),
    (8192, 8192, 8192, "nt"),
    (16384, 11008, 4096, "nt"),
    (4096, 4096, 64, "nn"),
    (4096, 4096, 256, "nn"),
]


def build():
    from torch.utils import cpp_extension

    build_dir = ROOT / "build" / "tune_gemm"
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="tk_tune_gemm",
        sources=[str(ROOT / "benchmarks" / "tune" / "binding.cpp"), str(ROOT / "benchmarks" / "tune" / "gemm_plans.cu")],
        extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "benchmarks" / "tune")],
        extra_cflags=["-O2", "-std=c++20"],
        extra_cuda_cflags=["-O3", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr"],
        build_directory=str(build_dir),
    )


def operands(m, n, k, layout):
    a = torch.randn(k, m, device="cuda").bfloat16().mT if layout[0] == "t" else torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(n, k, device="cuda").bfloat16().mT if layout[1] == "t" else torch.randn(k, n, device="cuda").bfloat16()
    return a, b


def main() -> None:
    import tk_ops

    tiny = operands(256, 256, 256, "nn")
    print("host us per call (256^3): " + ", ".join(
        f"{name} {common.host_us_per_call(fn, tiny):.1f}"
        for name, fn in (("tk_ops.matmul", tk_ops.matmul), ("torch.ops.tk.matmul", torch.ops.tk.matmul.default),
                         ("torch.matmul", torch.matmul))
    ))
    plans = build()
    names = [plans.candidate_name(i) for i in range(plans.candidates())]
    print("candidates:", ", ".join(f"{i}: {name}" for i, name in enumerate(names)))
    ratios = {i: [] for i in range(len(names))}
    for m, n, k, layout in SHAPES:
        first = operands(m, n, k, layout)
        sets = [first] + [operands(m, n, k, layout) for _ in range(common.rotation_count(2 * (m * k + k * n + m * n)) - 1)]
        flops = 2.0 * m * n * k
        expected = torch.matmul(*first).float()
        for i in range(len(names)):
            out = plans.run(i, *first)
            assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2, f"candidate {i} is wrong"
        short = flops < 2e11
        timer = common.time_graph_ms if short else common.time_ms
        # Passes interleave cuBLAS and the candidates in a rotating order, so that clock and
        # temperature drift spread over all of them; each candidate's ratio is the median over passes.
        per_pass = {i: [] for i in range(len(names))}
        for p in range(PASSES):
            order = list(range(len(names)))
            order = order[p % len(order):] + order[: p % len(order)]
            base = timer(torch.matmul, sets)
            for i in order:
                per_pass[i].append(base / timer(lambda a, b: plans.run(i, a, b), sets))
        line = f"{m}x{n}x{k} {layout} ({'graph' if short else 'eager'}), cuBLAS {flops / base / 1e9:6.1f} TF/s, ratios:"
        for i in range(len(names)):
            median = statistics.median(per_pass[i])
            ratios[i].append(median)
            line += f" {i}: {median:.3f} [{min(per_pass[i]):.3f}-{max(per_pass[i]):.3f}]"
        print(line, flush=True)
        del sets, first
        torch.cuda.empty_cache()
    print("geometric mean of the ratios over the shapes:")
    for i, name in enumerate(names):
        print(f"  {i}: {statistics.geometric_mean(ratios[i]):.3f}  {name}")


if __name__ == "__main__":
    main()
