// cuBLASLt GEMMs that XLA does not issue itself, as XLA FFI handlers (host code only).
//
// * MtjaxCublasLtBlockFp8Gemm: block-scaled FP8 (cuBLAS >= 12.9, Hopper).
//   out [m, n] = a [m, k] . b [n, k]^T, both FP8 and contracted over their last axis, with one float32
//   dequantization scale per 1x128 tile of `a` (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) and, for `b`,
//   per 128x128 block (BLK128x128_32F) or per 1x128 tile (VEC128_32F). Scale layouts (the Python
//   wrapper, mtjax.kernels.cublaslt, writes them):
//     a_scale: [ceil(k/128), m] float32 (rows contiguous per K block);
//     b_scale: 1x128 tiles as a_scale's ([ceil(k/128), n]); 128x128 blocks as [ceil(n/128), kb4],
//              kb4 = ceil(k/128) rounded up to 4 (K blocks contiguous per N block).
//   cuBLASLt wants m and n multiples of 4 and k of 16 (the wrapper pads m and n to 16, k to whole
//   blocks); the handler checks these shapes, since a wrong one would read out of bounds.
//
// * MtjaxCublasLtGroupedGemm: the grouped GEMM of a mixture of experts. lhs [M, K] has its rows
//   sorted by group; out[rows of g] = lhs[rows of g] . rhs[g] with rhs [G, K, N], or rhs[g]^T with rhs
//   [G, N, K] (transpose_rhs: the layout FP8 operands need), times group_scale[g] when has_scale (FP8:
//   the operands' dequantization scales). Rows past sum(group_sizes) are zeros.
// * MtjaxCublasLtGroupedGemmWgrad: its weight gradient, out[g] [K, N] = lhs[rows of g]^T . grad[rows of g].
//
// Both grouped handlers copy group_sizes (and group_scale, which becomes each GEMM's alpha) to the host
// (one stream synchronization per call) and issue one cuBLASLt GEMM per non-empty group. FP8 GEMMs take
// rows in multiples of 16: a group's last rows past one go through a zero-padded 16-row copy.
//
// XLA's row-major [r, c] array is cuBLASLt's column-major [c, r]: every GEMM below is written in
// cuBLASLt's column-major terms, D = op(A) . op(B).

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <cublasLt.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr uintptr_t kWorkspaceAlignment = 256;  // cuBLASLt's requirement; XLA's allocator promises 16

ffi::Error CublasError(const char* what, cublasStatus_t status) {
  return ffi::Error::Internal(std::string("mtjax cuBLASLt GEMM: ") + what + ": " + cublasLtGetStatusString(status));
}

#define MTJAX_RETURN_IF_ERROR(what, expr)                                    \
  do {                                                                       \
    cublasStatus_t status_ = (expr);                                         \
    if (status_ != CUBLAS_STATUS_SUCCESS) return CublasError(what, status_); \
  } while (0)

bool Fp8Type(ffi::DataType type, cudaDataType_t* out) {
  switch (type) {
    case ffi::DataType::F8E4M3FN: *out = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: *out = CUDA_R_8F_E5M2; return true;
    default: return false;
  }
}

bool OutType(ffi::DataType type, cudaDataType_t* out) {
  switch (type) {
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return true;
    case ffi::DataType::F16: *out = CUDA_R_16F; return true;
    case ffi::DataType::F32: *out = CUDA_R_32F; return true;
    default: return false;
  }
}

// Operand types of the grouped GEMMs: FP8, or 16-bit floats.
bool OperandType(ffi::DataType type, cudaDataType_t* out) {
  if (Fp8Type(type, out)) return true;
  switch (type) {
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return true;
    case ffi::DataType::F16: *out = CUDA_R_16F; return true;
    default: return false;
  }
}

// RAII owners of the cuBLASLt descriptors of one GEMM.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// One column-major cuBLASLt GEMM: D [m, n] = op(A) [m, k] . op(B) [k, n], float32 accumulation.
struct Gemm {
  cudaDataType_t a_type, b_type, d_type;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  int64_t m, n, k, lda, ldb, ldd;
  int32_t a_scale_mode = -1, b_scale_mode = -1;  // -1: one scale for the operand (cuBLASLt's default)
  const void* a_scale = nullptr;                 // device float32 dequantization scales (FP8 only)
  const void* b_scale = nullptr;
  float alpha = 1.0f;                            // D = alpha * op(A) . op(B)
  int32_t fast_accum = 0;  // FP8: accumulate in the tensor core's precision without promotion
  // The algorithm cache files a GEMM under its shape, with the dimension that varies from call to
  // call (a group's rows) rounded up to a power of two: the algorithm found for the first such shape
  // serves the others (and, should cuBLASLt refuse it, the exact shape's is looked up).
  int varying_dimension = -1;  // 0: m, 1: n, 2: k
};

// The largest power of two up to 256 that divides the address.
uint32_t Alignment(const void* pointer) {
  uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment) alignment /= 2;
  return alignment;
}

int64_t PowerOfTwoAtLeast(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

using AlgoKey = std::array<int64_t, 18>;

std::mutex& Mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<AlgoKey, cublasLtMatmulAlgo_t>& Algorithms() {
  static auto* algorithms = new std::map<AlgoKey, cublasLtMatmulAlgo_t>();
  return *algorithms;
}

ffi::Error Handle(cublasLtHandle_t* handle) {
  static cublasLtHandle_t shared = nullptr;
  static cublasStatus_t created = cublasLtCreate(&shared);
  if (created != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtCreate", created);
  *handle = shared;
  return ffi::Error::Success();
}

// `bytes` of XLA's scratch memory starting on a 256-byte boundary (cuBLASLt's workspace alignment).
ffi::Error Scratch(ffi::ScratchAllocator& scratch, size_t bytes, void** memory) {
  std::optional<void*> allocated = scratch.Allocate(bytes + kWorkspaceAlignment);
  if (!allocated.has_value()) return ffi::Error::Internal("mtjax cuBLASLt GEMM: no scratch memory");
  const uintptr_t address = reinterpret_cast<uintptr_t>(allocated.value());
  *memory = reinterpret_cast<void*>((address + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment);
  return ffi::Error::Success();
}

ffi::Error Workspace(ffi::ScratchAllocator& scratch, void** workspace) {
  return Scratch(scratch, kWorkspaceBytes, workspace);
}

// cuBLASLt's heuristic's best algorithm for the GEMM of `desc`.
ffi::Error Heuristic(cublasLtHandle_t handle, Descriptors& desc, const uint32_t (&alignments)[3],
                     cublasLtMatmulAlgo_t* algo) {
  if (desc.preference == nullptr) {
    MTJAX_RETURN_IF_ERROR("preference", cublasLtMatmulPreferenceCreate(&desc.preference));
  }
  const size_t workspace_bytes = kWorkspaceBytes;
  MTJAX_RETURN_IF_ERROR("workspace preference", cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  // The heuristic assumes 256-byte aligned operands unless told what they are.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> preferences[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignments[0]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignments[1]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignments[2]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignments[2]}};
  for (const auto& [attribute, bytes] : preferences) {
    MTJAX_RETURN_IF_ERROR("alignment preference",
                          cublasLtMatmulPreferenceSetAttribute(desc.preference, attribute, &bytes, sizeof(bytes)));
  }
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  MTJAX_RETURN_IF_ERROR("heuristic", cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d,
                                                                      desc.preference, 1, &result, &found));
  if (found == 0) return ffi::Error::Internal("mtjax cuBLASLt GEMM: cuBLASLt has no algorithm for this GEMM");
  *algo = result.algo;
  return ffi::Error::Success();
}

// A CUDA driver function, looked up in the driver library the process already has loaded (so the
// library links cuBLASLt only); the first name found of `names`, or nullptr.
template <typename Function>
Function DriverFunction(std::initializer_list<const char*> names) {
  static void* library = [] {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return handle != nullptr ? handle : dlopen("libcuda.so.1", RTLD_NOW);
  }();
  if (library == nullptr) return nullptr;
  for (const char* name : names) {
    if (void* symbol = dlsym(library, name)) return reinterpret_cast<Function>(symbol);
  }
  return nullptr;
}

ffi::Error Run(cublasLtHandle_t handle, const Gemm& g, const void* a, const void* b, void* d, void* workspace,
               cudaStream_t stream) {
  Descriptors desc;
  MTJAX_RETURN_IF_ERROR("matmul descriptor", cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MTJAX_RETURN_IF_ERROR("TRANSA", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &g.trans_a,
                                                                  sizeof(g.trans_a)));
  MTJAX_RETURN_IF_ERROR("TRANSB", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &g.trans_b,
                                                                  sizeof(g.trans_b)));
  if (g.a_scale_mode >= 0) {
    MTJAX_RETURN_IF_ERROR("A scale mode", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                                          &g.a_scale_mode, sizeof(g.a_scale_mode)));
  }
  if (g.b_scale_mode >= 0) {
    MTJAX_RETURN_IF_ERROR("B scale mode", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                                          &g.b_scale_mode, sizeof(g.b_scale_mode)));
  }
  if (g.a_scale != nullptr) {
    MTJAX_RETURN_IF_ERROR("A scale", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                                     &g.a_scale, sizeof(g.a_scale)));
  }
  if (g.b_scale != nullptr) {
    MTJAX_RETURN_IF_ERROR("B scale", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                                     &g.b_scale, sizeof(g.b_scale)));
  }
  if (g.fast_accum) {
    const int8_t fast = 1;
    MTJAX_RETURN_IF_ERROR("fast accumulation", cublasLtMatmulDescSetAttribute(
        desc.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  const bool a_kept = g.trans_a == CUBLAS_OP_N, b_kept = g.trans_b == CUBLAS_OP_N;
  MTJAX_RETURN_IF_ERROR("A layout", cublasLtMatrixLayoutCreate(&desc.a, g.a_type, a_kept ? g.m : g.k,
                                                                 a_kept ? g.k : g.m, g.lda));
  MTJAX_RETURN_IF_ERROR("B layout", cublasLtMatrixLayoutCreate(&desc.b, g.b_type, b_kept ? g.k : g.n,
                                                                 b_kept ? g.n : g.k, g.ldb));
  MTJAX_RETURN_IF_ERROR("D layout", cublasLtMatrixLayoutCreate(&desc.d, g.d_type, g.m, g.n, g.ldd));

  const uint32_t alignments[3] = {Alignment(a), Alignment(b), Alignment(d)};
  int64_t dims[3] = {g.m, g.n, g.k};
  if (g.varying_dimension >= 0) dims[g.varying_dimension] = PowerOfTwoAtLeast(dims[g.varying_dimension]);
  const AlgoKey key{dims[0], dims[1], dims[2], g.lda, g.ldb, g.ldd, g.a_type, g.b_type, g.d_type, g.trans_a,
                    g.trans_b, g.a_scale_mode, g.b_scale_mode, g.a_scale != nullptr, g.fast_accum,
                    alignments[0], alignments[1], alignments[2]};
  cublasLtMatmulAlgo_t algo;
  bool cached;
  {
    std::lock_guard<std::mutex> lock(Mutex());
    auto found = Algorithms().find(key);
    cached = found != Algorithms().end();
    if (cached) algo = found->second;
  }
  if (!cached) {
    if (ffi::Error error = Heuristic(handle, desc, alignments, &algo); error.failure()) return error;
    std::lock_guard<std::mutex> lock(Mutex());
    Algorithms().emplace(key, algo);
  }
  const float beta = 0.0f;
  auto matmul = [&] {
    return cublasLtMatmul(handle, desc.op, &g.alpha, a, desc.a, b, desc.b, &beta, d, desc.d, d, desc.d, &algo,
                          workspace, kWorkspaceBytes, stream);
  };
  cublasStatus_t status = matmul();
  if (status != CUBLAS_STATUS_SUCCESS && cached && g.varying_dimension >= 0) {
    // The algorithm of this shape's bucket does not take this shape: ask for the shape's own.
    if (ffi::Error error = Heuristic(handle, desc, alignments, &algo); error.failure()) return error;
    status = matmul();
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    const std::string what = "matmul of m=" + std::to_string(g.m) + ", n=" + std::to_string(g.n) +
                             ", k=" + std::to_string(g.k);
    return CublasError(what.c_str(), status);
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// Block-scaled FP8
// ------------------------------------------------------------------------------------------------

ffi::Error BlockFp8Gemm(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer a,
                        ffi::Buffer<ffi::F32> a_scale, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scale,
                        ffi::Result<ffi::AnyBuffer> out, int32_t b_blocks) {
  auto a_dims = a.dimensions();
  auto b_dims = b.dimensions();
  if (a_dims.size() != 2 || b_dims.size() != 2 || a_dims[1] != b_dims[1]) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt block FP8 GEMM: expected a [m, k] and b [n, k]");
  }
  const int64_t m = a_dims[0], k = a_dims[1], n = b_dims[0];
  const int64_t kb = (k + 127) / 128, kb4 = (kb + 3) / 4 * 4;
  auto as_dims = a_scale.dimensions();
  auto bs_dims = b_scale.dimensions();
  const bool shapes_ok =
      m % 4 == 0 && n % 4 == 0 && k % 16 == 0 && as_dims.size() == 2 && as_dims[0] == kb && as_dims[1] == m &&
      bs_dims.size() == 2 &&
      (b_blocks ? (bs_dims[0] == (n + 127) / 128 && bs_dims[1] == kb4) : (bs_dims[0] == kb && bs_dims[1] == n));
  if (!shapes_ok) {
    return ffi::Error::InvalidArgument(
        "mtjax cuBLASLt block FP8 GEMM: expected m and n multiples of 4, k of 16, a_scale [ceil(k/128), m] and "
        "b_scale [ceil(k/128), n] (tiles) or [ceil(n/128), ceil(k/128) rounded up to 4] (blocks)");
  }
  Gemm g;
  if (!Fp8Type(a.element_type(), &g.b_type) || !Fp8Type(b.element_type(), &g.a_type)) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt block FP8 GEMM: a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (!OutType(out->element_type(), &g.d_type)) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt block FP8 GEMM: out must be bfloat16, float16 or float32");
  }
  // out^T [n, m] = b . a^T: cuBLASLt's A is our b (k x n, transposed), its B our a (k x m), the TN
  // form its FP8 GEMMs take.
  g.trans_a = CUBLAS_OP_T;
  g.m = n, g.n = m, g.k = k, g.lda = k, g.ldb = k, g.ldd = n;
  g.a_scale_mode = b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  g.b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  g.a_scale = b_scale.typed_data();
  g.b_scale = a_scale.typed_data();
  cublasLtHandle_t handle;
  if (ffi::Error error = Handle(&handle); error.failure()) return error;
  void* workspace;
  if (ffi::Error error = Workspace(scratch, &workspace); error.failure()) return error;
  return Run(handle, g, b.untyped_data(), a.untyped_data(), out->untyped_data(), workspace, stream);
}

// ------------------------------------------------------------------------------------------------
// Grouped GEMMs
// ------------------------------------------------------------------------------------------------

// The CUDA driver calls the grouped GEMMs need (read group sizes and scales, copy and zero rows).
struct Driver {
  using MemcpyDtoHAsync = int (*)(void*, unsigned long long, size_t, void*);
  using MemcpyDtoDAsync = int (*)(unsigned long long, unsigned long long, size_t, void*);
  using MemsetD8Async = int (*)(unsigned long long, unsigned char, size_t, void*);
  using StreamSynchronize = int (*)(void*);
  MemcpyDtoHAsync memcpy_dtoh = nullptr;
  MemcpyDtoDAsync memcpy_dtod = nullptr;
  MemsetD8Async memset_d8 = nullptr;
  StreamSynchronize synchronize = nullptr;
};

const Driver* LoadDriver() {
  static const Driver* driver = []() -> const Driver* {
    auto* found = new Driver;
    found->memcpy_dtoh = DriverFunction<Driver::MemcpyDtoHAsync>({"cuMemcpyDtoHAsync_v2"});
    found->memcpy_dtod = DriverFunction<Driver::MemcpyDtoDAsync>({"cuMemcpyDtoDAsync_v2"});
    found->memset_d8 = DriverFunction<Driver::MemsetD8Async>({"cuMemsetD8Async"});
    found->synchronize = DriverFunction<Driver::StreamSynchronize>({"cuStreamSynchronize"});
    if (!found->memcpy_dtoh || !found->memcpy_dtod || !found->memset_d8 || !found->synchronize) return nullptr;
    return found;
  }();
  return driver;
}

unsigned long long Address(const void* pointer) { return reinterpret_cast<unsigned long long>(pointer); }

ffi::Error Zero(const Driver& driver, void* pointer, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return ffi::Error::Success();
  if (driver.memset_d8(Address(pointer), 0, bytes, stream) != 0) {
    return ffi::Error::Internal("mtjax cuBLASLt grouped GEMM: cuMemsetD8Async failed");
  }
  return ffi::Error::Success();
}

ffi::Error Copy(const Driver& driver, void* to, const void* from, size_t bytes, cudaStream_t stream) {
  if (driver.memcpy_dtod(Address(to), Address(from), bytes, stream) != 0) {
    return ffi::Error::Internal("mtjax cuBLASLt grouped GEMM: cuMemcpyDtoDAsync failed");
  }
  return ffi::Error::Success();
}

// Copies group_sizes (and group_scale, when given) to the host.
ffi::Error ReadToHost(const Driver& driver, ffi::Buffer<ffi::S32>& group_sizes, const float* group_scale,
                      int64_t rows, cudaStream_t stream, std::vector<int32_t>* sizes, std::vector<float>* scales) {
  sizes->resize(group_sizes.element_count());
  scales->assign(sizes->size(), 1.0f);
  if (sizes->empty()) return ffi::Error::Success();
  bool failed = driver.memcpy_dtoh(sizes->data(), Address(group_sizes.typed_data()),
                                   sizes->size() * sizeof(int32_t), stream) != 0;
  if (group_scale != nullptr) {
    failed = failed || driver.memcpy_dtoh(scales->data(), Address(group_scale), scales->size() * sizeof(float),
                                          stream) != 0;
  }
  if (failed || driver.synchronize(stream) != 0) {
    return ffi::Error::Internal("mtjax cuBLASLt grouped GEMM: reading group_sizes failed");
  }
  // Sizes past the rows there are are clipped, as the other implementations do (the op leaves the
  // result of such sizes unspecified); negative ones are empty groups.
  int64_t start = 0;
  for (int32_t& size : *sizes) {
    size = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(size, rows - start)));
    start += size;
  }
  return ffi::Error::Success();
}

// What both grouped handlers need before their GEMMs.
struct GroupedCall {
  cublasLtHandle_t handle;
  void* workspace;
  const Driver* driver;
  std::vector<int32_t> sizes;  // on the host, clipped to the rows there are
  std::vector<float> scales;   // on the host (ones without group_scale)
};

// Sets `gemm`'s types (cuBLASLt's A and B are the `a` and `b` given here) and prepares `call`.
ffi::Error Prepare(ffi::ScratchAllocator& scratch, cudaStream_t stream, ffi::DataType a, ffi::DataType b,
                   ffi::DataType out, ffi::Buffer<ffi::S32>& group_sizes, const float* group_scale, int64_t rows,
                   Gemm* gemm, GroupedCall* call) {
  if (!OperandType(a, &gemm->a_type) || !OperandType(b, &gemm->b_type) || !OutType(out, &gemm->d_type)) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt grouped GEMM: unsupported dtypes");
  }
  call->driver = LoadDriver();
  if (call->driver == nullptr) {
    return ffi::Error::Internal("mtjax cuBLASLt grouped GEMM: no CUDA driver (libcuda.so.1)");
  }
  if (ffi::Error error = Handle(&call->handle); error.failure()) return error;
  if (ffi::Error error = Workspace(scratch, &call->workspace); error.failure()) return error;
  return ReadToHost(*call->driver, group_sizes, group_scale, rows, stream, &call->sizes, &call->scales);
}

// cuBLASLt's FP8 GEMMs take row counts in multiples of this: a group's last rows past a multiple go
// through a padded copy.
constexpr int64_t kFp8Rows = 16;

ffi::Error GroupedGemm(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::F32> group_scale,
                       ffi::Result<ffi::AnyBuffer> out, int32_t transpose_rhs, int32_t has_scale,
                       int32_t fast_accum) {
  auto l = lhs.dimensions();
  auto r = rhs.dimensions();
  auto o = out->dimensions();
  const int64_t groups = static_cast<int64_t>(group_sizes.element_count());
  if (l.size() != 2 || r.size() != 3 || o.size() != 2 || r[0] != groups ||
      static_cast<int64_t>(group_scale.element_count()) != groups) {
    return ffi::Error::InvalidArgument(
        "mtjax cuBLASLt grouped GEMM: expected lhs [M, K], rhs [G, K, N] or [G, N, K], group_sizes and "
        "group_scale [G], out [M, N]");
  }
  const int64_t m = l[0], k = l[1], n = transpose_rhs ? r[1] : r[2];
  if ((transpose_rhs ? r[2] : r[1]) != k || o[0] != m || o[1] != n || k % 16 || n % 16) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt grouped GEMM: shapes disagree, or K or N not a multiple of 16");
  }
  Gemm g;
  GroupedCall call;
  if (ffi::Error error = Prepare(scratch, stream, rhs.element_type(), lhs.element_type(), out->element_type(),
                                 group_sizes, has_scale ? group_scale.typed_data() : nullptr, m, &g, &call);
      error.failure()) {
    return error;
  }
  // out[rows of g]^T [n, rows] = op(rhs[g]) [n, k] . lhs[rows of g]^T [k, rows].
  g.trans_a = transpose_rhs ? CUBLAS_OP_T : CUBLAS_OP_N;
  g.m = n, g.k = k, g.lda = transpose_rhs ? k : n, g.ldb = k, g.ldd = n;
  g.fast_accum = fast_accum;
  g.varying_dimension = 1;
  const size_t lhs_bytes = ffi::ByteWidth(lhs.element_type()), rhs_bytes = ffi::ByteWidth(rhs.element_type()),
               out_bytes = ffi::ByteWidth(out->element_type());
  const bool fp8 = lhs_bytes == 1;
  char* padded_lhs = nullptr;  // kFp8Rows rows of lhs and of out, for an FP8 group's last rows
  char* padded_out = nullptr;
  if (fp8) {
    void* memory;
    if (ffi::Error error = Scratch(scratch, kFp8Rows * (k * lhs_bytes + n * out_bytes), &memory); error.failure()) {
      return error;
    }
    padded_lhs = static_cast<char*>(memory);
    padded_out = padded_lhs + kFp8Rows * k * lhs_bytes;
  }
  const auto* lhs_data = static_cast<const char*>(lhs.untyped_data());
  const auto* rhs_data = static_cast<const char*>(rhs.untyped_data());
  auto* out_data = static_cast<char*>(out->untyped_data());
  int64_t start = 0;
  for (int64_t group = 0; group < groups; ++group) {
    const int64_t rows = call.sizes[group];
    const int64_t whole = fp8 ? rows / kFp8Rows * kFp8Rows : rows, rest = rows - whole;
    const char* weights = rhs_data + group * n * k * rhs_bytes;
    g.alpha = call.scales[group];
    if (whole > 0) {
      g.n = whole;
      if (ffi::Error error = Run(call.handle, g, weights, lhs_data + start * k * lhs_bytes,
                                 out_data + start * n * out_bytes, call.workspace, stream);
          error.failure()) {
        return error;
      }
    }
    if (rest > 0) {  // the last rows, zero-padded to kFp8Rows
      g.n = kFp8Rows;
      const int64_t first = start + whole;
      ffi::Error error = Zero(*call.driver, padded_lhs, kFp8Rows * k * lhs_bytes, stream);
      if (!error.failure()) {
        error = Copy(*call.driver, padded_lhs, lhs_data + first * k * lhs_bytes, rest * k * lhs_bytes, stream);
      }
      if (!error.failure()) error = Run(call.handle, g, weights, padded_lhs, padded_out, call.workspace, stream);
      if (!error.failure()) {
        error = Copy(*call.driver, out_data + first * n * out_bytes, padded_out, rest * n * out_bytes, stream);
      }
      if (error.failure()) return error;
    }
    start += rows;
  }
  return Zero(*call.driver, out_data + start * n * out_bytes, (m - start) * n * out_bytes, stream);
}

ffi::Error GroupedGemmWgrad(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer lhs,
                            ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  auto l = lhs.dimensions();
  auto d = grad.dimensions();
  auto o = out->dimensions();
  const int64_t groups = static_cast<int64_t>(group_sizes.element_count());
  if (l.size() != 2 || d.size() != 2 || o.size() != 3 || l[0] != d[0] || o[0] != groups || o[1] != l[1] ||
      o[2] != d[1] || l[1] % 16 || d[1] % 16) {
    return ffi::Error::InvalidArgument(
        "mtjax cuBLASLt grouped GEMM weight gradient: expected lhs [M, K], grad [M, N], out [G, K, N], K and N "
        "multiples of 16");
  }
  const int64_t m = l[0], k = l[1], n = d[1];
  Gemm g;
  GroupedCall call;
  if (ffi::Error error = Prepare(scratch, stream, grad.element_type(), lhs.element_type(), out->element_type(),
                                 group_sizes, nullptr, m, &g, &call);
      error.failure()) {
    return error;
  }
  // out[g]^T [n, k] = grad[rows of g]^T [n, rows] . lhs[rows of g] [rows, k].
  g.trans_b = CUBLAS_OP_T;
  g.m = n, g.n = k, g.lda = n, g.ldb = k, g.ldd = n;
  g.varying_dimension = 2;
  const size_t lhs_bytes = ffi::ByteWidth(lhs.element_type()), grad_bytes = ffi::ByteWidth(grad.element_type()),
               out_bytes = ffi::ByteWidth(out->element_type());
  const auto* lhs_data = static_cast<const char*>(lhs.untyped_data());
  const auto* grad_data = static_cast<const char*>(grad.untyped_data());
  auto* out_data = static_cast<char*>(out->untyped_data());
  int64_t start = 0;
  for (int64_t group = 0; group < groups; ++group) {
    const int64_t rows = call.sizes[group];
    char* group_out = out_data + group * k * n * out_bytes;
    g.k = rows;
    ffi::Error error = rows == 0 ? Zero(*call.driver, group_out, k * n * out_bytes, stream)
                                 : Run(call.handle, g, grad_data + start * n * grad_bytes,
                                       lhs_data + start * k * lhs_bytes, group_out, call.workspace, stream);
    if (error.failure()) return error;
    start += rows;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtjaxCublasLtBlockFp8Gemm, BlockFp8Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("b_blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtjaxCublasLtGroupedGemm, GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("transpose_rhs")
                                  .Attr<int32_t>("has_scale")
                                  .Attr<int32_t>("fast_accum"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtjaxCublasLtGroupedGemmWgrad, GroupedGemmWgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

// For the build check: the cuBLASLt version this library runs against.
extern "C" size_t MtjaxCublasLtVersion() { return cublasLtGetVersion(); }
