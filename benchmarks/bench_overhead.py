"""Host time per eager call: each kernel-backed tk op against its torch counterpart, on inputs so
small that the GPU is idle and a call costs what the host spends on it (the public function, the
dispatcher, autograd, the C++ checks, tensor-map encoding, the launch).

Counterparts: torch.matmul, F.linear, F.scaled_dot_product_attention, F.layer_norm, F.rms_norm, and
for rope / rope_qk the rotate_half formula compiled with torch.compile (as Hugging Face models run
it compiled). Inputs require grad in both passes (a training step's calls): fwd is the forward call
alone, fwd_bwd the forward and out.sum().backward().

Run from the repository root on the GPU machine: python3 -m benchmarks.bench_overhead [--out DIR]
(--dry-run: the same calls on the CPU, nothing timed). Rows: benchmarks/common.py's, against the
baseline "torch", per op and pass; ours_ms / baseline_ms: wall-clock milliseconds per call, the
median over ROUNDS rounds of CALLS back-to-back calls closed by a synchronize (with the GPU idle,
the host's time per call).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
CALLS = 200
ROUNDS = 7
POSITIONS, HEAD_DIM = 64, 64


@dataclasses.dataclass(frozen=True)
class Case:
    op: str

    @property
    def label(self) -> str:
        return self.op


def rotate_half_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


compiled_rope = torch.compile(rotate_half_rope, fullgraph=True, dynamic=False)


def full_table(half):
    return torch.cat((half, half), -1)


OPS = {  # op -> (ours, torch's): each on the op's whole input set
    "matmul": (tk_ops.matmul, torch.matmul),
    "linear": (tk_ops.linear, F.linear),
    "attention": (lambda *qkv: tk_ops.attention(*qkv, causal=True),
                  lambda *qkv: F.scaled_dot_product_attention(*qkv, is_causal=True)),
    "layer_norm": (lambda x, w, b: tk_ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (256,), w, b)),
    "rms_norm": (lambda x, w: tk_ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (256,), w, 1e-6)),
    # ours takes the half tables (cos, sin), the formula the full ones
    "rope": (lambda x, cos, sin, *full: tk_ops.rope(x, cos, sin), lambda x, cos, sin, *full: compiled_rope(x, *full)),
    "rope_qk": (lambda q, k, cos, sin, *full: tk_ops.rope_qk(q, k, cos, sin),
                lambda q, k, cos, sin, *full: (compiled_rope(q, *full), compiled_rope(k, *full))),
}
CASES = [Case(op) for op in OPS]


def inputs(case: Case, pass_: str, device) -> tuple:
    """The op's inputs; every floating input but the rotary tables requires grad."""

    def t(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=DTYPE, requires_grad=grad)

    if case.op == "matmul":
        return t(64, 64), t(64, 64)
    if case.op == "linear":
        return t(64, 256), t(128, 256), t(128)
    if case.op == "attention":
        return t(1, 2, 64, 64), t(1, 2, 64, 64), t(1, 2, 64, 64)
    if case.op in ("layer_norm", "rms_norm"):
        return (t(64, 256), t(256), t(256))[: 3 if case.op == "layer_norm" else 2]
    cos, sin = t(POSITIONS, HEAD_DIM // 2, grad=False), t(POSITIONS, HEAD_DIM // 2, grad=False)
    heads = (t(1, 2, POSITIONS, HEAD_DIM),) if case.op == "rope" else (t(1, 2, POSITIONS, HEAD_DIM), t(1, 1, POSITIONS, HEAD_DIM))
    return *heads, cos, sin, full_table(cos), full_table(sin)


def fwd_bwd(fn):
    def run(*inputs):
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(out.sum() for out in outs).backward()

    return run


def provider(name: str, side: int) -> common.Provider:
    return common.Provider(name, lambda case, pass_: OPS[case.op][side] if pass_ == "fwd" else fwd_bwd(OPS[case.op][side]))


BENCH = common.Bench(
    "overhead", "Host time per eager call (tiny inputs): tk_ops vs torch", provider("tk_ops", 0), (provider("torch", 1),),
    inputs, passes=("fwd", "fwd_bwd"), set_bytes=lambda case, pass_, inputs: 0, max_sets=1,
    timer=lambda fn, sets: common.host_us_per_call(fn, sets[0], CALLS, ROUNDS) / 1e3,
)


def main(argv=None) -> None:
    args = common.arguments(__doc__, check=False).parse_args(argv)
    if not common.without_gpu(args, BENCH, CASES):
        common.run(BENCH, CASES, out=args.out, calls_per_round=CALLS, rounds=ROUNDS,
                   timing="wall clock (perf_counter) around CALLS calls and a synchronize, median over ROUNDS")


if __name__ == "__main__":
    main()
