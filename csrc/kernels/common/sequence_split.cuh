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
// plan_split is the cost model deciding the cut (mamba2_ssd and based_attention each give it their
// measured constants), in a kernel's unit of work (a chunk, or a block of positions) on an SM running
// the forward's `per_sm` blocks. A pass of `grid` equal blocks of `units` units takes
// ceil(grid / (per_sm SMs)) waves of units, or solo_unit of that when every block has an SM to itself.
// The split adds a start per task (the entering state and the first loads), the states pass
// (states_unit a unit, on its own tasks and blocks an SM), the scan (scan_segment a segment) and its
// extra launches. Every segment count up to max_waves waves of states-pass tasks is tried; the fastest
// predicted one wins (1: one pass, no split).
#pragma once

#include <algorithm>
#include <cstdint>

#include "tk/tk.cuh"

namespace tk::sequence_split {

struct split_costs {
  double solo_unit;       // a unit of a block alone on its SM (<= 1)
  double task_start;      // a task's entering state and first loads
  double states_unit;     // a unit of the states pass
  double scan_segment;    // a segment of the scan
  double split_launches;  // the split's two extra launches
  int max_waves;          // segment counts tried: up to this many waves of states-pass tasks
};

// What is cut: sequences of `chunks` chunks (`chunk_units` units each, `sequence_units` in all: the
// last chunk may be short), run by `tasks` forward tasks (`per_sm` an SM) and, when split,
// `states_tasks` states-pass tasks (`states_per_sm` an SM) a segment.
struct split_work {
  int64_t tasks;
  int per_sm;
  int64_t states_tasks;
  int states_per_sm;
  int chunks;
  double chunk_units;
  double sequence_units;
  int max_segments;
};

// How each sequence is cut: `segments` runs of `chunks_per_segment` chunks (the last may be shorter).
struct split {
  int chunks_per_segment;
  int segments;
};

// A grid of `grid` equal blocks of `units` units each, `per_sm` an SM.
inline double pass_time(int64_t grid, double units, int per_sm, int sms, const split_costs& c) {
  if (per_sm > 1 && grid <= sms) return c.solo_unit * units;
  return double(ceil_div<int64_t>(grid, int64_t(per_sm) * sms)) * units;
}

// The predicted time (units) of cutting `w`'s sequences into `segments` segments (one launch when 1).
inline double predicted_time(const split_work& w, int segments, int sms, const split_costs& c) {
  if (segments <= 1) return pass_time(w.tasks, w.sequence_units + c.task_start, w.per_sm, sms, c);
  const double segment_units = ceil_div(w.chunks, segments) * w.chunk_units;
  return pass_time(w.tasks * segments, segment_units + c.task_start, w.per_sm, sms, c) +
         c.states_unit * pass_time(w.states_tasks * (segments - 1), segment_units, w.states_per_sm, sms, c) +
         c.scan_segment * segments + c.split_launches;
}

// The fastest predicted cut of `w`'s sequences.
inline split plan_split(const split_work& w, int sms, const split_costs& c) {
  split best{w.chunks, 1};
  double best_time = predicted_time(w, 1, sms, c);
  const int64_t most = std::min<int64_t>(
      {int64_t(w.chunks), int64_t(w.max_segments), int64_t(c.max_waves) * w.states_per_sm * sms / w.states_tasks});
  for (int segments = 2; segments <= most; ++segments) {
    const int chunks_per_segment = ceil_div(w.chunks, segments);
    if (ceil_div(w.chunks, chunks_per_segment) != segments) continue;  // the same cut as fewer segments
    const double time = predicted_time(w, segments, sms, c);
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
// one slot is its own prefix sum). A template too, instantiated only where called, so that a unit
// including this header for the cost model alone (mamba2_ssd, whose scan decays) compiles no scan kernel.
template <typename = void>
cudaError_t segment_prefix_sum(float* data, int64_t sequences, int slots, int64_t elements, cudaStream_t stream) {
  if (slots < 2) return cudaSuccess;
  const int64_t blocks = sequences * ceil_div<int64_t>(elements, SCAN_ELEMENTS_PER_BLOCK);
  return pipeline::launch(segment_prefix_sum_kernel<SCAN_THREADS>, dim3(unsigned(blocks)), dim3(SCAN_THREADS), 0,
                          stream, data, slots, elements);
}

}  // namespace tk::sequence_split
