// Sequence-parallel tasks for kernels that carry a running state along a sequence (a scan over
// chunks): when the (batch, head, ...) tasks alone leave SMs idle, each sequence is cut into
// `segments` runs of whole chunks, and three launches replace one:
//
//   states pass   one task per (sequence, segment but the last): the segment's contribution to the
//                 state, from zero, no outputs
//   segment scan  the states entering the segments: an exclusive prefix over them (here a plain sum;
//                 mamba2_ssd's scan also decays, in its own kernel)
//   forward       one task per (sequence, segment), from the state entering its segment
//
// plan_split is the cost model deciding the cut, first written for mamba2_ssd (which still has its own
// copy with its measured constants: moving it onto this one is a host-only change left for a session
// that can re-run its split tests), in units of one chunk of the forward on an SM running `per_sm`
// blocks. A pass of `grid` equal blocks of `chunks` chunks takes ceil(grid / (per_sm SMs)) waves of
// chunks, or solo_chunk of that when every block has an SM to itself. The split adds a start per task
// (the entering state and the first loads), the states pass (states_chunk a chunk), the scan
// (scan_segment a segment) and its extra launches. Every segment count up to max_waves waves' worth is
// tried; the fastest predicted one wins (1: one pass, no split).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tk/tk.cuh"

namespace tk::sequence_split {

struct split_costs {
  int per_sm;             // blocks an SM, the forward and the states pass alike
  double solo_chunk;      // a chunk of a block alone on its SM (<= 1)
  double task_start;      // a task's entering state and first loads
  double states_chunk;    // a chunk of the states pass
  double scan_segment;    // a segment of the scan
  double split_launches;  // the split's two extra launches
  int max_waves;          // segment counts tried: up to this many waves of tasks
};

// How each sequence is cut: `segments` runs of `chunks_per_segment` chunks (the last may be shorter).
struct split {
  int chunks_per_segment;
  int segments;
};

// A grid of `grid` equal blocks of `chunks` chunks each.
inline double pass_time(int64_t grid, double chunks, int sms, const split_costs& c) {
  if (c.per_sm > 1 && grid <= sms) return c.solo_chunk * chunks;
  return double(ceil_div<int64_t>(grid, int64_t(c.per_sm) * sms)) * chunks;
}

// The predicted time (chunks) of `segments` segments for `tasks` tasks a segment (one launch when 1).
inline double predicted_time(int64_t tasks, int chunks, int segments, int sms, const split_costs& c) {
  if (segments <= 1) return pass_time(tasks, chunks + c.task_start, sms, c);
  const int chunks_per_segment = ceil_div(chunks, segments);
  return pass_time(tasks * segments, chunks_per_segment + c.task_start, sms, c) +
         c.states_chunk * pass_time(tasks * (segments - 1), chunks_per_segment, sms, c) +
         c.scan_segment * segments + c.split_launches;
}

// The fastest predicted cut of sequences of `chunks` chunks, `tasks` tasks a segment.
inline split plan_split(int64_t tasks, int chunks, int max_segments, int sms, const split_costs& c) {
  split best{chunks, 1};
  double best_time = predicted_time(tasks, chunks, 1, sms, c);
  const int64_t most =
      std::min<int64_t>({int64_t(chunks), int64_t(max_segments), int64_t(c.max_waves) * c.per_sm * sms / tasks});
  for (int segments = 2; segments <= most; ++segments) {
    const int chunks_per_segment = ceil_div(chunks, segments);
    if (ceil_div(chunks, chunks_per_segment) != segments) continue;  // the same cut as fewer segments
    const double time = predicted_time(tasks, chunks, segments, sms, c);
    if (time < best_time) {
      best = {chunks_per_segment, segments};
      best_time = time;
    }
  }
  return best;
}

// ------------------------------------------------------------------------------ the scan

constexpr int SCAN_THREADS = 256;
constexpr int SCAN_ELEMENTS_PER_THREAD = 4;
constexpr int SCAN_ELEMENTS_PER_BLOCK = SCAN_THREADS * SCAN_ELEMENTS_PER_THREAD;

// data[sequence][slot][element] (fp32, contiguous), slot s holding segment s's contribution (the
// segments but the last): replaced in place by its inclusive prefix sum over the slots, so slot s
// becomes the state entering segment s + 1. One block per (sequence, SCAN_ELEMENTS_PER_BLOCK
// elements), each element's sum in one thread; the next slot is loaded before this one is stored.
// A template, so that every translation unit including this header may launch it.
template <int THREADS = SCAN_THREADS>
__global__ void __launch_bounds__(THREADS) segment_prefix_sum_kernel(float* data, int slots, int64_t elements) {
  const int64_t pieces = ceil_div<int64_t>(elements, SCAN_ELEMENTS_PER_BLOCK);
  const int64_t sequence = int64_t(blockIdx.x) / pieces;
  const int64_t first = (int64_t(blockIdx.x) % pieces) * SCAN_ELEMENTS_PER_BLOCK + threadIdx.x;
  float* base = data + sequence * slots * elements;
  float sum[SCAN_ELEMENTS_PER_THREAD] = {}, next[SCAN_ELEMENTS_PER_THREAD] = {};
  const auto in_range = [&](int k) { return first + int64_t(k) * THREADS < elements; };
#pragma unroll
  for (int k = 0; k < SCAN_ELEMENTS_PER_THREAD; ++k) {
    if (in_range(k)) next[k] = base[first + k * THREADS];
  }
  for (int slot = 0; slot < slots; ++slot) {
    float* here = base + int64_t(slot) * elements + first;
#pragma unroll
    for (int k = 0; k < SCAN_ELEMENTS_PER_THREAD; ++k) {
      const float contribution = next[k];
      if (slot + 1 < slots && in_range(k)) next[k] = here[elements + k * THREADS];
      sum[k] += contribution;
      if (in_range(k)) here[k * THREADS] = sum[k];
    }
  }
}

// Launches the scan over `sequences` x `slots` records of `elements` floats (nothing when slots < 2:
// one slot is its own prefix sum).
inline cudaError_t segment_prefix_sum(float* data, int64_t sequences, int slots, int64_t elements,
                                      cudaStream_t stream) {
  if (slots < 2) return cudaSuccess;
  const int64_t blocks = sequences * ceil_div<int64_t>(elements, SCAN_ELEMENTS_PER_BLOCK);
  return pipeline::launch(segment_prefix_sum_kernel<SCAN_THREADS>, dim3(unsigned(blocks)), dim3(SCAN_THREADS), 0,
                          stream, data, slots, elements);
}

}  // namespace tk::sequence_split
