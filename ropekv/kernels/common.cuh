// Device helpers shared by every ropekv kernel: vector loads and stores, dtype casts (fp8 with
// round-to-nearest-even and saturation), and the rotation of one chunk of RoPE pairs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace ropekv {

typedef long long i64;

// Programmatic Dependent Launch (sm_90+). A kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it on the stream is still running:
// pdl_wait() blocks until that kernel has completed and its writes are visible, so every kernel
// calls it before its first global memory access; pdl_launch_dependents() lets the next kernel
// start its own prologue (it will wait in turn), so kernels call it first thing. Without the
// attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// N elements of T moved as one access: 16 bytes at most per instruction, so a Vec<float, 8>
// becomes two 16-byte loads. Callers guarantee the alignment (the Python side picks N).
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

// A row's chunk that the call reads once (q, k, v inputs), loaded with the streaming hint
// (ld.global.cs: evict first from L1 and L2), which leaves the caches to the call's stores and to
// what it reads again (cos/sin rows, indices, weights). Used where it measured faster: the QK-norm
// kernel built for 4 rows a lane group (Qwen3-32B prefill among its calls) and the paged C-chunk
// lean kernel on calls that move more bytes than most of the L2 holds (docs/design/kernels.md).
// Elsewhere it read 1-13% slower, and where a call's bytes fit in L2 (paged MLA decode at 128
// tokens) 1.22x slower under graph replay, so other kernels keep plain loads.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_stream(const T* p) {
  Vec<T, N> r;
  if constexpr (sizeof(Vec<T, N>) == 16) {
    unsigned* w = reinterpret_cast<unsigned*>(&r);
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p));
  } else if constexpr (sizeof(Vec<T, N>) == 8) {
    unsigned* w = reinterpret_cast<unsigned*>(&r);
    asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    r = load<T, N>(p);
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& x) {
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(signed char x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// int8 (caches with per-token-head scales): round to nearest even, saturate to [-127, 127]
// (symmetric, so -x always has a code); NaN becomes 0 (cvt.rni.s32.f32 gives 0 for NaN).
template <>
__device__ __forceinline__ signed char from_float<signed char>(float x) {
  return static_cast<signed char>(max(-127, min(127, __float2int_rn(x))));
}
// fp8: round to nearest even, out-of-range values (and +-inf) saturate to the largest finite.
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
  return r;
}

// pick_type<C, X, Y>::type: X where C holds, else Y (std::conditional, which NVRTC's headers lack).
template <bool C, typename X, typename Y>
struct pick_type {
  using type = X;
};
template <typename X, typename Y>
struct pick_type<false, X, Y> {
  using type = Y;
};

template <typename T>
struct is_fp8 {
  static constexpr bool value = false;
};
template <>
struct is_fp8<__nv_fp8_e4m3> {
  static constexpr bool value = true;
};
template <>
struct is_fp8<__nv_fp8_e5m2> {
  static constexpr bool value = true;
};

// Stored types whose values are codes of a scale: fp8 and int8.
template <typename T>
struct is_quantized {
  static constexpr bool value = is_fp8<T>::value;
};
template <>
struct is_quantized<signed char> {
  static constexpr bool value = true;
};

// The largest code of a quantized type: what a computed scale maps a row's largest |x| onto.
template <typename T>
__device__ __forceinline__ constexpr float max_code();
template <>
__device__ __forceinline__ constexpr float max_code<__nv_fp8_e4m3>() { return 448.f; }
template <>
__device__ __forceinline__ constexpr float max_code<__nv_fp8_e5m2>() { return 57344.f; }
template <>
__device__ __forceinline__ constexpr float max_code<signed char>() { return 127.f; }

// Computed scales (dynamic fp8 Q, per-token-head KV scales; docs/conventions.md): for a row whose
// largest magnitude is amax, a = max(amax, 1e-6), the dequantization scale a / max_code is what
// the caller receives and the row is stored as T(x * (max_code / a)). fmaxf drops a NaN amax (a
// row of NaN gets a = 1e-6); an infinite amax gives scale inf and mul 0 (inf * 0 = NaN codes).
struct RowScale {
  float mul;    // what the row is multiplied by before rounding to T
  float scale;  // the dequantization scale written beside it
};
template <typename T>
__device__ __forceinline__ RowScale row_scale(float amax) {
  const float a = fmaxf(amax, 1e-6f);
  return {max_code<T>() / a, a / max_code<T>()};
}

// Largest value over LANES consecutive lanes of a warp (LANES a power of two, at most 32; every
// lane of the warp must call it). fmaxf drops NaN, as row_scale expects.
template <int LANES>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T, int N>
struct ToFloats {
  static __device__ __forceinline__ void run(const Vec<T, N>& v, float (&out)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
  }
};

// bf16 -> float32 is exact: the bits move to the upper half. Done on the 32-bit words the vector
// was loaded as (the per-element conversion goes through 16-bit registers: more registers, more
// instructions).
template <int N>
struct ToFloats<__nv_bfloat16, N> {
  static __device__ __forceinline__ void run(const Vec<__nv_bfloat16, N>& v, float (&out)[N]) {
    if constexpr (N % 2 == 0) {
      const unsigned* w = reinterpret_cast<const unsigned*>(v.v);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
    }
  }
};

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&out)[N]) {
  ToFloats<T, N>::run(v, out);
}

template <typename T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  to_floats<T, N>(load<T, N>(p), out);
}

// Stores x * scale rounded to T (scale is 1 for non-quantized outputs, ignored for 16-bit T).
template <typename T>
struct fp8_interpretation;
template <>
struct fp8_interpretation<__nv_fp8_e4m3> {
  static constexpr __nv_fp8_interpretation_t value = __NV_E4M3;
};
template <>
struct fp8_interpretation<__nv_fp8_e5m2> {
  static constexpr __nv_fp8_interpretation_t value = __NV_E5M2;
};

template <typename T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&x)[N], float scale = 1.f) {
  if constexpr (is_fp8<T>::value && N % 4 == 0) {
    // two values per conversion instruction (cvt.rn.satfinite.*x2.f32 on sm_89+), the pairs
    // packed straight into 32-bit words (no per-byte repacking)
    Vec<unsigned, N / 4> w;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const unsigned lo = __nv_cvt_float2_to_fp8x2(
          make_float2(x[4 * i] * scale, x[4 * i + 1] * scale), __NV_SATFINITE,
          fp8_interpretation<T>::value);
      const unsigned hi = __nv_cvt_float2_to_fp8x2(
          make_float2(x[4 * i + 2] * scale, x[4 * i + 3] * scale), __NV_SATFINITE,
          fp8_interpretation<T>::value);
      w.v[i] = lo | (hi << 16);
    }
    store<unsigned, N / 4>(reinterpret_cast<unsigned*>(p), w);
    return;
  }
  Vec<T, N> v;
  if constexpr (is_fp8<T>::value && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
          make_float2(x[2 * i] * scale, x[2 * i + 1] * scale), __NV_SATFINITE,
          fp8_interpretation<T>::value);
      v.v[2 * i].__x = static_cast<__nv_fp8_storage_t>(two & 0xFF);
      v.v[2 * i + 1].__x = static_cast<__nv_fp8_storage_t>(two >> 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v.v[i] = from_float<T>(is_quantized<T>::value ? x[i] * scale : x[i]);
    }
  }
  store<T, N>(p, v);
}

// RoPE on one chunk of a head row.
//   cos_sin: one float32 row of the table, (R,): cos in [0, R/2), sin in [R/2, R).
//   neox: the chunk is pairs (i, i + R/2) for i in [i0, i0 + N): a[k] = x[i0 + k],
//         b[k] = x[R/2 + i0 + k], rotated by theta_{i0 + k}.
//   interleaved: the chunk is elements [e0, e0 + N), pairs (e0 + 2k, e0 + 2k + 1) rotated by
//         theta_{e0/2 + k}; b is unused.
// x' = x cos - y sin, y' = y cos + x sin.
// RoPE on one chunk whose cos/sin values are already in registers (loaded once per thread and
// reused across heads): neox rotates a[k] with b[k] by angle k (M = N); interleaved rotates
// a[2k] with a[2k + 1] by angle k (M = N / 2) and leaves b alone.
template <bool NEOX, int N, int M>
__device__ __forceinline__ void rotate_chunk(float (&a)[N], float (&b)[N], const float (&c)[M],
                                             const float (&s)[M]) {
  if constexpr (NEOX) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float x = a[k], y = b[k];
      a[k] = x * c[k] - y * s[k];
      b[k] = y * c[k] + x * s[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const float x = a[2 * k], y = a[2 * k + 1];
      a[2 * k] = x * c[k] - y * s[k];
      a[2 * k + 1] = y * c[k] + x * s[k];
    }
  }
}

template <int N>
__device__ __forceinline__ void rotate_neox(float (&a)[N], float (&b)[N], const float* cos_sin,
                                            int half_r, int i0) {
  float c[N], s[N];
  load_float<float, N>(cos_sin + i0, c);
  load_float<float, N>(cos_sin + half_r + i0, s);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float x = a[k], y = b[k];
    a[k] = x * c[k] - y * s[k];
    b[k] = y * c[k] + x * s[k];
  }
}

template <int N>
__device__ __forceinline__ void rotate_interleaved(float (&a)[N], const float* cos_sin,
                                                   int half_r, int e0) {
  static_assert(N % 2 == 0, "interleaved chunks hold whole pairs");
  float c[N / 2], s[N / 2];
  load_float<float, N / 2>(cos_sin + e0 / 2, c);
  load_float<float, N / 2>(cos_sin + half_r + e0 / 2, s);
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const float x = a[2 * k], y = a[2 * k + 1];
    a[2 * k] = x * c[k] - y * s[k];
    a[2 * k + 1] = y * c[k] + x * s[k];
  }
}

// ---- Ragged batches over a paged cache (MAX / vLLM block-table convention) -------------------
// Request b owns tokens [offsets[b], offsets[b + 1]); token t of request b sits at position
// p = cache_lengths[b] + (t - offsets[b]), stored in page block_table[b, p / page_size], entry
// p % page_size. Whatever the index values, nothing is read outside offsets[0..B],
// cache_lengths[0..B) and row b of block_table[0..max_pages).

// The request owning token t: the last b with offsets[b] <= t (so zero-length requests are passed
// over), found by binary search; -1 when t lies before offsets[0] or at or past offsets[B], or the
// offsets are not monotonic around t. Offsets are read as 32-bit unsigned: int32 and uint32 arrays
// share one kernel (a negative int32 offset reads as a huge one, and so matches no token).
__device__ __forceinline__ int ragged_request(const unsigned* offsets, int B, i64 t) {
  int lo = 0, hi = B + 1;  // upper bound of t in offsets[0..B]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (i64(offsets[mid]) <= t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int b = lo - 1;
  if (b < 0 || b >= B || t < i64(offsets[b]) || t >= i64(offsets[b + 1])) return -1;
  return b;
}

struct PagedSlot {
  int request;  // -1: the token belongs to no request (then pos and page are -1)
  i64 pos;      // position of the token in its request's sequence (the RoPE position)
  i64 page;     // page id, or -1 when p < 0, p / page_size >= max_pages or the id is outside
                // [0, num_pages): the token must not be written
  int entry;    // p % page_size
};

// Request and position of token t (page left at -1): what RoPE needs, without the block-table
// load, which only the threads that write the cache wait for.
__device__ __forceinline__ PagedSlot ragged_position(const unsigned* offsets,
                                                     const int* cache_lengths, int B, i64 t) {
  PagedSlot s{-1, -1, -1, 0};
  const int b = ragged_request(offsets, B, t);
  if (b < 0) return s;
  s.request = b;
  s.pos = i64(cache_lengths[b]) + (t - i64(offsets[b]));
  return s;
}

// ragged_position for a batch of B < 32 requests held in the warp's lanes (by %laneid): lane l <=
// B holds offsets[l] in `off`, lane l < B cache_lengths[l] in `len` (the other lanes anything).
// Every lane of the warp calls it, converged. TOKENS: how many tokens the warp's lanes ask about,
// 1 (the same t in every lane) or 2 (lane 0's and lane 31's: a warp of consecutive rows of a
// ragged sequence; a warp whose lanes hold more takes the search below).
// Where offsets[0..B] is non-decreasing (as unsigned), a ballot a token answers: the binary
// search's upper bound u of t over the B + 1 offsets gives request u - 1 where 1 <= u <= B and -1
// otherwise, and in a sorted array u - 1 is then the one lane l < B with offsets[l] <= t <
// offsets[l + 1] (for u = 0 or u = B + 1 no lane is). Other batches run ragged_request's binary
// search over the lanes, every lane every step. Either way the answer is ragged_request's exactly.
template <int TOKENS>
__device__ __forceinline__ PagedSlot lane_position(unsigned off, int len, int B, int t) {
  static_assert(TOKENS == 1 || TOKENS == 2, "one or two tokens a warp");
  constexpr unsigned kAll = 0xffffffffu;
  unsigned lane;  // the lane within the warp, whatever the block's shape (MLA's are 2-D)
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  const unsigned next = __shfl_down_sync(kAll, off, 1);  // offsets[l + 1] in lanes l < B
  const bool in = int(lane) < B;
  const int t0 = TOKENS == 1 ? t : __shfl_sync(kAll, t, 0);
  const int t1 = TOKENS == 1 ? t : __shfl_sync(kAll, t, 31);
  int b;
  if (__all_sync(kAll, (!in || off <= next) && (TOKENS == 1 || t == t0 || t == t1))) {
    unsigned hit = __ballot_sync(kAll, in && off <= unsigned(t0) && unsigned(t0) < next);
    if (TOKENS == 2) {
      const unsigned hit1 = __ballot_sync(kAll, in && off <= unsigned(t1) && unsigned(t1) < next);
      if (t != t0) hit = hit1;
    }
    b = hit ? __ffs(hit) - 1 : -1;
  } else {
    int lo = 0, hi = B + 1;
    while (__any_sync(kAll, lo < hi)) {
      const bool step = lo < hi;
      const int mid = (lo + hi) >> 1;
      const unsigned o = __shfl_sync(kAll, off, step ? mid : 0);
      if (step) {
        if (o <= unsigned(t)) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
    }
    b = lo - 1;  // <= B: the shuffles below read lanes <= B < 32
    const int r = b < 0 ? 0 : b;
    const unsigned o0 = __shfl_sync(kAll, off, r);
    const unsigned o1 = __shfl_sync(kAll, off, r + 1 > B ? B : r + 1);
    if (b >= B || unsigned(t) < o0 || unsigned(t) >= o1) b = -1;
  }
  const int r = b < 0 ? 0 : b;
  const unsigned o0 = __shfl_sync(kAll, off, r);
  const int l0 = __shfl_sync(kAll, len, r);
  PagedSlot s{-1, -1, -1, 0};
  if (b >= 0) {
    s.request = b;
    s.pos = i64(l0) + (i64(t) - i64(o0));
  }
  return s;
}

// The decode guess (a call of as many tokens as requests: token t of request t) checked against
// ragged_request's own search, for B <= 512 requests. The search's path to a result g is fixed by
// g and B alone: it returns g exactly when every probe on that path compares as it would for g
// (offsets[mid] <= t where mid <= g, > t past it), and then -1 unless offsets[g] <= t <
// offsets[g + 1]. So the path's probes load at once, with offsets[g], offsets[g + 1] and
// cache_lengths[g]: slot k of those kGuessSlots is loaded by lane k % L of the L lanes (a power of
// two, an aligned group of the warp) that share token t, and a ballot tells whether the path held.
// It replaces staging every offset in shared memory, a barrier and a search there (every block
// reading the same lines), or a dependent load a step in global memory. load() issues the loads
// (with the rows, before anything waits), resolve() reads them; every lane of the warp calls both
// (converged). Where the path did not hold (offsets not one token a request, or not monotonic)
// resolve() returns false and the caller runs the search.
constexpr int kGuessSteps = 10;  // ragged_request's steps over offsets[0..B], B + 1 <= 513 entries
constexpr int kGuessSlots = kGuessSteps + 3;

template <int L>
struct RequestGuess {
  static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "an aligned power-of-two lane group");
  static constexpr int PER = (kGuessSlots + L - 1) / L;  // slots a lane
  unsigned val[PER];
  bool below[PER];  // a path probe that must compare <= t
  bool probe[PER];  // the slot is a probe of the path
  int g;

  __device__ __forceinline__ void load(const unsigned* offsets, const int* cache_lengths, int B,
                                       int t) {
    const int j = threadIdx.x & (L - 1);
    g = t < B ? t : B - 1;  // 0 <= t: 0 <= g < B
    int mid[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      mid[i] = 0;
      probe[i] = below[i] = false;
    }
    int lo = 0, hi = B + 1;
#pragma unroll
    for (int k = 0; k < kGuessSteps; ++k) {  // ragged_request's loop, its comparisons g's
      const int m = (lo + hi) >> 1;
      const bool step = lo < hi;
      if (step && k % L == j) {
        mid[k / L] = m;
        probe[k / L] = true;
        below[k / L] = m <= g;
      }
      if (step) {
        if (m <= g) {
          lo = m + 1;
        } else {
          hi = m;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int slot = j + i * L;
      val[i] = 0;
      if (probe[i]) {
        val[i] = offsets[mid[i]];
      } else if (slot == kGuessSteps || slot == kGuessSteps + 1) {
        val[i] = offsets[g + slot - kGuessSteps];  // g + 1 <= B
      } else if (slot == kGuessSteps + 2) {
        val[i] = unsigned(cache_lengths[g]);
      }
    }
  }

  // Whether the path held; then s is ragged_position's result (request -1 where t is outside
  // request g: the search's own answer).
  __device__ __forceinline__ bool resolve(int t, PagedSlot& s) const {
    bool bad = false;
#pragma unroll
    for (int i = 0; i < PER; ++i) bad |= probe[i] && (val[i] <= unsigned(t)) != below[i];
    const int lane = threadIdx.x & 31;
    const int at = lane & ~(L - 1);
    const unsigned group = L == 32 ? 0xffffffffu : ((1u << L) - 1) << at;
    const bool held = (__ballot_sync(0xffffffffu, bad) & group) == 0;
    constexpr int K0 = kGuessSteps, K1 = kGuessSteps + 1, KL = kGuessSteps + 2;
    const unsigned o0 = __shfl_sync(0xffffffffu, val[K0 / L], at + K0 % L);
    const unsigned o1 = __shfl_sync(0xffffffffu, val[K1 / L], at + K1 % L);
    const int len = int(__shfl_sync(0xffffffffu, val[KL / L], at + KL % L));
    s = PagedSlot{-1, -1, -1, 0};
    if (held && o0 <= unsigned(t) && unsigned(t) < o1) {
      s.request = g;
      s.pos = i64(len) + (i64(t) - i64(o0));
    }
    return held;
  }
};

// n / d for 0 <= n < 2^31 from the host's (magic, shift) of d (_launch.division_magic): a
// multiply-high, an add and a shift, where the division of a runtime d is about 20 dependent
// instructions through a reciprocal (QK-norm decode: the flat kernel's row -> token before its
// first load, the position -> page-table index; qkv_mma: a weight load's group).
__device__ __forceinline__ unsigned fast_div(unsigned n, unsigned magic, int shift) {
  return (__umulhi(n, magic) + n) >> shift;  // no overflow: __umulhi(n, magic) <= n < 2^31
}

// q = x / d for 0 <= x and d > 0: a 32-bit division when x fits (every realistic position), the
// 64-bit routine (tens of instructions more on a decode's critical path) otherwise.
__device__ __forceinline__ i64 div_pos(i64 x, int d) {
  return x <= 0x7fffffff ? i64(unsigned(x) / unsigned(d)) : x / d;
}

// Fills s.page and s.entry from row s.request of the block table (page -1 when out of range).
__device__ __forceinline__ void page_of(PagedSlot& s, const int* block_table,
                                        i64 block_table_stride, int max_pages, int page_size,
                                        i64 num_pages) {
  s.page = -1;
  if (s.request < 0 || s.pos < 0) return;
  const i64 index = div_pos(s.pos, page_size);
  if (index >= max_pages) return;
  const i64 page = block_table[s.request * block_table_stride + index];
  if (page < 0 || page >= num_pages) return;
  s.page = page;
  s.entry = int(s.pos - index * page_size);
}

__device__ __forceinline__ PagedSlot paged_slot(const unsigned* offsets, const int* cache_lengths,
                                                const int* block_table, i64 block_table_stride,
                                                int B, int max_pages, int page_size,
                                                i64 num_pages, i64 t) {
  PagedSlot s = ragged_position(offsets, cache_lengths, B, t);
  page_of(s, block_table, block_table_stride, max_pages, page_size, num_pages);
  return s;
}

// Whether token t is the last of its request (s from ragged_position): the token at the request's
// new length - 1, whose page is the request's last page. offsets[s.request + 1] is in bounds
// (request < B).
__device__ __forceinline__ bool last_of_request(const unsigned* offsets, const PagedSlot& s,
                                                i64 t) {
  return s.request >= 0 && i64(offsets[s.request + 1]) == t + 1;
}

// clear_unused_last_page_rows: zeroes the N elements at `e` of each row after `row` to the end
// of its page (entries entry + 1 .. page_size - 1, `entry_stride` elements apart): the rows past
// a request's new length on its last page. Zero bits are +0 in every cache dtype.
template <typename CacheT, int N>
__device__ __forceinline__ void zero_rest_of_page(CacheT* row, i64 entry_stride, int entry,
                                                  int page_size, int e) {
  Vec<CacheT, N> z;
#pragma unroll
  for (int i = 0; i < N; ++i) z.v[i] = from_float<CacheT>(0.f);
  for (int r = 1; r < page_size - entry; ++r) store<CacheT, N>(row + r * entry_stride + e, z);
}

// ---- mRoPE (Qwen2-VL, Qwen3-VL): three positions per token --------------------------------------
// Rotary half-dim i takes its angle from one of the token's temporal, height and width positions:
// sections (t, h, w) of half-dims summing to R/2. Qwen2-VL (chunked): axis 0 for i < t, 1 for
// i < t + h, else 2. Qwen3-VL (interleaved): axis 1 when i % 3 == 1 and i < 3h, 2 when i % 3 == 2
// and i < 3w, else 0.
struct MRope {
  int t, h, w, interleaved;
};

__device__ __forceinline__ int mrope_axis(const MRope& m, int i) {
  if (m.interleaved) {
    const int r = i % 3;
    return (r == 1 && i < 3 * m.h) ? 1 : (r == 2 && i < 3 * m.w) ? 2 : 0;
  }
  return i < m.t ? 0 : i < m.t + m.h ? 1 : 2;
}

// The three positions of item t of a (3, n) position array (int32 or int64, rows `stride` apart).
__device__ __forceinline__ void mrope_positions(const void* ids, int is64, i64 t, i64 stride,
                                                i64 (&pos)[3]) {
#pragma unroll
  for (int a = 0; a < 3; ++a)
    pos[a] = is64 ? static_cast<const i64*>(ids)[a * stride + t]
                  : i64(static_cast<const int*>(ids)[a * stride + t]);
}

__device__ __forceinline__ bool mrope_in_range(const i64 (&pos)[3], int P) {
  return pos[0] >= 0 && pos[0] < P && pos[1] >= 0 && pos[1] < P && pos[2] >= 0 && pos[2] < P;
}

// cos/sin of half-dims [i0, i0 + M) from the table rows of their axes (`table` row 0, rows
// `row_stride` apart, cos at column i, sin at half_r + i). A text token (one position on all
// three axes) takes the vector loads of plain RoPE; otherwise the chunk of all three rows, with
// vector loads (in flight together), then each element picked by its axis.
template <int M>
__device__ __forceinline__ void load_mrope_cos_sin(const float* table, i64 row_stride,
                                                   const i64 (&pos)[3], const MRope& m,
                                                   int half_r, int i0, float (&c)[M],
                                                   float (&s)[M]) {
  if (pos[0] == pos[1] && pos[1] == pos[2]) {
    const float* row = table + pos[0] * row_stride + i0;
    load_float<float, M>(row, c);
    load_float<float, M>(row + half_r, s);
    return;
  }
  float c3[3][M], s3[3][M];
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const float* row = table + pos[a] * row_stride + i0;
    load_float<float, M>(row, c3[a]);
    load_float<float, M>(row + half_r, s3[a]);
  }
#pragma unroll
  for (int k = 0; k < M; ++k) {
    const int a = mrope_axis(m, i0 + k);
    c[k] = a == 0 ? c3[0][k] : a == 1 ? c3[1][k] : c3[2][k];
    s[k] = a == 0 ? s3[0][k] : a == 1 ? s3[1][k] : s3[2][k];
  }
}

// ---- status=: on-device validation of ragged offsets (graph-capturable, no host sync) ---------
// The code of offsets[0..B] for a batch of T tokens (every thread of the block calls it, after
// the offsets are readable): 1 offsets[0] != 0, 2 an offset below the one before it, 3
// offsets[B] != T, 0 valid (then every offset lies in [0, T]). Read as 32-bit unsigned, as the
// request search reads them. Every block computes the same code, so a block that finds the
// offsets malformed writes nothing and no block needs to wait for another.
__device__ __forceinline__ int ragged_offsets_status(const unsigned* offsets, int B, i64 T) {
  bool decreasing = false;
  for (int i = threadIdx.x; i < B; i += blockDim.x) decreasing |= offsets[i + 1] < offsets[i];
  const bool first = __syncthreads_or(threadIdx.x == 0 && offsets[0] != 0u);
  const bool dec = __syncthreads_or(decreasing);
  const bool last = __syncthreads_or(threadIdx.x == 0 && i64(offsets[B]) != T);
  return first ? 1 : dec ? 2 : last ? 3 : 0;
}

// A weight vector (RMSNorm gamma) stored as T or as float32.
template <typename T, int N>
__device__ __forceinline__ void load_weight(const void* w, bool f32, int i0, float (&out)[N]) {
  if (f32) {
    load_float<float, N>(static_cast<const float*>(w) + i0, out);
  } else {
    load_float<T, N>(static_cast<const T*>(w) + i0, out);
  }
}

}  // namespace ropekv
