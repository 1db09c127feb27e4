"""tk_ops.based_attention / tk_ops.linear_attention against flash-linear-attention (fla-core 0.6.0) in the same run.

Based (Taylor feature map inside, normalised, causal): B·N = 32768, H = 16, F = 16, Dv = 64,
N = 1024 ... 16384, against fla's parallel_based and fused_chunk_based. Generic causal linear
attention on feature-mapped q, k (unnormalised): B = 8, H = 16, N = 4096, (F, Dv) = (16, 64),
(32, 64), (64, 64), (128, 128), (256, 64), against fla's chunk_linear_attn and
fused_chunk_linear_attn. bf16; forward, and forward + backward (the gradients of q, k, v for a
given output gradient). Ours reads (B, H, N, F) tensors, fla (B, N, H, F): each is timed on
contiguous tensors in its own layout, holding the same values.

Conventions, so that both compute the same numbers (derived in the docstrings of tk_ops/ops/based_attention.py
and linear_attention.py):
  Based    fla: parallel_based(q, k, v, scale=F**-0.5, use_norm=True), which divides by z + 1e-6;
           ours: based_attention(q, k, v, eps=1e-6) (1/sqrt(F) is inside our feature map).
  generic  fla: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0] (its default scale
           F**-0.5 would scale the output); ours: linear_attention(q, k, v, normalize=False).
Each row also has the relative difference of ours from the baseline (the output, and for fwd+bwd
the gradients).

HBM floor: the bytes that must cross HBM once (forward: q, k, v read and out written; forward +
backward adds q, k, v and the output gradient read and their gradients written) over the
device-to-device copy bandwidth measured in this run. Rows: benchmarks/common.py's schema (ratio =
baseline_ms / ours_ms: above 1 we are faster; floor_ms and the fraction of it each side reaches;
the error of a baseline that could not run). Writes
benchmarks/results/linear_attention.json and linear_attention.png (and into --out).

  python3 -m benchmarks.bench_linear_attention [--out DIR] [--only based|generic] [--pass fwd|fwd+bwd]
                                  [--isolate-baselines] [--features F ...] [--baseline NAME ...]
                                  benchmark (after the correctness sweep)
  python3 -m benchmarks.bench_linear_attention --check
                                  only the correctness sweep: small odd shapes, strided views,
                                  bf16/fp16, normalised or not, forward and gradients against a
                                  float64 quadratic form; exits non-zero on a failure
  python3 -m benchmarks.bench_linear_attention --dry-run [--out DIR]
                                  CPU, tiny shapes, nothing timed: builds and prints the rows
                                  (the JSON and plot into --out), to check the script without a GPU
fla comes from the carried wheels (.baselines, see gpu_session.sh); without it, or where one of
its kernels fails, the baseline's row says why and ours is still measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import subprocess
import sys
from typing import Callable

import torch

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
PASSES = ("fwd", "fwd+bwd")
FLA_BASED_EPS = 1e-6  # the epsilon parallel_based / fused_chunk_based add to the denominator
GENERIC_NORMALIZE = False
FLA = "fla-core"  # the distribution of the fla package
BASELINES = {
    "based": ("parallel_based", "fused_chunk_based"),
    "generic": ("chunk_linear_attn", "fused_chunk_linear_attn"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str  # "based" or "generic"
    batch: int
    heads: int
    seq_len: int
    features: int
    value_dim: int

    @property
    def label(self) -> str:
        return f"{self.kind} B={self.batch} H={self.heads} N={self.seq_len} F={self.features} Dv={self.value_dim}"

    def hbm_bytes(self, pass_: str) -> int:
        """q, k, v read and out written once; forward + backward adds q, k, v, grad_out read and
        grad_q, grad_k, grad_v written."""
        rows = self.batch * self.heads * self.seq_len
        qk, v = 2 * rows * self.features, rows * self.value_dim
        forward = qk + 2 * v
        return DTYPE.itemsize * (forward if pass_ == "fwd" else forward + 2 * qk + 3 * v)


BASED_SHAPES = tuple(Shape("based", 32768 // n, 16, n, 16, 64) for n in (1024, 2048, 4096, 8192, 16384))
GENERIC_SHAPES = tuple(Shape("generic", 8, 16, 4096, f, dv) for f, dv in ((16, 64), (32, 64), (64, 64), (128, 128), (256, 64)))
# --dry-run: the same kinds and feature dims at sizes a CPU runs in a moment.
DRY_RUN_SHAPES = tuple(Shape("based", 64 // n, 2, n, 16, 64) for n in (16, 32)) + tuple(
    dataclasses.replace(s, batch=1, heads=2, seq_len=33) for s in GENERIC_SHAPES
)


# ------------------------------------------------------------------------------ providers and inputs


def ours(kind: str) -> Callable:
    """Our op on (B, H, N, F) q, k and (B, H, N, Dv) v."""
    if kind == "based":
        return lambda q, k, v: tk_ops.based_attention(q, k, v, eps=FLA_BASED_EPS)
    return lambda q, k, v: tk_ops.linear_attention(q, k, v, normalize=GENERIC_NORMALIZE)


def fla(kind: str) -> dict[str, Callable]:
    """fla's ops of a kind by name, on (B, N, H, F) q, k and (B, N, H, Dv) v (Missing without fla)."""
    if kind == "based":
        based = common.need("fla.ops.based", FLA)
        return {
            "parallel_based": lambda q, k, v: based.parallel_based(q, k, v, scale=q.shape[-1] ** -0.5, use_norm=True),
            "fused_chunk_based": lambda q, k, v: based.fused_chunk_based(q, k, v, scale=q.shape[-1] ** -0.5, use_norm=True),
        }
    linear = common.need("fla.ops.linear_attn", FLA)
    return {
        "chunk_linear_attn": lambda q, k, v: linear.chunk_linear_attn(q, k, v, scale=1.0, normalize=GENERIC_NORMALIZE)[0],
        "fused_chunk_linear_attn": lambda q, k, v: linear.fused_chunk_linear_attn(
            q, k, v, scale=1.0, normalize=GENERIC_NORMALIZE)[0],
    }


def input_set(shape: Shape, device, dtype, backward: bool) -> tuple[tuple, tuple]:
    """(ours, fla's) (q, k, v, grad_out): the same values, (B, H, N, .) and (B, N, H, .) contiguous.
    Generic q, k are scaled by F**-0.25 so that q . k is of order 1 (unnormalised outputs stay in range)."""
    b, h, n = shape.batch, shape.heads, shape.seq_len
    scale = 1.0 if shape.kind == "based" else shape.features**-0.25
    q, k = (scale * torch.randn(b, h, n, shape.features, device=device) for _ in range(2))
    v, grad_out = (torch.randn(b, h, n, shape.value_dim, device=device) for _ in range(2))
    bhnd = [t.to(dtype) for t in (q, k, v, grad_out)]
    bnhd = [t.transpose(1, 2).contiguous() for t in bhnd]
    for tensors in (bhnd, bnhd):
        for t in tensors[:3]:
            t.requires_grad_(backward)
    return tuple(bhnd), tuple(bnhd)


def fla_provider(kind: str, name: str) -> common.Provider:
    """One fla op on its (B, N, H, .) half of each input set, its outputs seen as (B, H, N, .) for the check."""
    return common.Provider(
        name, lambda shape, pass_: common.step(fla(kind)[name], pass_ != "fwd") if shape.kind == kind else None,
        prepare=lambda shape, pass_, inputs: inputs[1],
        as_ours=lambda shape, pass_, outputs: [t.transpose(1, 2) for t in outputs])


OURS = common.Provider("tk_ops", lambda shape, pass_: common.step(ours(shape.kind), pass_ != "fwd"),
                       prepare=lambda shape, pass_, inputs: inputs[0])
FLA_PROVIDERS = tuple(fla_provider(kind, name) for kind, names in BASELINES.items() for name in names)
BENCH = common.Bench(
    "linear_attention", "Linear attention: tk_ops vs flash-linear-attention (bf16)", OURS, FLA_PROVIDERS,
    inputs=lambda shape, pass_, device: input_set(shape, device, DTYPE, pass_ == "fwd+bwd"), passes=PASSES,
    panel=lambda row: row["kind"], tick=lambda row: row["shape"].split(" ", 1)[1])


def measured_in_subprocess(shape: Shape, pass_: str, name: str, dry_run: bool) -> dict:
    """common.measure's dict of one fla baseline, measured in a fresh process, so that a fault in it
    (fla 0.6.0's linear-attention kernels hit an illegal address on the H100 when timed in the same
    process as ours) costs only its own row."""
    fields = [shape.kind, shape.batch, shape.heads, shape.seq_len, shape.features, shape.value_dim, pass_, name]
    command = [sys.executable, "-m", "benchmarks.bench_linear_attention", "--time-baseline", *map(str, fields)]
    command += ["--dry-run"] if dry_run else []
    done = subprocess.run(command, capture_output=True, text=True, cwd=common.ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("BASELINE "):
            return json.loads(line.removeprefix("BASELINE "))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"subprocess exit {done.returncode}: {tail}"}


def time_one_baseline(fields: list[str], dry_run: bool) -> None:
    """--time-baseline: ours' outputs on the first set, then the fla baseline checked against them and
    timed (on the CPU with --dry-run: run once); prints its measure dict as one line."""
    kind, b, h, n, f, dv, pass_, name = fields
    shape, device = Shape(kind, int(b), int(h), int(n), int(f), int(dv)), "cpu" if dry_run else "cuda"
    count = common.input_set_count(shape.hbm_bytes(pass_), device)
    sets = [input_set(shape, device, DTYPE, pass_ == "fwd+bwd") for _ in range(count)]
    ours_outputs = common.measure(OURS, shape, pass_, sets[:1], timer=None).get("outputs", [])
    provider = next(p for p in FLA_PROVIDERS if p.name == name)
    timer = common.run_once if dry_run else common.time_ms
    print("BASELINE", json.dumps(common.measure(provider, shape, pass_, sets, timer, ours_outputs)))


# ---------------------------------------------------------------------------------- correctness

# (kind, B, H, N, F, Dv, strided): kernel sizes (F = 16, Dv = 64 for Based) and others, odd N; the
# sanitizers run this sweep, so it holds a Based shape whose forward splits.
CHECK_SHAPES = (
    ("based", 2, 3, 77, 16, 64, False), ("based", 1, 2, 333, 16, 64, True), ("based", 3, 1, 1, 16, 64, False),
    ("based", 2, 2, 129, 8, 32, False),
    # Few tasks, long enough that the forward splits the sequence into segments (states pass, scan).
    ("based", 1, 1, 1100, 16, 64, True),
    ("generic", 2, 3, 77, 16, 64, False), ("generic", 1, 2, 200, 64, 64, True), ("generic", 2, 1, 129, 128, 128, False),
    ("generic", 1, 2, 65, 256, 64, False), ("generic", 2, 2, 33, 32, 40, True),
)
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2}  # forward; gradients 1.5x
CHECK_EPS = 1e-6


def quadratic_reference(kind: str, q, k, v, normalize: bool, eps: float) -> torch.Tensor:
    """out_i = sum_{j<=i} A_ij v_j (/ (sum_{j<=i} A_ij + eps)), A the full N x N scores, float64."""
    dots = torch.einsum("bhif,bhjf->bhij", q.double(), k.double())
    if kind == "based":
        s = dots / math.sqrt(q.shape[-1])
        dots = 1 + s + s * s / 2
    scores = dots.tril()
    numerator = torch.einsum("bhij,bhjd->bhid", scores, v.double())
    return numerator / (scores.sum(-1, keepdim=True) + eps) if normalize else numerator


def check_inputs(kind, b, h, n, f, dv, strided, normalize, device, dtype) -> tuple:
    """q, k, v as (B, H, N, .) tensors (views of (B, N, H, .) storage when strided); positive generic
    features when normalising, so that the denominator stays away from zero."""
    positive = kind == "generic" and normalize

    def make(width, scale=1.0, features=False):
        shape = (b, n, h, width)
        values = torch.rand(shape, device=device) + 0.1 if features and positive else torch.randn(shape, device=device)
        bnhd = (scale * values).to(dtype)
        return (bnhd.transpose(1, 2) if strided else bnhd.transpose(1, 2).contiguous()).requires_grad_()

    scale = 1.0 if kind == "based" or positive else f**-0.25
    return make(f, scale, True), make(f, scale, True), make(dv)


def run_check(device) -> None:
    failures = []
    cases = 0
    for kind, b, h, n, f, dv, strided in CHECK_SHAPES:
        op = tk_ops.based_attention if kind == "based" else tk_ops.linear_attention
        for dtype in CHECK_TOLERANCE:
            for normalize in (True, False):
                cases += 1
                q, k, v = check_inputs(kind, b, h, n, f, dv, strided, normalize, device, dtype)
                out = op(q, k, v, normalize=normalize, eps=CHECK_EPS)
                exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
                reference = quadratic_reference(kind, *exact, normalize, CHECK_EPS)
                grad_out = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
                reference_grads = torch.autograd.grad(reference, exact, grad_out.double())
                name = f"{kind} B={b} H={h} N={n} F={f} Dv={dv} {str(dtype)[6:]} normalize={normalize} strided={strided}"
                tolerance = CHECK_TOLERANCE[dtype]
                compared = [("out", out, reference, tolerance)] + [
                    (f"grad_{x}", g, r, 1.5 * tolerance) for x, g, r in zip("qkv", grads, reference_grads)]
                if normalize and n == 1:  # out = v for any q, k: their exact gradients are O(eps), below rounding
                    del compared[1:3]
                for label, got, want, tol in compared:
                    error = common.relative_difference(got, want)
                    if not error <= tol or got.dtype != dtype:
                        failures.append(f"{name} {label}: rel err {error:.2e} (tol {tol:.0e}), {got.dtype}")
    common.finish_check(f"correctness sweep on {device} (based_attention: {tk_ops.backends()['based_attention']}, "
                        f"linear_attention: {tk_ops.backends()['linear_attention']}): {cases} cases (out and the "
                        f"gradients of q, k, v)", failures)


# ------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.arguments(__doc__, PASSES)
    parser.add_argument("--only", choices=tuple(BASELINES), help="only the Based or only the generic shapes")
    parser.add_argument("--isolate-baselines", action="store_true",
                        help="time each fla baseline in a process of its own (a fault costs only its row)")
    parser.add_argument("--features", type=int, nargs="+", help="only the shapes of these feature dims F")
    parser.add_argument("--baseline", dest="baselines", action="append",
                        choices=sorted({name for names in BASELINES.values() for name in names}),
                        help="only this fla baseline (repeatable; default: both of each kind)")
    parser.add_argument("--time-baseline", nargs=8, metavar="FIELD", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected_shapes(args: argparse.Namespace) -> tuple[Shape, ...]:
    shapes = DRY_RUN_SHAPES if args.dry_run else BASED_SHAPES + GENERIC_SHAPES
    return tuple(shape for shape in shapes
                 if args.only in (None, shape.kind) and (not args.features or shape.features in args.features))


def selected_bench(args: argparse.Namespace) -> common.Bench:
    """The fla baselines of --baseline, each in a process of its own with --isolate-baselines."""
    baselines = [p for p in FLA_PROVIDERS if not args.baselines or p.name in args.baselines]
    if args.isolate_baselines:
        baselines = [dataclasses.replace(p, measured_by=functools.partial(measured_in_subprocess, name=p.name,
                                                                          dry_run=args.dry_run)) for p in baselines]
    return dataclasses.replace(BENCH, baselines=tuple(baselines))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.time_baseline:
        return time_one_baseline(args.time_baseline, args.dry_run)
    if common.without_gpu(args, selected_bench(args), selected_shapes(args)):
        return
    run_check("cuda")
    if args.check:
        return
    common.run(selected_bench(args), selected_shapes(args), passes=args.passes, out=args.out,
               copy_gbps=common.measured_copy_bandwidth(),
               dtype="bf16", fla=common.peer("fla", FLA)[1], based_eps=FLA_BASED_EPS, generic_normalize=GENERIC_NORMALIZE,
               ours_backends={op: tk_ops.backends()[op] for op in ("based_attention", "linear_attention")})


if __name__ == "__main__":
    main()
