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
  const void* position_ids;  // (B, S) int32 or int64, or null: RoPE positions, < 0 padding;
                             // mRoPE: (3, B, S)
  const float* kv_scale;    // (2,) or () dequantization scales of K and V (fp8 caches), or null
                            // for scales given as constants (inv_k_scale, inv_v_scale)
  i64 q_sb, q_ss, q_sh;     // strides in elements; the last dimension is contiguous
  i64 k_sb, k_ss, k_sh;
  i64 v_sb, v_ss, v_sh;
  i64 c_sb, c_skv, c_sh, c_st;
  i64 cs_sb, cs_sp;         // cs_sb is 0 for one table shared by the batch
  float inv_k_scale, inv_v_scale;  // stored = fp8(x * inv_scale) when kv_scale is null
  int B, S, Hq, Hkv, D, R, C, P;
  int write_k_in_place;
  int group;  // lanes per head row: one chunk each (blockDim.x is a multiple)
  int rows;   // head rows each lane group holds, 1 ..= kRowsMax
  int index64;  // bit 0: kv_end_lens is int64, bit 1: position_ids is int64
  int v_scale_index;  // kv_scale[v_scale_index] is V's scale: 1 for (2,), 0 for one shared ()
  int mrope;          // position_ids is (3, B, S): mRoPE by sections (MRope in common.cuh)
  int mrope_t, mrope_h, mrope_w, mrope_interleaved;
};

__device__ __forceinline__ i64 read_index(const void* p, i64 i, int is64) {
  return is64 ? static_cast<const i64*>(p)[i] : i64(static_cast<const int*>(p)[i]);
}

constexpr int kRowsMax = 4;  // head rows a lane group holds at once

// A token's head rows are Q (Hq), K (Hkv) and V (Hkv): H = Hq + 2 Hkv rows of D dims, each cut
// into `items` chunks: chunk j < rot_items holds RoPE pairs (neox: dims [jN, jN + N) and their
// partners R/2 further; interleaved: dims [jN, jN + N)), the rest N pass-through dims of [R, D).
// A group of G = items lanes holds one row, lane j chunk j; a block of blockDim.x / G groups takes
// p.rows rows per group: grid (B * S, splits), splits = ceil(H / (blockDim.x / G * p.rows)), so
// decode splits a token's rows over several blocks and prefill gives a block a whole token.
// Every lane loads all its rows first, then reads the token's slot and position (and through the
// position its cos/sin values), then ropes and stores: one round trip to memory for the rows,
// overlapping the index loads. Q pass-through dims are not touched (Q is roped in place); K rows
// go to the cache (quantized), their rotary dims back into k when asked; V rows are copied.
// A token whose slot falls outside [0, C) or whose position falls outside [0, P) is skipped whole:
// nothing is read through its indices, nothing is written.
// OPTS: the options (mRoPE, constant K/V scales) are read; without it they are compiled out and
// the kernel is the plain one (an option costs nothing when off).
template <typename T, typename CacheT, bool NEOX, int N, bool OPTS>
__global__ void __launch_bounds__(256) apply_rope_write_kv(const RopeWriteKVParams p) {
  pdl_launch_dependents();
  const int token = blockIdx.x;
  const int b = token / p.S;
  const int s = token - b * p.S;
  const int G = p.group;
  const int U = p.rows;
  const int slots = blockDim.x / G;
  const int j = threadIdx.x % G;
  const int first = blockIdx.y * slots * U + threadIdx.x / G;  // row of u = 0; u adds u * slots
  const int H = p.Hq + 2 * p.Hkv;
  const int half_r = p.R >> 1;
  const int rot_items = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < rot_items;
  const bool pair = NEOX && rotary;  // two vectors per chunk
  const int ea = rotary ? j * N : p.R + (j - rot_items) * N;
  const int eb = ea + half_r;

  T* q = static_cast<T*>(p.q) + b * p.q_sb + s * p.q_ss;
  T* k = static_cast<T*>(p.k) + b * p.k_sb + s * p.k_ss;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + s * p.v_ss;

  pdl_wait();
  // 1. this lane's chunks of its rows (Q rows: rotary chunks only)
  Vec<T, N> va[kRowsMax], vb[kRowsMax];
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || (h < p.Hq && !rotary)) continue;
    const T* row = h < p.Hq             ? q + h * p.q_sh
                   : h < p.Hq + p.Hkv ? k + (h - p.Hq) * p.k_sh
                                      : v + (h - p.Hq - p.Hkv) * p.v_sh;
    va[u] = load<T, N>(row + ea);
    if (pair) vb[u] = load<T, N>(row + eb);
  }

  // 2. slot, position, scales, cos/sin
  const i64 end = p.kv_end_lens ? read_index(p.kv_end_lens, b, p.index64 & 1) : i64(p.S);
  const i64 slot = end < i64(p.S) - s ? -1 : end - p.S + s;  // no overflow at int64 extremes
  const bool mrope = OPTS && p.mrope;
  i64 pos = p.position_ids && !mrope ? read_index(p.position_ids, token, p.index64 & 2) : slot;
  i64 mpos[3] = {0, 0, 0};
  if (mrope) {  // three positions, rows B * S apart; one outside [0, P) skips the token
    mrope_positions(p.position_ids, p.index64 & 2, token, i64(p.B) * p.S, mpos);
    pos = mrope_in_range(mpos, p.P) ? 0 : -1;
  }
  float k_scale = 1.f, v_scale = 1.f;
  if (is_fp8<CacheT>::value) {  // stored = fp8(x / scale)
    if (!OPTS || p.kv_scale) {
      k_scale = 1.f / p.kv_scale[0];
      v_scale = 1.f / p.kv_scale[p.v_scale_index];
      // a scale outside (0, inf) (read on the device, unchecked by the host) writes nothing
      constexpr float kMax = 3.40282347e38f;  // FLT_MAX: NaN and inf fail the test below
      if (!(k_scale > 0.f && k_scale <= kMax && v_scale > 0.f && v_scale <= kMax)) return;
    } else {  // constants, checked by the host
      k_scale = p.inv_k_scale;
      v_scale = p.inv_v_scale;
    }
  }
  if (slot < 0 || slot >= p.C || pos < 0 || pos >= p.P) return;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (rotary && mrope) {
    const MRope m{p.mrope_t, p.mrope_h, p.mrope_w, p.mrope_interleaved};
    load_mrope_cos_sin<M>(p.cos_sin + b * p.cs_sb, p.cs_sp, mpos, m, half_r, NEOX ? ea : ea / 2,
                          c, sn);
  } else if (rotary) {
    const float* cs = p.cos_sin + b * p.cs_sb + pos * p.cs_sp + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }
  CacheT* k_cache = static_cast<CacheT*>(p.cache) + b * p.c_sb + slot * p.c_st;

  // 3. rope, store
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || (h < p.Hq && !rotary)) continue;
    float a[N], bb[N];
    to_floats<T, N>(va[u], a);
    if (pair) to_floats<T, N>(vb[u], bb);
    if (h >= p.Hq + p.Hkv) {  // V: copied (quantized)
      CacheT* dst = k_cache + p.c_skv + (h - p.Hq - p.Hkv) * p.c_sh;
      store_float<CacheT, N>(dst + ea, a, v_scale);
      if (pair) store_float<CacheT, N>(dst + eb, bb, v_scale);
      continue;
    }
    if (rotary) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
    if (h < p.Hq) {  // Q: rotated in place
      T* row = q + h * p.q_sh;
      store_float<T, N>(row + ea, a);
      if (pair) store_float<T, N>(row + eb, bb);
    } else {  // K: to the cache (quantized), and back into k when asked
      const int hk = h - p.Hq;
      CacheT* dst = k_cache + hk * p.c_sh;
      store_float<CacheT, N>(dst + ea, a, k_scale);
      if (pair) store_float<CacheT, N>(dst + eb, bb, k_scale);
      if (p.write_k_in_place && rotary) {
        T* row = k + hk * p.k_sh;
        store_float<T, N>(row + ea, a);
        if (pair) store_float<T, N>(row + eb, bb);
      }
    }
  }
}
