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

// The lean kernel's record where its offsets are 32-bit (I = int; the host then also keeps every
// stride within int32): RopeWriteKVParams's fields that it reads, in its order, strides as int. A
// kernel reads its parameters through the constant cache: from RopeWriteKVParams the lean
// kernel's SASS (sm_90a) read 5 lines of 64 bytes, from these 168 bytes 3 (QKDecodeParams in
// qknorm.cu: the same change took 3-6% off its decode calls). 64-bit offsets keep
// RopeWriteKVParams. Field order and types mirror LEAN_PARAMS in ropekv/contiguous.py.
struct RopeWriteKVLeanParams {
  void* q;
  void* k;
  const void* v;
  void* cache;
  const float* cos_sin;
  const void* kv_end_lens;
  const void* position_ids;
  const float* kv_scale;
  int q_sb, q_ss, q_sh;
  int k_sb, k_ss, k_sh;
  int v_sb, v_ss, v_sh;
  int c_sb, c_skv, c_sh, c_st;
  int cs_sb, cs_sp;
  float inv_k_scale, inv_v_scale;
  int S, Hq, Hkv, R, C, P;
  int write_k_in_place;
  int index64;
  int v_scale_index;
};

template <typename I>
using LeanParams =
    typename pick_type<sizeof(I) == 4, RopeWriteKVLeanParams, RopeWriteKVParams>::type;

__device__ __forceinline__ i64 read_index(const void* p, i64 i, int is64) {
  return is64 ? static_cast<const i64*>(p)[i] : i64(static_cast<const int*>(p)[i]);
}

// read_index through the read-only path (the lean kernel: index arrays are never written)
__device__ __forceinline__ i64 ldg_index(const void* p, int i, int is64) {
  return is64 ? __ldg(static_cast<const i64*>(p) + i) : i64(__ldg(static_cast<const int*>(p) + i));
}

constexpr int kRowsMax = 4;  // head rows a lane group holds at once
// ... in the computed-scale MODEs 3-5 (their registers: a block of 2-row groups in prefill)
constexpr int kScaledRowsMax = 2;
constexpr int kMaxBlock = 256;

// Largest value of a lane group's row over its G lanes (G a power of two, groups aligned to G).
// Every thread of the block calls reduce(v, u) for u = 0, 1, ... in turn (lanes without a row
// passing 0). Values are >= 0 and never NaN, so their bits order as unsigned integers (the
// shared-memory path for G > 32: one slot per lane group and row, zeroed once).
struct GroupMax {
  int G;
  unsigned mask;  // the lanes of this warp (a last, partial warp holds whole groups only)
  __device__ __forceinline__ explicit GroupMax(int g) : G(g) {
    const int base = threadIdx.x & ~31;
    mask = blockDim.x - base >= 32 ? 0xffffffffu : (1u << (blockDim.x - base)) - 1u;
    if (G > 32) {
      if (threadIdx.x < kRowsMax * (blockDim.x / G)) slots()[threadIdx.x] = 0u;
      __syncthreads();
    }
  }
  static __device__ __forceinline__ unsigned* slots() {
    __shared__ unsigned m[kRowsMax * (kMaxBlock / 64)];
    return m;
  }
  __device__ __forceinline__ float reduce(float v, int u) const {
    if (G <= 32) {
      for (int o = G >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
      return v;
    }
    unsigned* m = slots() + u * (blockDim.x / G) + threadIdx.x / G;
    if (v > 0.f) atomicMax(m, __float_as_uint(v));
    __syncthreads();
    return __uint_as_float(*m);
  }
};

// x unchanged, but (to the compiler) computed from dep: what is derived from x waits for dep.
template <typename T, int Nv>
__device__ __forceinline__ void chain(Vec<T, Nv>& x, float dep) {
  if constexpr (sizeof(x) % 4 == 0) {
    unsigned* w = reinterpret_cast<unsigned*>(&x);
#pragma unroll
    for (int i = 0; i < int(sizeof(x) / 4); ++i) asm volatile("" : "+r"(w[i]) : "f"(dep));
  } else {
    unsigned short* w = reinterpret_cast<unsigned short*>(&x);
#pragma unroll
    for (int i = 0; i < int(sizeof(x) / 2); ++i) asm volatile("" : "+h"(w[i]) : "f"(dep));
  }
}

// row_scale (common.cuh) without its two IEEE divisions (each a call into a slow path): mul =
// max_code * rcp(a) by the fast division, scale = a * (1 / max_code). Both within a few ulp of
// the exact quotients (the tests compare dequantized rows and scales with float32 tolerance);
// a = inf still gives scale inf and mul 0.
template <typename T>
__device__ __forceinline__ RowScale fast_row_scale(float amax) {
  const float a = fmaxf(amax, 1e-6f);
  return {__fdividef(max_code<T>(), a), a * (1.f / max_code<T>())};
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
// q_out (QT; whole rows when q_full, a skipped token's row unrotated) with a static scale (also
// the kernel of constant K/V scales without mRoPE: Q in place through q_out = q); 3 the same
// with a computed scale per Q row, 4 with static Q and computed K/V scales, 5 with both
// computed; none of 2-5 reads mRoPE positions (mRoPE's three cos/sin rows cost ~40 registers,
// the prefill's occupancy), and 6, every quantized option read at run time, does. A computed
// scale needs the row's amax before its first store (3a): row by row, the lane converts and
// ropes its chunk once, the lane group reduces the row's amax, and the lane stores from the same
// floats; the next row's vectors are tied to this row's amax (chain), so that the compiler does
// not convert rows ahead across the reduction (the others wait as loaded 16-bit vectors; ptxas's
// register count was the same without it, the measured build has it).
template <typename T, typename CacheT, typename QT, bool NEOX, int N, int MODE>
__device__ __forceinline__ void rope_write_kv(const RopeWriteKVParams& p) {
  constexpr bool OPTS = MODE >= 1;
  constexpr bool QUANT = MODE >= 2;
  // computed Q scales, computed K/V scales (quantized types only: the flags of MODE 6 are
  // only set for them)
  const bool qdyn = is_quantized<QT>::value && (MODE == 6 ? p.q_dynamic != 0
                                                          : MODE == 3 || MODE == 5);
  const bool kvdyn = is_quantized<CacheT>::value && (MODE == 6 ? p.kv_dynamic != 0
                                                               : MODE == 4 || MODE == 5);
  constexpr int kRows = MODE >= 3 && MODE <= 5 ? kScaledRowsMax : kRowsMax;
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
  Vec<T, N> va[kRows], vb[kRows];
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
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

  // 3a. computed scales (MODE 3-5, 6 with them)
  if (MODE >= 3 && (qdyn || kvdyn)) {
    // store row h's roped floats; amax: the row's largest magnitude (read only where its scale is
    // computed)
    auto store_row = [&](int h, float (&a)[N], float (&bb)[N], float amax) {
      if (h >= p.Hq + p.Hkv) {  // V: copied (quantized)
        const int hv = h - p.Hq - p.Hkv;
        CacheT* dst = k_cache + p.c_skv + hv * p.c_sh;
        float mul = v_scale;
        if constexpr (is_quantized<CacheT>::value) {
          if (kvdyn) {
            const RowScale r = fast_row_scale<CacheT>(amax);
            mul = r.mul;
            if (j == 0)
              p.cache_scales[b * p.ks_sb + p.ks_skv + hv * p.ks_sh + slot * p.ks_st] = r.scale;
          }
        }
        store_float<CacheT, N>(dst + ea, a, mul);
        if (pair) store_float<CacheT, N>(dst + eb, bb, mul);
        return;
      }
      if (h < p.Hq) {  // Q: rotated in place, or to q_out
        if constexpr (QUANT) {
          QT* row = static_cast<QT*>(p.q_out) + b * p.qo_sb + s * p.qo_ss + h * p.qo_sh;
          float mul = p.inv_q_scale;
          if constexpr (is_quantized<QT>::value) {
            if (qdyn) {
              const RowScale r = fast_row_scale<QT>(amax);
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
            const RowScale r = fast_row_scale<CacheT>(amax);
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
    };
    GroupMax gm(G);
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if (u >= U) break;  // U is the block's: uniform
      const int h = first + u * slots;
      const bool w = writes(u, h);
      float a[N], bb[N];
      float amax = 0.f;
      if (w) {
        row_floats(u, a, bb);
        if (h < p.Hq + p.Hkv && rotary && valid) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
        if (h < p.Hq ? qdyn : kvdyn) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            amax = fmaxf(amax, fabsf(a[i]));
            if (pair) amax = fmaxf(amax, fabsf(bb[i]));
          }
        }
      }
      amax = gm.reduce(amax, u);
      if (u + 1 < kRows) {  // row u + 1 converts after this row's amax
        chain(va[u + 1], amax);
        if (pair) chain(vb[u + 1], amax);
      }
      if (w) store_row(h, a, bb, amax);
    }
    return;
  }

  // 3. rope, store
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    const int h = first + u * slots;
    if (!writes(u, h)) continue;
    float a[N], bb[N];
    row_floats(u, a, bb);
    if (h >= p.Hq + p.Hkv) {  // V: copied (quantized)
      const int hv = h - p.Hq - p.Hkv;
      CacheT* dst = k_cache + p.c_skv + hv * p.c_sh;
      const float mul = v_scale;
      store_float<CacheT, N>(dst + ea, a, mul);
      if (pair) store_float<CacheT, N>(dst + eb, bb, mul);
      continue;
    }
    if (rotary && valid) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
    if (h < p.Hq) {  // Q: rotated in place, or to q_out
      if constexpr (QUANT) {
        QT* row = static_cast<QT*>(p.q_out) + b * p.qo_sb + s * p.qo_ss + h * p.qo_sh;
        const float mul = p.inv_q_scale;
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
      const float mul = k_scale;
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

// The kernels: MODE 0-2 and 6, and the computed-scale MODEs 3-5 under a register cap of 80, the
// plain kernel's count (uncapped, ptxas gives them ~100 with 2 rows a group, ~110 with 4; capped
// at 80 with 2 rows nothing spills on sm_90). A separate entry because any cap or block-count hint
// on the one template changes the plain kernel's code too.
template <typename T, typename CacheT, typename QT, bool NEOX, int N, int MODE>
__global__ void __launch_bounds__(kMaxBlock) apply_rope_write_kv(const RopeWriteKVParams p) {
  rope_write_kv<T, CacheT, QT, NEOX, N, MODE>(p);
}

#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define ROPEKV_SCALED_BOUNDS __maxnreg__(80)
#else
#define ROPEKV_SCALED_BOUNDS __launch_bounds__(kMaxBlock)
#endif

template <typename T, typename CacheT, typename QT, bool NEOX, int N, int MODE>
__global__ void ROPEKV_SCALED_BOUNDS apply_rope_write_kv_scaled(const RopeWriteKVParams p) {
  static_assert(MODE >= 3 && MODE <= 5, "the computed-scale modes");
  rope_write_kv<T, CacheT, QT, NEOX, N, MODE>(p);
}

// The lean decode kernel (the plain call: no mRoPE, no q_out, no computed scales; Q roped in
// place, K/V into a 16-bit or fp8 cache with a scale array or constants): one N-element chunk of
// one head row per thread, the layout qk_rope_lean (qk_rope.cu) found fastest at decode. Block
// (items, rows): threadIdx.x is the chunk j, threadIdx.y the row of blockIdx.x's group of
// blockDim.y rows (Q [0, Hq), K, V); grid (splits, S, B): blockIdx.y is s, blockIdx.z is b, so
// no index needs a division. The index loads (kv_end_lens, position_ids, kv_scale) are issued
// first and the row loads right behind them; only the cos/sin loads (Q and K rotary chunks) wait
// for the position, the cache stores for the slot. Same rules as rope_write_kv (MODE 0, and 2
// with q_out = q): a token whose slot falls outside [0, C) or whose position falls outside
// [0, P) writes nothing; a kv_scale array holding a scale outside (0, inf) makes the launch
// write nothing (Q included); Q pass-through chunks are not touched; K's rotary chunks go back
// into k with write_k_in_place. Offsets are of type I (int where every array's span fits in 31
// bits, the host decides; long long otherwise); the slot and position are checked before they
// take part in one.
template <typename T, typename CacheT, bool NEOX, int N, typename I>
__global__ void __launch_bounds__(kMaxBlock)
    apply_rope_write_kv_lean(const LeanParams<I> p) {
  pdl_launch_dependents();
  const int h = blockIdx.x * blockDim.y + threadIdx.y;
  const int H = p.Hq + 2 * p.Hkv;
  const int j = threadIdx.x;
  const int half_r = p.R >> 1;
  const int rot = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < rot;
  const bool is_q = h < p.Hq;
  if (h >= H || (is_q && !rotary)) return;  // no row, or a Q pass-through chunk (left as is)
  const int s = blockIdx.y;
  const int b = blockIdx.z;
  pdl_wait();
  // 1. the indices (and scales), then this lane's chunk of its row: all loads in flight together
  i64 end = p.S;
  if (p.kv_end_lens) end = ldg_index(p.kv_end_lens, b, p.index64 & 1);
  i64 pos = 0;
  if (p.position_ids) pos = ldg_index(p.position_ids, b * p.S + s, p.index64 & 2);
  float k_div = 1.f, v_div = 1.f;  // the scales of a kv_scale array
  if (is_fp8<CacheT>::value && p.kv_scale) {
    k_div = __ldg(p.kv_scale);
    v_div = __ldg(p.kv_scale + p.v_scale_index);
  }
  const bool is_k = !is_q && h < p.Hq + p.Hkv;
  const int hh = is_q ? h : is_k ? h - p.Hq : h - p.Hq - p.Hkv;  // head within Q, K or V
  const bool pair = NEOX && rotary;  // two vectors per chunk: x[e] and its partner x[e + R/2]
  const int e = rotary ? j * N : p.R + (j - rot) * N;
  // V is only read (the cast lets one pointer serve the three)
  T* row = static_cast<T*>(is_q ? p.q : is_k ? p.k : const_cast<void*>(p.v)) +
           (I(b) * I(is_q ? p.q_sb : is_k ? p.k_sb : p.v_sb) +
            I(s) * I(is_q ? p.q_ss : is_k ? p.k_ss : p.v_ss) +
            I(hh) * I(is_q ? p.q_sh : is_k ? p.k_sh : p.v_sh) + I(e));
  const Vec<T, N> va = load<T, N>(row);
  Vec<T, N> vb;
  if (pair) vb = load<T, N>(row + half_r);

  // 2. slot, position, scales: a token outside the cache or the table writes nothing
  const i64 slot = end < i64(p.S) - s ? -1 : end - p.S + s;  // no overflow at int64 extremes
  if (!p.position_ids) pos = slot;
  float k_scale = 1.f, v_scale = 1.f;  // stored = fp8(x * (1 / scale))
  if constexpr (is_fp8<CacheT>::value) {
    if (p.kv_scale) {
      k_scale = __frcp_rn(k_div);  // 1 / scale, correctly rounded, as rope_write_kv's 1.f / x
      v_scale = __frcp_rn(v_div);
      constexpr float kMax = 3.40282347e38f;  // FLT_MAX: NaN and inf fail the test below
      if (!(k_scale > 0.f && k_scale <= kMax && v_scale > 0.f && v_scale <= kMax)) return;
    } else {  // constants, checked by the host
      k_scale = p.inv_k_scale;
      v_scale = p.inv_v_scale;
    }
  }
  if (slot < 0 || slot >= p.C || pos < 0 || pos >= p.P) return;
  float a[N], bb[N];
  to_floats<T, N>(va, a);
  if (pair) to_floats<T, N>(vb, bb);
  CacheT* dst = static_cast<CacheT*>(p.cache) + (I(b) * I(p.c_sb) + (is_k ? I(0) : I(p.c_skv)) +
                                                  I(hh) * I(p.c_sh) + I(slot) * I(p.c_st) + I(e));
  if (!is_q && !is_k) {  // V: copied (quantized)
    store_float<CacheT, N>(dst, a, v_scale);
    if (pair) store_float<CacheT, N>(dst + half_r, bb, v_scale);
    return;
  }

  // 3. Q and K: cos/sin (rotary chunks), rotate, store
  if (rotary) {
    constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
    float c[M], sn[M];
    const float* cs = p.cos_sin + (I(b) * I(p.cs_sb) + I(pos) * I(p.cs_sp) + I(NEOX ? e : e / 2));
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
    rotate_chunk<NEOX, N, M>(a, bb, c, sn);
  }
  if (is_q || (is_k && p.write_k_in_place && rotary)) {  // Q in place; K back into k
    store_float<T, N>(row, a);
    if (pair) store_float<T, N>(row + half_r, bb);
  }
  if (is_k) {
    store_float<CacheT, N>(dst, a, k_scale);
    if (pair) store_float<CacheT, N>(dst + half_r, bb, k_scale);
  }
}
