// Fused multi-tensor pack / unpack: many strided views <-> one flat uint8 buffer, one launch.
//
// Contract: nereus_lightning/kernels/pack.py (the torch reference). View i occupies bytes
// [offset_i, offset_i + nbytes_i) of the buffer, offsets 16-byte aligned, in list order; the
// padding bytes between slots are never touched.
//
// Host side: each view is collapsed (size-1 dims dropped, dims merged where the memory is
// contiguous across them) into `rows` rows of `row_bytes` contiguous bytes, addressed through at
// most kMaxDims outer (size, byte stride) pairs. The copy unit W (16, 8, 4, 2 or 1 bytes) is the
// largest power of two that divides the row length, the address and every outer stride, so
// aligned bf16/fp32 slices move as 16-byte vectors. Each view is cut into chunks of
// `chunk_bytes`; a prefix sum of chunk counts lets any block find its view by a 256-way search,
// so one launch covers thousands of views. Metadata travels in device memory.
//
// ROCm: this file is hipified by torch.utils.cpp_extension at build time (see ../hip/README.md);
// keep it to the CUDA runtime API and intrinsics that hipify maps.

#include "pack_kernels.cuh"

namespace nereus {

template <int W> struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = uint32_t; };
template <> struct Vec<2> { using T = uint16_t; };
template <> struct Vec<1> { using T = uint8_t; };

enum Mode { kContiguous = 0, kRows = 1, kGeneral = 2 };

// Byte offset, from d.strided, of unit `first + q` of the view (q < chunk_units); r0, c0: row and
// column of unit `first`.
template <int W, int kMode>
__device__ __forceinline__ int64_t strided_offset(const ViewDesc& d, int64_t first, int64_t r0, int64_t c0,
                                                  int64_t chunk_units, int64_t q) {
  if (kMode == kContiguous) return (first + q) * W;
  int64_t lr, col;
  const int64_t t = c0 + q;
  if (d.row_units >= chunk_units) {
    // c0 < row_units and q < chunk_units <= row_units: the chunk spans at most two rows.
    lr = t >= d.row_units ? 1 : 0;
    col = t - lr * d.row_units;
  } else {
    // Short rows: t < 2 * chunk_units <= 2^31, so 32-bit division is exact.
    const uint32_t tt = static_cast<uint32_t>(t), ru = static_cast<uint32_t>(d.row_units);
    const uint32_t l = tt / ru;
    lr = l;
    col = tt - l * ru;
  }
  int64_t off = col * W;
  if (kMode == kRows) return off + (r0 + lr) * d.strides[0];
  uint32_t row = static_cast<uint32_t>(r0 + lr);  // the host keeps rows < 2^32 on this path
  // Volatile reads keep the compiler from hoisting all 16 (size, stride) words into registers.
  const volatile int64_t* sizes = d.sizes;
  const volatile int64_t* strides = d.strides;
#pragma unroll
  for (int k = 0; k < kMaxDims; ++k) {
    if (k == d.ndim - 1) {
      off += static_cast<int64_t>(row) * strides[k];
      break;
    }
    const uint32_t size = static_cast<uint32_t>(sizes[k]);
    const uint32_t next = row / size;
    off += static_cast<int64_t>(row - next * size) * strides[k];
    row = next;
  }
  return off;
}

// Copies units [first, first + chunk_units) of view d (clipped to its end) between its strided
// memory and its packed slot; kUnroll independent loads per thread are in flight before the stores.
template <bool kPack, int W, int kMode>
__device__ __forceinline__ void copy_chunk(const ViewDesc& d, uint8_t* __restrict__ buffer, int64_t first,
                                           int64_t chunk_units) {
  using T = typename Vec<W>::T;
  constexpr int U = kMode == kGeneral ? 2 : kUnroll;  // the general index math needs more registers
  const int n = static_cast<int>(min(chunk_units, d.units - first));  // chunk_units <= 2^16 * 16
  int64_t r0 = 0, c0 = 0;
  if (kMode != kContiguous) {
    r0 = first / d.row_units;
    c0 = first - r0 * d.row_units;
  }
  uint8_t* packed = buffer + d.packed + first * W;
  uint8_t* strided = reinterpret_cast<uint8_t*>(d.strided);
  for (int base = threadIdx.x; base < n; base += kThreads * U) {
    T v[U];
    int64_t off[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int q = base + k * kThreads;
      if (q < n) {
        off[k] = strided_offset<W, kMode>(d, first, r0, c0, chunk_units, q);
        v[k] = kPack ? *reinterpret_cast<const T*>(strided + off[k])
                     : *reinterpret_cast<const T*>(packed + static_cast<int64_t>(q) * W);
      }
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int q = base + k * kThreads;
      if (q < n) {
        if (kPack) *reinterpret_cast<T*>(packed + static_cast<int64_t>(q) * W) = v[k];
        else *reinterpret_cast<T*>(strided + off[k]) = v[k];
      }
    }
  }
}

// The general path lives in its own function so its index registers don't spill the fast paths.
template <bool kPack, int W>
__device__ __noinline__ void copy_chunk_general(const ViewDesc& d, uint8_t* __restrict__ buffer, int64_t first,
                                                int64_t chunk_units) {
  copy_chunk<kPack, W, kGeneral>(d, buffer, first, chunk_units);
}

template <bool kPack, int W>
__device__ __forceinline__ void copy_chunk_any(const ViewDesc& d, uint8_t* __restrict__ buffer, int64_t first,
                                               int64_t chunk_units) {
  if (d.ndim == 0) copy_chunk<kPack, W, kContiguous>(d, buffer, first, chunk_units);
  else if (d.ndim == 1) copy_chunk<kPack, W, kRows>(d, buffer, first, chunk_units);
  else copy_chunk_general<kPack, W>(d, buffer, first, chunk_units);
}

// Index of the view that owns chunk c: the largest i with begin[i] <= c (256-way search, block-uniform).
__device__ __forceinline__ int find_view(const int64_t* __restrict__ begin, int n, int64_t c) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int step = (hi - lo + kThreads - 1) / kThreads;
    const int idx = lo + static_cast<int>(threadIdx.x) * step;
    const bool le = idx < hi && begin[idx] <= c;
    const int count = __syncthreads_count(le);  // begin[lo] <= c always, so count >= 1
    lo += (count - 1) * step;
    hi = min(lo + step, hi);
  }
  return lo;
}

template <bool kPack>
__global__ void __launch_bounds__(kThreads, kMinBlocks) pack_kernel(const ViewDesc* __restrict__ descs,
                                                        const int64_t* __restrict__ begin, int n,
                                                        int64_t total_chunks, int log2_chunk,
                                                        uint8_t* __restrict__ buffer) {
  __shared__ ViewDesc d;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    const int i = find_view(begin, n, c);
    if (threadIdx.x < kDescWords) {
      reinterpret_cast<int64_t*>(&d)[threadIdx.x] = reinterpret_cast<const int64_t*>(descs + i)[threadIdx.x];
    }
    __syncthreads();
    const int64_t chunk_units = int64_t{1} << (log2_chunk - d.log2w);
    const int64_t first = (c - begin[i]) * chunk_units;
    switch (d.log2w) {
      case 4: copy_chunk_any<kPack, 16>(d, buffer, first, chunk_units); break;
      case 3: copy_chunk_any<kPack, 8>(d, buffer, first, chunk_units); break;
      case 2: copy_chunk_any<kPack, 4>(d, buffer, first, chunk_units); break;
      case 1: copy_chunk_any<kPack, 2>(d, buffer, first, chunk_units); break;
      default: copy_chunk_any<kPack, 1>(d, buffer, first, chunk_units); break;
    }
    __syncthreads();  // d is rewritten by the next chunk
  }
}

cudaError_t launch_copy_views(const ViewDesc* descs, const int64_t* begin, int n, int64_t total_chunks,
                              int log2_chunk, uint8_t* buffer, bool pack, cudaStream_t stream) {
  const int64_t cap = int64_t{1} << 30;
  const unsigned grid = static_cast<unsigned>(total_chunks < cap ? total_chunks : cap);
  // Braced statements: hipify rewrites each launch into a call and would glue it to a bare `else`.
  if (pack) {
    pack_kernel<true><<<grid, kThreads, 0, stream>>>(descs, begin, n, total_chunks, log2_chunk, buffer);
  } else {
    pack_kernel<false><<<grid, kThreads, 0, stream>>>(descs, begin, n, total_chunks, log2_chunk, buffer);
  }
  return cudaGetLastError();
}

}  // namespace nereus
