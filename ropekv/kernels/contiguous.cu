// RoPE on Q and K, and the write of K/V into a contiguous cache [B, 2, Hkv, C, D]
// (TensorRT-Edge-LLM's applyRopeWriteKV family: plain, tree decoding and split QKV).
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/contiguous.py.
struct RopeWriteKVParams {
  void* q;                  // (B, S, Hq, D) T, roped in place (read only when q_out is another)
  void* k;                  // (B, S, Hkv, D) T, roped in place when write_k_in_place
  const void* v;            // (B, S, Hkv, D) T
  void* cache;              // (B, 2, Hkv, C, D) CacheT
  const float* cos_sin;     // (Bc, P, R) float32, cos half then sin half
  const void* kv_end_lens;   // (B,) int32 or int64, or null: cache end after writing
  const void* position_ids;  // (B, S) int32 or int64, or null: RoPE positions, < 0 padding;
                             // mRoPE: (3, B, S)
  const float* kv_scale;    // (2,) or () dequantization scales of K and V (fp8 caches), or null
                            // for scales given as constants (inv_k_scale, inv_v_scale)
  void* q_out;              // MODE >= 2: (B, S, Hq, D) QT, the roped queries (q itself in place)
  float* q_scale_out;       // (B, S, Hq) float32 computed Q scales, or null
  float* cache_scales;      // (B, 2, Hkv, C) float32 computed K/V scales, or null
  i64 q_sb, q_ss, q_sh;     // strides in elements; the last dimension is contiguous
  i64 k_sb, k_ss, k_sh;
  i64 v_sb, v_ss, v_sh;
  i64 c_sb, c_skv, c_sh, c_st;
  i64 cs_sb, cs_sp;         // cs_sb is 0 for one table shared by the batch
  i64 qo_sb, qo_ss, qo_sh;  // q_out
  i64 qs_sb, qs_ss, qs_sh;  // q_scale_out
  i64 ks_sb, ks_skv, ks_sh, ks_st;  // cache_scales
  float inv_k_scale, inv_v_scale;  // stored = fp8(x * inv_scale) when kv_scale is null
  float inv_q_scale;        // fp8 QT with a static scale: stored = fp8(q * inv_q_scale)
  int B, S, Hq, Hkv, D, R, C, P;
  int write_k_in_place;
  int group;  // lanes per head row: one chunk each (blockDim.x is a multiple)
  int rows;   // head rows each lane group holds, 1 ..= kRowsMax
  int index64;  // bit 0: kv_end_lens is int64, bit 1: position_ids is int64
  int v_scale_index;  // kv_scale[v_scale_index] is V's scale: 1 for (2,), 0 for one shared ()
  int mrope;          // position_ids is (3, B, S): mRoPE by sections (MRope in common.cuh)
  int mrope_t, mrope_h, mrope_w, mrope_interleaved;
  int items;  // chunks per head row (= group, or less where computed scales pad groups to 2^k)
  int q_full;     // MODE >= 2: whole Q rows go to q_out, skipped tokens' rows unrotated
  int q_dynamic;  // MODE 6: computed Q scales (MODE 3, 5: always; 2, 4: never)
  int kv_dynamic;  // MODE 6: computed K/V scales (MODE 4, 5: always; 2, 3: never)
};

__device__ __forceinline__ i64 read_index(const void* p, i64 i, int is64) {
  return is64 ? static_cast<const i64*>(p)[i] : i64(static_cast<const int*>(p)[i]);
}

constexpr int kRowsMax = 4;  // head rows a lane group holds at once
constexpr int kMaxBlock = 256;

// An opaque copy of a loaded vector: the compiler must convert it anew (the asm "changes" it)
// instead of keeping values derived from it earlier.
template <typename T, int N>
__device__ __forceinline__ void launder(Vec<T, N>& x) {
  if constexpr (sizeof(x) % 4 == 0) {
    unsigned* w = reinterpret_cast<unsigned*>(&x);
#pragma unroll
    for (int i = 0; i < int(sizeof(x) / 4); ++i) asm volatile("" : "+r"(w[i]));
  } else {
    unsigned short* w = reinterpret_cast<unsigned short*>(&x);
#pragma unroll
    for (int i = 0; i < int(sizeof(x) / 2); ++i) asm volatile("" : "+h"(w[i]));
  }
}

// Largest value of each of a lane group's rows over its G lanes (G a power of two, groups aligned
// to G; every thread of the block calls it, lanes without a row passing 0). Values are >= 0 and
// never NaN, so their bits order as unsigned integers (the shared-memory path for G > 32).
__device__ __forceinline__ void group_row_max(float (&v)[kRowsMax], int G, int U) {
  if (G <= 32) {
    const int base = threadIdx.x & ~31;  // a last, partial warp holds whole groups only
    const unsigned mask = blockDim.x - base >= 32 ? 0xffffffffu
                                                  : (1u << (blockDim.x - base)) - 1u;
#pragma unroll
    for (int u = 0; u < kRowsMax; ++u) {
      if (u >= U) break;  // U is the block's: uniform
      for (int o = G >> 1; o > 0; o >>= 1) v[u] = fmaxf(v[u], __shfl_xor_sync(mask, v[u], o));
    }
    return;
  }
  __shared__ unsigned m[kRowsMax * (kMaxBlock / 64)];
  const int slots = blockDim.x / G, slot = threadIdx.x / G;
  if (threadIdx.x < kRowsMax * slots) m[threadIdx.x] = 0u;
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u)
    if (u < U && v[u] > 0.f) atomicMax(&m[u * slots + slot], __float_as_uint(v[u]));
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u)
    if (u < U) v[u] = __uint_as_float(m[u * slots + slot]);
}

// A token's head rows are Q (Hq), K (Hkv) and V (Hkv): H = Hq + 2 Hkv rows of D dims, each cut
// into `items` chunks: chunk j < rot_items holds RoPE pairs (neox: dims [jN, jN + N) and their
// partners R/2 further; interleaved: dims [jN, jN + N)), the rest N pass-through dims of [R, D).
// A group of G = items lanes holds one row, lane j chunk j; a block of blockDim.x / G groups takes
// p.rows rows per group: grid (B * S, splits), splits = ceil(H / (blockDim.x / G * p.rows)), so
// decode splits a token's rows over several blocks and prefill gives a block a whole token.
// Every lane loads all its rows first, then reads the token's slot and position (and through the
// position its cos/sin values), then ropes and stores: one round trip to memory for the rows,
// overlapping the index loads. Q pass-through dims are not touched (Q roped in place); K rows
// go to the cache (quantized), their rotary dims back into k when asked; V rows are copied.
// A token whose slot falls outside [0, C) or whose position falls outside [0, P) is skipped whole:
// nothing is read through its indices, nothing is written.
// MODE (docs/conventions.md, "Options cost nothing when off"): 0 the plain kernel, every option
// compiled out; 1 reads mRoPE and constant K/V scales; 2 adds the quantized outputs: Q goes to
// q_out (QT; whole rows when q_full, a skipped token's row unrotated) with a static scale; 3 the
// same with a computed scale per Q row, 4 with static Q and computed K/V scales, 5 with both
// computed; none of 2-5 reads mRoPE positions (mRoPE's three cos/sin rows cost ~40 registers,
// the prefill's occupancy), and 6, every quantized option read at run time, does. A computed
// scale needs the row's amax before its first store: the rows are converted
// (and roped) once for the amax, reduced over the lane group (padded to a power of two), and
// converted again for the stores from the loaded vectors, laundered so that the compiler does
// not keep the first pass's floats alive instead (registers: occupancy is the prefill's lever).
template <typename T, typename CacheT, typename QT, bool NEOX, int N, int MODE>
__global__ void __launch_bounds__(kMaxBlock) apply_rope_write_kv(const RopeWriteKVParams p) {
  constexpr bool OPTS = MODE >= 1;
  constexpr bool QUANT = MODE >= 2;
  // computed Q scales, computed K/V scales (quantized types only: the flags of MODE 6 are
  // only set for them)
  const bool qdyn = is_quantized<QT>::value && (MODE == 6 ? p.q_dynamic != 0
                                                          : MODE == 3 || MODE == 5);
  const bool kvdyn = is_quantized<CacheT>::value && (MODE == 6 ? p.kv_dynamic != 0
                                                               : MODE == 4 || MODE == 5);
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
  const bool live = !QUANT || j < p.items;  // a lane of a padded group's tail holds no chunk
  const bool q_full = QUANT && p.q_full;    // Q pass-through chunks are moved too

  T* q = static_cast<T*>(p.q) + b * p.q_sb + s * p.q_ss;
  T* k = static_cast<T*>(p.k) + b * p.k_sb + s * p.k_ss;
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + s * p.v_ss;

  pdl_wait();
  // 1. this lane's chunks of its rows (Q rows: rotary chunks only, unless q_full)
  Vec<T, N> va[kRowsMax], vb[kRowsMax];
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || !live || (h < p.Hq && !rotary && !q_full)) continue;
    const T* row = h < p.Hq             ? q + h * p.q_sh
                   : h < p.Hq + p.Hkv ? k + (h - p.Hq) * p.k_sh
                                      : v + (h - p.Hq - p.Hkv) * p.v_sh;
    va[u] = load<T, N>(row + ea);
    if (pair) vb[u] = load<T, N>(row + eb);
  }

  // 2. slot, position, scales, cos/sin
  const i64 end = p.kv_end_lens ? read_index(p.kv_end_lens, b, p.index64 & 1) : i64(p.S);
  const i64 slot = end < i64(p.S) - s ? -1 : end - p.S + s;  // no overflow at int64 extremes
  const bool mrope = (MODE == 1 || MODE == 6) && p.mrope;
  i64 pos = p.position_ids && !mrope ? read_index(p.position_ids, token, p.index64 & 2) : slot;
  i64 mpos[3] = {0, 0, 0};
  if (mrope) {  // three positions, rows B * S apart; one outside [0, P) skips the token
    mrope_positions(p.position_ids, p.index64 & 2, token, i64(p.B) * p.S, mpos);
    pos = mrope_in_range(mpos, p.P) ? 0 : -1;
  }
  float k_scale = 1.f, v_scale = 1.f;
  if (is_fp8<CacheT>::value && !kvdyn) {  // stored = fp8(x / scale)
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
  const bool valid = !(slot < 0 || slot >= p.C || pos < 0 || pos >= p.P);
  if (!valid && !q_full) return;  // with q_full a skipped token still writes its Q rows
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (rotary && valid && mrope) {
    const MRope m{p.mrope_t, p.mrope_h, p.mrope_w, p.mrope_interleaved};
    load_mrope_cos_sin<M>(p.cos_sin + b * p.cs_sb, p.cs_sp, mpos, m, half_r, NEOX ? ea : ea / 2,
                          c, sn);
  } else if (rotary && valid) {
    const float* cs = p.cos_sin + b * p.cs_sb + pos * p.cs_sp + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }
  CacheT* k_cache = static_cast<CacheT*>(p.cache) + b * p.c_sb + slot * p.c_st;

  // row u as floats (not roped)
  auto row_floats = [&](int u, float (&a)[N], float (&bb)[N]) {
    to_floats<T, N>(va[u], a);
    if (pair) to_floats<T, N>(vb[u], bb);
  };
  // whether this lane holds a chunk of row u (h) that the call writes
  auto writes = [&](int u, int h) {
    if (u >= U || h >= H || !live || (h < p.Hq && !rotary && !q_full)) return false;
    return QUANT ? (h < p.Hq || valid) : true;
  };

  // computed scales: each row's amax (a row whose scale is static reduces a 0 nobody reads)
  float amax[kRowsMax];
  if (qdyn || kvdyn) {
#pragma unroll
    for (int u = 0; u < kRowsMax; ++u) {
      const int h = first + u * slots;
      amax[u] = 0.f;
      if (!writes(u, h) || (h < p.Hq ? !qdyn : !kvdyn)) continue;
      float a[N], bb[N];
      row_floats(u, a, bb);
      if (rotary && valid && h < p.Hq + p.Hkv) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        amax[u] = fmaxf(amax[u], fabsf(a[i]));
        if (pair) amax[u] = fmaxf(amax[u], fabsf(bb[i]));
      }
      launder(va[u]);  // the stores convert again (above)
      if (pair) launder(vb[u]);
    }
    group_row_max(amax, G, U);
  }

  // 3. rope, store
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (!writes(u, h)) continue;
    float a[N], bb[N];
    row_floats(u, a, bb);
    if (h >= p.Hq + p.Hkv) {  // V: copied (quantized)
      const int hv = h - p.Hq - p.Hkv;
      CacheT* dst = k_cache + p.c_skv + hv * p.c_sh;
      float mul = v_scale;
      if constexpr (is_quantized<CacheT>::value) {
        if (kvdyn) {
          const RowScale r = row_scale<CacheT>(amax[u]);
          mul = r.mul;
          if (j == 0)
            p.cache_scales[b * p.ks_sb + p.ks_skv + hv * p.ks_sh + slot * p.ks_st] = r.scale;
        }
      }
      store_float<CacheT, N>(dst + ea, a, mul);
      if (pair) store_float<CacheT, N>(dst + eb, bb, mul);
      continue;
    }
    if (rotary && valid) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
    if (h < p.Hq) {  // Q: rotated in place, or to q_out
      if constexpr (QUANT) {
        QT* row = static_cast<QT*>(p.q_out) + b * p.qo_sb + s * p.qo_ss + h * p.qo_sh;
        float mul = p.inv_q_scale;
        if constexpr (is_quantized<QT>::value) {
          if (qdyn) {
            const RowScale r = row_scale<QT>(amax[u]);
            mul = r.mul;
            if (j == 0) p.q_scale_out[b * p.qs_sb + s * p.qs_ss + h * p.qs_sh] = r.scale;
          }
        }
        store_float<QT, N>(row + ea, a, mul);
        if (pair) store_float<QT, N>(row + eb, bb, mul);
      } else {
        T* row = q + h * p.q_sh;
        store_float<T, N>(row + ea, a);
        if (pair) store_float<T, N>(row + eb, bb);
      }
    } else {  // K: to the cache (quantized), and back into k when asked
      const int hk = h - p.Hq;
      CacheT* dst = k_cache + hk * p.c_sh;
      float mul = k_scale;
      if constexpr (is_quantized<CacheT>::value) {
        if (kvdyn) {
          const RowScale r = row_scale<CacheT>(amax[u]);
          mul = r.mul;
          if (j == 0) p.cache_scales[b * p.ks_sb + hk * p.ks_sh + slot * p.ks_st] = r.scale;
        }
      }
      store_float<CacheT, N>(dst + ea, a, mul);
      if (pair) store_float<CacheT, N>(dst + eb, bb, mul);
      if (p.write_k_in_place && rotary) {
        T* row = k + hk * p.k_sh;
        store_float<T, N>(row + ea, a);
        if (pair) store_float<T, N>(row + eb, bb);
      }
    }
  }
}
