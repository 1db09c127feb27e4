// Shared-memory tiles in the swizzled layouts that TMA writes and wgmma reads.
//
// A tile of ROWS x COLS elements (COLS is the contiguous dimension) is stored as panels: each panel
// is ROWS rows of exactly one swizzle span (32, 64 or 128 bytes), and panels follow each other
// along the columns. A TMA box fills BOX_ROWS rows of one panel (all of it by default), and one
// panel is one swizzle-atom column of a wgmma operand:
//
//   panel p holds columns [p * panel_cols, (p + 1) * panel_cols), row r at byte r * swizzle_bytes.
//
// Inside a panel the 16-byte chunks of a row are permuted by the hardware swizzle: address bits
// [4, 4 + log2(swizzle_bytes / 16)) are XORed with bits [7, ...). The permutation is a function of
// the absolute shared address (period: 8 rows of the span), so a tile starts on a 1024-byte boundary,
// every panel starts on a period, and TMA, wgmma and `offset()` all see the same layout.
#pragma once

#include <type_traits>

#include "../common.cuh"

namespace tk {

// none: plain row-major bytes (shared_vector below); never a wgmma operand.
enum class swizzle_mode : int { none = 0, bytes32 = 32, bytes64 = 64, bytes128 = 128 };

// Every swizzled pattern repeats after 8 rows of the widest span; tiles align to that period.
constexpr int SWIZZLE_PERIOD_BYTES = 1024;

// The widest swizzle whose span divides a row of `row_bytes` bytes.
constexpr swizzle_mode widest_swizzle(int row_bytes) {
  return row_bytes % 128 == 0 ? swizzle_mode::bytes128
       : row_bytes % 64 == 0  ? swizzle_mode::bytes64
                              : swizzle_mode::bytes32;
}

// BOX_ROWS: rows per TMA box (a panel moves in ROWS / BOX_ROWS copies; a box has at most 256 rows).
template <typename T, int ROWS, int COLS, swizzle_mode SWIZZLE = widest_swizzle(COLS * int(sizeof(T))),
          int BOX_ROWS = (ROWS < 256 ? ROWS : 256)>
struct alignas(SWIZZLE_PERIOD_BYTES) shared_tile {
  using element = T;
  static constexpr int rows = ROWS;
  static constexpr int cols = COLS;
  static constexpr swizzle_mode swizzle = SWIZZLE;
  static constexpr int swizzle_bytes = int(SWIZZLE);
  static constexpr int panel_cols = swizzle_bytes / int(sizeof(T));
  static constexpr int panels = COLS / panel_cols;
  static constexpr int panel_bytes = ROWS * swizzle_bytes;
  static constexpr int bytes = ROWS * COLS * int(sizeof(T));
  static constexpr int box_rows = BOX_ROWS;
  static constexpr int boxes_per_panel = ROWS / BOX_ROWS;

  static_assert(COLS % panel_cols == 0, "a tile row must be a whole number of swizzle spans");
  static_assert(ROWS % 8 == 0, "the swizzle pattern repeats every 8 rows: panels hold whole periods");
  static_assert(ROWS % BOX_ROWS == 0 && BOX_ROWS % 8 == 0 && BOX_ROWS <= 256, "boxes split a panel into whole periods");

  T data[ROWS * COLS];

  // Byte offset of element (row, col) from the start of the tile.
  __host__ __device__ static constexpr uint32_t offset(int row, int col) {
    const uint32_t linear = uint32_t((col / panel_cols) * panel_bytes + row * swizzle_bytes +
                                     (col % panel_cols) * int(sizeof(T)));
    // 16-byte chunk index XOR (row within the period), as the swizzle unit sees address bits 7+.
    const uint32_t chunk_mask = uint32_t(swizzle_bytes / 16 - 1);
    return linear ^ (((linear >> 7) & chunk_mask) << 4);
  }

  __device__ T& at(int row, int col) {
    return *reinterpret_cast<T*>(reinterpret_cast<char*>(data) + offset(row, col));
  }
  __device__ const T& at(int row, int col) const {
    return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(data) + offset(row, col));
  }
  __device__ const T* panel(int p) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(data) + p * panel_bytes);
  }
  __device__ T* panel(int p) { return reinterpret_cast<T*>(reinterpret_cast<char*>(data) + p * panel_bytes); }
};

// Columns [index * Part::cols, (index + 1) * Part::cols) of a tile as a tile of their own: whole panels,
// so the same bytes in the same layout (e.g. one consumer's columns of a gradient, staged in a resident tile).
template <typename Part, typename Tile>
__device__ __forceinline__ Part& column_part(Tile& tile, int index) {
  static_assert(std::is_same_v<typename Part::element, typename Tile::element> && Part::rows == Tile::rows &&
                    Part::swizzle == Tile::swizzle && Tile::cols % Part::cols == 0,
                "a column part has the tile's element, rows and swizzle, and divides its columns");
  return *reinterpret_cast<Part*>(tile.panel(index * Part::panels));
}

// N contiguous elements, unswizzled: one row that TMA moves as a single box of a 2-D layout (e.g. a
// per-row statistic for a step's rows), read back with ordinary loads. It offers the members that
// tma::load and make_tma_map read from a tile: one panel of one box of one row.
template <typename T, int N>
struct alignas(16) shared_vector {
  using element = T;
  static constexpr int rows = 1;
  static constexpr int cols = N;
  static constexpr swizzle_mode swizzle = swizzle_mode::none;
  static constexpr int bytes = N * int(sizeof(T));
  static constexpr int swizzle_bytes = bytes;  // the "span" is the whole row
  static constexpr int panel_cols = N;
  static constexpr int panels = 1;
  static constexpr int panel_bytes = bytes;
  static constexpr int box_rows = 1;
  static constexpr int boxes_per_panel = 1;
  static_assert(bytes % 16 == 0, "TMA moves whole 16-byte units");

  T data[N];

  __device__ const T* panel(int) const { return data; }
  __device__ T* panel(int) { return data; }
};

}  // namespace tk
