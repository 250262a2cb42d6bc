// Shared between the device code (pack_kernels.cu) and the host code (pack_host.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nereus {

constexpr int kMaxDims = 8;
// Tunables (the benchmark builds variants with -D): threads per block, independent loads in flight per thread, and
// the blocks per multiprocessor the register budget must allow (6 x 128 threads: 80 registers, no
// spills). With the host's 8 KiB chunks each thread moves exactly kUnroll 16-byte vectors per chunk;
// H200 sweep (benchmarks/results/pack_h200_sweep.json): this is the best of the variants tried.
#ifndef NEREUS_PACK_THREADS
#define NEREUS_PACK_THREADS 128
#endif
#ifndef NEREUS_PACK_UNROLL
#define NEREUS_PACK_UNROLL 4
#endif
#ifndef NEREUS_PACK_MIN_BLOCKS
#define NEREUS_PACK_MIN_BLOCKS 6
#endif
constexpr int kThreads = NEREUS_PACK_THREADS;
constexpr int kUnroll = NEREUS_PACK_UNROLL;
constexpr int kMinBlocks = NEREUS_PACK_MIN_BLOCKS;
constexpr int64_t kAlign = 16;

struct ViewDesc {
  int64_t strided;             // address of the view's first element
  int64_t packed;              // byte offset of its slot in the buffer
  int64_t units;               // W-byte units in the view
  int64_t row_units;           // contiguous units per row
  int64_t rows;                // number of rows
  int64_t sizes[kMaxDims];     // outer dims, innermost first
  int64_t strides[kMaxDims];   // their strides in bytes
  int32_t ndim;                // outer dims in use (0: the whole view is contiguous)
  int32_t log2w;               // W = 1 << log2w
};
static_assert(sizeof(ViewDesc) % 8 == 0, "ViewDesc is copied as 8-byte words");
constexpr int kDescWords = sizeof(ViewDesc) / 8;
static_assert(kDescWords <= kThreads, "one thread per ViewDesc word");

// Launches the pack (views -> buffer) or unpack kernel over `n` described views on `stream`.
cudaError_t launch_copy_views(const ViewDesc* descs, const int64_t* begin, int n, int64_t total_chunks,
                              int log2_chunk, uint8_t* buffer, bool pack, cudaStream_t stream);

}  // namespace nereus
