"""tk_ops.matmul / tk_ops.linear against cuBLAS (torch.matmul / F.linear) in the same run.

Short problems (under 0.1 ms) are also timed as CUDA-graph replays, which removes launch overhead
from both sides (the eager numbers include our Python op layer; the host cost per call is
printed first). Shapes: M = N = K from 1024 to 16384; M = N = 4096 with K from 64 to 1024; the Llama MLP linear
(T = 16384, K = 4096, N = 11008) with the weight row-major and column-major; all four operand
layouts at 8192^3; bf16 and fp16. Prints TFLOP/s (2 M N K per product), the ratio to cuBLAS and
the fraction of the cuBLAS bf16 8192^3 rate measured in this run; writes
benchmarks/results/gemm.json and gemm.png.

Run from the repository root: python3 -m benchmarks.bench_gemm [--out DIR] [--only square ...];
redraw the plot from a results file: python3 -m benchmarks.bench_gemm --plot-from benchmarks/results/gemm.json
A small correctness pass (what compute-sanitizer runs): python3 -m benchmarks.bench_gemm --check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

BASELINE = {"matmul": "torch.matmul (cuBLAS)", "linear": "F.linear (cuBLAS)"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAPH_BELOW_MS = 0.1  # eager times this short are dominated by launch overhead: also time graph replays


@dataclasses.dataclass(frozen=True)
class Case:
    group: str  # square, k_sweep, layouts, llama
    op: str  # matmul or linear
    m: int
    n: int
    k: int
    layout: str  # matmul: A then B, n = row-major, t = column-major view; linear: weight row/col-major
    dtype: str

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def shape(self) -> str:
        return f"M={self.m} N={self.n} K={self.k}"


def cases(groups: set[str]) -> list[Case]:
    out = []
    for dtype in DTYPES:
        if "square" in groups:
            out += [Case("square", "matmul", s, s, s, "nn", dtype) for s in (1024, 2048, 4096, 8192, 16384)]
        if "k_sweep" in groups:
            out += [Case("k_sweep", "matmul", 4096, 4096, k, "nn", dtype) for k in (64, 128, 256, 512, 1024)]
        if "layouts" in groups:
            out += [Case("layouts", "matmul", 8192, 8192, 8192, layout, dtype) for layout in ("nt", "tn", "tt")]
        if "llama" in groups:
            out += [Case("llama", "linear", 16384, 11008, 4096, layout, dtype) for layout in ("weight-row-major", "weight-col-major")]
    return out


def make_inputs(case: Case) -> tuple:
    dtype = DTYPES[case.dtype]

    def matrix(rows, cols, column_major):
        if column_major:
            return torch.randn(cols, rows, device="cuda", dtype=dtype).mT
        return torch.randn(rows, cols, device="cuda", dtype=dtype)

    if case.op == "matmul":
        return matrix(case.m, case.k, case.layout[0] == "t"), matrix(case.k, case.n, case.layout[1] == "t")
    x = torch.randn(case.m, case.k, device="cuda", dtype=dtype)
    weight = matrix(case.n, case.k, case.layout == "weight-col-major") / case.k**0.5
    return x, weight


def functions(case: Case):
    if case.op == "matmul":
        return tk_ops.matmul, torch.matmul
    return tk_ops.linear, F.linear


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_case(case: Case) -> dict:
    ours, baseline = functions(case)
    first = make_inputs(case)
    bytes_per_set = sum(t.numel() * t.element_size() for t in first) + case.m * case.n * first[0].element_size()
    sets = [first] + [make_inputs(case) for _ in range(common.rotation_count(bytes_per_set) - 1)]
    error = rel_err(ours(*first), baseline(*first))
    ours_ms = common.time_ms(ours, sets)
    baseline_ms = common.time_ms(baseline, sets)
    graph = {}
    if ours_ms < GRAPH_BELOW_MS:
        ours_graph_ms = common.time_graph_ms(ours, sets)
        baseline_graph_ms = common.time_graph_ms(baseline, sets)
        graph = {
            "ours_graph_ms": round(ours_graph_ms, 5),
            "baseline_graph_ms": round(baseline_graph_ms, 5),
            "graph_ratio": round(baseline_graph_ms / ours_graph_ms, 4),
        }
    del sets, first
    torch.cuda.empty_cache()
    return {
        "group": case.group,
        "op": case.op,
        "shape": case.shape,
        "m": case.m,
        "n": case.n,
        "k": case.k,
        "dtype": case.dtype,
        "layout": case.layout,
        "ours_ms": round(ours_ms, 5),
        "baseline": BASELINE[case.op],
        "baseline_ms": round(baseline_ms, 5),
        "ratio": round(baseline_ms / ours_ms, 4),
        "ours_tflops": round(case.flops / ours_ms / 1e9, 1),
        "baseline_tflops": round(case.flops / baseline_ms / 1e9, 1),
        "rel_err_vs_baseline": float(f"{error:.3e}"),
        **graph,
    }


def tflops(row: dict, key: str) -> float | None:
    return None if key not in row else 2.0 * row["m"] * row["n"] * row["k"] / row[key] / 1e9


def plot(rows: list[dict], ceiling: float, path: pathlib.Path) -> None:
    """Squares and the K sweep as lines (CUDA-graph rates dashed where measured), the rest as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    panels = [("square", "M = N = K"), ("k_sweep", "K  (M = N = 4096)")]
    for ax, (group, xlabel) in zip(axes, panels):
        for dtype, marker in (("bf16", "o"), ("fp16", "^")):
            sel = [r for r in rows if r["group"] == group and r["dtype"] == dtype]
            if not sel:
                continue
            xs = [r["k"] for r in sel]
            for who, color in (("ours", "tab:red"), ("baseline", "tab:gray")):
                name = "tk_ops" if who == "ours" else "cuBLAS"
                ax.plot(xs, [tflops(r, f"{who}_ms") for r in sel], marker + "-", color=color, label=f"{name} {dtype}")
                graph = [(x, tflops(r, f"{who}_graph_ms")) for x, r in zip(xs, sel) if f"{who}_graph_ms" in r]
                if graph:
                    ax.plot(*zip(*graph), marker + "--", color=color, alpha=0.55, label=f"{name} {dtype}, CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TFLOP/s")
        ax.axhline(ceiling, color="black", lw=0.6, ls=":", label="cuBLAS bf16 8192^3")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    bars = [r for r in rows if r["group"] in ("layouts", "llama")]
    short = {"weight-row-major": "Llama W", "weight-col-major": "Llama W^T"}
    labels = [f"{short.get(r['layout'], r['layout'])}\n{r['dtype']}" for r in bars]
    xs = range(len(bars))
    axes[2].bar([x - 0.2 for x in xs], [r["ours_tflops"] for r in bars], 0.4, color="tab:red", label="tk_ops")
    axes[2].bar([x + 0.2 for x in xs], [r["baseline_tflops"] for r in bars], 0.4, color="tab:gray", label="cuBLAS")
    axes[2].set_xticks(list(xs), labels, fontsize=7)
    axes[2].set_title("8192^3 layouts (A, B: n row-major, t column-major) and the Llama linear", fontsize=8)
    axes[2].set_ylabel("TFLOP/s")
    axes[2].legend(fontsize=7)
    fig.suptitle("GEMM: tk_ops vs cuBLAS, same run (solid: eager, through the Python op; dashed: CUDA-graph replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------- correctness

# (M, K, N) with tails everywhere and K = 1; the last has several tiles per dimension.
CHECK_SHAPES = [(1, 8, 8), (97, 1, 136), (131, 72, 264), (200, 136, 520), (520, 64, 1040)]


def check() -> None:
    """Every operand layout, the linear with bias and both backward products on awkward shapes,
    against float64; exits non-zero on a wrong result."""

    def expect(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
        err = rel_err(out, expected)
        print(f"{name:50} rel err {err:.2e} {'ok' if err < 1e-2 else 'WRONG'}")
        if not err < 1e-2:
            raise SystemExit(f"{name}: relative error {err:.2e}")

    def column_major(t: torch.Tensor) -> torch.Tensor:
        return t.mT.contiguous().mT

    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in CHECK_SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)
            for layout, (x, y) in {
                "nn": (a, b), "nt": (a, column_major(b)), "tn": (column_major(a), b), "tt": (column_major(a), column_major(b))
            }.items():
                expect(f"matmul {m}x{k}x{n} {layout} {dtype}", tk_ops.matmul(x, y), a.double() @ b.double())
            weight = torch.randn(n, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
            expect(f"linear+bias {m}x{k}x{n} {dtype}", tk_ops.linear(a, weight, bias),
                   a.double() @ weight.double().T + bias.double())
            grad = torch.randn(m, n, device="cuda", dtype=dtype)
            grad_x, grad_w, _ = torch.ops.tk.linear_bwd(grad, a, weight, [True, True, True])
            expect(f"linear_bwd dx {m}x{k}x{n} {dtype}", grad_x, grad.double() @ weight.double())
            expect(f"linear_bwd dw {m}x{k}x{n} {dtype}", grad_w, grad.double().T @ a.double())
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    parser.add_argument("--only", nargs="*", default=["square", "k_sweep", "layouts", "llama"])
    parser.add_argument("--plot-from", type=pathlib.Path, help="only redraw gemm.png next to this results file")
    parser.add_argument("--check", action="store_true", help="only the small correctness pass against float64")
    args = parser.parse_args()
    if args.plot_from:
        document = json.loads(args.plot_from.read_text())
        plot(document["rows"], document["ceiling_tflops"], args.plot_from.with_suffix(".png"))
        return

    assert tk_ops.backends()["matmul"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        check()
        return
    ceiling_case = Case("ceiling", "matmul", 8192, 8192, 8192, "nn", "bf16")
    ceiling_sets = [make_inputs(ceiling_case) for _ in range(2)]
    ceiling = ceiling_case.flops / common.time_ms(torch.matmul, ceiling_sets) / 1e9
    del ceiling_sets
    print(f"cuBLAS bf16 8192^3 in this run: {ceiling:.1f} TFLOP/s")
    tiny = make_inputs(Case("host", "matmul", 256, 256, 256, "nn", "bf16"))
    host_us = {
        "tk_ops.matmul": common.host_us_per_call(tk_ops.matmul, tiny),
        "torch.ops.tk.matmul": common.host_us_per_call(torch.ops.tk.matmul.default, tiny),
        "torch.matmul": common.host_us_per_call(torch.matmul, tiny),
    }
    print("host us per call (256^3, launch-bound): " + ", ".join(f"{k} {v:.1f}" for k, v in host_us.items()))

    rows = []
    header = (f"{'op':7} {'shape':26} {'dtype':5} {'layout':17} {'ours ms':>9} {'ours TF/s':>9} {'cuBLAS TF/s':>11} "
              f"{'ratio':>6} {'of ceil':>7} {'err':>9} {'graph ratio':>11}")
    print(header)
    for case in cases(set(args.only)):
        row = run_case(case)
        row["fraction_of_ceiling"] = round(row["ours_tflops"] / ceiling, 3)
        rows.append(row)
        print(
            f"{row['op']:7} {row['shape']:26} {row['dtype']:5} {row['layout']:17} {row['ours_ms']:9.4f} "
            f"{row['ours_tflops']:9.1f} {row['baseline_tflops']:11.1f} {row['ratio']:6.3f} "
            f"{row['fraction_of_ceiling']:7.3f} {row['rel_err_vs_baseline']:9.2e} {row.get('graph_ratio', ''):>11}"
        )

    out_dirs = [common.RESULTS] + ([args.out] if args.out else [])
    common.write_results("gemm", rows, out_dirs, ceiling_tflops=round(ceiling, 1),
                         ceiling="torch.matmul bf16 8192^3 (cuBLAS), this run",
                         host_us_per_call={k: round(v, 1) for k, v in host_us.items()})
    for directory in out_dirs:
        plot(rows, ceiling, directory / "gemm.png")


if __name__ == "__main__":
    main()
