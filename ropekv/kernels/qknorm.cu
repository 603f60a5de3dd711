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
};

// One block per token. A head row of D dims is cut into `items` chunks: chunk j < rot_items holds
// RoPE pairs (neox: dims [jN, jN + N) and their partners R/2 further; interleaved: dims
// [jN, jN + N)), the rest N pass-through dims of [R, D). A group of G >= items lanes (G = p.group,
// a power of two <= 32) owns one head row, lane j holding chunk j. The Q then K rows are walked
// two per step, hp = blockDim.x / G rows side by side; the RMS of a row is a shuffle sum over its
// group. V rows are plain copies spread over the block.
//   y = rope(x / sqrt(mean(x^2) + epsilon) * gamma), in float32, rounded once.
// A token outside every request, or with a position outside [0, P), has its q row copied
// unchanged and writes nothing; a token whose page is out of range is normalised and roped but
// writes nothing.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(256, 3) qk_rmsnorm_rope_append(const QKNormParams p) {
  const i64 t = blockIdx.x;
  const int G = p.group;
  const int half_r = p.R >> 1;
  const int rot_items = NEOX ? half_r / N : p.R / N;
  const int items = rot_items + (p.D - p.R) / N;
  const int hp = blockDim.x / G;
  const int j = threadIdx.x % G;
  const int h0 = threadIdx.x / G;
  const int H = p.Hq + p.Hkv;
  const bool has_chunk = j < items;
  const bool rotary = j < rot_items;
  const int ea = rotary ? j * N : p.R + (j - rot_items) * N;
  const int eb = ea + half_r;

  const T* q = static_cast<const T*>(p.q) + t * p.q_st;
  T* q_out = static_cast<T*>(p.q_out) + t * p.qo_st;
  const T* k = static_cast<const T*>(p.k) + t * p.k_st;

  // Rows of one step: loaded and their squares summed (shuffle within each G-lane group). The
  // first step is loaded before the token's request and position are looked up (a chain of
  // dependent loads), so both are in flight together.
  float xa[2][N], xb[2][N], ss[2];
  auto load_step = [&](int base) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      ss[u] = 0.f;
      const int h = base + h0 + u * hp;
      if (h >= H || !has_chunk) continue;
      const T* row = h < p.Hq ? q + h * p.q_sh : k + (h - p.Hq) * p.k_sh;
      load_float<T, N>(row + ea, xa[u]);
      if (NEOX && rotary) load_float<T, N>(row + eb, xb[u]);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        ss[u] += xa[u][i] * xa[u][i];
        if (NEOX && rotary) ss[u] += xb[u][i] * xb[u][i];
      }
    }
  };
  load_step(0);

  PagedSlot slot = ragged_position(p.offsets, p.cache_lengths, p.B, t);
  const bool roped = slot.request >= 0 && slot.pos >= 0 && slot.pos < p.P;
  if (roped) page_of(slot, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
  const bool write = slot.page >= 0;
  CacheT* k_cache = static_cast<CacheT*>(p.k_cache) + slot.page * p.kc_sp + slot.entry * p.kc_se;
  CacheT* v_cache = static_cast<CacheT*>(p.v_cache) + slot.page * p.vc_sp + slot.entry * p.vc_se;

  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (roped && rotary) {
    const float* cs = p.cos_sin + slot.pos * p.cs_sp + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }

  // A block-uniform number of steps, so every lane reaches every shuffle.
  for (int base = 0; base < H; base += 2 * hp) {
    if (base) load_step(base);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      for (int o = G >> 1; o; o >>= 1) ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int h = base + h0 + u * hp;
      if (h >= H || !has_chunk) continue;
      const bool is_q = h < p.Hq;
      if (!is_q && !write) continue;
      float* a = xa[u];
      float* b = xb[u];
      if (roped) {  // a token without a position has its q copied unchanged
        const float rms = rsqrtf(ss[u] / float(p.D) + p.epsilon);
        const void* gamma = is_q ? p.q_gamma : p.k_gamma;
        const bool gamma_f32 = is_q ? p.q_gamma_f32 : p.k_gamma_f32;
        float g[N];
        load_weight<T, N>(gamma, gamma_f32, ea, g);
#pragma unroll
        for (int i = 0; i < N; ++i) a[i] *= rms * g[i];
        if (NEOX && rotary) {
          load_weight<T, N>(gamma, gamma_f32, eb, g);
#pragma unroll
          for (int i = 0; i < N; ++i) b[i] *= rms * g[i];
        }
        if (rotary) rotate_chunk<NEOX, N, M>(xa[u], xb[u], c, sn);
      }
      if (is_q) {
        store_float<T, N>(q_out + h * p.qo_sh + ea, xa[u]);
        if (NEOX && rotary) store_float<T, N>(q_out + h * p.qo_sh + eb, xb[u]);
      } else {
        CacheT* dst = k_cache + (h - p.Hq) * p.kc_sh;
        store_float<CacheT, N>(dst + ea, xa[u], p.inv_k_scale);
        if (NEOX && rotary) store_float<CacheT, N>(dst + eb, xb[u], p.inv_k_scale);
      }
    }
  }

  if (!write) return;
  const T* v = static_cast<const T*>(p.v) + t * p.v_st;
  const int v_items = p.D / N;
  for (int w = threadIdx.x; w < p.Hkv * v_items; w += blockDim.x) {
    const int h = w / v_items;
    const int e0 = (w - h * v_items) * N;
    float x[N];
    load_float<T, N>(v + h * p.v_sh + e0, x);
    store_float<CacheT, N>(v_cache + h * p.vc_sh + e0, x, p.inv_v_scale);
  }
}
