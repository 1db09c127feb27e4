"""The warp-level tile core on the GPU: register tiles and vectors, the warp ops, and the mapping
of wgmma's register fragments onto register tiles (csrc/tk/types/register_*, csrc/tk/ops/warp,
csrc/tk/ops/warpgroup/register_fragments.cuh), complex tiles and their mma (csrc/tk/types/complex_tile.cuh,
ops/warp/complex.cuh) and fragment-order tables (ops/warp/fragments.cuh).

Each case runs one small kernel of tests/core/warp_kernels.cu (one warp; one warpgroup for wgmma),
built once per module with torch.utils.cpp_extension.load and called through ctypes (the kernels
know no torch), and compares with float64 torch results. Everything here needs an sm_90 GPU.
"""

from __future__ import annotations

import ctypes
import pathlib

import pytest
import torch

import tk_testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "tests" / "core" / "warp_kernels.cu"

# Shapes fixed in warp_kernels.cu.
BASE_TILE = 16
ROWS, COLS = 2 * BASE_TILE, 3 * BASE_TILE
ROW_STRIDE = COLS + BASE_TILE // 2
SHARED_ROWS, SHARED_COLS = ROWS + BASE_TILE, 4 * BASE_TILE
WINDOW = (slice(BASE_TILE, BASE_TILE + ROWS), slice(BASE_TILE, BASE_TILE + COLS))
MMA_M, MMA_N, MMA_K = 2 * BASE_TILE, 3 * BASE_TILE, 4 * BASE_TILE
WGMMA_M, WGMMA_N = 64, 2 * BASE_TILE
PROBE_N = PROBE_K = BASE_TILE

DTYPES = {"bf16": torch.bfloat16, "half": torch.float16, "float": torch.float32}
LAYOUTS = ["row", "col"]
# fp32 accumulation and the MUFU approximations (about 2^-22) against float64.
FLOAT_TOLERANCE = 1e-5

requires_hopper = pytest.mark.skipif(not tk_testing.IS_HOPPER, reason="the test kernels are built for sm_90a")


def gpu_test(test):
    return tk_testing.requires_cuda(requires_hopper(test))


@pytest.fixture(scope="module")
def kernels():
    from torch.utils import cpp_extension

    library_path = cpp_extension.load(
        name="tk_core_warp_kernels",
        sources=[str(KERNELS)],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cuda_cflags=["-std=c++20", "-gencode=arch=compute_90a,code=sm_90a"],
        is_python_module=False,
    )
    library = ctypes.CDLL(library_path)
    library.run_case.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    library.run_case.restype = ctypes.c_int
    return library


def run(kernels, name: str, *tensors: torch.Tensor) -> None:
    pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    status = kernels.run_case(name.encode(), pointers, torch.cuda.current_stream().cuda_stream)
    assert status == 0, f"{name}: run_case returned {status} (-1: unknown case, else a cudaError_t)"
    torch.cuda.synchronize()


def poisoned(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def randn(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


@gpu_test
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "global_dtype, tile_dtype", [("bf16", "bf16"), ("half", "half"), ("float", "float"), ("bf16", "float")]
)
def test_global_round_trip(kernels, global_dtype, tile_dtype, layout):
    src = randn(ROWS, ROW_STRIDE, dtype=DTYPES[global_dtype])
    dst = poisoned(ROWS, ROW_STRIDE, dtype=DTYPES[global_dtype])
    run(kernels, f"global/{global_dtype}/{tile_dtype}/{layout}", src, dst)
    assert torch.equal(dst[:, :COLS], src[:, :COLS])
    assert dst[:, COLS:].isnan().all(), "the padding past the tile's columns was written"


@gpu_test
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "shared_dtype, tile_dtype, swizzle_bytes",
    [("bf16", "bf16", 128), ("half", "float", 32), ("float", "float", 128), ("float", "bf16", 64)],
)
def test_shared_round_trip(kernels, shared_dtype, tile_dtype, swizzle_bytes, layout):
    src = randn(SHARED_ROWS, SHARED_COLS, dtype=DTYPES[shared_dtype])
    dst = poisoned(SHARED_ROWS, SHARED_COLS, dtype=DTYPES[shared_dtype])
    run(kernels, f"shared/{shared_dtype}/{tile_dtype}/{layout}/{swizzle_bytes}", src, dst)
    expected = torch.zeros_like(src)
    expected[WINDOW] = src[WINDOW].to(DTYPES[tile_dtype]).to(src.dtype)
    assert torch.equal(dst, expected)


@gpu_test
@pytest.mark.parametrize("dtype", ["bf16", "half"])
@pytest.mark.parametrize("form", ["AB", "ABt", "AtB", "AtBt"])
def test_mma(kernels, form, dtype):
    a_transposed, b_transposed = form.startswith("At"), form.endswith("Bt")
    a = randn(*((MMA_K, MMA_M) if a_transposed else (MMA_M, MMA_K)), dtype=DTYPES[dtype])
    b = randn(*((MMA_N, MMA_K) if b_transposed else (MMA_K, MMA_N)), dtype=DTYPES[dtype])
    c = randn(MMA_M, MMA_N)
    d = poisoned(MMA_M, MMA_N)
    run(kernels, f"mma/{form}/{dtype}", a, b, c, d)
    a64 = a.double().T if a_transposed else a.double()
    b64 = b.double().T if b_transposed else b.double()
    tk_testing.assert_rel_close(d, a64 @ b64 + c.double(), FLOAT_TOLERANCE, f"mma_{form}")


def _where_kept(x, keep, value):
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    cols = torch.arange(x.shape[1], device=x.device)[None, :]
    return torch.where(keep(rows, cols), x, value)


def _softmax2(x, y, u, w):
    shifted = x - x.amax(dim=1, keepdim=True)
    return 2**shifted / (2**shifted).sum(dim=1, keepdim=True)


# (name, reference on float64 x, y, u, w, exact): in the order elementwise_suite writes them.
TILE_CASES = [
    ("copy_through_bf16", lambda x, y, u, w: x.bfloat16().double(), True),
    ("exp2", lambda x, y, u, w: 2**x, False),
    ("exp", lambda x, y, u, w: x.exp(), False),
    ("log2", lambda x, y, u, w: y.log2(), False),
    ("neg", lambda x, y, u, w: -x, True),
    ("add", lambda x, y, u, w: x + y, False),
    ("sub", lambda x, y, u, w: x - y, False),
    ("mul", lambda x, y, u, w: x * y, False),
    ("div", lambda x, y, u, w: x / y, False),
    ("max", lambda x, y, u, w: torch.maximum(x, y), True),
    ("min", lambda x, y, u, w: torch.minimum(x, y), True),
    ("add_scalar", lambda x, y, u, w: x + 0.75, False),
    ("mul_scalar", lambda x, y, u, w: x * -1.25, False),
    ("add_row", lambda x, y, u, w: x + u[:, None], False),
    ("sub_row", lambda x, y, u, w: x - u[:, None], False),
    ("mul_row", lambda x, y, u, w: x * u[:, None], False),
    ("div_row", lambda x, y, u, w: x / u[:, None], False),
    ("add_col", lambda x, y, u, w: x + w[None, :], False),
    ("sub_col", lambda x, y, u, w: x - w[None, :], False),
    ("mul_col", lambda x, y, u, w: x * w[None, :], False),
    ("div_col", lambda x, y, u, w: x / w[None, :], False),
    ("zero", lambda x, y, u, w: torch.zeros_like(x), True),
    ("fill", lambda x, y, u, w: torch.full_like(x, 2.5), True),
    ("neg_infty", lambda x, y, u, w: torch.full_like(x, float("-inf")), True),
    ("softmax2", _softmax2, False),
    ("tril", lambda x, y, u, w: _where_kept(x, lambda r, c: c + 5 <= r + 3 + 2, float("-inf")), True),
    ("mask_predicate", lambda x, y, u, w: _where_kept(x, lambda r, c: (r + 7 + c + 11) % 3 != 0, 0.0), True),
    ("columns", lambda x, y, u, w: torch.cat([x[:, COLS - BASE_TILE :], torch.zeros_like(x[:, BASE_TILE:])], 1), True),
]
ROW_CASES = [
    ("row_max", lambda x, y, u, w: x.amax(dim=1), True),
    ("row_sum", lambda x, y, u, w: x.sum(dim=1), False),
    ("row_max_with_init", lambda x, y, u, w: torch.maximum(x.amax(dim=1), u), True),
    ("row_sum_with_init", lambda x, y, u, w: x.sum(dim=1) + u, False),
    ("vector_round_trip", lambda x, y, u, w: u, True),
    ("vector_exp2", lambda x, y, u, w: 2**u, False),
    ("vector_sub", lambda x, y, u, w: x.amax(dim=1) - u, False),
    ("lane_row_sum", lambda x, y, u, w: x.sum(dim=1) + y.sum(dim=1), False),
    ("bounded_load", lambda x, y, u, w: torch.where(torch.arange(ROWS, device=u.device) < ROWS - 11, u, 0.0), True),
]
COL_CASES = [
    ("col_max", lambda x, y, u, w: x.amax(dim=0), True),
    ("col_sum", lambda x, y, u, w: x.sum(dim=0), False),
    ("col_max_with_init", lambda x, y, u, w: torch.maximum(x.amax(dim=0), w), True),
    ("col_sum_with_init", lambda x, y, u, w: x.sum(dim=0) + w, False),
    ("vector_round_trip", lambda x, y, u, w: w, True),
]


def _check_cases(cases, outputs, inputs, tile_dtype, tolerance, what):
    for (name, reference, exact), out in zip(cases, outputs, strict=True):
        expected = reference(*inputs)
        if exact:
            assert torch.equal(out.double().cpu(), expected.to(tile_dtype).double().cpu()), f"{what} {name}"
        else:
            tk_testing.assert_rel_close(out, expected, tolerance, f"{what} {name}")


@gpu_test
def test_suite_case_lists_match_the_kernel(kernels):
    counts = [ctypes.c_int() for _ in range(3)]
    kernels.suite_case_counts(*(ctypes.byref(count) for count in counts))
    assert [count.value for count in counts] == [len(TILE_CASES), len(ROW_CASES), len(COL_CASES)]


@gpu_test
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float", "bf16"])
def test_maps_broadcasts_reductions(kernels, dtype, layout):
    tile_dtype = DTYPES[dtype]
    # Inputs the tile's type holds exactly; y, u and w stay away from zero (log2, div).
    x = (2 * randn(ROWS, COLS)).to(tile_dtype).float()
    y = (torch.rand(ROWS, COLS, device="cuda") + 0.5).to(tile_dtype).float()
    u = torch.rand(ROWS, device="cuda") + 0.5
    w = torch.rand(COLS, device="cuda") + 0.5
    tiles = poisoned(len(TILE_CASES), ROWS, COLS)
    rows = poisoned(len(ROW_CASES), ROWS)
    cols = poisoned(len(COL_CASES), COLS)
    transposed = poisoned(COLS, ROWS)
    swapped = poisoned(ROWS, COLS)
    run(kernels, f"suite/{dtype}/{layout}", x, y, u, w, tiles, rows, cols, transposed, swapped)

    inputs = [t.double() for t in (x, y, u, w)]
    tile_tolerance = tk_testing.TOLERANCE[tile_dtype] if tile_dtype != torch.float32 else FLOAT_TOLERANCE
    _check_cases(TILE_CASES, tiles, inputs, tile_dtype, tile_tolerance, "tile")
    # Vectors are float and reductions accumulate in float, whatever the tile's type.
    _check_cases(ROW_CASES, rows, inputs, torch.float32, FLOAT_TOLERANCE, "per-row vector")
    _check_cases(COL_CASES, cols, inputs, torch.float32, FLOAT_TOLERANCE, "per-col vector")
    assert torch.equal(transposed, x.T), "transpose"
    if tile_dtype != torch.float32:
        assert torch.equal(swapped, x), "swap_layout"


@gpu_test
def test_wgmma_accumulator_layout(kernels):
    out = poisoned(WGMMA_M, WGMMA_N)
    fragment_out = poisoned(WGMMA_M, WGMMA_N)
    run(kernels, "wgmma/accumulator_layout", out, fragment_out)
    coordinates = torch.arange(WGMMA_M * WGMMA_N, device="cuda", dtype=torch.float32).view(WGMMA_M, WGMMA_N)
    assert torch.equal(out, coordinates), "fragment -> register tile"
    assert torch.equal(fragment_out, coordinates), "register tile -> fragment"


@gpu_test
@pytest.mark.parametrize("case", ["register_a", "register_a_library"])
def test_wgmma_register_a_operand(kernels, case):
    """register_a: a raw wgmma on a hand-built descriptor; register_a_library: ops/warpgroup/wgmma.cuh."""
    a = randn(WGMMA_M, PROBE_K, dtype=torch.bfloat16)
    bt = randn(PROBE_N, PROBE_K, dtype=torch.bfloat16)
    d = poisoned(WGMMA_M, PROBE_N)
    run(kernels, f"wgmma/{case}", a, bt, d)
    tk_testing.assert_rel_close(d, a.double() @ bt.double().T, FLOAT_TOLERANCE, "wgmma with a register A")


@gpu_test
@pytest.mark.parametrize("per_lane", [1, 2, 3])
def test_inclusive_scan(kernels, per_lane):
    """warp::inclusive_scan: lane l holds entries [per_lane l, per_lane (l + 1)); every lane gets the total."""
    values = randn(32 * per_lane)
    out, total = poisoned(32 * per_lane), poisoned(32)
    run(kernels, f"scan/{per_lane}", values, out, total)
    want = values.double().cumsum(0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total.double(), want[-1].expand(32), rtol=1e-5, atol=1e-5)


# ---- complex tiles (csrc/tk/types/complex_tile.cuh, csrc/tk/ops/warp/complex.cuh, fragments.cuh) ----

COMPLEX_M = BASE_TILE
COMPLEX_SHARED_ROWS, COMPLEX_SHARED_COLS = MMA_K + BASE_TILE, 4 * BASE_TILE
TABLE_COL_BLOCKS = COLS // BASE_TILE + 3


def complex_planes(*shape: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)


def as_complex(re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    return torch.complex(re.double(), im.double())


@gpu_test
@pytest.mark.parametrize(
    "source, dtype, conj",
    [("mma", "bf16", "ab"), ("mma", "bf16", "conj_a"), ("mma", "bf16", "conj_b"), ("mma", "bf16", "conj_ab"),
     ("mma", "half", "ab"), ("mma", "half", "conj_a"), ("mma_shared", "bf16", "ab"),
     ("mma_shared", "bf16", "conj_a"), ("mma_shared", "half", "conj_b"), ("mma_shared", "half", "conj_ab")],
)
def test_complex_mma(kernels, source, dtype, conj):
    """cmma_AB: d = op(a) op(b) + c as four real products; the shared form reads b's window at (16, 16)."""
    a = complex_planes(COMPLEX_M, MMA_K, dtype=DTYPES[dtype])
    b_shape = (COMPLEX_SHARED_ROWS, COMPLEX_SHARED_COLS) if source == "mma_shared" else (MMA_K, MMA_N)
    b = complex_planes(*b_shape, dtype=DTYPES[dtype])
    c = complex_planes(COMPLEX_M, MMA_N, dtype=torch.float32)
    d = (poisoned(COMPLEX_M, MMA_N), poisoned(COMPLEX_M, MMA_N))
    run(kernels, f"complex/{source}/{dtype}/{conj}", *a, *b, *c, *d)
    a64, b64 = as_complex(*a), as_complex(*b)
    if source == "mma_shared":
        b64 = b64[BASE_TILE : BASE_TILE + MMA_K, BASE_TILE : BASE_TILE + MMA_N]
    if conj in ("conj_a", "conj_ab"):
        a64 = a64.conj()
    if conj in ("conj_b", "conj_ab"):
        b64 = b64.conj()
    expected = a64 @ b64 + as_complex(*c)
    tk_testing.assert_rel_close(d[0], expected.real, FLOAT_TOLERANCE, "re")
    tk_testing.assert_rel_close(d[1], expected.imag, FLOAT_TOLERANCE, "im")


@gpu_test
@pytest.mark.parametrize("conj", ["b", "conj_b"])
def test_complex_mul(kernels, conj):
    a, b = complex_planes(ROWS, COLS, dtype=torch.float32), complex_planes(ROWS, COLS, dtype=torch.float32)
    d = (poisoned(ROWS, COLS), poisoned(ROWS, COLS))
    run(kernels, f"complex/mul/{conj}", *a, *b, *d)
    b64 = as_complex(*b)
    expected = as_complex(*a) * (b64.conj() if conj == "conj_b" else b64)
    tk_testing.assert_rel_close(d[0], expected.real, FLOAT_TOLERANCE, "re")
    tk_testing.assert_rel_close(d[1], expected.imag, FLOAT_TOLERANCE, "im")


@gpu_test
@pytest.mark.parametrize("dtype", ["bf16", "float"])
def test_fragments_round_trip(kernels, dtype):
    """store_fragments / load_fragments: bit-exact round trip, written only where the tile's base tiles go."""
    src = randn(ROWS, COLS, dtype=DTYPES[dtype])
    table_rows = ROWS // BASE_TILE + 2
    table = poisoned(table_rows * TABLE_COL_BLOCKS * BASE_TILE * BASE_TILE, dtype=DTYPES[dtype])
    dst = poisoned(ROWS, COLS, dtype=DTYPES[dtype])
    run(kernels, f"fragments/{dtype}", src, table, dst)
    assert torch.equal(dst, src)
    blocks = table.view(table_rows, TABLE_COL_BLOCKS, BASE_TILE * BASE_TILE)
    written = torch.zeros(table_rows, TABLE_COL_BLOCKS, dtype=torch.bool)
    written[1 : 1 + ROWS // BASE_TILE, 2 : 2 + COLS // BASE_TILE] = True
    assert not blocks[written.to(blocks.device)].isnan().any()
    assert blocks[~written.to(blocks.device)].isnan().all()
    # Each base tile holds exactly its 256 values (in lane order).
    for br in range(ROWS // BASE_TILE):
        for bc in range(COLS // BASE_TILE):
            tile = src[BASE_TILE * br : BASE_TILE * (br + 1), BASE_TILE * bc : BASE_TILE * (bc + 1)]
            stored = blocks[1 + br, 2 + bc]
            assert torch.equal(stored.sort().values, tile.flatten().sort().values)
