"""Gated DeltaNet's token mixer: tk_ops.gated_delta_rule against flash-linear-attention's
chunk_gated_delta_rule in the same run.

Shapes (bf16 q, k (B, T, Hk, 128), v (B, T, Hv, 128); fp32 g (log decays) and beta (B, T, Hv); the q/k
l2 norm in the op, as Qwen3-Next calls it; the final state returned):
  B = 1, T = 32768, Hk = 16, Hv = 32 (one long sequence, grouped value heads as Qwen3-Next)
  B = 8, T = 4096,  Hk = 16, Hv = 32
  B = 4, T = 8192,  Hk = 16, Hv = 16
Passes fwd and fwd+bwd (the gradients of q, k, v, g and beta for random output gradients). HBM floor: q,
k, v, g and beta read and o written once (the state traffic of a chunked kernel comes on top), over the
device-to-device copy bandwidth measured in the same run.

Baseline: fla (fla-core, `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, where it imports:
benchmarks/wheels/baselines.sh). Its backward refuses to run on Hopper with Triton 3.6 (fla issue #640):
that row then says so and the forward rows still compare.
Ours is whatever serves tk.gated_delta_rule on the device (tk_ops.backends() says which; the results
header records it): the forward kernels on an H100/H200 (bf16/fp16, K = V = 128), the chunked PyTorch
reference for the backward.

  python3 -m benchmarks.bench_gated_delta_rule [--out DIR] [--pass fwd|fwd+bwd]
  python3 -m benchmarks.bench_gated_delta_rule --check   # the forward kernels on small odd cases vs float64
  python3 -m benchmarks.bench_gated_delta_rule --dry-run [--out DIR]   # CPU, tiny shapes
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
PASSES = ("fwd", "fwd+bwd")
FLA = ("fla.ops.gated_delta_rule", "fla-core")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq_len: int
    k_heads: int
    v_heads: int
    head_dim: int = 128

    def hbm_bytes(self, pass_: str) -> int:
        """q, k, v, g, beta read and o written once (forward); the backward reads them and do again and
        writes their gradients."""
        tokens = self.batch * self.seq_len
        forward = tokens * (2 * self.k_heads * self.head_dim + 2 * self.v_heads * self.head_dim) * 2
        forward += tokens * 2 * self.v_heads * 4  # g and beta, fp32
        return forward if pass_ == "fwd" else 3 * forward

    @property
    def label(self) -> str:
        return f"B={self.batch} T={self.seq_len} Hk={self.k_heads} Hv={self.v_heads}"


CASES = [Case(1, 32768, 16, 32), Case(8, 4096, 16, 32), Case(4, 8192, 16, 16)]
DRY_RUN_CASES = [Case(2, 70, 2, 4, 16), Case(1, 130, 2, 2, 8)]


def make_inputs(case: Case, device) -> tuple:
    """q, k, v (bf16), g in (-0.5, 0) and beta in (0.05, 0.95) (fp32), all requiring grad, and the output
    gradients (do, and for the final state dh)."""
    def leaf(t):
        return t.requires_grad_()

    b, t, hk, hv, d = case.batch, case.seq_len, case.k_heads, case.v_heads, case.head_dim
    q = leaf(torch.randn(b, t, hk, d, device=device, dtype=DTYPE))
    k = leaf(torch.randn(b, t, hk, d, device=device, dtype=DTYPE))
    v = leaf(torch.randn(b, t, hv, d, device=device, dtype=DTYPE))
    g = leaf(-0.5 * torch.rand(b, t, hv, device=device))
    beta = leaf(0.05 + 0.9 * torch.rand(b, t, hv, device=device))
    grad_o = torch.randn(b, t, hv, d, device=device, dtype=DTYPE)
    grad_state = torch.randn(b, hv, d, d, device=device)
    return q, k, v, g, beta, (grad_o, grad_state)


def ours(q, k, v, g, beta):
    return tk_ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)


def fla(q, k, v, g, beta):
    chunk = common.need(*FLA).chunk_gated_delta_rule
    return chunk(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


BENCH = common.Bench(
    "gated_delta_rule", "Gated delta rule: tk_ops vs fla chunk_gated_delta_rule (bf16)",
    # each pass on (q, k, v, g, beta, (do, dh)): (o, final state), and with the backward the gradients of
    # q, k, v, g and beta too
    ours=common.stepped("tk_ops", ours),
    baselines=(common.stepped("fla", fla),),
    inputs=lambda case, pass_, device: make_inputs(case, device), passes=PASSES,
    set_bytes=lambda case, pass_, inputs: common.tensor_bytes(inputs), max_sets=4,
    timer=functools.partial(common.time_ms, warmup=2, rounds=5, batch=3),
    tolerance=2e-2,
)


# (lengths of the packed sequences, or (B, T); Hk, Hv, dtype, K = V): T not a multiple of the chunk, grouped
# value heads, packed sequences with an empty and a one-position one; every case with initial states. The
# last three are the recurrent kernel's (no sequence longer than 16: a decode step, K = V = 64 too).
CHECK_CASES = [((2, 70), 2, 4, torch.bfloat16, 128), ((0, 1, 59, 70), 2, 2, torch.bfloat16, 128),
               ((1, 257), 1, 2, torch.float16, 128), ((5, 1), 2, 4, torch.bfloat16, 128),
               ((3, 16), 1, 2, torch.float16, 64), ((0, 1, 5, 16), 2, 2, torch.bfloat16, 64)]


def check() -> None:
    """The forward (o and the final states) against the op in float64 on the CPU (the correctness run
    compute-sanitizer watches); exits non-zero on a wrong result."""
    failures = []
    for lengths, hk, hv, dtype, d in CHECK_CASES:
        packed = len(lengths) > 2
        batch, total = (1, sum(lengths)) if packed else lengths
        sequences = len(lengths) if packed else batch
        q, k = (torch.randn(batch, total, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        v = torch.randn(batch, total, hv, d, device="cuda", dtype=dtype)
        g = -0.5 * torch.rand(batch, total, hv, device="cuda")
        beta = 0.05 + 0.9 * torch.rand(batch, total, hv, device="cuda")
        state = torch.randn(sequences, hv, d, d, device="cuda")
        cu_seqlens = None
        if packed:
            cu_seqlens = torch.tensor((0, *lengths), device="cuda").cumsum(0).to(torch.int32)
        inputs = (q, k, v, g, beta)
        options = dict(initial_state=state, output_final_state=True, use_qk_l2norm=True)
        got = tk_ops.gated_delta_rule(*inputs, cu_seqlens=cu_seqlens, **options)
        cpu = lambda t: None if t is None else t.cpu()
        want = tk_ops.gated_delta_rule(*(t.cpu().double() for t in inputs), cu_seqlens=cpu(cu_seqlens),
                                       **dict(options, initial_state=state.cpu().double()))
        err = max(common.relative_difference(a.cpu(), b) for a, b in zip(got, want))
        status = "ok" if err < 2e-2 else "WRONG"
        print(f"gated_delta_rule {'packed ' if packed else ''}{lengths} Hk={hk} Hv={hv} D={d} {dtype}: "
              f"rel err {err:.2e} {status}")
        if status != "ok":
            failures.append(f"{lengths} Hk={hk} Hv={hv} D={d} {dtype}: {err:.2e}")
    common.finish_check(f"gated_delta_rule check on {tk_ops.backends()['gated_delta_rule']}", failures)


def main(argv=None) -> None:
    args = common.arguments(__doc__, PASSES).parse_args(argv)
    torch.manual_seed(0)
    if common.without_gpu(args, BENCH, DRY_RUN_CASES):
        return
    if args.check:
        return check()
    _, fla_version = common.peer(*FLA)
    common.run(BENCH, CASES, passes=args.passes, out=args.out, copy_gbps=common.measured_copy_bandwidth(),
               dtype="bf16", fla=fla_version, ours_backend=tk_ops.backends()["gated_delta_rule"])


if __name__ == "__main__":
    main()
