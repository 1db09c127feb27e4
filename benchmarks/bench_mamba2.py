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

Each side runs at every chunk size of --chunks (default 64, 128, 256). Per shape and pass: a row
per chunk size, ours against mamba_ssm at that size (baseline "mamba_ssm@256"), and a row of each
at its own fastest size ("mamba_ssm@best"; ours_chunk and baseline_chunk say which). A row
(benchmarks/common.py's schema, with the chunk sizes and peaks added) has both times (CUDA events
after warm-up, median over rounds of back-to-back calls, inputs rotated through more than twice
the L2), ratio = baseline_ms / ours_ms (above 1 we are faster), both peak
memories in MiB (torch.cuda.max_memory_allocated during one call, less what was allocated before
it: the inputs) and peak_ratio = ours / mamba_ssm's, the relative difference of our y (and for
fwd+bwd of our gradients: the largest) from mamba_ssm's, and the HBM floor: the bytes that must
cross HBM once (forward: x, dt, B, C read and y written; forward + backward adds x, dt, B, C and
the output gradient read and their gradients written) over the device-to-device copy bandwidth
measured in the run, with each side's fraction of it. Writes benchmarks/results/mamba2.json after
every shape and mamba2.png at the end (and both into --out). The header's ours_backends says what
served our forward and backward (the CUDA kernels, or the PyTorch reference in a build without them).

mamba_ssm (the carried .baselines, see gpu_session.sh) runs in a worker process, one request per
row: a call that fails or kills the worker costs only its row (the worker leaves after a failure;
the next row starts a new one), and without mamba_ssm the rows say why while ours is still
measured. The worker keeps Triton's autotuning results on disk (TRITON_CACHE_AUTOTUNING=1): a new
worker tunes again only the kernels whose configurations have hooks, which Triton does not cache.
mamba_ssm's first call at each chunk size and (H, N) compiles and autotunes its Triton kernels
(about 130 configurations for the forward and backward): on a cold Triton cache that is most of
the run, an estimated 3 to 4 of about 5 minutes on the H100 (an estimate; the log prints each
first call's seconds). --chunks 256 or --pass fwd cut it.

  python3 -m benchmarks.bench_mamba2 [--out DIR] [--pass fwd|fwd+bwd] [--chunks C [C ...]]
        the correctness sweep, then the benchmark: every forward row, then every forward +
        backward row, each printed as it is measured. A failing sweep is recorded in the
        results and in the exit status, and the timing runs all the same
  python3 -m benchmarks.bench_mamba2 --check
        only the correctness sweep (the mamba2_ssd kernel family's run under compute-sanitizer):
        the forward of every kernel variant (bf16/fp16, N 64/128, chunk 64/128/256, gating, D,
        dt_bias + softplus, initial states, L = 1, 333, 700) against a float64 sequential
        recurrence on the CPU, and y, the final states and the gradient of every input against
        the op's float64 reference on the CPU; exits non-zero on a failure
  python3 -m benchmarks.bench_mamba2 --dry-run [--out DIR]
        CPU, tiny shapes, CPU wall-clock times in place of GPU times, no peak memory: measures,
        prints and writes every row, the JSON and the plot (into --out), through the worker
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
FP32_BYTES = 4  # dt, A, D, dt_bias and their gradients
PASSES = ("fwd", "fwd+bwd")
CHUNKS = (64, 128, 256)  # the chunk sizes our kernel takes
BASELINE = "mamba_ssm"
CALL = ("D (H,), dt_bias, dt_softplus=True, z=None, no initial_states, return_final_states=False; "
        "x, B, C bf16, dt, A, D, dt_bias fp32; gradients of x, dt, A, B, C, D, dt_bias")
# The GPU timer sizes its batch and rounds from one timed call: about TIMED_MS of timed calls in
# batches of about BATCH_MS, 5 to 15 rounds of 1 to 10 calls (a call of our PyTorch backward at 64k
# tokens takes a fraction of a second; a forward, a fraction of a millisecond).
BATCH_MS, TIMED_MS = 20.0, 400.0
MIB = 2**20
TOLERANCE = 5e-2  # the largest relative difference from mamba_ssm's outputs that is not flagged a mismatch
TITLE = "Mamba-2 SSD: tk_ops vs mamba_ssm's Triton SSD (bf16)"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    heads: int
    state_size: int
    head_dim: int = 64
    groups: int = 1

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


# ---------------------------------------------------------------------------------- the callables


def ours(chunk: int) -> Callable:
    return lambda x, dt, A, B, C, D, dt_bias: tk_ops.mamba2_ssd(
        x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, dt_softplus=True)


def theirs(scan: Callable, chunk: int) -> Callable:
    """mamba_chunk_scan_combined, whose chunk_size is positional and has no default."""
    return lambda x, dt, A, B, C, D, dt_bias: scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)


# ---------------------------------------------------------------------------------------- inputs


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


def input_sets(shape: Shape, pass_: str, device) -> list[tuple]:
    """Enough sets that a rotation through them exceeds twice the L2 (one on the CPU)."""
    count = common.input_set_count(shape.hbm_bytes(pass_), device)
    return [input_set(shape, device, pass_ == "fwd+bwd", seed) for seed in range(count)]


# ------------------------------------------------------------------------------------ measuring


def gpu_ms(fn: Callable, sets: list[tuple]) -> float:
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


def cpu_wall_ms(fn: Callable, sets: list[tuple]) -> float:
    """--dry-run's stand-in for gpu_ms: CPU wall-clock milliseconds per call, one call per set."""
    start = time.perf_counter()
    for inputs in sets:
        fn(*inputs)
    return (time.perf_counter() - start) * 1e3 / len(sets)


def peak_bytes(fn: Callable, inputs: tuple) -> int:
    """The most memory one call allocates beyond what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(fn: Callable, sets: list[tuple], device) -> dict:
    """{"ms", "peak_bytes", "first_call_s"} of fn: the time and memory are taken after a first call
    (lazy initialisation; mamba_ssm's Triton compiling and autotuning at a new chunk size or (H, N)),
    which is timed on its own."""
    started = time.perf_counter()
    fn(*sets[0])
    if device != "cuda":
        return {"ms": cpu_wall_ms(fn, sets), "peak_bytes": None, "first_call_s": round(time.perf_counter() - started, 2)}
    torch.cuda.synchronize()
    first_call_s = round(time.perf_counter() - started, 2)
    peak = peak_bytes(fn, sets[0])
    return {"ms": gpu_ms(fn, sets), "peak_bytes": peak, "first_call_s": first_call_s}


def agreement(scan: Callable, chunk: int, inputs: tuple, backward: bool) -> Optional[float]:
    """The largest relative difference of our y (and gradients) from mamba_ssm's, at one chunk size."""
    ours_outputs, theirs_outputs = (common.tensors_of(common.step(fn, backward)(*inputs)) for fn in (ours(chunk), theirs(scan, chunk)))
    return common.largest_difference(ours_outputs, theirs_outputs)


# ---------------------------------------------------------------------- mamba_ssm in its own process


def baseline_worker(dry_run: bool) -> None:
    """--baseline-worker: a READY line (with the versions) or an UNAVAILABLE line (why), then for
    each request on stdin (a JSON line: shape, pass, chunk) a RESULT line, measure_baseline's dict;
    one with an "error" is the last."""
    device = "cpu" if dry_run else "cuda"
    try:
        import mamba_ssm
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as error:  # not carried, or triton or einops missing
        print("UNAVAILABLE", f"mamba_ssm not importable ({common.describe_error(error)})", flush=True)
        return
    versions = {"version": getattr(mamba_ssm, "__version__", None), "path": str(pathlib.Path(mamba_ssm.__file__).parent),
                "triton": getattr(sys.modules.get("triton"), "__version__", None)}
    print("READY", json.dumps(versions), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = measure_baseline(mamba_chunk_scan_combined, Shape(**request["shape"]), request["pass"],
                                      request["chunk"], device)
        except Exception as error:
            result = {"error": common.describe_error(error)}
        if "error" in result:  # the CUDA context may be unusable now: report, and leave it
            print("RESULT", json.dumps(result), flush=True)
            return
        if device == "cuda":
            torch.cuda.empty_cache()  # the parent's turn next: leave it the memory
        print("RESULT", json.dumps(result), flush=True)


def measure_baseline(scan: Callable, shape: Shape, pass_: str, chunk: int, device) -> dict:
    """measure's dict for mamba_ssm, with "rel_diff" (agreement), or with an "error" that says why
    there is none: the agreement runs ours too, whose PyTorch backward may run out of memory where
    mamba_ssm did not, and the timing stands."""
    backward = pass_ == "fwd+bwd"
    sets = input_sets(shape, pass_, device)
    result = measure(common.step(theirs(scan, chunk), backward), sets, device)
    try:
        result["rel_diff"] = agreement(scan, chunk, sets[0], backward)
    except Exception as error:
        result["error"] = f"no relative difference: {common.describe_error(error)}"
    return result


class BaselineWorker:
    """The parent's end of --baseline-worker: started at the first request, and again at the request
    after a failure. `missing` says why mamba_ssm cannot run at all (no worker is started again):
    not importable, or GIVE_UP_AFTER failures in a row without a time (each new worker costs seconds
    of imports and CUDA start-up, which a failure of every row would pay some thirty times)."""

    PROTOCOL = ("READY", "UNAVAILABLE", "RESULT")
    GIVE_UP_AFTER = 3

    def __init__(self, dry_run: bool):
        self.command = [sys.executable, "-m", "benchmarks.bench_mamba2", "--baseline-worker"] + (["--dry-run"] if dry_run else [])
        self.process: Optional[subprocess.Popen] = None
        self.missing: Optional[str] = None
        self.versions: Optional[dict] = None
        self.failures_in_a_row = 0

    def _reply(self) -> tuple[str, str]:
        """The worker's next protocol line, passing its other output through; ("EXIT", why) when it ends."""
        for line in self.process.stdout:
            kind, _, payload = line.rstrip("\n").partition(" ")
            if kind in self.PROTOCOL:
                return kind, payload
            print(line, end="", flush=True)
        return "EXIT", f"baseline worker exited with status {self.process.wait()}"

    def _start(self) -> None:
        env = {"TRITON_CACHE_AUTOTUNING": "1", **os.environ}  # unless the caller chose otherwise
        self.process = subprocess.Popen(self.command, cwd=common.ROOT, env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        kind, payload = self._reply()
        if kind == "READY":
            self.versions = json.loads(payload)
        else:  # not importable, or the import itself crashed: a new worker would fare no better
            self.missing = payload
            self.close()

    def measure(self, shape: Shape, pass_: str, chunk: int) -> dict:
        if self.process is None and self.missing is None:
            self._start()
        if self.missing is not None:
            return {"error": self.missing}
        request = {"shape": dataclasses.asdict(shape), "pass": pass_, "chunk": chunk}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            kind, payload = self._reply()
        except BrokenPipeError:  # it died after its last reply
            kind, payload = "EXIT", f"baseline worker exited with status {self.process.wait()}"
        result = json.loads(payload) if kind == "RESULT" else {"error": payload}
        if "error" in result:  # the worker has left, or is leaving
            self.close()
        self.failures_in_a_row = 0 if "ms" in result else self.failures_in_a_row + 1
        if self.failures_in_a_row == self.GIVE_UP_AFTER:
            self.missing = f"not run after {self.GIVE_UP_AFTER} failures in a row, the last: {result['error']}"
        return result

    def close(self) -> None:
        if self.process is not None:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
            self.process.wait()
            self.process = None


# ------------------------------------------------------------------------------------------- rows


def fastest(results: dict[int, dict]) -> Optional[int]:
    """The chunk size of the fastest result that has a time, or None."""
    timed = [chunk for chunk, result in results.items() if result.get("ms") is not None]
    return min(timed, key=lambda chunk: results[chunk]["ms"], default=None)


def mib(n: Optional[int]) -> Optional[float]:
    return None if n is None else round(n / MIB, 1)


def rows_of(shape: Shape, pass_: str, ours_results: dict[int, dict], theirs_results: dict[int, dict],
            copy_gbps: Optional[float]) -> list[dict]:
    """A row per chunk size (both at that size) and one of each side at its fastest size."""
    pairs = [(f"{BASELINE}@{chunk}", chunk, chunk) for chunk in ours_results]
    pairs.append((f"{BASELINE}@best", fastest(ours_results), fastest(theirs_results)))
    rows = []
    for name, ours_chunk, theirs_chunk in pairs:
        # a side with no timed chunk size shows the error of its first
        mine = ours_results[ours_chunk] if ours_chunk is not None else next(iter(ours_results.values()))
        other = theirs_results[theirs_chunk] if theirs_chunk is not None else next(iter(theirs_results.values()))
        row = common.comparison_row(shape, pass_, name, mine, other, TOLERANCE, copy_gbps)
        row.update(ours_chunk=ours_chunk, baseline_chunk=theirs_chunk, ours_peak_mib=mib(mine.get("peak_bytes")),
                   baseline_peak_mib=mib(other.get("peak_bytes")),
                   peak_ratio=common.ratio(mine.get("peak_bytes"), other.get("peak_bytes")))
        rows.append(row)
    common.mark_best(rows)
    return rows


def panel(row: dict) -> str:
    """The plot's panel of a row: both sides at one chunk size, or each at its fastest."""
    return row["baseline"]


def table(shapes: tuple[Shape, ...], chunks: tuple[int, ...]) -> common.Table:
    return common.Table(shapes, PASSES, [f"{BASELINE}@{chunk}" for chunk in (*chunks, "best")],
                        extra=("ours_chunk", "baseline_chunk", "ours_peak_mib", "baseline_peak_mib", "peak_ratio"))


def progress(shape: Shape, pass_: str, side: str, chunk: int, result: dict, started: float) -> None:
    """One line per measurement as it ends, so that a run cut short still shows what it measured."""
    what = []
    if "ms" in result:
        what.append(f"{result['ms']:.4f} ms, peak {mib(result['peak_bytes'])} MiB, first call {result['first_call_s']} s")
    if "rel_diff" in result:
        what.append(f"rel diff of ours from it {result['rel_diff']:.2e}")
    if "error" in result:
        what.append(result["error"])
    print(f"  {shape.label} {pass_} {side}@{chunk}: {'; '.join(what)} ({time.perf_counter() - started:.1f} s in all)",
          flush=True)


def measure_shape(shape: Shape, pass_: str, chunks: tuple[int, ...], device, worker: BaselineWorker,
                  copy_gbps: Optional[float]) -> list[dict]:
    """Ours at every chunk size, then mamba_ssm at every chunk size (in the worker), then the rows."""
    backward = pass_ == "fwd+bwd"
    ours_results = {}
    sets = input_sets(shape, pass_, device)
    for chunk in chunks:
        started = time.perf_counter()
        try:
            ours_results[chunk] = measure(common.step(ours(chunk), backward), sets, device)
        except Exception as error:  # e.g. out of memory: the rows say so
            ours_results[chunk] = {"error": common.describe_error(error)}
        progress(shape, pass_, "tk_ops", chunk, ours_results[chunk], started)
    del sets
    if device == "cuda":
        torch.cuda.empty_cache()  # the worker's turn: leave it the memory
    theirs_results = {}
    for chunk in chunks:
        started = time.perf_counter()
        theirs_results[chunk] = worker.measure(shape, pass_, chunk)
        progress(shape, pass_, BASELINE, chunk, theirs_results[chunk], started)
    return rows_of(shape, pass_, ours_results, theirs_results, copy_gbps)


def benchmark(args: argparse.Namespace, shapes: tuple[Shape, ...], device, copy_gbps: Optional[float],
              out_dirs: list[pathlib.Path], header: dict, device_name: str) -> list[dict]:
    """Every forward row, then every forward + backward row; the results file rewritten after each
    shape (so that a run cut short keeps what it measured), the plot at the end."""
    chunks = tuple(args.chunks)
    rows = []
    printed = table(shapes, chunks)
    print(printed.header())
    with contextlib.closing(BaselineWorker(args.dry_run)) as worker:
        for pass_ in args.passes or PASSES:
            for shape in shapes:
                shape_rows = measure_shape(shape, pass_, chunks, device, worker, copy_gbps)
                printed.print(shape_rows)
                rows += shape_rows
                common.write_results("mamba2", rows, out_dirs, **header, chunks=list(chunks),
                                     mamba_ssm=worker.versions or worker.missing, rel_diff_tolerance=TOLERANCE)
    for directory in out_dirs:
        common.plot(rows, directory / "mamba2.png", TITLE, device_name, panel=panel)
    return rows


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
    parser.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.baseline_worker:
        baseline_worker(args.dry_run)
        return
    if args.plot_from:
        document = json.loads(args.plot_from.read_text())
        return common.plot(document["rows"], args.plot_from.with_suffix(".png"), TITLE, document.get("gpu") or "CPU",
                           panel=panel)
    header = dict(dtype="bf16", call=CALL,
                  ours_backends={op: tk_ops.backends()[op] for op in ("mamba2_ssd", "mamba2_ssd_bwd")})
    if args.dry_run:
        benchmark(args, DRY_RUN_SHAPES, "cpu", None, [args.out] if args.out else [],
                  dict(header, timing="CPU wall-clock, one call per input set (dry run)"), "CPU (dry run: CPU wall-clock times)")
        return
    summary, failures, largest = run_check("cuda")
    common.finish_check(summary, failures, exit_on_failure=args.check)
    if args.check:
        return
    copy = common.measured_copy_bandwidth()
    header.update(
        **common.copy_ceiling_header(copy),
        timing=f"CUDA events, median over 5-15 rounds of 1-10 calls (about {TIMED_MS:.0f} ms timed), after warm-up",
        check={"summary": summary, "failures": failures, "largest_rel_err": largest},
    )
    benchmark(args, SHAPES, "cuda", copy, [common.RESULTS] + ([args.out] if args.out else []), header,
              torch.cuda.get_device_name())
    if failures:
        raise SystemExit(1)  # timed all the same, so that one run brings back both


if __name__ == "__main__":
    main()
