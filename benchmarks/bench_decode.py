"""Decoding attention: tk_ops.attention_with_kvcache against FlashAttention-4 and SDPA in the same run.

A decode step reads every cached key and value once per KV head: attention is bound by HBM bytes, so
each row reports the KV bytes a call must read (sum over sequences of cache_seqlens[b] x Hkv x (D + Dv)
x 2 bytes) over its time, against the device-to-device copy bandwidth measured in the same run
(floor_ms, and the fraction of it each side reaches).

Shapes (bf16, Hq = 32, Hkv = 8, D = Dv = 128, causal; cache lengths drawn once from a fixed seed):
  paged, block 128   B = 64, lengths 1024..7168 (a serving batch); B = 8, lengths 8192..57344 (long
                     contexts, few sequences: where split-KV matters); B = 16, Nq = 4, lengths
                     4096..12288 (speculative decoding's draft tokens)
  dense              B = 1 at 4096, 32768 and 131072 tokens (one stream, the latency case); B = 16 at
                     16384
  attention          B = 1 and 16 at 4096 and 16384 tokens through tk_ops.attention: q (B, Hq, 1, D) against
                     head-major (B, Hkv, L, D) keys and values, as Hugging Face's cache holds them (a decoding
                     step of a model that calls attention, not a cache op)
Baselines:
  fa4    flash_attn.cute.flash_attn_varlen_func on the same cache tensors: q (B, Nq, Hq, D), seqused_k
         = cache_seqlens, page_table = block_table (FlashAttention-4 4.0.0b36; a baseline only where it
         imports, as in bench_attention)
  sdpa   F.scaled_dot_product_attention on a dense cache cut to the longest sequence (a paged cache
         gathered into one outside the timing), with enable_gqa and no length mask: it reads the whole
         rectangle, the best SDPA does without a mask (a mask sends it to the math path)
Ours is whatever serves tk.attention_with_kvcache on the device: on dense caches and paged ones in blocks
of a multiple of 128 (the paged rows here) the attention forward kernel's packed variant (Nq <= 16: a KV
head's Nq x G query rows as a task's rows, split-KV; not a dedicated decode kernel), else the PyTorch reference
(the results header records which). No append is timed (k = v = None): the cache is what a decode step reads.

  python3 -m benchmarks.bench_decode [--out DIR]
  python3 -m benchmarks.bench_decode --dry-run [--out DIR]   # CPU, tiny shapes, nothing timed
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import bench_attention, common

DTYPE = torch.bfloat16
BYTES = 2  # bf16


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    group: str  # paged or dense
    batch: int
    min_len: int
    max_len: int
    q_len: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 0  # 0: dense

    def lengths(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.batch * 7919 + self.max_len)
        return torch.randint(self.min_len, self.max_len + 1, (self.batch,), generator=generator, dtype=torch.int32)

    def hbm_bytes(self, pass_: str) -> int:
        """The KV a decode call must read: every cached token's key and value, once per KV head."""
        return int(self.lengths().sum()) * self.kv_heads * 2 * self.head_dim * BYTES

    @property
    def label(self) -> str:
        lengths = f"L={self.max_len}" if self.min_len == self.max_len else f"L={self.min_len}..{self.max_len}"
        layout = f"paged {self.block_size}" if self.block_size else self.group
        return f"B={self.batch} Nq={self.q_len} Hq={self.q_heads} Hkv={self.kv_heads} {lengths} {layout}"


CASES = [
    DecodeCase("paged", 64, 1024, 7168, block_size=128),
    DecodeCase("paged", 8, 8192, 57344, block_size=128),
    DecodeCase("paged", 16, 4096, 12288, q_len=4, block_size=128),
    DecodeCase("dense", 1, 4096, 4096),
    DecodeCase("dense", 1, 32768, 32768),
    DecodeCase("dense", 1, 131072, 131072),
    DecodeCase("dense", 16, 16384, 16384),
    DecodeCase("attention", 1, 4096, 4096),
    DecodeCase("attention", 16, 16384, 16384),
]
# (equal lengths in the last: SDPA's rows are compared with ours only there)
DRY_RUN_CASES = [DecodeCase("paged", 3, 5, 40, q_len=2, q_heads=4, kv_heads=2, head_dim=16, block_size=8),
                 DecodeCase("dense", 2, 7, 33, q_heads=4, kv_heads=2, head_dim=16),
                 DecodeCase("paged", 2, 24, 24, q_len=3, q_heads=4, kv_heads=2, head_dim=16, block_size=8),
                 DecodeCase("attention", 2, 33, 33, q_heads=4, kv_heads=2, head_dim=16)]


def make_inputs(case: DecodeCase, device) -> tuple:
    """q (B, Nq, Hq, D), k_cache and v_cache (dense (B, Lmax, Hkv, D) or paged (blocks, block_size, Hkv,
    D) with each sequence's blocks scattered over the pool), cache_seqlens (B,) int32 and block_table
    (B, max_blocks) int32 or None."""
    lengths = case.lengths()
    options = dict(dtype=DTYPE, device=device)
    q = torch.randn(case.batch, case.q_len, case.q_heads, case.head_dim, **options)
    if not case.block_size:  # dense and attention
        shape = (case.batch, case.max_len, case.kv_heads, case.head_dim)
        return q, torch.randn(shape, **options), torch.randn(shape, **options), lengths.to(device), None
    blocks_per_sequence = -(-case.max_len // case.block_size)
    pool = case.batch * blocks_per_sequence
    shape = (pool, case.block_size, case.kv_heads, case.head_dim)
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    block_table = order.view(case.batch, blocks_per_sequence)
    return (q, torch.randn(shape, **options), torch.randn(shape, **options), lengths.to(device),
            block_table.to(device))


def ours(case: DecodeCase, pass_: str):
    if case.group == "attention":
        return lambda q, k, v: tk_ops.attention(q, k, v, causal=True).transpose(1, 2)

    def run(q, k_cache, v_cache, cache_seqlens, block_table):
        return tk_ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                             block_table=block_table, causal=True, check_contents=False)
    return run


def ours_inputs(case: DecodeCase, pass_: str, inputs: tuple) -> tuple:
    """Through tk.attention: q (B, Hq, 1, D) and the caches head-major (B, Hkv, L, D), made outside the
    timing; the cache op's inputs as they are otherwise."""
    if case.group != "attention":
        return inputs
    q, k_cache, v_cache, _, _ = inputs
    return (q.transpose(1, 2), *(t.transpose(1, 2).contiguous() for t in (k_cache, v_cache)))


def fa4(case: DecodeCase, pass_: str):
    flash_attn_varlen_func = common.need(*bench_attention.FA4).flash_attn_varlen_func

    def run(q, k_cache, v_cache, cache_seqlens, block_table):
        return flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=cache_seqlens, page_table=block_table,
                                      causal=True)[0]
    return run


def sdpa(case: DecodeCase, pass_: str):
    """SDPA on the dense (B, Hkv, Lmax, D) caches sdpa_inputs made, no length mask (bottom-right causal
    among the Nq queries where Nq > 1)."""
    mask = None

    def run(q, k, v):
        nonlocal mask
        if case.q_len > 1 and mask is None:
            mask = _bottom_right(case.q_len, k.shape[2], q.device)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    return run


def sdpa_inputs(case: DecodeCase, pass_: str, inputs: tuple) -> tuple:
    """The caches as dense (B, Hkv, Lmax, D) tensors cut to the longest sequence (a paged cache gathered),
    made outside the timing."""
    q, k_cache, v_cache, _, block_table = inputs
    if block_table is not None:
        k_cache, v_cache = (t[block_table.long()].flatten(1, 2) for t in (k_cache, v_cache))
    return (q, *(t[:, :case.max_len].transpose(1, 2) for t in (k_cache, v_cache)))


def _bottom_right(q_len: int, key_len: int, device) -> torch.Tensor:
    return torch.ones(q_len, key_len, dtype=torch.bool, device=device).tril(key_len - q_len)


def sdpa_as_ours(case: DecodeCase, pass_: str, outputs: list) -> list:
    """SDPA attends every cached token, so its output is ours only where all lengths are the longest."""
    return outputs if case.min_len == case.max_len else [None]


BENCH = common.Bench(
    "decode", "Decode attention: tk_ops vs FlashAttention-4 / SDPA (bf16, KV bytes over time)",
    ours=common.Provider("tk_ops", ours, prepare=ours_inputs, graph=True),
    baselines=(common.Provider("sdpa", sdpa, prepare=sdpa_inputs, as_ours=sdpa_as_ours, graph=True),),
    inputs=lambda case, pass_, device: make_inputs(case, device),
    set_bytes=lambda case, pass_, inputs: common.tensor_bytes(inputs), max_sets=8,
    timer=functools.partial(common.time_ms, warmup=3, rounds=10, batch=5),
    graph_below_ms=0.5,
    panel=lambda row: row["group"],
)


def with_fa4(bench: common.Bench) -> tuple[common.Bench, str]:
    """The bench with FA4 among the baselines where flash_attn.cute imports, else as it is (one line says so)."""
    module, description = common.peer(*bench_attention.FA4)
    if module is None or not hasattr(module, "flash_attn_varlen_func"):
        print(f"FlashAttention-4 absent, no fa4 rows: {description}", flush=True)
        return bench, f"absent: {description}"
    return dataclasses.replace(bench, baselines=(*bench.baselines, common.Provider("fa4", fa4))), description


def main(argv=None) -> None:
    args = common.arguments(__doc__, check=False).parse_args(argv)
    torch.manual_seed(0)
    bench, fa4_version = (BENCH, None) if args.plot_from else with_fa4(BENCH)
    if common.without_gpu(args, bench, DRY_RUN_CASES):
        return
    common.run(bench, CASES, out=args.out, copy_gbps=common.measured_copy_bandwidth(), fa4=fa4_version,
               dtype="bf16", ours_backend=tk_ops.backends()["attention_with_kvcache"])


if __name__ == "__main__":
    main()
