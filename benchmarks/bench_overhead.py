"""Host time per eager call: each kernel-backed tk op against its torch counterpart, on inputs so
small that the GPU is idle and the call costs what the host spends on it (the Python op layer,
argument checks, tensor-map encoding, the launch).

Run from the repository root on the GPU machine: python3 -m benchmarks.bench_overhead [--out DIR]
(--dry-run: the same calls on the CPU, nothing timed). Rows: benchmarks/common.py's, against the
baseline "torch", per op and pass (fwd, or fwd_bwd through autograd); ours_ms / baseline_ms:
milliseconds of host time per call.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16


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


OPS = {  # op -> (ours, torch's): each on the op's whole input set
    "matmul": (tk_ops.matmul, torch.matmul),
    "linear": (tk_ops.linear, F.linear),
    "attention": (lambda *qkv: tk_ops.attention(*qkv, causal=True),
                  lambda *qkv: F.scaled_dot_product_attention(*qkv, is_causal=True)),
    "layer_norm": (lambda x, w, b: tk_ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (256,), w, b)),
    "rms_norm": (lambda x, w: tk_ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (256,), w, 1e-6)),
    # ours takes the half tables (cos, sin), torch's formula the full ones
    "rope": (lambda x, cos, sin, *full: tk_ops.rope(x, cos, sin), lambda x, cos, sin, *full: rotate_half_rope(x, *full)),
}
CASES = [Case(op) for op in OPS]


def inputs(case: Case, pass_: str, device) -> tuple:
    """The op's inputs; the tensors that take gradients have requires_grad."""

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
    cos, sin = t(64, 32, grad=False), t(64, 32, grad=False)
    return t(1, 2, 64, 64), cos, sin, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def fwd_bwd(fn):
    def run(*inputs):
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()

    return run


def provider(name: str, side: int) -> common.Provider:
    return common.Provider(name, lambda case, pass_: OPS[case.op][side] if pass_ == "fwd" else fwd_bwd(OPS[case.op][side]))


BENCH = common.Bench(
    "overhead", "Host time per eager call (tiny inputs): tk_ops vs torch", provider("tk_ops", 0), (provider("torch", 1),),
    inputs, passes=("fwd", "fwd_bwd"), set_bytes=lambda case, pass_, inputs: 0, max_sets=1,
    timer=lambda fn, sets: common.host_us_per_call(fn, sets[0]) / 1e3,
)


def main(argv=None) -> None:
    args = common.arguments(__doc__, check=False).parse_args(argv)
    if not common.without_gpu(args, BENCH, CASES):
        common.run(BENCH, CASES, out=args.out)


if __name__ == "__main__":
    main()
