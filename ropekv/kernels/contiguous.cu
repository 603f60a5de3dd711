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
  const void* kv_end_lens;   // (B,) int32 or int64, or null: cache end after writing
  const void* position_ids;  // (B, S) int32 or int64, or null: RoPE positions, < 0 marks padding
  const float* kv_scale;    // (2,) dequantization scales of K and V (fp8 caches)
  i64 q_sb, q_ss, q_sh;     // strides in elements; the last dimension is contiguous
  i64 k_sb, k_ss, k_sh;
  i64 v_sb, v_ss, v_sh;
  i64 c_sb, c_skv, c_sh, c_st;
  i64 cs_sb, cs_sp;         // cs_sb is 0 for one table shared by the batch
  int B, S, Hq, Hkv, D, R, C, P;
  int write_k_in_place;
  int index64;  // bit 0: kv_end_lens is int64, bit 1: position_ids is int64
};

__device__ __forceinline__ i64 read_index(const void* p, i64 i, int is64) {
  return is64 ? static_cast<const i64*>(p)[i] : i64(static_cast<const int*>(p)[i]);
}

// One block per token (b, s). Thread t owns chunk j = t % items of a head row (a chunk of RoPE
// pairs, or N pass-through dims of [R, D)) and walks the Q then K heads h = t / items, t / items +
// hp, ... (hp = blockDim.x / items), so its cos/sin values are loaded once, and two heads are in
// flight per step. V is a plain copy spread over the whole block. (Four heads in flight per step
// was tried: 98 registers, 25% occupancy, slower.)
// A token whose slot falls outside [0, C) or whose position falls outside [0, P) is skipped whole:
// nothing is read through its indices, nothing is written.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(256) apply_rope_write_kv(const RopeWriteKVParams p) {
  const int token = blockIdx.x;
  const int b = token / p.S;
  const int s = token - b * p.S;
  const i64 end = p.kv_end_lens ? read_index(p.kv_end_lens, b, p.index64 & 1) : i64(p.S);
  const i64 slot = end < i64(p.S) - s ? -1 : end - p.S + s;  // no overflow at int64 extremes
  const i64 pos = p.position_ids ? read_index(p.position_ids, token, p.index64 & 2) : slot;
  if (slot < 0 || slot >= p.C || pos < 0 || pos >= p.P) return;

  float k_scale = 1.f, v_scale = 1.f;
  if (is_fp8<CacheT>::value) {  // stored = fp8(x / scale)
    k_scale = 1.f / p.kv_scale[0];
    v_scale = 1.f / p.kv_scale[1];
    // a scale outside (0, inf) (read on the device, unchecked by the host) writes nothing
    constexpr float kMax = 3.40282347e38f;  // FLT_MAX: NaN and inf fail the test below
    if (!(k_scale > 0.f && k_scale <= kMax && v_scale > 0.f && v_scale <= kMax)) return;
  }
  const int half_r = p.R >> 1;
  const int rot_items = NEOX ? half_r / N : p.R / N;
  const int items = rot_items + (p.D - p.R) / N;  // chunks per head row
  const int hp = blockDim.x / items;              // heads in parallel
  const int j = threadIdx.x % items;
  const int h0 = threadIdx.x / items;

  T* q = static_cast<T*>(p.q) + b * p.q_sb + s * p.q_ss;
  T* k = static_cast<T*>(p.k) + b * p.k_sb + s * p.k_ss;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + s * p.v_ss;
  CacheT* k_cache = static_cast<CacheT*>(p.cache) + b * p.c_sb + slot * p.c_st;
  CacheT* v_cache = k_cache + p.c_skv;

  if (h0 < hp) {
    const bool rotary = j < rot_items;
    const int ea = rotary ? j * N : p.R + (j - rot_items) * N;  // first operand of the chunk
    const int eb = ea + half_r;                                 // its neox partner
    constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
    float c[M], sn[M];
    if (rotary) {
      const float* cs = p.cos_sin + b * p.cs_sb + pos * p.cs_sp + (NEOX ? ea : ea / 2);
      load_float<float, M>(cs, c);
      load_float<float, M>(cs + half_r, sn);
    }
    const int H = p.Hq + p.Hkv;
    for (int h = h0; h < H; h += 2 * hp) {
      const int hs[2] = {h, h + hp};
      float xa[2][N], xb[2][N];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (hs[u] >= H || (!rotary && hs[u] < p.Hq)) continue;  // Q pass-through stays as is
        const T* row = hs[u] < p.Hq ? q + hs[u] * p.q_sh : k + (hs[u] - p.Hq) * p.k_sh;
        load_float<T, N>(row + ea, xa[u]);
        if (NEOX && rotary) load_float<T, N>(row + eb, xb[u]);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (hs[u] >= H || (!rotary && hs[u] < p.Hq)) continue;
        if (rotary) {
          rotate_chunk<NEOX, N, M>(xa[u], xb[u], c, sn);
        }
        if (hs[u] < p.Hq) {  // Q: rotated in place
          T* row = q + hs[u] * p.q_sh;
          store_float<T, N>(row + ea, xa[u]);
          if (NEOX) store_float<T, N>(row + eb, xb[u]);
        } else {  // K: to the cache (quantized), and back into k when asked
          const int hk = hs[u] - p.Hq;
          CacheT* dst = k_cache + hk * p.c_sh;
          store_float<CacheT, N>(dst + ea, xa[u], k_scale);
          if (NEOX && rotary) store_float<CacheT, N>(dst + eb, xb[u], k_scale);
          if (p.write_k_in_place && rotary) {
            T* row = k + hk * p.k_sh;
            store_float<T, N>(row + ea, xa[u]);
            if (NEOX) store_float<T, N>(row + eb, xb[u]);
          }
        }
      }
    }
  }

  const int v_items = p.D / N;
  for (int w = threadIdx.x; w < p.Hkv * v_items; w += blockDim.x) {
    const int h = w / v_items;
    const int e0 = (w - h * v_items) * N;
    float x[N];
    load_float<T, N>(v + h * p.v_sh + e0, x);
    store_float<CacheT, N>(v_cache + h * p.c_sh + e0, x, v_scale);
  }
}
