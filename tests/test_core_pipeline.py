"""Tile-core primitives on the GPU: swizzled TMA round trips, wgmma, the producer/consumer pipeline,
the TMA store ring, publishing shared memory to the async proxy, turn rotations.

The kernels (tests/core/core_kernels.cu) are built on first use with torch.utils.cpp_extension; every
test here needs a Hopper GPU and skips elsewhere. That build also checks, by static_assert, which kernels
the template's contract (pipeline::pipeline_kernel) accepts and which it rejects.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib

import pytest
import torch

from tk_testing import IS_HOPPER, TOLERANCE, assert_rel_close

ROOT = pathlib.Path(__file__).resolve().parents[1]


def requires_hopper(test):
    """Marked ``gpu`` (the device script selects them) and skipped without an sm_90 GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 GPU")(test))


@functools.cache
def core():
    from torch.utils import cpp_extension

    build_dir = ROOT / "build" / "core_tests"
    build_dir.mkdir(parents=True, exist_ok=True)
    undefine = ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    return cpp_extension.load(
        name="tk_core_tests",
        sources=[str(ROOT / "tests" / "core" / "core_binding.cpp"), str(ROOT / "tests" / "core" / "core_kernels.cu")],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O2", "-std=c++20"],
        extra_cuda_cflags=["-O3", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr"]
        + undefine,
        build_directory=str(build_dir),
        verbose=os.environ.get("TK_VERBOSE_BUILD") == "1",
    )


# ------------------------------------------------------------------------------- TMA round trip

SPAN = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}  # elements in 128 bytes


@requires_hopper
@pytest.mark.parametrize("box_rows", [64, 16], ids=["one-box", "four-boxes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("swizzle", ["32B", "64B", "128B", "2x128B"])
@pytest.mark.parametrize(
    "rows, cols, row0, col0",
    [(64, 128, 0, 0), (100, 200, 64, 128), (37, 90, 0, 40), (130, 72, 96, 24)],
    ids=["inside", "bottom-right-corner", "short-and-narrow", "crossing-both-edges"],
)
def test_tma_round_trip(dtype, swizzle, rows, cols, row0, col0, box_rows):
    tile_cols = {"32B": SPAN[dtype] // 4, "64B": SPAN[dtype] // 2, "128B": SPAN[dtype], "2x128B": 2 * SPAN[dtype]}[swizzle]
    row_stride = (cols + 7) // 8 * 8 + 16  # a multiple of 16 bytes wider than a row, as TMA needs
    storage = torch.randn(rows, row_stride, device="cuda").to(dtype)
    source = storage[:, 8 : 8 + cols]  # a strided view whose base is 16 or 32 bytes in
    dense, out = core().tma_round_trip(source, tile_cols, box_rows, row0, col0)
    window = source[row0 : row0 + 64, col0 : col0 + tile_cols]
    expected = torch.zeros(64, tile_cols, dtype=dtype, device="cuda")  # out of bounds reads as zero
    expected[: window.shape[0], : window.shape[1]] = window
    assert torch.equal(dense, expected), "the swizzled shared tile disagrees with TMA's placement"
    written = torch.zeros_like(out, dtype=torch.bool)
    written[row0 : row0 + 64, col0 : col0 + tile_cols] = True
    assert torch.equal(out[written], source[written]), "the TMA store lost or moved elements"
    assert out[~written].isnan().all(), "the TMA store wrote outside its box or past the edges"


# ----------------------------------------------------------------------------------------- wgmma


def product_operands(n: int, dtype, a_mn_major: bool, b_mn_major: bool):
    """Logical A (64 x 64) and B (64 x n) and their stored forms."""
    a = torch.randn(64, 64, device="cuda").to(dtype)
    b = torch.randn(64, n, device="cuda").to(dtype)
    a_stored = a.mT.contiguous() if a_mn_major else a
    b_stored = b.contiguous() if b_mn_major else b.mT.contiguous()
    return a, b, a_stored, b_stored


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("majors", ["k-k", "k-mn", "mn-k", "mn-mn", "registers-k", "registers-mn"])
def test_wgmma_against_float64(dtype, n, majors):
    a_form, b_form = majors.split("-")
    a, b, a_stored, b_stored = product_operands(n, dtype, a_form == "mn", b_form == "mn")
    bias = torch.randn(n, device="cuda").to(dtype)
    out32, out16 = core().wgmma_product(a_stored, b_stored, bias, a_form == "mn", b_form == "mn", a_form == "registers")
    expected = a.double() @ b.double()
    assert_rel_close(out32, expected, 1e-5, "fp32 accumulator")  # exact products, fp32 sums
    assert_rel_close(out16, expected + bias.double(), TOLERANCE[dtype], "epilogue (bias, stmatrix, TMA store)")


# --------------------------------------------------------------------------------------- pipeline


def grouped_order(tiles_m: int, tiles_n: int, group_rows: int):
    """The tile of each task index, as pipeline::grouped_tile_order orders them."""
    tiles = []
    for index in range(tiles_m * tiles_n):
        group, in_group = divmod(index, group_rows * tiles_n)
        first_row = group * group_rows
        rows_in_group = min(group_rows, tiles_m - first_row)
        tiles.append((first_row + in_group % rows_in_group, in_group // rows_in_group))
    return tiles


@requires_hopper
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize(
    "rows, cols, iterations, grid",
    # (777, 1000) in 128 x 64 tiles: 7 x 16 = 112 tasks
    [(64, 64, 1, 1), (1000, 304, 3, 3), (4100, 136, 7, 5), (777, 1000, 2, 132), (777, 1000, 2, 112)],
    ids=["one-tile", "tails", "many-tiles-per-block", "more-blocks-than-tiles", "one-block-per-task"],
)
def test_pipeline_template_hooks(stages, consumers, rows, cols, iterations, grid):
    """Two-part stages, a resident tile per task and scratch kept across tasks, on persistent grids
    (several tasks per block) and on one block per task."""
    x, y = (torch.randn(rows, cols, device="cuda").bfloat16() for _ in range(2))  # cols % 8 == 0: 16-byte rows
    rows_per_tile = 64 * iterations
    tiles_m, tiles_n = math.ceil(rows / rows_per_tile), math.ceil(cols / 64)
    z = torch.randn(64 * tiles_m, cols, device="cuda").bfloat16()
    out, tasks_before = core().pipeline_sums(x, y, z, iterations, stages, consumers, 3, grid)
    padded = torch.zeros(tiles_m * rows_per_tile, cols, dtype=torch.float64, device="cuda")
    padded[:rows] = x.double() + 2 * y.double()
    expected = padded.view(tiles_m, rows_per_tile, cols).sum(1) + 3 * z.double().view(tiles_m, 64, cols).sum(1)
    assert not out.isnan().any(), "a work tile was never stored"
    assert_rel_close(out, expected, 1e-5)
    expected_before = torch.empty(tiles_m, tiles_n, dtype=torch.int32)
    for index, (row, col) in enumerate(grouped_order(tiles_m, tiles_n, 3)):
        expected_before[row, col] = index // grid
    assert torch.equal(tasks_before.cpu(), expected_before), "scratch did not persist across a block's tasks"



@requires_hopper
@pytest.mark.parametrize(
    "rows, cols, iterations, grid",
    [(64, 64, 1, 1), (1000, 304, 3, 3), (777, 1000, 2, 132)],
    ids=["one-tile", "tails", "more-blocks-than-tiles"],
)
def test_pipeline_template_without_optional_hooks(rows, cols, iterations, grid):
    """Only the required hooks (no store, prefetch, init, finish, resident tiles, scratch): compute
    writes the task's results itself."""
    x = torch.randn(rows, cols, device="cuda").bfloat16()
    out = core().pipeline_bare_sums(x, iterations, grid)
    rows_per_tile = 64 * iterations
    tiles_m = math.ceil(rows / rows_per_tile)
    padded = torch.zeros(tiles_m * rows_per_tile, cols, dtype=torch.float64, device="cuda")
    padded[:rows] = x.double()
    assert_rel_close(out, padded.view(tiles_m, rows_per_tile, cols).sum(1), 1e-5)


# ------------------------------------------------------------------------------- TMA store ring


@requires_hopper
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("tiles", [1, 2, 7, 16])
def test_store_ring_reuses_slots_only_once_read(tiles, slots):
    """Each tile reaches global memory as written, though its slot is rewritten right after."""
    out = core().store_ring_tiles(tiles, slots)
    expected = torch.arange(tiles * 64 * 64, dtype=torch.float32, device="cuda").view(tiles * 64, 64)
    assert torch.equal(out, expected)


# -------------------------------------------------------------------------------------- publish


@requires_hopper
def test_publish_makes_every_writer_visible_to_one_store():
    """Two warpgroups write halves of a tile with ordinary stores; one thread's TMA store sees both."""
    out = core().publish_tile()
    assert torch.equal(out, torch.arange(64 * 64, dtype=torch.float32, device="cuda").view(64, 64))


# -------------------------------------------------------------------------------- turn rotation


@requires_hopper
@pytest.mark.parametrize("members", [1, 2, 3])
@pytest.mark.parametrize("rounds", [1, 5, 100])
def test_turn_rotation_cycles_through_the_members(members, rounds):
    """Turns go 0, 1, ..., members - 1, 0, ... and the block ends (every opened turn completes)."""
    order = core().turn_order(members, rounds)
    assert order.tolist() == list(range(members)) * rounds
