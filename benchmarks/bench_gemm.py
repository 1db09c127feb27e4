"""tk_ops.matmul / tk_ops.linear against cuBLAS (torch.matmul / F.linear) in the same run.

Short problems (under 0.1 ms) are also timed as CUDA-graph replays, which removes launch overhead
from both sides (the eager numbers include our Python op layer; the host cost per call is
printed first). Shapes: M = N = K from 1024 to 16384; M = N = 4096 with K from 64 to 1024; the Llama MLP linear
(T = 16384, K = 4096, N = 11008) with the weight row-major and column-major; all four operand
layouts at 8192^3; bf16 and fp16; and (llama_train, bf16) every product of one Llama-3.2-1B
training step (models/presets.py "1b", 8 x 2048 tokens) in the operand layouts tk_ops.linear's
forward and backward hand the kernel: forward x @ W^T (weight row-major), dX = grad @ W (both
row-major), dW = grad^T @ x (grad as a transposed view), with each product's count per step and a
step-weighted total at the end. Prints TFLOP/s (2 M N K per product), the ratio to cuBLAS and
the fraction of the cuBLAS bf16 8192^3 rate measured in this run, and the relative difference of
ours from cuBLAS; writes benchmarks/results/gemm.json and gemm.png (benchmarks/common.py's rows).

Run from the repository root: python3 -m benchmarks.bench_gemm [--out DIR] [--only square ...];
redraw the plot from a results file: python3 -m benchmarks.bench_gemm --plot-from benchmarks/results/gemm.json
A small correctness pass (what compute-sanitizer runs): python3 -m benchmarks.bench_gemm --check
On the CPU, tiny cases, nothing timed: python3 -m benchmarks.bench_gemm --dry-run [--out DIR]
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GROUPS = ("square", "k_sweep", "layouts", "llama", "llama_train")
GRAPH_BELOW_MS = 0.1  # eager times this short are dominated by launch overhead: also time graph replays


@dataclasses.dataclass(frozen=True)
class Case:
    group: str  # square, k_sweep, layouts, llama, llama_train
    op: str  # matmul or linear
    m: int
    n: int
    k: int
    layout: str  # matmul: A then B, n = row-major, t = column-major view; linear: weight row/col-major
    dtype: str

    def flops(self, pass_: str) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def label(self) -> str:
        return f"M={self.m} N={self.n} K={self.k}"


# One Llama-3.2-1B training step (models/presets.py "1b": hidden 2048, 16 layers, 32 query / 8 kv
# heads of 64, MLP 8192, vocabulary 8192, lm_head tied to the embedding; 8 x 2048 tokens). Every
# linear is tk_ops.linear without bias: q, k, v, o and gate, up, down per layer (nothing fused) and
# the lm_head once. Per linear (in -> out features) the step runs three products (tk::linear and
# tk::linear_bwd, csrc/torch/gemm.cpp):
#   forward  x (T, in) @ W^T             M = T,   N = out, K = in   linear, weight row-major: A and B K-major
#   dX       grad (T, out) @ W (out, in) M = T,   N = in,  K = out  matmul nn: A K-major, B MN-major
#   dW       grad^T (out, T) @ x (T, in) M = out, N = in,  K = T    matmul tn: A and B MN-major
LLAMA_TOKENS = 8 * 2048
LLAMA_LINEARS = {  # name: (in features, out features, count per step)
    "q_proj": (2048, 2048, 16), "k_proj": (2048, 512, 16), "v_proj": (2048, 512, 16), "o_proj": (2048, 2048, 16),
    "gate_proj": (2048, 8192, 16), "up_proj": (2048, 8192, 16), "down_proj": (8192, 2048, 16), "lm_head": (2048, 8192, 1),
}


def llama_train_products() -> dict[tuple[str, int, int, int, str], list[tuple[str, int]]]:
    """(op, M, N, K, layout) -> [(linear and product, count per step)]: the distinct products of the step."""
    out: dict[tuple[str, int, int, int, str], list[tuple[str, int]]] = {}
    for name, (fan_in, fan_out, count) in LLAMA_LINEARS.items():
        for product, key in (("fwd", ("linear", LLAMA_TOKENS, fan_out, fan_in, "weight-row-major")),
                             ("dX", ("matmul", LLAMA_TOKENS, fan_in, fan_out, "nn")),
                             ("dW", ("matmul", fan_out, fan_in, LLAMA_TOKENS, "tn"))):
            out.setdefault(key, []).append((f"{name} {product}", count))
    return out


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
        if "llama_train" in groups and dtype == "bf16":  # the step's dtype
            out += [Case("llama_train", op, m, n, k, layout, dtype) for op, m, n, k, layout in llama_train_products()]
    return out


def step_total(rows: list[dict]) -> None:
    """Print the llama_train rows weighted by their counts per step: the GEMM time of one step."""
    products = llama_train_products()
    ours = theirs = 0.0
    for row in rows:
        key = (row["op"], row["m"], row["n"], row["k"], row["layout"])
        if row["group"] != "llama_train" or key not in products or row["ours_ms"] is None or row["baseline_ms"] is None:
            continue
        count = sum(n for _, n in products[key])
        ours, theirs = ours + count * row["ours_ms"], theirs + count * row["baseline_ms"]
        print(f"  {row['shape']} {row['layout']}: x{count} ({', '.join(name for name, _ in products[key])})")
    if ours:
        print(f"llama_train, one step's GEMMs (sum of count x eager ms): tk_ops {ours:.1f} ms, cuBLAS {theirs:.1f} ms, "
              f"ratio {theirs / ours:.3f}")


# --dry-run: each group's operand layouts at sizes a CPU runs in a moment
DRY_RUN_CASES = [Case("square", "matmul", 48, 48, 48, "nn", "bf16"), Case("k_sweep", "matmul", 40, 48, 8, "nn", "fp16"),
                 Case("layouts", "matmul", 40, 24, 56, "tt", "bf16"), Case("llama", "linear", 32, 40, 24, "weight-col-major", "bf16"),
                 Case("llama_train", "linear", 64, 16, 32, "weight-row-major", "bf16"),  # forward
                 Case("llama_train", "matmul", 64, 32, 16, "nn", "bf16"),  # dX
                 Case("llama_train", "matmul", 16, 32, 64, "tn", "bf16")]  # dW


def make_inputs(case: Case, device="cuda") -> tuple:
    dtype = DTYPES[case.dtype]

    def matrix(rows, cols, column_major):
        if column_major:
            return torch.randn(cols, rows, device=device, dtype=dtype).mT
        return torch.randn(rows, cols, device=device, dtype=dtype)

    if case.op == "matmul":
        return matrix(case.m, case.k, case.layout[0] == "t"), matrix(case.k, case.n, case.layout[1] == "t")
    x = torch.randn(case.m, case.k, device=device, dtype=dtype)
    weight = matrix(case.n, case.k, case.layout == "weight-col-major") / case.k**0.5
    return x, weight


def cublas(name: str, op: str, fn) -> common.Provider:
    """cuBLAS through torch on one op's cases (matmul or linear)."""
    return common.Provider(name, lambda case, pass_: fn if case.op == op else None, graph=True)


BENCH = common.Bench(
    "gemm", "GEMM: tk_ops vs cuBLAS (solid: eager, through the Python op; hatched: CUDA-graph replay)",
    ours=common.Provider("tk_ops", lambda case, pass_: tk_ops.matmul if case.op == "matmul" else tk_ops.linear, graph=True),
    baselines=(cublas("torch.matmul (cuBLAS)", "matmul", torch.matmul), cublas("F.linear (cuBLAS)", "linear", F.linear)),
    inputs=lambda case, pass_, device: make_inputs(case, device),
    set_bytes=lambda case, pass_, inputs: common.tensor_bytes(inputs) + case.m * case.n * inputs[0].element_size(),
    graph_below_ms=GRAPH_BELOW_MS,
    tick=lambda row: f"{row['shape']} {row['layout']} {row['dtype']}",
)


# ---------------------------------------------------------------------------------- correctness

# (M, K, N) with tails everywhere and K = 1; the last has several tiles per dimension.
CHECK_SHAPES = [(1, 8, 8), (97, 1, 136), (131, 72, 264), (200, 136, 520), (520, 64, 1040)]


def check() -> None:
    """Every operand layout, the linear with bias and both backward products on awkward shapes,
    against float64; exits non-zero on a wrong result."""

    def expect(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
        err = common.relative_difference(out, expected)
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


def main(argv=None) -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--only", nargs="*", choices=GROUPS, default=list(GROUPS))
    args = parser.parse_args(argv)
    if common.without_gpu(args, BENCH, [case for case in DRY_RUN_CASES if case.group in args.only]):
        return
    assert tk_ops.backends()["matmul"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        return check()
    ceiling_case = Case("ceiling", "matmul", 8192, 8192, 8192, "nn", "bf16")
    ceiling_sets = [make_inputs(ceiling_case) for _ in range(2)]
    ceiling = ceiling_case.flops("fwd") / common.time_ms(torch.matmul, ceiling_sets) / 1e9
    del ceiling_sets
    print(f"cuBLAS bf16 8192^3 in this run: {ceiling:.1f} TFLOP/s")
    tiny = make_inputs(Case("host", "matmul", 256, 256, 256, "nn", "bf16"))
    host_us = {
        "tk_ops.matmul": common.host_us_per_call(tk_ops.matmul, tiny),
        "torch.ops.tk.matmul": common.host_us_per_call(torch.ops.tk.matmul.default, tiny),
        "torch.matmul": common.host_us_per_call(torch.matmul, tiny),
    }
    print("host us per call (256^3, launch-bound): " + ", ".join(f"{k} {v:.1f}" for k, v in host_us.items()))
    rows = common.run(BENCH, cases(set(args.only)), out=args.out, tflops_ceiling=ceiling, ceiling_tflops=round(ceiling, 1),
                      ceiling="torch.matmul bf16 8192^3 (cuBLAS), this run",
                      host_us_per_call={k: round(v, 1) for k, v in host_us.items()})
    step_total(rows)


if __name__ == "__main__":
    main()
