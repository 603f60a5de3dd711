// Device helpers shared by every ropekv kernel: vector loads and stores, dtype casts (fp8 with
// round-to-nearest-even and saturation), and the rotation of one chunk of RoPE pairs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace ropekv {

typedef long long i64;

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

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& x) {
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

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

template <typename T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  const Vec<T, N> v = load<T, N>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
}

// Stores x * scale rounded to T (scale is 1 for non-quantized outputs).
template <typename T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&x)[N], float scale = 1.f) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(is_fp8<T>::value ? x[i] * scale : x[i]);
  store<T, N>(p, v);
}

// RoPE on one chunk of a head row.
//   cos_sin: one float32 row of the table, (R,): cos in [0, R/2), sin in [R/2, R).
//   neox: the chunk is pairs (i, i + R/2) for i in [i0, i0 + N): a[k] = x[i0 + k],
//         b[k] = x[R/2 + i0 + k], rotated by theta_{i0 + k}.
//   interleaved: the chunk is elements [e0, e0 + N), pairs (e0 + 2k, e0 + 2k + 1) rotated by
//         theta_{e0/2 + k}; b is unused.
// x' = x cos - y sin, y' = y cos + x sin.
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

}  // namespace ropekv
