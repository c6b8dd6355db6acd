// One decode step of grouped-query attention over a key/value cache (autopolicy.nn.llama's
// layouts), float32, as an XLA FFI call: for each batch row b and key/value head h,
//   logits[g, s] = sum_d q[b, h, g, d] * keys[b, h, d, s]            for s < length
//   p[g, :]      = softmax(logits[g, :length])
//   out[b, h, g, d] = sum_{s < length} p[g, s] * values[b, h, s, d]
// q comes scaled by 1/sqrt(head_dim); positions at or past `length` (not yet written) are left
// out, as the XLA path's mask does.
//
// Why: XLA ran these as two library fusions and seven small ops per block, about 60 us a block
// at cache 256 on a 2-core Xeon VM (2.2 ms of an 11.6 ms int8 SmolLM2 decode step); this call
// took about 43 us in the same place. Each cache row is read once for all the query heads of
// its group: the key rows along the positions (head_dim outer), the value rows along head_dim
// (positions outer), in plain loops the compiler vectorizes for the CPU's widest vectors
// (AVX-512, AVX2 or baseline, chosen at run time). The exponentials are std::exp. One thread:
// the call is bound by reading the caches from the last-level cache; a first split over two
// threads (by head and half of the positions, then of head_dim, three hand-offs a call, its
// loops left at the baseline ISA) measured slower, 51-56 us against 39-43 us a block for 30
// blocks' caches in a chain.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopolicy_cpu {
namespace {

// The head's logits for groups [0, groups) into `logits` (groups x length); k is (d, stride).
template <int kChunk>
__attribute__((always_inline)) inline void head_logits(const float* q, int64_t groups, int64_t d, const float* k,
                                                       int64_t stride, int64_t length, float* logits) {
  for (int64_t s0 = 0; s0 < length; s0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, length - s0);
    for (int64_t g = 0; g < groups; ++g) {
      float acc[kChunk] = {};
      const float* qg = q + g * d;
      for (int64_t i = 0; i < d; ++i) {
        const float qi = qg[i];
        const float* row = k + i * stride + s0;
        if (n == kChunk) {
          for (int j = 0; j < kChunk; ++j) acc[j] += qi * row[j];
        } else {
          for (int64_t j = 0; j < n; ++j) acc[j] += qi * row[j];
        }
      }
      std::copy(acc, acc + n, logits + g * length + s0);
    }
  }
}

// out (groups x d) = p (groups x length) @ v (length x d), d <= kMaxD.
template <int kMaxD>
__attribute__((always_inline)) inline void head_values(const float* p, int64_t groups, int64_t length, const float* v,
                                                       int64_t d, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    float acc[kMaxD] = {};
    const float* pg = p + g * length;
    for (int64_t s = 0; s < length; ++s) {
      const float ps = pg[s];
      const float* row = v + s * d;
      for (int64_t j = 0; j < d; ++j) acc[j] += ps * row[j];
    }
    std::copy(acc, acc + d, out + g * d);
  }
}

struct Shape {
  int64_t batch, heads, groups, d, max_length;
};

__attribute__((always_inline)) inline void softmax_rows(float* logits, int64_t groups, int64_t length) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = logits + g * length;
    float top = row[0];
    for (int64_t s = 1; s < length; ++s) top = std::max(top, row[s]);
    float sum = 0.0f;
    for (int64_t s = 0; s < length; ++s) {
      row[s] = std::exp(row[s] - top);
      sum += row[s];
    }
    const float inv = 1.0f / sum;
    for (int64_t s = 0; s < length; ++s) row[s] *= inv;
  }
}

template <int kMaxD>
__attribute__((always_inline)) inline void attend(const Shape& sh, const float* q, const float* keys,
                                                  const float* values, int64_t length, float* out) {
  std::vector<float> logits(static_cast<size_t>(sh.groups * length));
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      const int64_t bh = b * sh.heads + h;
      head_logits<64>(q + bh * sh.groups * sh.d, sh.groups, sh.d, keys + bh * sh.d * sh.max_length, sh.max_length,
                      length, logits.data());
      softmax_rows(logits.data(), sh.groups, length);
      head_values<kMaxD>(logits.data(), sh.groups, length, values + bh * sh.max_length * sh.d, sh.d,
                         out + bh * sh.groups * sh.d);
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void attend_avx512(
    const Shape& sh, const float* q, const float* k, const float* v, int64_t length, float* out) {
  attend<256>(sh, q, k, v, length, out);
}
__attribute__((target("avx2,fma"))) void attend_avx2(const Shape& sh, const float* q, const float* k, const float* v,
                                                     int64_t length, float* out) {
  attend<256>(sh, q, k, v, length, out);
}
#endif
void attend_baseline(const Shape& sh, const float* q, const float* k, const float* v, int64_t length, float* out) {
  attend<256>(sh, q, k, v, length, out);
}

using AttendFn = void (*)(const Shape&, const float*, const float*, const float*, int64_t, float*);

AttendFn attend_kernel() {
#if defined(__x86_64__)
  static const AttendFn fn = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                                 ? attend_avx512
                                 : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? attend_avx2
                                                                                                   : attend_baseline);
  return fn;
#else
  return attend_baseline;
#endif
}

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                               ffi::Buffer<ffi::S32> position, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions();
  auto bad = [&](const std::string& what) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "autopolicy decode attention: " + what + "; q " + dims_of(qd) + ", keys " + dims_of(kd) +
                          ", values " + dims_of(vd));
  };
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return bad("q must be (batch, kv_heads, groups, head_dim), keys (batch, kv_heads, head_dim, length) and "
               "values (batch, kv_heads, length, head_dim)");
  const Shape sh{qd[0], qd[1], qd[2], qd[3], kd[3]};
  if (kd[0] != sh.batch || kd[1] != sh.heads || kd[2] != sh.d || vd[0] != sh.batch || vd[1] != sh.heads ||
      vd[2] != sh.max_length || vd[3] != sh.d)
    return bad("the operands' batch, heads, head_dim and length disagree");
  if (sh.d > 256) return bad("head_dim must be at most 256");
  if (position.element_count() != 1) return bad("the position must be one int32");
  const int64_t pos = position.typed_data()[0];
  if (pos < 0 || pos >= sh.max_length)
    return bad("the position " + std::to_string(pos) + " is outside the cache [0, " + std::to_string(sh.max_length) +
               ")");
  if (sh.batch * sh.heads * sh.groups * sh.d == 0) return ffi::Error::Success();
  attend_kernel()(sh, q.typed_data(), keys.typed_data(), values.typed_data(), pos + 1, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace autopolicy_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyDecodeAttention, autopolicy_cpu::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
