"""tk_ops.attention forward and backward against SDPA (cuDNN and flash backends) in the same run.

Shapes (../shared/anchors.md): N from 512 to 16384 with B = 16384 / N, D = 128 with H = 16 and
D = 64 with H = 32, causal and not; GQA (B = 4, Hq = 32, Hkv = 8, N = 4096, D = 128); odd N
(1000, 4097) at D = 128. TFLOP/s count 4 B H Nq Nk D for the forward (halved when causal) and 2.5x
that for the backward, which is timed alone (the forward that feeds it runs outside the timing).
Each row names its pass (fwd; bwd, the default backward; bwd_one_pass, the one-pass dq method
forced; bwd_det, deterministic=True; each backward against the baseline's backward, timed beside
it) and its baseline (sdpa_cudnn, sdpa_flash), with the relative difference of ours from it (fwd:
the output; the backwards: the gradients of q, k, v); calls under GRAPH_BELOW_MS (the short
forwards) are also replayed in CUDA graphs, ours and cuDNN's (graph_ratio: the ratio without host
overhead); writes benchmarks/results/attention.json and attention.png (benchmarks/common.py's rows).

Run from the repository root: python3 -m benchmarks.bench_attention [--out DIR] [--only grid gqa odd]
A small correctness pass (what compute-sanitizer runs): python3 -m benchmarks.bench_attention --check
On the CPU, tiny cases, nothing timed: python3 -m benchmarks.bench_attention --dry-run [--out DIR]
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tk_ops
from benchmarks import common

TOKENS = 16384
GROUPS = ("grid", "gqa", "odd")
# Our backward passes: (deterministic, TK_OPS_ATTENTION_BACKWARD): the default method for the shape,
# the one-pass method forced, the deterministic one.
OUR_BACKWARDS = {"bwd": (False, None), "bwd_one_pass": (False, "one_pass"), "bwd_det": (True, None)}
PASSES = ("fwd", *OUR_BACKWARDS)
# Calls shorter than this (the forwards at N <= 1024) are also timed as CUDA-graph replays, ours and
# cuDNN's: host overhead apart, so the eager ratio can be read against the device-time ratio.
GRAPH_BELOW_MS = 0.35


@dataclasses.dataclass(frozen=True)
class Case:
    group: str  # grid, gqa, odd
    batch: int
    q_heads: int
    kv_heads: int
    n: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"

    def flops(self, pass_: str) -> float:
        forward = 4.0 * self.batch * self.q_heads * self.n * self.n * self.head_dim
        forward = forward / 2 if self.causal else forward
        return forward if pass_ == "fwd" else 2.5 * forward

    @property
    def label(self) -> str:
        heads = f"H={self.q_heads}" if self.q_heads == self.kv_heads else f"Hq={self.q_heads} Hkv={self.kv_heads}"
        return f"B={self.batch} {heads} N={self.n} D={self.head_dim}" + (" causal" if self.causal else "")


def cases(groups: set[str]) -> list[Case]:
    out = []
    for causal in (False, True):
        if "grid" in groups:
            for head_dim, heads in ((128, 16), (64, 32)):
                out += [Case("grid", TOKENS // n, heads, heads, n, head_dim, causal) for n in (512, 1024, 2048, 4096, 8192, 16384)]
        if "gqa" in groups:
            out.append(Case("gqa", 4, 32, 8, 4096, 128, causal))
        if "odd" in groups:
            out += [Case("odd", max(1, TOKENS // n), 16, 16, n, 128, causal) for n in (1000, 4097)]
    return out


# --dry-run: each group at sizes a CPU runs in a moment
DRY_RUN_CASES = [Case("grid", 2, 2, 2, 64, 64, False), Case("gqa", 1, 4, 2, 48, 64, True), Case("odd", 1, 2, 2, 33, 128, True)]


def make_inputs(case: Case, device="cuda") -> tuple:
    def heads(count):
        return torch.randn(case.batch, count, case.n, case.head_dim, device=device, dtype=torch.bfloat16)

    q, k, v = heads(case.q_heads), heads(case.kv_heads), heads(case.kv_heads)
    return q, k, v, torch.randn_like(q)


def call(backward):
    """bwd's timed call: the closure that each provider's prepare built per input set after running
    the forward, outside the timing."""
    return backward()


def ours(case: Case, pass_: str):
    scale = case.head_dim**-0.5
    if pass_ != "fwd":
        return call
    return lambda q, k, v, grad_out: torch.ops.tk.attention(q, k, v, case.causal, scale, False)


def ours_backward(case: Case, pass_: str, inputs: tuple) -> tuple:
    """The backwards: the backward op alone, on the forward's own out and lse, by the pass's method
    (TK_OPS_ATTENTION_BACKWARD = the method forced, during the call)."""
    if pass_ == "fwd":
        return inputs
    deterministic, forced_method = OUR_BACKWARDS[pass_]
    scale = case.head_dim**-0.5
    q, k, v, grad_out = inputs
    out, lse = torch.ops.tk.attention(q, k, v, case.causal, scale, deterministic)

    def run():
        if forced_method is not None:
            os.environ["TK_OPS_ATTENTION_BACKWARD"] = forced_method
        try:
            return torch.ops.tk.attention_bwd(grad_out, None, q, k, v, out, lse, case.causal, scale, deterministic)
        finally:
            os.environ.pop("TK_OPS_ATTENTION_BACKWARD", None)

    return (run,)


def sdpa_forward(case: Case, pass_: str, backend):
    if pass_ != "fwd":
        return call
    group = case.q_heads // case.kv_heads

    def run(q, k, v, grad_out):
        if group > 1:  # the fused backends take GQA as repeated K/V heads: the copy is part of the timed call
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return run


def sdpa_backward(case: Case, pass_: str, inputs: tuple, backend) -> tuple:
    """The backwards: autograd's backward of SDPA alone, on repeated K/V heads for GQA."""
    if pass_ == "fwd":
        return inputs
    q, k, v, grad_out = inputs
    group = case.q_heads // case.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return (lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),)


def kv_heads_summed(case: Case, pass_: str, outputs: list) -> list:
    """SDPA's gradients of the repeated K/V heads summed per head, as ours has them (GQA)."""
    if pass_ == "fwd":
        return outputs
    grad_q, *grad_kv = outputs
    return [grad_q, *(g.unflatten(1, (case.kv_heads, -1)).sum(2) for g in grad_kv)]


def sdpa(name: str, backend, graph: bool = False) -> common.Provider:
    return common.Provider(name, functools.partial(sdpa_forward, backend=backend),
                           prepare=functools.partial(sdpa_backward, backend=backend), as_ours=kv_heads_summed,
                           graph=graph)


BENCH = common.Bench(
    "attention", "Attention: tk_ops vs SDPA cuDNN / flash (bf16)",
    ours=common.Provider("tk_ops", ours, prepare=ours_backward, graph=True),
    baselines=(sdpa("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, graph=True),
               sdpa("sdpa_flash", SDPBackend.FLASH_ATTENTION)),
    inputs=lambda case, pass_, device: make_inputs(case, device), passes=PASSES,
    set_bytes=lambda case, pass_, inputs: 2 * common.tensor_bytes(inputs), max_sets=4,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=5),
    graph_below_ms=GRAPH_BELOW_MS,
    panel=lambda row: f"{row['group']} D={row['head_dim']}",
)


# ---------------------------------------------------------------------------- correctness

CHECK_SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D, causal): tails, Nq != Nk, GQA, rows that see no key
    (1, 2, 1, 1, 1, 64, False),
    (1, 2, 2, 17, 33, 128, True),
    (2, 4, 2, 130, 70, 64, True),
    (1, 2, 1, 200, 300, 128, False),
]


def check() -> None:
    """The forward against float64 SDPA (rows that see no key left out) and finite gradients, on tails,
    Nq != Nk and GQA; exits non-zero on a wrong result."""
    for batch, q_heads, kv_heads, q_len, k_len, head_dim, causal in CHECK_SHAPES:
        q = torch.randn(batch, q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scale = head_dim**-0.5
        out, lse = torch.ops.tk.attention(q, k, v, causal, scale, False)
        grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, False)
        deterministic = torch.ops.tk.attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, True)
        methods_err = max(common.relative_difference(a, b) for a, b in zip(grads, deterministic))
        group = q_heads // kv_heads
        expected = F.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
            attn_mask=torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").tril(k_len - q_len) if causal else None,
            scale=scale)
        seen = torch.isfinite(lse)[..., None]
        err = common.relative_difference(out.double() * seen, torch.nan_to_num(expected) * seen)
        finite = all(torch.isfinite(g).all() for g in grads)
        status = "ok" if err < 1e-2 and methods_err < 1e-2 and finite else "WRONG"
        print(f"attention {batch}x{q_heads}/{kv_heads}x{q_len}x{k_len}x{head_dim} causal={causal}: rel err {err:.2e}, "
              f"one-pass vs deterministic grads {methods_err:.2e} {status}")
        if status != "ok":
            raise SystemExit("attention check: wrong result")
    torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = common.arguments(__doc__)
    parser.add_argument("--only", nargs="*", choices=GROUPS, default=list(GROUPS))
    args = parser.parse_args(argv)
    if common.without_gpu(args, BENCH, [case for case in DRY_RUN_CASES if case.group in args.only]):
        return
    assert tk_ops.backends()["attention"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    if args.check:
        return check()
    common.run(BENCH, cases(set(args.only)), out=args.out,
               flops="fwd 4 B H Nq Nk D (halved when causal), bwd 2.5x fwd; bf16")


if __name__ == "__main__":
    main()
