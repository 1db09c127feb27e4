"""The kernel families that gpu_session.sh checks and profiles: adding a family is one entry here.

Per family: the tk op whose kernel it is (as ``tk_ops.backends()`` names it), the bench whose
``--check`` is its small GPU correctness run (every kernel path against float64, non-zero exit on a
wrong result; what compute-sanitizer watches), and its Nsight Compute cases: the case in
benchmarks/profile_kernels.py, a regex over the kernels' demangled names, kernels per call.

The regexes name the kernel structs (gemm_kernel, forward_kernel, ...), which are the template
arguments of a shared __global__ entry (``ENTRY<tk::gemm::gemm_kernel<...>>(...)``): ncu must match
them with ``--kernel-name-base demangled``, since its default base, ``function``, is the entry's
name without its template arguments. A case makes only its own launches, and
``--launch-skip`` counts only matching launches, so a regex need not exclude other families.

    python3 -m benchmarks.families checks [FAMILY ...]    FAMILY MODULE ARGS...  (python3 -m MODULE ARGS)
    python3 -m benchmarks.families profiles [FAMILY|CASE ...]  CASE REGEX LAUNCH_SKIP LAUNCH_COUNT  (ncu's)

one line each, for the families named, or by default for those whose op is served by a CUDA kernel
(the others are listed on stderr as skipped). `profiles` also takes case names, to profile only those.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class Profile:
    case: str  # a key of profile_kernels.CASES
    kernels: str  # regex over the demangled kernel names
    per_call: int  # matching launches per call of the case


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    op: str  # key of tk_ops.backends()
    bench: str  # benchmarks.bench_<bench> --check is the correctness run
    profiles: tuple[Profile, ...] = ()

    @property
    def check(self) -> list[str]:
        return [f"benchmarks.bench_{self.bench}", "--check"]


FAMILIES = (
    Family("matmul", op="matmul", bench="gemm", profiles=(
        Profile("gemm_k64", "gemm_kernel", 1),
        Profile("gemm_4096", "gemm_kernel", 1),
        Profile("linear_llama_row_major_weight", "gemm_kernel", 1),
    )),
    Family("attention", op="attention", bench="attention", profiles=(
        Profile("attention_fwd_d128_n8192", "forward_kernel", 1),
        # the one-pass method: the default at this shape (the memset of the dq accumulator is no kernel)
        Profile("attention_bwd_d128_n8192", "attention::.*(statistics_kernel|dkdv_kernel|dq_convert_kernel)", 3),
        # a KV-cache decode call: the prepare launch, the packed forward over the chunks, the combine
        Profile("decode_paged_b8_l8k_57k", "attention::.*(prepare_kernel|forward_kernel|combine_kernel)", 3),
        # four queries: the tail call on the last three keys is one more forward launch
        Profile("decode_paged_b16_nq4", "attention::.*(prepare_kernel|forward_kernel|combine_kernel)", 4),
    )),
    Family("based_attention", op="based_attention", bench="linear_attention", profiles=(
        Profile("based_fwd_n4096", "based::.*forward_kernel", 1),
        # the statistics and reduce kernels are chunked_causal_bwd.cuh's, shared with linear_attention
        Profile("based_bwd_n4096", "based::.*(dq_kernel|dkdv_kernel)|causal_backward::(statistics_kernel|reduce_kernel)", 4),
    )),
    Family("linear_attention", op="linear_attention", bench="linear_attention", profiles=(
        Profile("linear_attention_fwd_f64_n4096", "linear::.*forward_kernel", 1),
        Profile("linear_attention_fwd_f256_n4096", "linear::.*forward_kernel", 1),
        # Dv = 64 is one value block at F = 64: no reduce launch
        Profile("linear_attention_bwd_f64_n4096", "linear::.*(dq_kernel|dkdv_kernel)|causal_backward::statistics_kernel", 3),
        # F = 256 runs the F = 128 kernels on each feature half, then adds the halves' grad_v
        Profile("linear_attention_bwd_f256_n4096",
                "linear::.*(dq_kernel|dkdv_kernel|add_into_kernel)|causal_backward::statistics_kernel", 6),
    )),
    Family("mamba2_ssd", op="mamba2_ssd", bench="mamba2", profiles=(
        Profile("mamba2_ssd_fwd_n128_l4096", "mamba2::.*forward_kernel", 1),
        # the block states, the reverse sweep, then grad_B and grad_C summed over the heads of a group
        Profile("mamba2_ssd_bwd_n128_l4096", "mamba2::.*(states_kernel|backward_kernel|reduce_kernel)", 3),
        # the longest target shape (B = 2, L = 16384, H = 80), where fwd+bwd is at parity with mamba_ssm
        Profile("mamba2_ssd_fwd_n128_l16384", "mamba2::.*(forward_kernel|segment_ends_kernel|segment_scan_kernel)", 3),
        Profile("mamba2_ssd_bwd_n128_l16384", "mamba2::.*(states_kernel|backward_kernel|reduce_kernel)", 3),
    )),
    Family("fftconv", op="fftconv", bench="fftconv", profiles=(
        # the table launch, then the convolution (cuFFT's rfft of the filter matches neither)
        Profile("fftconv_fwd_n4096", "fftconv::.*(prepare_kernel|convolution_kernel)", 2),
        # the tables with conj(K), the convolution kernel for grad_u, the filter gradient (grad_k, grad_D)
        Profile("fftconv_bwd_n4096", "fftconv::.*(prepare_kernel|convolution_kernel|filter_gradient_kernel)", 3),
    )),
    Family("causal_conv1d", op="causal_conv1d", bench="conv1d", profiles=(
        Profile("causal_conv1d_fwd_bdl_l4096", "causal_conv1d::channel_first_forward_kernel", 1),
        Profile("causal_conv1d_fwd_bld_l4096", "causal_conv1d::channel_last_forward_kernel", 1),
        # the backward kernel, then the fixed-order sum of its partial rows of grad_weight and grad_bias
        Profile("causal_conv1d_bwd_bdl_l4096", "causal_conv1d::(channel_first_backward_kernel|sum_partials_kernel)", 2),
        Profile("causal_conv1d_bwd_bld_l4096", "causal_conv1d::(channel_last_backward_kernel|sum_partials_kernel)", 2),
    )),
    Family("rope", op="rope_qk", bench="rope"),
    Family("layer_norm", op="layer_norm", bench="norms", profiles=(
        # the row kernel, then the sum of its per-block partial rows of dweight and dbias
        Profile("layer_norm_bwd_h1024", "norm_backward_kernel|sum_partial_rows_kernel", 2),
        Profile("layer_norm_bwd_h4096", "norm_backward_kernel|sum_partial_rows_kernel", 2),
    )),
    Family("linear_cross_entropy", op="linear_cross_entropy", bench="linear_cross_entropy"),
    Family("gated_delta_rule", op="gated_delta_rule", bench="gated_delta_rule", profiles=(
        # the chunks' solve, then the scan along the sequence (Qwen3-Next's heads, one long sequence)
        Profile("gated_delta_rule_fwd_t32768", "gdn::.*(solve_kernel|scan_kernel)", 2),
    )),
)
BY_NAME = {family.name: family for family in FAMILIES}


def profile(case: str) -> Profile:
    return next(p for family in FAMILIES for p in family.profiles if p.case == case)


def selected(names: list[str]) -> list[Family]:
    """The families named, or every family whose op has a CUDA kernel in this build."""
    if names:
        unknown = sorted(set(names) - set(BY_NAME))
        if unknown:
            raise SystemExit(f"unknown kernel families {unknown}; known: {', '.join(BY_NAME)}")
        return [BY_NAME[name] for name in names]
    import tk_ops

    backends = tk_ops.backends()
    skipped = [f.name for f in FAMILIES if backends[f.op] != "cuda kernel"]
    if skipped:
        print(f"no CUDA kernel in this build for: {', '.join(skipped)} (skipped; {tk_ops.extension_status()})", file=sys.stderr)
    return [f for f in FAMILIES if f.name not in skipped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("checks", "profiles"))
    parser.add_argument("families", nargs="*", help=f"default: those with kernels; known: {', '.join(BY_NAME)}")
    args = parser.parse_args()
    if args.what == "checks":
        for family in selected(args.families):
            print(family.name, *family.check)
        return
    from benchmarks.profile_kernels import WARMUP_CALLS

    cases = [name for name in args.families if name not in BY_NAME and any(p.case == name for f in FAMILIES for p in f.profiles)]
    chosen = [profile(case) for case in cases]
    named_families = [name for name in args.families if name not in cases]
    if named_families or not cases:
        chosen += [p for family in selected(named_families) for p in family.profiles]
    for p in chosen:
        print(p.case, p.kernels, WARMUP_CALLS * p.per_call, p.per_call)


if __name__ == "__main__":
    main()
