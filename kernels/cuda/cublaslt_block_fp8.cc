// Block-scaled FP8 GEMM on cuBLASLt (cuBLAS >= 12.9, Hopper): an XLA FFI handler.
//
// out [m, n] = a [m, k] . b [n, k]^T, both FP8 and contracted over their last axis, with one float32
// dequantization scale per 1x128 tile of `a` (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) and, for `b`,
// per 128x128 block (BLK128x128_32F) or per 1x128 tile (VEC128_32F). cuBLASLt is column-major: the
// row-major `out` is its column-major transpose, so cuBLASLt computes out^T [n, m] = b . a^T with its
// "A" operand our `b` (transposed, k x n) and its "B" our `a` (k x m), the TN form its FP8 GEMMs take.
//
// Scale layouts (the Python wrapper, mtjax.kernels.cublaslt, writes them):
//   a_scale: [ceil(k/128), m] float32 (rows contiguous per K block);
//   b_scale: 1x128 tiles as a_scale's ([ceil(k/128), n]); 128x128 blocks as [ceil(n/128), kb4],
//            kb4 = ceil(k/128) rounded up to 4 (K blocks contiguous per N block).
// cuBLASLt wants m and n multiples of 4 and k of 16 (the wrapper pads m and n to 16, k to whole
// blocks); the handler checks these shapes, since a wrong one would read out of bounds.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <mutex>
#include <string>
#include <tuple>

#include <cublasLt.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr uintptr_t kWorkspaceAlignment = 256;  // cuBLASLt's requirement; XLA's allocator promises 16

ffi::Error CublasError(const char* what, cublasStatus_t status) {
  return ffi::Error::Internal(std::string("mtjax cuBLASLt block FP8 GEMM: ") + what + ": " +
                              cublasLtGetStatusString(status));
}

#define MTJAX_RETURN_IF_ERROR(what, expr)                 \
  do {                                                    \
    cublasStatus_t status_ = (expr);                      \
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

// RAII owners of the cuBLASLt descriptors of one call.
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

// Shape, types, scale mode and the operands' alignments (the heuristic's choice may depend on them).
using AlgoKey = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, uint32_t, uint32_t, uint32_t>;

// The largest power of two up to 256 that divides the address.
uint32_t Alignment(const void* pointer) {
  uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment) alignment /= 2;
  return alignment;
}

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
  cudaDataType_t a_type, b_type, d_type;
  if (!Fp8Type(a.element_type(), &a_type) || !Fp8Type(b.element_type(), &b_type)) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt block FP8 GEMM: a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (!OutType(out->element_type(), &d_type)) {
    return ffi::Error::InvalidArgument("mtjax cuBLASLt block FP8 GEMM: out must be bfloat16, float16 or float32");
  }
  cublasLtHandle_t handle;
  if (ffi::Error error = Handle(&handle); error.failure()) return error;
  std::optional<void*> scratch_memory = scratch.Allocate(kWorkspaceBytes + kWorkspaceAlignment);
  if (!scratch_memory.has_value()) {
    return ffi::Error::Internal("mtjax cuBLASLt block FP8 GEMM: no workspace");
  }
  const uintptr_t scratch_address = reinterpret_cast<uintptr_t>(scratch_memory.value());
  void* workspace = reinterpret_cast<void*>((scratch_address + kWorkspaceAlignment - 1) / kWorkspaceAlignment *
                                            kWorkspaceAlignment);

  Descriptors desc;
  MTJAX_RETURN_IF_ERROR("matmul descriptor", cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  MTJAX_RETURN_IF_ERROR("TRANSA", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                                  sizeof(transpose)));
  MTJAX_RETURN_IF_ERROR("TRANSB", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep,
                                                                  sizeof(keep)));
  // cuBLASLt's A is our b, its B our a.
  const int32_t lt_a_mode = b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                     : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t lt_b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void* lt_a_scale = b_scale.typed_data();
  const void* lt_b_scale = a_scale.typed_data();
  MTJAX_RETURN_IF_ERROR("A scale mode", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                                        &lt_a_mode, sizeof(lt_a_mode)));
  MTJAX_RETURN_IF_ERROR("B scale mode", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                                        &lt_b_mode, sizeof(lt_b_mode)));
  MTJAX_RETURN_IF_ERROR("A scale", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                                   &lt_a_scale, sizeof(lt_a_scale)));
  MTJAX_RETURN_IF_ERROR("B scale", cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                                   &lt_b_scale, sizeof(lt_b_scale)));
  MTJAX_RETURN_IF_ERROR("A layout", cublasLtMatrixLayoutCreate(&desc.a, b_type, k, n, k));
  MTJAX_RETURN_IF_ERROR("B layout", cublasLtMatrixLayoutCreate(&desc.b, a_type, k, m, k));
  MTJAX_RETURN_IF_ERROR("D layout", cublasLtMatrixLayoutCreate(&desc.d, d_type, n, m, n));

  void* d = out->untyped_data();
  const uint32_t lt_a_alignment = Alignment(b.untyped_data()), lt_b_alignment = Alignment(a.untyped_data()),
                 d_alignment = Alignment(d);
  const AlgoKey key{m, n, k, static_cast<int>(a_type), static_cast<int>(b_type), static_cast<int>(d_type),
                    b_blocks, lt_a_alignment, lt_b_alignment, d_alignment};
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(Mutex());
    auto found = Algorithms().find(key);
    if (found != Algorithms().end()) {
      algo = found->second;
    } else {
      MTJAX_RETURN_IF_ERROR("preference", cublasLtMatmulPreferenceCreate(&desc.preference));
      const size_t workspace_bytes = kWorkspaceBytes;
      MTJAX_RETURN_IF_ERROR("workspace preference", cublasLtMatmulPreferenceSetAttribute(
          desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
      // The heuristic assumes 256-byte aligned operands unless told what they are.
      const std::tuple<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, lt_a_alignment},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, lt_b_alignment},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d_alignment},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d_alignment}};
      for (const auto& [attribute, bytes] : alignments) {
        MTJAX_RETURN_IF_ERROR("alignment preference",
                              cublasLtMatmulPreferenceSetAttribute(desc.preference, attribute, &bytes, sizeof(bytes)));
      }
      cublasLtMatmulHeuristicResult_t heuristic;
      int found_count = 0;
      MTJAX_RETURN_IF_ERROR("heuristic", cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d,
                                                                          desc.d, desc.preference, 1, &heuristic,
                                                                          &found_count));
      if (found_count == 0) {
        return ffi::Error::Internal("mtjax cuBLASLt block FP8 GEMM: cuBLASLt has no algorithm for this GEMM");
      }
      algo = heuristic.algo;
      Algorithms().emplace(key, algo);
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  MTJAX_RETURN_IF_ERROR("matmul", cublasLtMatmul(handle, desc.op, &alpha, b.untyped_data(), desc.a,
                                                  a.untyped_data(), desc.b, &beta, d, desc.d, d, desc.d, &algo,
                                                  workspace, kWorkspaceBytes, stream));
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

// For the build check: the cuBLASLt version this library runs against.
extern "C" size_t MtjaxCublasLtVersion() { return cublasLtGetVersion(); }
