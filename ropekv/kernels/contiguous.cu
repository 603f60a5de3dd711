// RoPE on Q and K, and the write of K/V into a contiguous cache [B, 2, Hkv, C, D]
// (TensorRT-Edge-LLM's applyRopeWriteKV family: plain, tree decoding and split QKV).
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror CONTIGUOUS_PARAMS in ropekv/contiguous.py.
struct RopeWriteKVParams {
  void* q;                  // (B, S, Hq, D) T, roped in place
  void* k;                  // (B, S, Hkv, D) T, roped in place when write_k_in_place
  const void* v;            // (B, S, Hkv, D) T
  void* cache;              // (B, 2, Hkv, C, D) CacheT
  const float* cos_sin;     // (Bc, P, R) float32, cos half then sin half
  const int* kv_end_lens;   // (B,) or null: cache end after writing
  const int* position_ids;  // (B, S) or null: RoPE positions, < 0 marks padding
  const float* kv_scale;    // (2,) dequantization scales of K and V (fp8 caches)
  i64 q_sb, q_ss, q_sh;     // strides in elements; the last dimension is contiguous
  i64 k_sb, k_ss, k_sh;
  i64 v_sb, v_ss, v_sh;
  i64 c_sb, c_skv, c_sh, c_st;
  i64 cs_sb, cs_sp;         // cs_sb is 0 for one table shared by the batch
  int B, S, Hq, Hkv, D, R, C, P;
  int write_k_in_place;
};

// Work item j of one head row, src -> dst (dst may alias src). Items [0, rot_items) rotate a
// chunk of pairs; the rest copy N pass-through dims of [R, D). `also` receives the roped values in
// the input dtype (K written back in place), or is null.
template <typename T, typename OutT, bool NEOX, int N>
__device__ __forceinline__ void rope_item(const T* src, OutT* dst, T* also, int j, int rot_items,
                                          int R, const float* cos_sin, float scale) {
  const int half_r = R >> 1;
  if (j < rot_items) {
    if constexpr (NEOX) {
      const int i0 = j * N;
      float a[N], b[N];
      load_float<T, N>(src + i0, a);
      load_float<T, N>(src + half_r + i0, b);
      rotate_neox<N>(a, b, cos_sin, half_r, i0);
      store_float<OutT, N>(dst + i0, a, scale);
      store_float<OutT, N>(dst + half_r + i0, b, scale);
      if (also) {
        store_float<T, N>(also + i0, a);
        store_float<T, N>(also + half_r + i0, b);
      }
    } else {
      const int e0 = j * N;
      float a[N];
      load_float<T, N>(src + e0, a);
      rotate_interleaved<N>(a, cos_sin, half_r, e0);
      store_float<OutT, N>(dst + e0, a, scale);
      if (also) store_float<T, N>(also + e0, a);
    }
  } else {
    const int e0 = R + (j - rot_items) * N;
    float a[N];
    load_float<T, N>(src + e0, a);
    store_float<OutT, N>(dst + e0, a, scale);
  }
}

// One block per token (b, s). A token whose slot falls outside [0, C) or whose position falls
// outside [0, P) is skipped whole: nothing is read through its indices, nothing is written.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(256) apply_rope_write_kv(const RopeWriteKVParams p) {
  const int token = blockIdx.x;
  const int b = token / p.S;
  const int s = token - b * p.S;
  const i64 slot = p.kv_end_lens ? i64(p.kv_end_lens[b]) - p.S + s : i64(s);
  const i64 pos = p.position_ids ? i64(p.position_ids[token]) : slot;
  if (slot < 0 || slot >= p.C || pos < 0 || pos >= p.P) return;

  const float* cos_sin = p.cos_sin + b * p.cs_sb + pos * p.cs_sp;
  float k_scale = 1.f, v_scale = 1.f;
  if (is_fp8<CacheT>::value) {  // stored = fp8(x / scale)
    k_scale = 1.f / p.kv_scale[0];
    v_scale = 1.f / p.kv_scale[1];
  }
  const int rot_items = NEOX ? (p.R / 2) / N : p.R / N;
  const int items = rot_items + (p.D - p.R) / N;  // per roped head row
  const int v_items = p.D / N;
  const int q_end = p.Hq * items;
  const int k_end = q_end + p.Hkv * items;
  const int end = k_end + p.Hkv * v_items;

  T* q = static_cast<T*>(p.q) + b * p.q_sb + s * p.q_ss;
  T* k = static_cast<T*>(p.k) + b * p.k_sb + s * p.k_ss;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + s * p.v_ss;
  CacheT* k_cache = static_cast<CacheT*>(p.cache) + b * p.c_sb + slot * p.c_st;
  CacheT* v_cache = k_cache + p.c_skv;

  for (int w = threadIdx.x; w < end; w += blockDim.x) {
    if (w < q_end) {
      const int h = w / items;
      T* row = q + h * p.q_sh;
      rope_item<T, T, NEOX, N>(row, row, nullptr, w - h * items, rot_items, p.R, cos_sin, 1.f);
    } else if (w < k_end) {
      const int h = (w - q_end) / items;
      T* row = k + h * p.k_sh;
      rope_item<T, CacheT, NEOX, N>(row, k_cache + h * p.c_sh, p.write_k_in_place ? row : nullptr,
                                    w - q_end - h * items, rot_items, p.R, cos_sin, k_scale);
    } else {
      const int h = (w - k_end) / v_items;
      const int e0 = (w - k_end - h * v_items) * N;
      float x[N];
      load_float<T, N>(v + h * p.v_sh + e0, x);
      store_float<CacheT, N>(v_cache + h * p.c_sh + e0, x, v_scale);
    }
  }
}
