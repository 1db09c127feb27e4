"""tk_ops.attention_with_kvcache against a float64 definition built from tk_ops.attention on each sequence's
gathered cache (tests/inputs/attention_with_kvcache.py): dense and paged caches, ragged cache lengths (empty
and full ones), appends across block boundaries, Nq from 1 to 16, GQA, every option; the caches after the
call, NaN canaries in every unused slot; torch.compile's handling of the in-place append; decode steps
replayed from a CUDA graph. The op contract (opcheck, export, bad inputs, a CUDA graph of one call, the
reference serving small paged blocks): tests/op_db.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import tk_ops
import tk_testing
from inputs.attention_with_kvcache import KVCacheCase, expected_caches, float64_definition, make_case

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# id -> block_size (None: a dense cache)
LAYOUTS = {"dense": None, "paged-4": 4, "paged-1": 1, "paged-16": 16}

# (id, cache lengths, Nq, Nnew, capacity): each has an empty sequence or one full after the append
SHAPES = (
    ("decode", [5, 0, 12, 7], 1, 1, 13),
    ("decode-without-append", [5, 1, 13], 1, 0, 13),
    ("speculative", [3, 9, 0], 4, 4, 13),
    ("chunked-prefill", [0, 6], 16, 16, 22),
    ("append-across-blocks", [3, 7, 0], 2, 6, 13),
    ("queries-before-the-first-key", [0, 2], 5, 1, 8),
    ("queries-on-cached-tokens", [4, 10], 3, 1, 11),
)

GROUPS = ((4, 4), (4, 2), (6, 2), (8, 2), (8, 1))  # (Hq, Hkv): GQA ratios 1, 2, 3, 4, 8

# (id, options of tk_ops.attention_with_kvcache, whether the row has sinks)
OPTIONS = (
    ("causal", dict(causal=True), False),
    ("not-causal", dict(causal=False), False),
    ("sliding-window", dict(causal=True, window=(3, -1)), False),
    ("window-both-sides", dict(causal=False, window=(2, 1)), False),
    ("softcap-scale", dict(softcap=2.0, scale=0.7), False),
    ("sinks", dict(), True),
    ("window-softcap-sinks", dict(causal=True, window=(4, -1), softcap=1.5), True),
)


def run_and_check(case, tol=tk_testing.TOLERANCE[torch.float64], with_sinks=False, **options):
    """One call on ``case`` matches the float64 definition (out and lse) and leaves the caches as expected_caches
    says (bit for bit, the NaN canaries included); the outputs are finite (no canary reached them)."""
    sinks = torch.randn(case.q.shape[2]) if with_sinks else None
    before = case.clone()
    out, lse = tk_ops.attention_with_kvcache(**case.arguments(), **options, sinks=sinks, return_lse=True)
    want_out, want_lse = float64_definition(before, **options, sinks=sinks)
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "a NaN canary reached the output"
    tk_testing.assert_rel_close(out, want_out, tol)
    torch.testing.assert_close(lse, want_lse, rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
    want_k_cache, want_v_cache = expected_caches(before)
    torch.testing.assert_close(case.k_cache, want_k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, want_v_cache, rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("q_heads, kv_heads", GROUPS, ids=[f"Hq{q}-Hkv{kv}" for q, kv in GROUPS])
@tk_testing.parametrize_with_ids("lengths, q_len, new_len, capacity", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_the_definition_and_appends_in_place(layout, lengths, q_len, new_len, capacity, q_heads, kv_heads):
    case = make_case(lengths, q_len, new_len, capacity=capacity, block_size=LAYOUTS[layout], q_heads=q_heads,
                     kv_heads=kv_heads)
    run_and_check(case)


@tk_testing.parametrize_with_ids("options, with_sinks", OPTIONS)
@tk_testing.parametrize_with_ids("lengths, q_len, new_len, capacity", [SHAPES[2], SHAPES[5]])
@pytest.mark.parametrize("layout", ["dense", "paged-4"])
def test_window_softcap_and_sinks(layout, lengths, q_len, new_len, capacity, options, with_sinks):
    case = make_case(lengths, q_len, new_len, capacity=capacity, block_size=LAYOUTS[layout])
    run_and_check(case, with_sinks=with_sinks, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["dense", "paged-4"])
def test_fp32_and_16_bit_inputs_accumulate_in_fp32(layout, dtype):
    case = make_case([3, 9, 0], 4, 4, capacity=13, block_size=LAYOUTS[layout], head_dim=64, dtype=dtype)
    run_and_check(case, tol=tk_testing.TOLERANCE[dtype], with_sinks=True, window=(6, -1), softcap=3.0)


def test_value_head_dim_may_differ_from_the_key_head_dim():
    case = make_case([4, 0, 9], 2, 2, block_size=4, head_dim=24, value_dim=8)
    assert run_and_check(case).shape == (3, 2, 4, 8)


def test_return_lse_false_returns_out_alone():
    case = make_case([4, 2], 1, 1)
    out = tk_ops.attention_with_kvcache(**case.clone().arguments())
    torch.testing.assert_close(out, tk_ops.attention_with_kvcache(**case.arguments(), return_lse=True)[0])


def test_an_int_cache_seqlens_is_every_sequence_at_that_length():
    case = make_case([5, 5, 5], 2, 3, capacity=9, block_size=4)
    copy = case.clone()
    out = tk_ops.attention_with_kvcache(**dict(case.arguments(), cache_seqlens=5))
    want = tk_ops.attention_with_kvcache(**copy.arguments())
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(case.k_cache, copy.k_cache, rtol=0, atol=0, equal_nan=True)


def test_decoding_token_by_token_equals_attention_over_the_whole_sequence():
    """A prefill of 5 tokens into an empty paged cache, then 9 decode steps: every step's output is the last
    row of causal tk_ops.attention over the sequence so far (two sequences, the second 3 tokens behind)."""
    batch, heads, kv_heads, head_dim, steps = 2, 4, 2, 16, 14
    q, k, v = (torch.randn(batch, steps, h, head_dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    case = make_case([0, 0], 1, 0, capacity=steps, block_size=4, q_heads=heads, kv_heads=kv_heads)
    k_cache, v_cache, block_table = case.k_cache, case.v_cache, torch.arange(8, dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([0, 0], dtype=torch.int32)
    full = tk_ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    out = tk_ops.attention_with_kvcache(q[:, :5], k_cache, v_cache, k[:, :5], v[:, :5], cache_seqlens=lengths,
                                        block_table=block_table)
    torch.testing.assert_close(out, full[:, :5])
    lengths += 5
    for step in range(5, steps):
        out = tk_ops.attention_with_kvcache(q[:, step:step + 1], k_cache, v_cache, k[:, step:step + 1],
                                            v[:, step:step + 1], cache_seqlens=lengths, block_table=block_table)
        torch.testing.assert_close(out, full[:, step:step + 1])
        lengths += 1


def test_strided_views_read_and_write_in_place():
    """q, k, v as transposed views, the caches as head slices of wider caches (strided in every dim but the
    last): the numbers of contiguous copies, and the append lands in the wider caches."""
    case = make_case([3, 6], 2, 2, capacity=8, block_size=4)
    contiguous = case.clone()
    wide_k = torch.full((*case.k_cache.shape[:2], 4, case.k_cache.shape[3]), float("nan"), dtype=torch.float64)
    wide_v = wide_k.clone()
    wide_k[:, :, 1:3], wide_v[:, :, 1:3] = case.k_cache, case.v_cache
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (case.q, case.k, case.v)]
    arguments = dict(case.arguments(), q=transposed[0], k=transposed[1], v=transposed[2],
                     k_cache=wide_k[:, :, 1:3], v_cache=wide_v[:, :, 1:3])
    assert not arguments["q"].is_contiguous() and not arguments["k_cache"].is_contiguous()
    out = tk_ops.attention_with_kvcache(**arguments)
    torch.testing.assert_close(out, tk_ops.attention_with_kvcache(**contiguous.arguments()), rtol=0, atol=0)
    torch.testing.assert_close(wide_k[:, :, 1:3], contiguous.k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(wide_v[:, :, 1:3], contiguous.v_cache, rtol=0, atol=0, equal_nan=True)
    assert wide_k[:, :, [0, 3]].isnan().all()


def test_forward_only_outputs_never_require_grad_and_the_caches_versions_move():
    case = make_case([2, 4], 1, 1, dtype=torch.float32)
    versions = case.k_cache._version, case.v_cache._version
    out, lse = tk_ops.attention_with_kvcache(**dict(case.arguments(), q=case.q.requires_grad_(),
                                                    k=case.k.requires_grad_()), return_lse=True)
    assert not out.requires_grad and not lse.requires_grad
    assert case.k_cache._version > versions[0] and case.v_cache._version > versions[1]


def test_bad_contents_raise_before_the_cache_is_written():
    """The op itself (below the public function's content checks: the reference's own) raises for an
    out-of-range block, with the caches untouched."""
    case = make_case([3, 6], 1, 2, capacity=8, block_size=4)
    case.block_table[1, 1] = 99
    before = case.clone()
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] must be a block index in \[0, num_blocks = 6\)"):
        torch.ops.tk.attention_with_kvcache(*case.op_arguments())
    torch.testing.assert_close(case.k_cache, before.k_cache, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------ torch.compile


def _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    return tk_ops.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                         block_table=block_table, window=(5, -1), return_lse=True)


@pytest.mark.parametrize("layout", ["dense", "paged-4"])
def test_compiled_calls_write_the_caches_as_eager_calls_do(layout):
    """torch.compile(fullgraph=True) of decode steps on graph-input caches: after each step the caches equal
    those of eager steps (the functionalized append is written back into them, in place: no copy of a
    cache in the generated code), the outputs match, and new cache lengths reuse the graph."""
    eager = make_case([3, 0, 7], 2, 2, capacity=14, block_size=LAYOUTS[layout], reserve=4, dtype=torch.float32)
    compiled_case = eager.clone()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_decode_step, fullgraph=True, backend=counter)
    for step in range(3):
        q, k, v = (torch.randn_like(t) for t in (eager.q, eager.k, eager.v))
        arguments = (eager.k_cache, eager.v_cache, k, v, eager.cache_seqlens, eager.block_table)
        want = _decode_step(q, *arguments)
        compiled_arguments = (compiled_case.k_cache, compiled_case.v_cache, k, v, compiled_case.cache_seqlens,
                              compiled_case.block_table)
        if step == 0:
            got, codes = run_and_get_code(compiled, q, *compiled_arguments)
            code = "\n".join(codes)
            assert "torch.ops.tk.attention_with_kvcache.default" in code
            assert ".clone(" not in code and "copy_" not in code, "the compiled graph copies a cache"
        else:
            got = compiled(q, *compiled_arguments)
        for i, (out, expected) in enumerate(zip(got, want)):
            torch.testing.assert_close(out, expected, msg=lambda message: f"step {step}, output {i}: {message}")
        torch.testing.assert_close(compiled_case.k_cache, eager.k_cache, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(compiled_case.v_cache, eager.v_cache, rtol=0, atol=0, equal_nan=True)
        eager.cache_seqlens += 2
        compiled_case.cache_seqlens += 2
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------ the CUDA kernel
# Dense caches, and paged ones in blocks of a multiple of 128 positions, run the attention forward kernel's
# packed variant (csrc/torch/attention.cpp): sequence b is its Nq query rows against the first
# cache_seqlens[b] + Nnew positions of its cache. Smaller paged blocks run the reference (op_db's fallback).


def on_cpu(case: KVCacheCase) -> KVCacheCase:
    return KVCacheCase(*(None if t is None else t.cpu() for t in (
        case.q, case.k_cache, case.v_cache, case.k, case.v, case.cache_seqlens, case.block_table)))


def check_kernel_call(case: KVCacheCase, with_sinks=False, **options):
    """One call on the kernel (no fallback) against the float64 definition, the caches after it bit for bit,
    and no NaN canary (every unused slot) in the output."""
    sinks = torch.randn(case.q.shape[2], device="cuda") if with_sinks else None
    before = on_cpu(case)
    with tk_testing.runs_the_kernels("attention_with_kvcache"):
        out, lse = tk_ops.attention_with_kvcache(**case.arguments(), **options, sinks=sinks, return_lse=True)
    want_out, want_lse = float64_definition(before, **options, sinks=None if sinks is None else sinks.cpu())
    assert out.dtype == case.q.dtype and out.is_contiguous() and lse.dtype == torch.float32 and lse.is_contiguous()
    assert torch.isfinite(out).all(), "a NaN canary reached the output"
    tol = tk_testing.TOLERANCE[case.q.dtype]
    tk_testing.assert_rel_close(out, want_out, tol)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=tol, atol=tol)
    want_k_cache, want_v_cache = expected_caches(before)
    torch.testing.assert_close(case.k_cache.cpu(), want_k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache.cpu(), want_v_cache, rtol=0, atol=0, equal_nan=True)


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2), (16, 1)], ids=["mha", "gqa4", "mqa16"])
@tk_testing.parametrize_with_ids("lengths, q_len, new_len, capacity", SHAPES)
def test_kernel_dense_cache_against_float64(lengths, q_len, new_len, capacity, q_heads, kv_heads, head_dim, dtype):
    case = make_case(lengths, q_len, new_len, capacity=capacity, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype, device="cuda")
    check_kernel_call(case)


@tk_testing.requires_kernel("attention_with_kvcache")
@tk_testing.parametrize_with_ids("options, with_sinks", OPTIONS)
@tk_testing.parametrize_with_ids("lengths, q_len, new_len, capacity", [SHAPES[0], SHAPES[2], SHAPES[5]])
def test_kernel_options(lengths, q_len, new_len, capacity, options, with_sinks):
    case = make_case(lengths, q_len, new_len, capacity=capacity, q_heads=8, kv_heads=2, head_dim=64,
                     dtype=torch.bfloat16, device="cuda")
    check_kernel_call(case, with_sinks=with_sinks, **options)


@tk_testing.requires_kernel("attention_with_kvcache")
def test_kernel_long_caches_across_key_blocks():
    """Cache lengths around the kernel's 128-key blocks (one key into a block, a block exactly full), a
    thousand-token cache, GQA 4."""
    case = make_case([1, 127, 128, 129, 1000, 0], 1, 1, capacity=1100, q_heads=16, kv_heads=4, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    check_kernel_call(case, causal=True)


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("q_len, new_len, with_sinks, options", [
    (1, 1, False, {}), (1, 1, True, dict(softcap=3.0)), (4, 4, False, dict(window=(100, -1))), (3, 0, True, {})],
    ids=["decode", "decode-sinks-softcap", "speculative-window", "no-append-sinks"])
def test_kernel_paged_cache_against_float64(block_size, q_len, new_len, with_sinks, options):
    """Paged caches whose blocks are whole 128-key blocks run the kernel: each key block read from the page
    the block table names (a shuffled pool, -1 past the blocks a sequence uses, NaN in every unused slot),
    the append written through the table; decoding splits the long sequence's keys across SMs."""
    case = make_case([0, 130, 1000, 255], q_len, new_len, capacity=1100, block_size=block_size, q_heads=8,
                     kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda")
    check_kernel_call(case, with_sinks=with_sinks, **options)


@tk_testing.requires_kernel("attention_with_kvcache")
def test_kernel_decode_steps_replay_in_a_cuda_graph():
    """A captured decode step (append one token, attend) replayed with new q, k, v and cache_seqlens moved on
    the device gives, step after step, the outputs and caches of eager calls (no host read of
    cache_seqlens: the step captures)."""
    case = make_case([5, 0, 30], 1, 1, capacity=40, q_heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                     device="cuda")
    eager = case.clone()
    tk_ops.attention_with_kvcache(**case.clone().arguments())  # warm up (launch setup) on copies: a call appends
    graph, captured = tk_testing.capture_cuda_graph(lambda: tk_ops.attention_with_kvcache(**case.arguments()),
                                                    warm_up=False)
    for _ in range(4):
        for live, mirror in ((case.q, eager.q), (case.k, eager.k), (case.v, eager.v)):
            mirror.copy_(torch.randn_like(mirror))
            live.copy_(mirror)
        graph.replay()
        want = tk_ops.attention_with_kvcache(**eager.arguments())
        torch.testing.assert_close(captured, want, rtol=0, atol=0)
        torch.testing.assert_close(case.k_cache, eager.k_cache, rtol=0, atol=0, equal_nan=True)
        case.cache_seqlens += 1
        eager.cache_seqlens += 1


@tk_testing.requires_kernel("attention_with_kvcache")
def test_kernel_bad_lengths_stay_in_their_rows():
    """cache_seqlens past the capacity or negative (unchecked by the op itself, as with check_contents=False or
    in a CUDA graph) neither fault nor write outside the sequences' own cache rows: the spare rows keep their NaN."""
    case = make_case([3, 6, 2], 1, 2, capacity=8, head_dim=64, dtype=torch.bfloat16, device="cuda")
    case.cache_seqlens.copy_(torch.tensor([-5, 1000, 7], dtype=torch.int32))
    torch.ops.tk.attention_with_kvcache(*case.op_arguments())
    torch.cuda.synchronize()
    assert case.k_cache[3:].isnan().all() and case.v_cache[3:].isnan().all()


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("layout, bad, message", [
    ("dense", "length", r"cache_seqlens\[1\] \+ Nnew \(8 \+ 2\) must be at most the cache's capacity"),
    ("paged", "length", r"cache_seqlens\[0\] \+ Nnew \(255 \+ 2\) must be at most the cache's capacity"),
    ("paged", "negative", r"cache_seqlens"),
    ("paged", "block", r"block_table\[1, 0\] must be a block index in \[0, num_blocks = 6\)"),
], ids=["dense-capacity", "paged-capacity", "paged-negative", "paged-block"])
def test_kernel_eager_calls_check_the_contents_first(layout, bad, message):
    """On a GPU in eager mode the public function reads cache_seqlens and block_table (one device sync) and
    raises a ValueError before anything is written; check_contents=False skips the read (the caller's
    promise, FlashAttention's contract) and the kernels keep every write inside the caches."""
    block_size = 128 if layout == "paged" else None
    case = make_case([3, 5], 1, 2, capacity=256 if block_size else 9, block_size=block_size, head_dim=64,
                     dtype=torch.bfloat16, device="cuda")
    if bad == "length":
        case.cache_seqlens[1 if layout == "dense" else 0] = 8 if layout == "dense" else 255
    elif bad == "negative":
        case.cache_seqlens[0] = -1
    else:
        case.block_table[1, 0] = 6
    before = case.clone()
    with pytest.raises(ValueError, match=message):
        tk_ops.attention_with_kvcache(**case.arguments())
    torch.testing.assert_close(case.k_cache, before.k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, before.v_cache, rtol=0, atol=0, equal_nan=True)
    if bad != "block":  # an unchecked out-of-pool block is clamped into the pool, so it may write a block
        tk_ops.attention_with_kvcache(**case.arguments(), check_contents=False)
        torch.cuda.synchronize()
        if layout == "dense":
            assert case.k_cache[2:].isnan().all() and case.v_cache[2:].isnan().all()


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("batch, capacity", [(1, 5000), (2, 700), (40, 300)], ids=["split-many", "split-few", "no-split"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_kernel_decode_form_splits_and_combines(batch, capacity, with_sinks):
    """Nq = 1 without a window takes the decode form: the query heads of a KV head as one task's rows and,
    when B x Hkv tasks are few, each cache row cut into chunks whose outputs are combined by their lse (the
    sinks joined there), against float64; ragged lengths, an empty cache and one full after the append,
    softcap, GQA 8."""
    generator = torch.Generator().manual_seed(batch)
    lengths = torch.randint(0, capacity, (batch,), generator=generator).tolist()
    lengths[0], lengths[-1] = 0, capacity - 1
    case = make_case(lengths, 1, 1, capacity=capacity, q_heads=16, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                     device="cuda")
    check_kernel_call(case, with_sinks=with_sinks, softcap=5.0)


@tk_testing.requires_kernel("attention_with_kvcache")
@pytest.mark.parametrize("batch, capacity, q_len, kv_heads, block_size", [
    (8, 20000, 1, 8, None), (8, 20000, 3, 8, 128), (300, 600, 1, 2, None), (520, 300, 1, 1, None)],
    ids=["ragged", "ragged-paged-speculative", "two-row-tiles", "one-chunk-a-row"])
def test_kernel_decode_form_cuts_chunks_by_length(batch, capacity, q_len, kv_heads, block_size):
    """The decode form cuts the rows into chunks by their lengths on the device (about two tasks per SM over
    all the keys, each row's chunks of one length, an empty row none, the combine finding a row's chunks from
    the offsets the prepare wrote): ragged rows whose rounding makes the prepare search for a longer chunk,
    rows over two of its 256-row passes, and more rows than it balances (one chunk a row), against float64;
    empty, one-token and full rows."""
    generator = torch.Generator().manual_seed(batch + capacity)
    lengths = torch.randint(0, capacity, (batch,), generator=generator).tolist()
    lengths[:3] = [0, 1, capacity - 1]
    case = make_case(lengths, q_len, 1, capacity=capacity, block_size=block_size, q_heads=2 * kv_heads,
                     kv_heads=kv_heads, head_dim=128, dtype=torch.bfloat16, device="cuda")
    check_kernel_call(case, causal=True)
