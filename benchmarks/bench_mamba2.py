"""tk_ops.mamba2_ssd against mamba_ssm's Triton SSD (mamba_chunk_scan_combined) in the same run.

Shapes: the Mamba-2 SSD family's target shapes, (Bt, L, H, N) = (8, 2048, 80, 128),
(8, 4096, 80, 128), (8, 4096, 32, 64) and (2, 16384, 80, 128), and one 64k-token sequence,
(1, 65536, 80, 128); P = 64, one group (G = 1); x, B, C bf16, dt, A, D, dt_bias fp32. Forward,
and forward + backward (the gradients of x, dt, A, B, C, D and dt_bias for a given output
gradient).

Both sides make a Mamba-2 layer's call (D per head, dt_bias and softplus, no z: the layer gates in
its RMSNorm; no initial or final states), on the same (Bt, L, H, P) and (Bt, L, G, N) tensors:
  ours       tk_ops.mamba2_ssd(x, dt, A, B, C, chunk_size=c, D=D, dt_bias=dt_bias, dt_softplus=True)
  mamba_ssm  mamba_chunk_scan_combined(x, dt, A, B, C, c, D=D, dt_bias=dt_bias, dt_softplus=True)
Inputs as a freshly initialised layer has them: A = -U[1, 16], D = 1, dt_bias the inverse
softplus of a log-uniform step in [1e-3, 1e-1], dt ~ N(0, 1) before bias and softplus.

On benchmarks/common.py's harness, with its chunk-size sweep: each side runs at every chunk size of
--chunks (default 64, 128, 256); per shape and pass a row per chunk size, ours against mamba_ssm at
that size (baseline "mamba_ssm@256"), and a row of each at its own fastest size ("mamba_ssm@best";
ours_chunk and baseline_chunk say which). Rows in the harness's schema with its peak memories
(the MiB a call allocates beyond its inputs; peak_ratio = ours / mamba_ssm's) and its HBM floor: the
bytes that must cross HBM once (forward: x, dt, B, C read and y written; forward + backward adds x,
dt, B, C and the output gradient read and their gradients written) over the device-to-device copy
bandwidth measured in the run. The timer sizes its batch and rounds from one timed call (a call
ranges from a fraction of a millisecond to a fraction of a second). The header's ours_backends says
what served our forward and backward (the CUDA kernels, or the PyTorch reference in a build
without them).

mamba_ssm (installed by benchmarks/wheels/baselines.sh) runs in the harness's Worker, a process of
its own kept from row to row: a call that fails or kills it costs only its row, and without
mamba_ssm the rows say why while ours is still measured. The worker keeps Triton's autotuning
results on disk (TRITON_CACHE_AUTOTUNING=1): a new worker tunes again only the kernels whose
configurations have hooks, which Triton does not cache. mamba_ssm's first call at each chunk size and
(H, N) compiles and autotunes its Triton kernels (about 130 configurations for the forward and
backward): on a cold Triton cache that is most of the run, an estimated 3 to 4 of about 5 minutes on
the H100. --chunks 256 or --pass fwd cut it.

  python3 -m benchmarks.bench_mamba2 [--out DIR] [--pass fwd|fwd+bwd] [--chunks C [C ...]]
        the correctness sweep, then the benchmark, each shape's rows printed as they are
        measured. A failing sweep is recorded in the results and in the exit status, and the
        timing runs all the same
  python3 -m benchmarks.bench_mamba2 --check
        only the correctness sweep (the mamba2_ssd kernel family's run under compute-sanitizer):
        the forward of every kernel variant (bf16/fp16, N 64/128, chunk 64/128/256, gating, D,
        dt_bias + softplus, initial states, L = 1, 333, 700) against a float64 sequential
        recurrence on the CPU, and y, the final states and the gradient of every input against
        the op's float64 reference on the CPU; exits non-zero on a failure
  python3 -m benchmarks.bench_mamba2 --dry-run [--out DIR]
        CPU, tiny shapes, nothing timed: every row through the worker, the JSON and the plot
        (into --out)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
FP32_BYTES = 4  # dt, A, D, dt_bias and their gradients
PASSES = ("fwd", "fwd+bwd")
CHUNKS = (64, 128, 256)  # the chunk sizes our kernel takes
MAMBA_SSM = ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm")
CALL = ("D (H,), dt_bias, dt_softplus=True, z=None, no initial_states, return_final_states=False; "
        "x, B, C bf16, dt, A, D, dt_bias fp32; gradients of x, dt, A, B, C, D, dt_bias")
# The GPU timer sizes its batch and rounds from one timed call: about TIMED_MS of timed calls in
# batches of about BATCH_MS, 5 to 15 rounds of 1 to 10 calls (a call of our PyTorch backward at 64k
# tokens takes a fraction of a second; a forward, a fraction of a millisecond).
BATCH_MS, TIMED_MS = 20.0, 400.0
TOLERANCE = 5e-2  # the largest relative difference from mamba_ssm's outputs that is not flagged a mismatch


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    heads: int
    state_size: int
    head_dim: int = 64
    groups: int = 1
    chunk: Optional[int] = None  # the sweep's: both sides run at each of --chunks

    @property
    def label(self) -> str:
        return f"Bt={self.batch} L={self.seq_len} H={self.heads} N={self.state_size}"

    def hbm_bytes(self, pass_: str) -> int:
        """x, dt, B, C read and y written once (and A, D, dt_bias read); forward + backward adds x,
        dt, B, C and grad_y read and grad_x, grad_dt, grad_B, grad_C written (and the parameters
        read again and their gradients written)."""
        element, tokens = DTYPE.itemsize, self.batch * self.seq_len
        activation = tokens * self.heads * self.head_dim  # x, y, grad_y or grad_x
        b_and_c = 2 * tokens * self.groups * self.state_size
        steps, parameters = tokens * self.heads, 3 * self.heads
        forward = element * (2 * activation + b_and_c) + FP32_BYTES * (steps + parameters)
        backward = element * (3 * activation + 2 * b_and_c) + FP32_BYTES * 2 * (steps + parameters)
        return forward if pass_ == "fwd" else forward + backward


ANCHOR_SHAPES = (Shape(8, 2048, 80, 128), Shape(8, 4096, 80, 128), Shape(8, 4096, 32, 64), Shape(2, 16384, 80, 128))
# The target shapes (ANCHOR_SHAPES), then 64k tokens in one sequence at their largest H and N (Mamba-2
# 2.7B's mixer): the long-context case, 80 (batch, head) sequences for 132 SMs.
SHAPES = ANCHOR_SHAPES + (Shape(1, 65536, 80, 128),)
# --dry-run: sizes a CPU runs in a moment, one with L a multiple of no chunk size
DRY_RUN_SHAPES = (Shape(1, 128, 2, 16), Shape(2, 80, 3, 8))


# ------------------------------------------------------------------------------ providers and inputs


def ours(shape: Shape, pass_: str) -> Callable:
    return common.step(lambda x, dt, A, B, C, D, dt_bias: tk_ops.mamba2_ssd(
        x, dt, A, B, C, chunk_size=shape.chunk, D=D, dt_bias=dt_bias, dt_softplus=True), pass_ != "fwd")


def mamba_ssm(shape: Shape, pass_: str) -> Callable:
    def scan(x, dt, A, B, C, D, dt_bias):
        combined = common.need(*MAMBA_SSM).mamba_chunk_scan_combined  # imported in the worker alone
        return combined(x, dt, A, B, C, shape.chunk, D=D, dt_bias=dt_bias, dt_softplus=True)  # chunk_size: positional

    return common.step(scan, pass_ != "fwd")


def mamba_ssm_versions() -> dict:
    """The worker's READY: where mamba_ssm comes from, its version and Triton's (Missing where it does not
    import)."""
    common.need(*MAMBA_SSM)
    import mamba_ssm as package

    return {"version": getattr(package, "__version__", None), "path": str(pathlib.Path(package.__file__).parent),
            "triton": getattr(sys.modules.get("triton"), "__version__", None)}


def input_set(shape: Shape, device, backward: bool, seed: int = 0) -> tuple:
    """(x, dt, A, B, C, D, dt_bias, grad_y), as a freshly initialised Mamba-2 layer has them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, h = shape.batch, shape.seq_len, shape.heads

    def normal(*size, dtype=torch.float32):
        return torch.randn(*size, device=device, generator=gen).to(dtype)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(h, device=device).uniform_(low, high, generator=gen)

    x, grad_y = (normal(b, n, h, shape.head_dim, dtype=DTYPE) for _ in range(2))
    B, C = (normal(b, n, shape.groups, shape.state_size, dtype=DTYPE) for _ in range(2))
    dt = normal(b, n, h)
    A = -uniform(1.0, 16.0)
    initial_step = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
    dt_bias = initial_step + torch.log(-torch.expm1(-initial_step))  # softplus(dt_bias) = initial_step
    D = torch.ones(h, device=device)
    leaves = (x, dt, A, B, C, D, dt_bias)
    for t in leaves:
        t.requires_grad_(backward)
    return (*leaves, grad_y)


def sized_time_ms(fn: Callable, sets: list[tuple]) -> float:
    """common.time_ms, with its batch and rounds sized from one timed call (BATCH_MS, TIMED_MS)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*sets[0])
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    batch = int(min(10, max(1, BATCH_MS // once)))
    rounds = int(min(15, max(5, TIMED_MS // (batch * once))))
    return common.time_ms(fn, sets, warmup=2, rounds=rounds, batch=batch)


BENCH = common.Bench(
    "mamba2", "Mamba-2 SSD: tk_ops vs mamba_ssm's Triton SSD (bf16)", common.Provider("tk_ops", ours),
    (common.Provider("mamba_ssm", mamba_ssm),),
    inputs=lambda shape, pass_, device: input_set(shape, device, pass_ == "fwd+bwd"), passes=PASSES,
    timer=sized_time_ms, tolerance=TOLERANCE, sweep=("chunk", CHUNKS), peak_memory=True,
    panel=lambda row: row["baseline"])  # a panel per chunk size, and one of each side at its fastest


# ---------------------------------------------------------------------------------- correctness

CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # y and final states; gradients 2x
TARGET_REL_ERR = 1e-2  # the family's goal for the relative error against float64 (reported, not the gate)
# forward + backward cases: (N, chunk_size, L, gated, D per channel (H, P) rather than per head)
BACKWARD_CASES = ((64, 64, 333, True, False), (128, 128, 200, True, True), (128, 256, 333, False, True))
GRADIENT_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def check_inputs(Bt, L, H, G, N, dtype, gated, device, per_channel_D=False, seed=0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, to=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(to)

    return dict(
        x=randn(Bt, L, H, 64), dt=randn(Bt, L, H, to=torch.float32) * 0.5 - 1.5,
        A=-0.3 - torch.rand(H, device=device, generator=gen), B=randn(Bt, L, G, N), C=randn(Bt, L, G, N),
        D=randn(*((H, 64) if per_channel_D else (H,)), to=torch.float32), z=randn(Bt, L, H, 64) if gated else None,
        dt_bias=randn(H, to=torch.float32) * 0.3, initial_states=randn(Bt, H, 64, N, to=torch.float32),
    )


def recurrence(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """y and the final state, one position at a time in float64 (softplus, dt_bias, D per head, z),
    on the CPU: hundreds of tiny steps there, not hundreds of launches under compute-sanitizer."""
    t = {name: None if u is None else u.cpu().double() for name, u in t.items()}
    x, B, C = t["x"], t["B"], t["C"]
    dt = F.softplus(t["dt"] + t["dt_bias"])
    A = t["A"]
    H = x.shape[2]
    B, C = (u.repeat_interleave(H // u.shape[2], 2) for u in (B, C))
    state = t["initial_states"]
    ys = []
    for i in range(x.shape[1]):
        decay_step = dt[:, i, :, None, None]
        state = torch.exp(decay_step * A[:, None, None]) * state + decay_step * x[:, i, :, :, None] * B[:, i, :, None, :]
        ys.append((state * C[:, i, :, None, :]).sum(-1))
    y = torch.stack(ys, 1) + x * t["D"][:, None]
    if t["z"] is not None:
        y = y * F.silu(t["z"])
    return y, state


def forward(t: dict, chunk_size: int):
    return torch.ops.tk.mamba2_ssd.default(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size, t["D"], t["z"], t["dt_bias"], True, t["initial_states"]
    )


def forward_and_gradients(t: dict, chunk_size: int, grad_y, grad_final) -> dict[str, torch.Tensor]:
    """y, the final states and the gradient of every input present, through tk_ops.mamba2_ssd."""
    leaves = {name: t[name].detach().requires_grad_() for name in GRADIENT_INPUTS if t[name] is not None}
    y, final = tk_ops.mamba2_ssd(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=chunk_size, D=leaves["D"],
        z=leaves.get("z"), dt_bias=leaves["dt_bias"], dt_softplus=True, initial_states=leaves["initial_states"],
        return_final_states=True)
    grads = torch.autograd.grad((y, final), list(leaves.values()), (grad_y, grad_final))
    return {"y": y, "final_states": final, **{f"grad_{name}": g for name, g in zip(leaves, grads)}}


def run_check(device) -> tuple[str, list[str], dict]:
    """The correctness sweep: (summary, failures, the largest relative error per dtype of the
    forward and of the gradients)."""
    failures, cases = [], 0
    largest = {str(dtype)[6:]: {"forward": 0.0, "gradients": 0.0} for dtype in CHECK_TOLERANCE}

    def compare(name: str, label: str, got: torch.Tensor, want: torch.Tensor, dtype, tolerance: float) -> None:
        error = common.relative_difference(got.cpu(), want)
        kind = "forward" if label in ("y", "final_states") else "gradients"
        largest[str(dtype)[6:]][kind] = max(largest[str(dtype)[6:]][kind], error)
        if not error <= tolerance:
            failures.append(f"{name} {label}: rel err {error:.2e} (tol {tolerance:.0e})")

    for dtype, tolerance in CHECK_TOLERANCE.items():
        for N in (64, 128):
            for chunk_size in CHUNKS:
                for L, gated in ((1, True), (333, True), (700, False)):
                    cases += 1
                    t = check_inputs(2, L, 4, 2, N, dtype, gated, device)
                    y, final, _ = forward(t, chunk_size)
                    want_y, want_final = recurrence(t)
                    name = f"forward {str(dtype)[6:]} N={N} chunk={chunk_size} L={L} gated={gated}"
                    compare(name, "y", y, want_y, dtype, tolerance)
                    compare(name, "final_states", final, want_final, dtype, tolerance)
        for N, chunk_size, L, gated, per_channel_D in BACKWARD_CASES:
            cases += 1
            t = check_inputs(2, L, 4, 2, N, dtype, gated, device, per_channel_D)
            grad_y = torch.randn(2, L, 4, 64, device=device).to(dtype)
            grad_final = torch.randn(2, 4, 64, N, device=device)
            got = forward_and_gradients(t, chunk_size, grad_y, grad_final)
            exact = {name: None if u is None else u.cpu().double() for name, u in t.items()}
            want = forward_and_gradients(exact, chunk_size, grad_y.cpu().double(), grad_final.cpu().double())
            name = f"backward {str(dtype)[6:]} N={N} chunk={chunk_size} L={L} gated={gated} D per channel={per_channel_D}"
            for label, value in got.items():
                compare(name, label, value, want[label], dtype, tolerance if label in ("y", "final_states") else 2 * tolerance)
    errors = "; ".join(f"{dtype} forward {e['forward']:.1e}, gradients {e['gradients']:.1e}" for dtype, e in largest.items())
    backends = tk_ops.backends()
    summary = (f"correctness sweep on {device} (mamba2_ssd: {backends['mamba2_ssd']}, mamba2_ssd_bwd: "
               f"{backends['mamba2_ssd_bwd']}): {cases} cases (forwards against a float64 recurrence, forwards and "
               f"gradients against the float64 reference op); largest relative errors: {errors} "
               f"(goal {TARGET_REL_ERR:.0e})")
    return summary, failures, largest


# ------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.arguments(__doc__, PASSES)
    parser.add_argument("--chunks", type=int, nargs="+", choices=CHUNKS, default=list(CHUNKS),
                        help="the chunk sizes both sides run at (default: 64 128 256)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.worker:
        return common.serve(BENCH, Shape, args.dry_run, mamba_ssm_versions)
    with contextlib.closing(common.Worker("benchmarks.bench_mamba2", args.dry_run, common.TRITON_AUTOTUNING_CACHE)) as worker:
        bench = dataclasses.replace(BENCH, baselines=tuple(map(worker.provider, BENCH.baselines)),
                                    sweep=("chunk", tuple(args.chunks)))

        def header() -> dict:
            return dict(dtype="bf16", call=CALL, chunks=list(args.chunks), mamba_ssm=worker.about,
                        ours_backends={op: tk_ops.backends()[op] for op in ("mamba2_ssd", "mamba2_ssd_bwd")})

        if common.without_gpu(args, bench, DRY_RUN_SHAPES, header):
            return
        summary, failures, largest = run_check("cuda")
        common.finish_check(summary, failures, exit_on_failure=args.check)
        if args.check:
            return
        common.run(bench, SHAPES, passes=args.passes, out=args.out, copy_gbps=common.measured_copy_bandwidth(),
                   timing=f"CUDA events, median over 5-15 rounds of 1-10 calls (about {TIMED_MS:.0f} ms timed), "
                          "after warm-up",
                   check={"summary": summary, "failures": failures, "largest_rel_err": largest}, **header())
    if failures:
        raise SystemExit(1)  # timed all the same, so that one run brings back both


if __name__ == "__main__":
    main()
