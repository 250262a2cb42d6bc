// Host side of the fused pack / unpack kernels: describes each view (see pack_kernels.cu), stages
// the metadata through pinned memory into device memory, launches, and binds it all to Python.
// Built by nereus_lightning/kernels/_ext.py through torch.utils.cpp_extension.load.

#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "pack_kernels.cuh"

namespace nereus {

namespace {

int64_t gcd64(int64_t a, int64_t b) {
  a = a < 0 ? -a : a;
  b = b < 0 ? -b : b;
  while (b != 0) { const int64_t t = a % b; a = b; b = t; }
  return a;
}

// Fills `d` for `view` (numel > 0); false when it needs more than kMaxDims outer dims or 2^32 rows.
bool describe(const at::Tensor& view, int64_t packed, int64_t buffer_addr, ViewDesc& d) {
  const int64_t esize = view.element_size();
  // Drop size-1 dims, then merge dim pairs that are contiguous in memory (outer stride = inner size * stride).
  std::vector<int64_t> sizes, strides;  // outermost first
  for (int64_t k = 0; k < view.dim(); ++k) {
    if (view.size(k) == 1) continue;
    const int64_t size = view.size(k), stride = view.stride(k);
    if (!sizes.empty() && strides.back() == size * stride) {
      sizes.back() *= size;
      strides.back() = stride;
    } else {
      sizes.push_back(size);
      strides.push_back(stride);
    }
  }
  int64_t row_bytes = esize;
  if (!sizes.empty() && strides.back() == 1) {
    row_bytes = sizes.back() * esize;
    sizes.pop_back();
    strides.pop_back();
  }
  if (static_cast<int>(sizes.size()) > kMaxDims) return false;
  std::memset(&d, 0, sizeof(d));
  d.strided = reinterpret_cast<int64_t>(view.data_ptr());
  d.packed = packed;
  d.ndim = static_cast<int32_t>(sizes.size());
  int64_t g = gcd64(gcd64(kAlign, buffer_addr), gcd64(row_bytes, d.strided));
  int64_t rows = 1;
  for (int k = 0; k < d.ndim; ++k) {
    const int j = d.ndim - 1 - k;  // innermost first
    d.sizes[k] = sizes[j];
    d.strides[k] = strides[j] * esize;
    g = gcd64(g, d.strides[k]);
    rows *= sizes[j];
  }
  int log2w = 0;  // g divides 16, so it is a power of two
  while ((int64_t{1} << (log2w + 1)) <= g) ++log2w;
  d.log2w = log2w;
  d.row_units = row_bytes >> log2w;
  d.rows = rows;
  d.units = rows * d.row_units;
  return d.ndim < 2 || rows <= 0xffffffffLL;  // the general path indexes rows in 32 bits
}

}  // namespace

int64_t packed_nbytes(const std::vector<at::Tensor>& views) {
  int64_t pos = 0;
  for (const auto& v : views) {
    const int64_t nbytes = v.numel() * v.element_size();
    pos += (nbytes + kAlign - 1) / kAlign * kAlign;
  }
  return pos;
}

// Copies views <-> buffer on the buffer's device and current stream. Returns false, having done
// nothing, when the kernels cannot reproduce torch's copy_ exactly (other devices, conj/neg views,
// autograd on, overlapping destinations, too many dims); the caller then uses the reference.
bool copy_views(const std::vector<at::Tensor>& views, const at::Tensor& buffer, bool pack, int64_t chunk_bytes) {
  if (!buffer.is_cuda() || buffer.scalar_type() != at::kByte || buffer.dim() != 1 || !buffer.is_contiguous()) {
    return false;
  }
  TORCH_CHECK(chunk_bytes >= 1024 && (chunk_bytes & (chunk_bytes - 1)) == 0 && chunk_bytes <= (int64_t{1} << 30),
              "chunk_bytes must be a power of two in [1 KiB, 1 GiB], got ", chunk_bytes);
  const bool grad = c10::GradMode::is_enabled();
  for (const auto& v : views) {
    if (v.device() != buffer.device() || v.layout() != at::kStrided || v.is_conj() || v.is_neg()) return false;
    if (grad && v.requires_grad()) return false;
    // torch's copy_ refuses destinations whose elements share memory; leave that error to it.
    if (!pack && at::has_internal_overlap(v) == at::MemOverlap::Yes) return false;
  }
  int log2_chunk = 0;
  while ((int64_t{1} << log2_chunk) < chunk_bytes) ++log2_chunk;

  std::vector<ViewDesc> descs;
  std::vector<int64_t> begin;
  descs.reserve(views.size());
  begin.reserve(views.size() + 1);
  const int64_t buffer_addr = reinterpret_cast<int64_t>(buffer.data_ptr());
  int64_t pos = 0, chunks = 0;
  for (const auto& v : views) {
    const int64_t nbytes = v.numel() * v.element_size();
    if (nbytes > 0) {
      ViewDesc d;
      if (!describe(v, pos, buffer_addr, d)) return false;
      descs.push_back(d);
      begin.push_back(chunks);
      chunks += (nbytes + chunk_bytes - 1) / chunk_bytes;
    }
    pos += (nbytes + kAlign - 1) / kAlign * kAlign;
  }
  if (descs.empty()) return true;
  TORCH_CHECK(descs.size() < (size_t{1} << 30), "too many views: ", descs.size());
  begin.push_back(chunks);

  // One pinned staging block [descs | begin]; the caching host allocator keeps it alive until the
  // asynchronous copy has run.
  const int64_t desc_bytes = static_cast<int64_t>(descs.size() * sizeof(ViewDesc));
  const int64_t begin_bytes = static_cast<int64_t>(begin.size() * sizeof(int64_t));
  at::Tensor host = at::empty({desc_bytes + begin_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr<uint8_t>(), descs.data(), desc_bytes);
  std::memcpy(host.data_ptr<uint8_t>() + desc_bytes, begin.data(), begin_bytes);

  c10::cuda::CUDAGuard guard(buffer.device());
  at::Tensor meta = host.to(buffer.device(), at::kByte, /*non_blocking=*/true);
  const auto* d_descs = reinterpret_cast<const ViewDesc*>(meta.data_ptr<uint8_t>());
  const auto* d_begin = reinterpret_cast<const int64_t*>(meta.data_ptr<uint8_t>() + desc_bytes);
  C10_CUDA_CHECK(launch_copy_views(d_descs, d_begin, static_cast<int>(descs.size()), chunks, log2_chunk,
                                   buffer.data_ptr<uint8_t>(), pack, c10::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace nereus

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "nereus-lightning fused multi-tensor pack/unpack kernels";
  m.def("packed_nbytes", &nereus::packed_nbytes, "Size in bytes of the packed buffer for these views",
        pybind11::arg("views"));
  m.def("copy_views", &nereus::copy_views,
        "pack=True: views -> buffer; pack=False: buffer -> views. False if not handled (caller uses the reference)",
        pybind11::arg("views"), pybind11::arg("buffer"), pybind11::arg("pack"), pybind11::arg("chunk_bytes"));
}
