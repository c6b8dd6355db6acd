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
// took about 43 us in the same place. Each key row is read once for every query head of its
// group (from L1 across heads where registers run short), each value row once for two or three
// heads, in vectors of GCC's vector extensions for the CPU's widest registers (AVX-512, AVX2 or
// the baseline's, as the SIMD path in use: set_path forces the baseline too), and the
// exponentials vectorized (Cephes' expf; std::exp per element had been most of the time). On a
// 2-core Zen 4 EPYC, a SmolLM2 block at cache 256 (30 blocks' caches in a chain) went from 42 to
// 16 us (AVX-512), 45 to 23 us (AVX2), on one thread. Where there are more threads than heads to
// share, each head's positions split into parts (attend, below): in a decode step the weights'
// streams have pushed the caches out to memory, and there two threads reading them took a
// SmolLM2-135M int4 decode step from 5.24-6.23 to 4.69-5.43 ms (AVX2 kernels, two runs each, the
// old and new libraries in alternating processes); with the caches of 30 blocks in L3 alone it made
// no difference (16-18 us a block).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopolicy_cpu {
namespace {

// The head's logits for groups [0, groups) into `logits` (groups x length); k is (d, stride).
// (logits rows `ld` apart: groups x length by default.)
template <int kChunk>
__attribute__((always_inline)) inline void head_logits(const float* q, int64_t groups, int64_t d, const float* k,
                                                       int64_t stride, int64_t length, float* logits, int64_t ld = -1) {
  if (ld < 0) ld = length;
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
      std::copy(acc, acc + n, logits + g * ld + s0);
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

// Vectors of W floats (GCC's vector extensions: W = 16 one ZMM register under AVX-512, 8 one YMM
// under AVX2, 4 one XMM at the baseline), and of W int32.
template <int W>
struct Lanes {
  typedef float V __attribute__((vector_size(4 * W), aligned(4)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
  static __attribute__((always_inline)) inline V load(const float* p) { return *reinterpret_cast<const V*>(p); }
  static __attribute__((always_inline)) inline void store(float* p, V v) { *reinterpret_cast<V*>(p) = v; }
  static __attribute__((always_inline)) inline V splat(float v) { return V{} + v; }
};

// exp(x) for x <= 0 (a softmax's shifted logits) within 2 ulp over the float range, for a float
// or a vector T of them: Cephes' expf (the range reduced by n = round(x / ln 2) in two parts, a
// degree-6 polynomial, 2^n put in the exponent bits). A call of std::exp per element was most of
// the call's time (2304 of them a SmolLM2 block). Below -87.3 (2^-126, where float32 turns
// subnormal), -inf included (a logit of -inf), it returns exp(-87.3), about 1e-38: nothing
// beside the largest term's 1. `to_bits` turns n + 127 (a whole number, as T) into the float
// whose exponent it is.
template <typename T, typename ToBits>
__attribute__((always_inline)) inline T exp_nonpositive(T x, ToBits to_bits) {
  constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const T low = T{} - 87.3365447505f;  // (not x * 0 - 87.3: NaN for x = -inf, left unclamped)
  x = x < low ? low : x;
  const T n = (x * kLog2e + kMagic) - kMagic;
  T r = x - n * kC1;
  r = r - n * kC2;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * to_bits(n + 127.0f);
}

__attribute__((always_inline)) inline float exp_scalar(float x) {
  if (std::isnan(x)) return x;  // (its exponent bits would come from a NaN cast to int)
  return exp_nonpositive(x, [](float e) {
    const int32_t bits = static_cast<int32_t>(e) << 23;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  });
}

// Each row of logits (groups x length) to the exponentials of its softmax, unnormalized
// (exp(logit - top), top the row's largest), W lanes at a time: partial maxima and sums in a
// vector each, the exp in vectors. tops[g] and sums[g]: each row's top and its exponentials' sum.
template <int W>
__attribute__((always_inline)) inline void softmax_parts(float* logits, int64_t groups, int64_t length, float* tops,
                                                         float* sums) {
  using L = Lanes<W>;
  using V = typename L::V;
  using I = typename L::I;
  const auto to_bits = [](V e) { return reinterpret_cast<V>(__builtin_convertvector(e, I) << 23); };
  for (int64_t g = 0; g < groups; ++g) {
    float* row = logits + g * length;
    const int64_t whole = length / W * W;
    float top = row[0];
    if (whole > 0) {
      V most = L::load(row);
      for (int64_t s = W; s < whole; s += W) {
        const V v = L::load(row + s);
        most = most > v ? most : v;
      }
      for (int j = 0; j < W; ++j) top = std::max(top, most[j]);
    }
    for (int64_t s = whole; s < length; ++s) top = std::max(top, row[s]);
    V parts{};
    for (int64_t s = 0; s < whole; s += W) {
      const V e = exp_nonpositive(L::load(row + s) - top, to_bits);
      L::store(row + s, e);
      parts += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < W; ++j) sum += parts[j];
    for (int64_t s = whole; s < length; ++s) {
      row[s] = exp_scalar(row[s] - top);
      sum += row[s];
    }
    tops[g] = top;
    sums[g] = sum;
  }
}

// The two products for a head_dim known when compiled (64: SmolLM2's, or 128), in vectors of
// Lanes<W> held in registers, each key or value row loaded once for every query head taken at
// once (head_fixed says how many). Written as plain loops over a runtime head_dim, the compiler
// kept the sums in memory.
// The logits of G query heads over whole chunks of CV vectors of positions (up to `whole`).
template <int W, int CV, int D, int G>
__attribute__((always_inline)) inline void logits_groups(const float* q, const float* k, int64_t stride, int64_t whole,
                                                         int64_t length, float* logits) {
  using L = Lanes<W>;
  using V = typename L::V;
  for (int64_t s0 = 0; s0 < whole; s0 += CV * W) {
    V a[G][CV] = {};
    for (int i = 0; i < D; ++i) {
      const float* row = k + i * stride + s0;
      if (G == 1) {  // each vector of the row used as it is loaded: CV sums and little else in registers
        const V qi = L::splat(q[i]);
        for (int j = 0; j < CV; ++j) a[0][j] += qi * L::load(row + W * j);
      } else {
        V r[CV];
        for (int j = 0; j < CV; ++j) r[j] = L::load(row + W * j);
        for (int g = 0; g < G; ++g) {
          const V qi = L::splat(q[g * D + i]);
          for (int j = 0; j < CV; ++j) a[g][j] += qi * r[j];
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CV; ++j) L::store(logits + g * length + s0 + W * j, a[g][j]);
  }
}

// out (G x D) = p (G x length) @ v (length x D), 4 W columns of D at a time.
template <int W, int D, int G>
__attribute__((always_inline)) inline void values_groups(const float* p, int64_t length, const float* v, float* out) {
  using L = Lanes<W>;
  using V = typename L::V;
  for (int c0 = 0; c0 < D; c0 += 4 * W) {
    V acc[G][4] = {};
    for (int64_t s = 0; s < length; ++s) {
      const float* row = v + s * D + c0;
      const V r0 = L::load(row), r1 = L::load(row + W), r2 = L::load(row + 2 * W), r3 = L::load(row + 3 * W);
      for (int g = 0; g < G; ++g) {
        const V ps = L::splat(p[g * length + s]);
        acc[g][0] += ps * r0, acc[g][1] += ps * r1, acc[g][2] += ps * r2, acc[g][3] += ps * r3;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) L::store(out + g * D + c0 + W * j, acc[g][j]);
  }
}

// One key/value head's attention for a head_dim D (a multiple of 4 W): the logits of 64
// positions at a time (CV = 64 / W vectors), for up to kMaxG query heads at once where the
// registers hold their sums (AVX-512's 32: three heads of four; AVX2's 16: one of eight, each key
// row then read again from L1 for the next head; reading 128 bytes of a row at a time instead, two
// heads at once, took 47 against 23 us a block from the caches of 30, on a 2-core Zen 4 EPYC); the
// values for up to two heads (three under AVX-512) at once.
template <int W, int kMaxG, int D>
__attribute__((always_inline)) inline void head_fixed(const float* q, int64_t groups, const float* k,
                                                      const float* v, int64_t stride, int64_t length, float* logits,
                                                      float* out, float* tops, float* sums) {
  constexpr int CV = 64 / W;
  const int64_t whole = length / 64 * 64;
  int64_t g = 0;
  if (kMaxG >= 3)
    for (; g + 3 <= groups; g += 3) logits_groups<W, CV, D, 3>(q + g * D, k, stride, whole, length, logits + g * length);
  if (kMaxG >= 2)
    for (; g + 2 <= groups; g += 2) logits_groups<W, CV, D, 2>(q + g * D, k, stride, whole, length, logits + g * length);
  for (; g < groups; ++g) logits_groups<W, CV, D, 1>(q + g * D, k, stride, whole, length, logits + g * length);
  if (whole < length)  // the last positions (fewer than 64), in plain loops
    head_logits<64>(q, groups, D, k + whole, stride, length - whole, logits + whole, length);
  softmax_parts<W>(logits, groups, length, tops, sums);
  g = 0;
  if (kMaxG >= 3)
    for (; g + 3 <= groups; g += 3) values_groups<W, D, 3>(logits + g * length, length, v, out + g * D);
  for (; g + 2 <= groups; g += 2) values_groups<W, D, 2>(logits + g * length, length, v, out + g * D);
  for (; g < groups; ++g) values_groups<W, D, 1>(logits + g * length, length, v, out + g * D);
}

// One key/value head over the positions [s0, s0 + n) of its cache (kh: (d, max_length), vh:
// (max_length, d)): out (groups x d) = sum_s exp(logit_s - top) v_s, unnormalized, with each query
// head's top and sum of exponentials (the parts of a head are merged after: attend).
template <int W, int kMaxG>
__attribute__((always_inline)) inline void head_part(const Shape& sh, const float* qh, const float* kh,
                                                     const float* vh, int64_t s0, int64_t n, float* logits,
                                                     float* out, float* tops, float* sums) {
  const float* k = kh + s0;
  const float* v = vh + s0 * sh.d;
  if (sh.d == 64) {
    head_fixed<W, kMaxG, 64>(qh, sh.groups, k, v, sh.max_length, n, logits, out, tops, sums);
  } else if (sh.d == 128) {
    head_fixed<W, kMaxG, 128>(qh, sh.groups, k, v, sh.max_length, n, logits, out, tops, sums);
  } else {
    head_logits<64>(qh, sh.groups, sh.d, k, sh.max_length, n, logits);
    softmax_parts<W>(logits, sh.groups, n, tops, sums);
    head_values<256>(logits, sh.groups, n, v, sh.d, out);
  }
}

using PartFn = void (*)(const Shape&, const float*, const float*, const float*, int64_t, int64_t, float*, float*,
                        float*, float*);

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void part_avx512(
    const Shape& sh, const float* qh, const float* kh, const float* vh, int64_t s0, int64_t n, float* logits,
    float* out, float* tops, float* sums) {
  head_part<16, 3>(sh, qh, kh, vh, s0, n, logits, out, tops, sums);
}
__attribute__((target("avx2,fma"))) void part_avx2(const Shape& sh, const float* qh, const float* kh, const float* vh,
                                                   int64_t s0, int64_t n, float* logits, float* out, float* tops,
                                                   float* sums) {
  head_part<8, 1>(sh, qh, kh, vh, s0, n, logits, out, tops, sums);
}
#endif
void part_baseline(const Shape& sh, const float* qh, const float* kh, const float* vh, int64_t s0, int64_t n,
                   float* logits, float* out, float* tops, float* sums) {
  head_part<4, 1>(sh, qh, kh, vh, s0, n, logits, out, tops, sums);
}

// The variant of the SIMD path in use (kernels.h's current_path, so set_path forces the baseline
// loops as it does the portable kernels): AVX-512 under avx512_vnni, AVX2 under avx_vnni and avx2.
PartFn part_kernel() {
#if defined(__x86_64__)
  const std::string name = current_path().name;
  if (name == "avx512_vnni") return part_avx512;
  if (name == "avx_vnni" || name == "avx2") return part_avx2;
#endif
  return part_baseline;
}

// Positions a part takes: whole chunks of 64 (the vector loops'); at most kMaxParts parts a head.
constexpr int64_t kChunkPositions = 64, kMaxParts = 64;

// The attention of every (batch row, key/value head), each head's positions split into parts of
// whole 64-position chunks where there are more threads than heads to share (a SmolLM2 block's 3
// heads over 2 threads: 6 parts, 2 a head), the parts claimed by the threads as they come free.
// Each part's unnormalized sums are merged as flash-decoding does: scaled by exp(top_p - top)
// over the head's sum of exponentials. Caches of fewer bytes than serial_max_bytes() run on the
// calling thread alone.
void attend(ffi::ThreadPool& pool, const Shape& sh, const float* q, const float* keys, const float* values,
            int64_t length, float* out) {
  const int64_t heads = sh.batch * sh.heads, g = sh.groups, d = sh.d;
  const bool serial = heads * length * d * 8 <= serial_max_bytes();
  const int64_t threads = serial ? 1 : call_threads(pool.num_threads());
  const int64_t chunks = (length + kChunkPositions - 1) / kChunkPositions;
  // One thread: one part a head, so a call's result does not depend on the threads it is split for.
  const int64_t parts = threads <= 1 ? 1 : std::max<int64_t>(
      1, std::min({(2 * threads + heads - 1) / heads, chunks, kMaxParts}));
  const int64_t per_part = (chunks + parts - 1) / parts * kChunkPositions;
  const int64_t tasks = heads * parts;
  // Partial sums stay zero for the empty parts (weighed 0 below, but read).
  std::vector<float> partial(static_cast<size_t>(tasks * g * d));
  std::vector<float> tops(static_cast<size_t>(tasks * g)), sums(static_cast<size_t>(tasks * g));
  const PartFn fn = part_kernel();
  float* pp = partial.data();
  float* tp = tops.data();
  float* sp = sums.data();
  const Shape shape = sh;
  share_tasks(pool, tasks, threads, [=](int64_t t) {
    const int64_t bh = t / parts, p = t % parts, s0 = p * per_part, n = std::min(length, s0 + per_part) - s0;
    if (n <= 0) {  // a part past the end (parts of whole chunks): nothing, weighed as nothing below
      for (int64_t j = 0; j < g; ++j) tp[t * g + j] = -INFINITY, sp[t * g + j] = 0.0f;
      return;
    }
    // Each thread's logits scratch, kept across calls (written in full before it is read): a
    // buffer for every part at once would be batch x heads x groups x length floats.
    thread_local std::vector<float> logits;
    if (logits.size() < static_cast<size_t>(g * per_part)) logits.resize(static_cast<size_t>(g * per_part));
    fn(shape, q + bh * g * d, keys + bh * d * shape.max_length, values + bh * shape.max_length * d, s0, n,
       logits.data(), pp + t * g * d, tp + t * g, sp + t * g);
  });
  for (int64_t bh = 0; bh < heads; ++bh) {
    for (int64_t j = 0; j < g; ++j) {
      float top = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, tops[(bh * parts + p) * g + j]);
      float weights[kMaxParts];
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t t = bh * parts + p;
        weights[p] = sums[t * g + j] > 0.0f ? std::exp(tops[t * g + j] - top) : 0.0f;
        total += weights[p] * sums[t * g + j];
      }
      float* o = out + (bh * g + j) * d;
      for (int64_t i = 0; i < d; ++i) {
        float acc = 0.0f;
        for (int64_t p = 0; p < parts; ++p) acc += weights[p] * partial[((bh * parts + p) * g + j) * d + i];
        o[i] = acc / total;
      }
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                               ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> position,
                               ffi::ResultBuffer<ffi::F32> out) {
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
  attend(pool, sh, q.typed_data(), keys.typed_data(), values.typed_data(), pos + 1, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace autopolicy_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyDecodeAttention, autopolicy_cpu::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
