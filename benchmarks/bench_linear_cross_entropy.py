"""The LM head and its loss: tk_ops.linear_cross_entropy against the unfused PyTorch form (eager and
torch.compile) and Liger's fused linear cross-entropy, in the same run.

Shapes (bf16 x (N, H) and weight (V, H), int64 targets with 1/16 of them ignore_index, mean reduction):
N = 16384 tokens (a 1B step's batch), H = 2048 and 4096 against Llama 3's vocabulary V = 128256, and
H = 4096 against V = 32000; passes fwd (the loss alone, as evaluation computes it: x and weight require no
grad) and fwd+bwd (the loss and the gradients of x and weight, as training does).
TFLOP/s count the GEMMs: 2 N H V forward, 3x that forward + backward (the logits, then the gradients
of x and weight), as Liger counts them. Each case's row also has the peak memory each implementation
allocates beyond its inputs for one forward + backward (``peak_gib``: the unfused form holds N x V
logits, in bf16 and again in fp32).

Baselines:
  eager     F.cross_entropy(F.linear(x, weight).float(), target)
  compiled  the same under torch.compile(dynamic=False)
  liger     liger_kernel.transformers.functional.liger_fused_linear_cross_entropy (liger-kernel, where
            it imports: benchmarks/wheels/baselines.sh)
Ours is whatever serves tk.linear_cross_entropy on the device (tk_ops.backends() says which; the
results header records it): with the extension, the GEMM and row kernels of
csrc/torch/linear_cross_entropy.cpp: fwd the forward alone (one GEMM); fwd+bwd, for this mean reduction,
the forward that computes the gradients (tk::linear_cross_entropy_with_grads: three GEMMs, as Liger's)
and a backward that scales them.

  python3 -m benchmarks.bench_linear_cross_entropy [--out DIR] [--pass fwd|fwd+bwd]
  python3 -m benchmarks.bench_linear_cross_entropy --dry-run [--out DIR]   # CPU, tiny shapes
  python3 -m benchmarks.bench_linear_cross_entropy --check   # the kernels on small odd shapes vs float64
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common

DTYPE = torch.bfloat16
PASSES = ("fwd", "fwd+bwd")
IGNORE_INDEX = -100
IGNORED_EVERY = 16  # one target in 16 is ignore_index (padding, prompt tokens)
LIGER = ("liger_kernel.transformers.functional", "liger-kernel")


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    vocab: int

    def flops(self, pass_: str) -> float:
        forward = 2.0 * self.tokens * self.hidden * self.vocab
        return forward if pass_ == "fwd" else 3 * forward

    @property
    def label(self) -> str:
        return f"N={self.tokens} H={self.hidden} V={self.vocab}"


CASES = [Case(16384, 2048, 128256), Case(16384, 4096, 128256), Case(16384, 4096, 32000)]
DRY_RUN_CASES = [Case(37, 24, 1000), Case(64, 16, 300)]


def make_inputs(case: Case, device, requires_grad: bool = True) -> tuple:
    """x (N, H) and weight (V, H) (weight ~ N(0, 1 / H): logits of unit size), requiring grad unless not
    ``requires_grad``, targets (N,) with every IGNORED_EVERY-th ignored, and the loss's gradient (a scalar)."""
    x = torch.randn(case.tokens, case.hidden, device=device).to(DTYPE).requires_grad_(requires_grad)
    weight = (torch.randn(case.vocab, case.hidden, device=device) / case.hidden**0.5).to(DTYPE)
    weight.requires_grad_(requires_grad)
    target = torch.randint(0, case.vocab, (case.tokens,), device=device)
    target[::IGNORED_EVERY] = IGNORE_INDEX
    return x, weight, target, torch.ones((), device=device)


# A pass on (x, weight, target, grad): the loss, and with the backward the gradients of x and weight too.
DIFFERENTIABLE = (0, 1)


def unfused(x, weight, target):
    return F.cross_entropy(F.linear(x, weight).float(), target, ignore_index=IGNORE_INDEX)


def ours(x, weight, target):
    return tk_ops.linear_cross_entropy(x, weight, target, ignore_index=IGNORE_INDEX)


def liger(x, weight, target):
    fused = common.need(*LIGER).liger_fused_linear_cross_entropy
    return fused(x, weight, target, ignore_index=IGNORE_INDEX)


PROVIDERS = {"tk_ops": ours, "eager": unfused, "compiled": torch.compile(unfused, dynamic=False), "liger": liger}


def peak_memory(case: Case, device) -> dict:
    """Per implementation, the GiB one forward + backward allocates beyond its inputs at its peak (None
    where it fails, e.g. liger absent); empty on the CPU."""
    if device != "cuda":
        return {}
    peaks = {}
    for name, loss in PROVIDERS.items():
        x, weight, target, grad = make_inputs(case, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            common.step(loss, True, DIFFERENTIABLE)(x, weight, target, grad)
            torch.cuda.synchronize()
            peaks[name] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)
        except Exception:  # the timed rows say why
            peaks[name] = None
        del x, weight, target, grad
        torch.cuda.empty_cache()
    return {"peak_gib": peaks}


BENCH = common.Bench(
    "linear_cross_entropy", "LM head + cross-entropy: tk_ops vs unfused PyTorch / Liger (bf16)",
    ours=common.stepped("tk_ops", ours, DIFFERENTIABLE),
    baselines=tuple(common.stepped(name, PROVIDERS[name], DIFFERENTIABLE) for name in ("eager", "compiled", "liger")),
    inputs=lambda case, pass_, device: make_inputs(case, device, requires_grad=pass_ != "fwd"), passes=PASSES,
    set_bytes=lambda case, pass_, inputs: common.tensor_bytes(inputs), max_sets=2,
    timer=functools.partial(common.time_ms, warmup=2, rounds=5, batch=2),
    tolerance=2e-2,
    case_fields=peak_memory,
    tick=lambda row: row["shape"],
)


# (N, H, V, options): odd sizes, a V past one tile of classes in the backward, every option; "mean" and "sum"
# compute the gradients in the forward, the last over three tiles of rows (128 rows of 2^20 + 8 classes a
# tile), so that grad_W's fp32 sum is added to by the accumulating GEMM
CHECK_CASES = [(37, 24, 1001, {}), (130, 64, 50257, dict(label_smoothing=0.1, softcap=30.0)),
               (300, 128, 3001, dict(reduction="sum", bias=True)), (5, 16, 77, dict(reduction="none")),
               (300, 16, (1 << 20) + 5, dict(bias=True))]


def check() -> None:
    """The kernels' loss and gradients against float64 autograd of the reference on the CPU (the
    correctness run compute-sanitizer watches); exits non-zero on a wrong result."""
    for n, h, v, options in CHECK_CASES:
        options = dict(options)
        x = torch.randn(n, h, device="cuda", dtype=DTYPE)
        weight = torch.randn(v, h, device="cuda", dtype=DTYPE) / h**0.5
        bias = torch.randn(v, device="cuda", dtype=DTYPE) if options.pop("bias", False) else None
        target = torch.randint(0, v, (n,), device="cuda")
        target[::IGNORED_EVERY] = IGNORE_INDEX
        leaves = [t.requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
        loss = tk_ops.linear_cross_entropy(x, weight, target, bias=bias, **options)
        grads = torch.autograd.grad(loss.sum(), leaves)
        leaves64 = [t.detach().cpu().double().requires_grad_() for t in leaves]
        expected = tk_ops.linear_cross_entropy(leaves64[0], leaves64[1], target.cpu(),
                                               bias=leaves64[2] if bias is not None else None, **options)
        expected_grads = torch.autograd.grad(expected.sum(), leaves64)
        err = max(common.relative_difference(got.detach().cpu(), want.detach())
                  for got, want in zip((loss, *grads), (expected, *expected_grads)))
        status = "ok" if err < 2e-2 else "WRONG"
        print(f"linear_cross_entropy N={n} H={h} V={v} {options or ''}: rel err {err:.2e} {status}")
        if status != "ok":
            raise SystemExit("linear_cross_entropy check: wrong result")


def main(argv=None) -> None:
    args = common.arguments(__doc__, PASSES).parse_args(argv)
    torch.manual_seed(0)
    if common.without_gpu(args, BENCH, DRY_RUN_CASES):
        return
    if args.check:
        return check()
    _, liger_version = common.peer(*LIGER)
    common.run(BENCH, CASES, passes=args.passes, out=args.out, tflops_ceiling=None, dtype="bf16",
               liger=liger_version, ours_backend=tk_ops.backends()["linear_cross_entropy"],
               flops="fwd 2 N H V, fwd+bwd 3x that (the GEMMs)")


if __name__ == "__main__":
    main()
