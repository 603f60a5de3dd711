// Qwen3-style attention input: per-head RMSNorm of Q and K, RoPE on both, and the append of K/V
// into a paged cache (NHD or HND) over a ragged batch, in one launch.
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/qknorm.py.
struct QKNormParams {
  const void* q;             // (T, Hq, D) T
  void* q_out;               // (T, Hq, D) T, may alias q
  const void* k;             // (T, Hkv, D) T
  const void* v;             // (T, Hkv, D) T
  const void* q_gamma;       // (D,) T or float32
  const void* k_gamma;       // (D,) T or float32
  const float* cos_sin;      // (P, R) float32, cos half then sin half
  const unsigned* offsets;   // (B + 1,) int32 or uint32, read as unsigned
  const int* cache_lengths;  // (B,)
  const int* block_table;    // (B, max_pages)
  void* k_cache;             // NHD (num_pages, page_size, Hkv, D), HND (num_pages, Hkv, page_size, D)
  void* v_cache;             // the same layout, CacheT
  i64 q_st, q_sh, qo_st, qo_sh, k_st, k_sh, v_st, v_sh, cs_sp, bt_sb;  // strides in elements
  i64 kc_sp, kc_se, kc_sh, vc_sp, vc_se, vc_sh;  // page, entry, head strides (layout-free)
  i64 num_pages;
  float epsilon;
  float inv_k_scale, inv_v_scale;  // stored = fp8(x * inv_scale); 1 for 16-bit caches
  int T, B, Hq, Hkv, D, R, P, max_pages, page_size, q_gamma_f32, k_gamma_f32;
  int group;  // lanes per head row: a power of two <= 32 dividing blockDim.x
  int rows;   // head rows each lane group holds, 1 ..= kRowsMax
};

constexpr int kRowsMax = 4;     // head rows a lane group holds at once
constexpr int kStageMax = 512;  // batches of up to this many requests are searched in shared memory
constexpr int kMaxD = 512;      // the largest head dim (32 lanes of 8 neox pairs; the host checks)

// The RMSNorm weight element i as float32, whichever its storage.
template <typename T>
__device__ __forceinline__ float weight_at(const void* w, int f32, int i) {
  return f32 ? static_cast<const float*>(w)[i] : to_float(static_cast<const T*>(w)[i]);
}

// A token's head rows are Q (Hq), K (Hkv) and V (Hkv): H = Hq + 2 Hkv rows of D dims. A row is cut
// into `items` chunks: chunk j < rot_items holds RoPE pairs (neox: dims [jN, jN + N) and their
// partners R/2 further; interleaved: dims [jN, jN + N)), the rest N pass-through dims of [R, D);
// V rows are cut the same way. A group of G >= items lanes (G = p.group, a power of two <= 32)
// holds one row, lane j chunk j; a block of blockDim.x / G groups takes p.rows rows per group, so
// grid (T, splits) with splits = ceil(H / (blockDim.x / G * p.rows)): decode splits a token's rows
// over several blocks (one row per group), prefill gives a block a whole token.
//   y = rope(x / sqrt(mean(x^2) + epsilon) * gamma), in float32, rounded once.
// Order, so that the dependent index loads overlap the row loads:
//   1. the rows (they depend on nothing); 2. the RMSNorm weights and, for batches of at most
//   kStageMax requests, the offsets and cache lengths, into shared memory; the sums of squares;
//   3. the token's request and position (a binary search over the offsets), then its page and its
//   cos/sin values; 4. normalise, rope, store.
// A token outside every request, or with a position outside [0, P), has its q row copied
// unchanged and writes nothing; a token whose page is out of range is normalised and roped but
// writes nothing.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(256) qk_rmsnorm_rope_append(const QKNormParams p) {
  __shared__ float s_gamma[2][kMaxD];
  __shared__ unsigned s_offsets[kStageMax + 1];
  __shared__ int s_lengths[kStageMax];
  pdl_launch_dependents();

  const i64 t = blockIdx.x;
  const int G = p.group;
  const int U = p.rows;
  const int slots = blockDim.x / G;
  const int j = threadIdx.x & (G - 1);
  const int first = blockIdx.y * slots * U + threadIdx.x / G;  // row of u = 0; u adds u * slots
  const int H = p.Hq + 2 * p.Hkv;
  const int half_r = p.R >> 1;
  const int rot_items = NEOX ? half_r / N : p.R / N;
  const int items = rot_items + (p.D - p.R) / N;
  const bool has_chunk = j < items;
  const bool rotary = j < rot_items;
  const bool pair = NEOX && rotary;  // two vectors per chunk
  const int ea = rotary ? j * N : p.R + (j - rot_items) * N;
  const int eb = ea + half_r;

  pdl_wait();
  // 1. this lane's chunks of its rows
  Vec<T, N> va[kRowsMax], vb[kRowsMax];
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || !has_chunk) continue;
    const T* row = h < p.Hq ? static_cast<const T*>(p.q) + t * p.q_st + h * p.q_sh
                   : h < p.Hq + p.Hkv
                       ? static_cast<const T*>(p.k) + t * p.k_st + (h - p.Hq) * p.k_sh
                       : static_cast<const T*>(p.v) + t * p.v_st + (h - p.Hq - p.Hkv) * p.v_sh;
    va[u] = load<T, N>(row + ea);
    if (pair) vb[u] = load<T, N>(row + eb);
  }

  // 2. weights and index arrays to shared memory: every load of a pass issued before any store
  const bool staged = p.B <= kStageMax;
  const int n_stage = staged ? p.B + 1 : 0;
  const int n_pass = p.D > n_stage ? p.D : n_stage;
  for (int base = threadIdx.x; base < n_pass; base += 2 * blockDim.x) {
    float gq[2], gk[2];
    unsigned off[2];
    int len[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = base + k * blockDim.x;
      if (i < p.D) {
        gq[k] = weight_at<T>(p.q_gamma, p.q_gamma_f32, i);
        gk[k] = weight_at<T>(p.k_gamma, p.k_gamma_f32, i);
      }
      if (i < n_stage) off[k] = p.offsets[i];
      if (i < n_stage - 1) len[k] = p.cache_lengths[i];
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = base + k * blockDim.x;
      if (i < p.D) {
        s_gamma[0][i] = gq[k];
        s_gamma[1][i] = gk[k];
      }
      if (i < n_stage) s_offsets[i] = off[k];
      if (i < n_stage - 1) s_lengths[i] = len[k];
    }
  }

  // partial sums of squares of the rows (Q and K rows use them)
  float ss[kRowsMax];
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    ss[u] = 0.f;
    const int h = first + u * slots;
    if (u >= U || h >= H || !has_chunk) continue;
    float x[N];
    to_floats<T, N>(va[u], x);
#pragma unroll
    for (int i = 0; i < N; ++i) ss[u] += x[i] * x[i];
    if (pair) {
      to_floats<T, N>(vb[u], x);
#pragma unroll
      for (int i = 0; i < N; ++i) ss[u] += x[i] * x[i];
    }
  }
  __syncthreads();

  // 3. request, position, page, cos/sin
  PagedSlot slot = staged ? ragged_position(s_offsets, s_lengths, p.B, t)
                          : ragged_position(p.offsets, p.cache_lengths, p.B, t);
  const bool roped = slot.request >= 0 && slot.pos >= 0 && slot.pos < p.P;
  if (roped && first + (U - 1) * slots >= p.Hq)  // this group holds a K or V row
    page_of(slot, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
  const bool write = slot.page >= 0;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (roped && rotary) {
    const float* cs = p.cos_sin + slot.pos * p.cs_sp + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }
  // the row sums: shuffles within each G-lane group (U and G are block-uniform: every lane takes
  // part)
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    if (u >= U) break;
    for (int o = G >> 1; o; o >>= 1) ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
  }

  // 4. normalise, rope, store
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || !has_chunk) continue;
    float a[N], b[N];
    to_floats<T, N>(va[u], a);
    if (pair) to_floats<T, N>(vb[u], b);
    if (h >= p.Hq + p.Hkv) {  // V: copied (quantized)
      if (!write) continue;
      CacheT* dst = static_cast<CacheT*>(p.v_cache) + slot.page * p.vc_sp + slot.entry * p.vc_se +
                    (h - p.Hq - p.Hkv) * p.vc_sh;
      store_float<CacheT, N>(dst + ea, a, p.inv_v_scale);
      if (pair) store_float<CacheT, N>(dst + eb, b, p.inv_v_scale);
      continue;
    }
    const bool is_q = h < p.Hq;
    if (!is_q && !write) continue;
    if (roped) {  // a token without a position has its q copied unchanged
      const float rms = rsqrtf(ss[u] / float(p.D) + p.epsilon);
      const float* g = s_gamma[is_q ? 0 : 1];
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] *= rms * g[ea + i];
      if (pair) {
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] *= rms * g[eb + i];
      }
      if (rotary) rotate_chunk<NEOX, N, M>(a, b, c, sn);
    }
    if (is_q) {
      T* dst = static_cast<T*>(p.q_out) + t * p.qo_st + h * p.qo_sh;
      store_float<T, N>(dst + ea, a);
      if (pair) store_float<T, N>(dst + eb, b);
    } else {
      CacheT* dst = static_cast<CacheT*>(p.k_cache) + slot.page * p.kc_sp + slot.entry * p.kc_se +
                    (h - p.Hq) * p.kc_sh;
      store_float<CacheT, N>(dst + ea, a, p.inv_k_scale);
      if (pair) store_float<CacheT, N>(dst + eb, b, p.inv_k_scale);
    }
  }
}
