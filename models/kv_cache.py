"""A paged KV cache for the attention layers of a decoder (``models.generate`` fills it).

Every layer has its own key and value blocks, (num_blocks, block_size, Hkv, D), the layout of
``tk_ops.attention_with_kvcache``'s paged caches; the block table (B, max_blocks) int32 and the cache
lengths (B,) int32 are shared by the layers, which hold the same positions. Blocks come from a pool as
the sequences grow, one at a time as a sequence crosses a block boundary, so the blocks of one sequence
are scattered over the pool (as in a serving engine whose sequences come and go).

The sequences of a batch grow together (equal prompt lengths, one token each per step), so their length
is also kept as a Python int (``length``): the model reads it for its rotary positions and to tell a
prefill (empty cache) from a decode step without reading a tensor.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LayerKVCache:
    """One attention layer's part of a PagedKVCache, as ``tk_ops.attention_with_kvcache`` takes it."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    length: int  # positions every sequence holds before this step

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (B, N, Hkv, D) at positions length .. length + N - 1 of every sequence (the prefill's
        keys and values, which its attention computed without the cache)."""
        block_size = self.k_cache.shape[1]
        positions = torch.arange(self.length, self.length + k.shape[1], device=k.device)
        blocks = self.block_table[:, positions // block_size].long()
        slots = (positions % block_size).expand_as(blocks)
        self.k_cache[blocks, slots] = k
        self.v_cache[blocks, slots] = v


class PagedKVCache:
    """Key and value blocks for ``layers`` attention layers of ``kv_heads`` heads of ``head_dim``, for
    ``batch`` sequences of up to ``max_length`` positions in blocks of ``block_size``."""

    def __init__(self, *, layers: int, batch: int, kv_heads: int, head_dim: int, max_length: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        if block_size < 1 or max_length < 1:
            raise ValueError(f"block_size and max_length must be >= 1, got {block_size} and {max_length}")
        self.block_size = block_size
        max_blocks = -(-max_length // block_size)
        num_blocks = batch * max_blocks
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        # -1: no block yet (the op reads no entry past the blocks a sequence uses)
        self.block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.length = 0
        self._free_blocks = list(range(num_blocks))
        self._blocks_per_sequence = 0

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def make_room(self, new_tokens: int) -> None:
        """Give every sequence the blocks its next ``new_tokens`` positions need (before a forward writes them)."""
        if self.length + new_tokens > self.capacity:
            raise ValueError(
                f"the cache holds {self.capacity} positions per sequence: no room for {new_tokens} more "
                f"after {self.length}"
            )
        needed = -(-(self.length + new_tokens) // self.block_size)
        for column in range(self._blocks_per_sequence, needed):
            for row in range(self.block_table.shape[0]):
                self.block_table[row, column] = self._free_blocks.pop(0)
        self._blocks_per_sequence = max(self._blocks_per_sequence, needed)

    def layer(self, index: int) -> LayerKVCache:
        return LayerKVCache(self.keys[index], self.values[index], self.block_table, self.cache_seqlens, self.length)

    def advance(self, new_tokens: int) -> None:
        """Count ``new_tokens`` more positions as cached (after every layer wrote them)."""
        self.length += new_tokens
        self.cache_seqlens += new_tokens
