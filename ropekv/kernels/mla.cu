// MLA cache append (Modular MAX's fused_rope_rmsnorm_quantization_kernel): RoPE on the query's
// rotary part, RMSNorm of the latent kv row, RoPE of its rotary tail, quantized write of the row
// into a paged cache, over a ragged batch. One launch.
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/mla.py.
struct MlaParams {
  const void* q;              // (T, Hq, R) T
  void* q_out;                // (T, Hq, R) T, may alias q
  const void* kv;             // (T, L + R) T: latent [0, L), rotary tail [L, L + R)
  const void* gamma;          // (kv_norm_dim,) T or float32
  const float* cos_sin;       // (P, R) float32, cos half then sin half
  const unsigned* offsets;    // (B + 1,) int32 or uint32, read as unsigned
  const int* cache_lengths;   // (B,)
  const int* block_table;     // (B, max_pages)
  void* ckv;                  // (num_pages, page_size, L) CacheT
  void* kpe;                  // (num_pages, page_size, R) CacheT (ckv + L for MAX's layout)
  int* status;                // status=: (1,) int32, the offsets' code (0 valid), or null
  i64 q_st, q_sh, qo_st, qo_sh, kv_st, cs_sp, bt_sb;  // strides in elements
  i64 ckv_sp, ckv_se, kpe_sp, kpe_se;
  i64 num_pages;
  float epsilon;
  float inv_kv_scale;  // 1 / kv_scale: stored = fp8(x * inv_kv_scale); 1 for 16-bit caches
  int T, B, Hq, L, R, P, kv_norm_dim, max_pages, page_size, gamma_f32;
  int heads_per_block;  // q heads of each of the grid.y blocks of a token (kHeadsMax per group)
  int clear;            // clear_unused_last_page_rows
  int check;            // status=: validate the offsets first (the grid has at least one block)
};

// status= (OPTS kernels): every block validates the offsets before any load of token data; a
// block writes nothing when they are malformed, and block (0, 0) writes the code. With no tokens
// the grid is one block, which only validates. Returns whether the block goes on.
template <bool OPTS>
__device__ __forceinline__ bool mla_check(const MlaParams& p) {
  if (!OPTS || !p.check) return true;
  const int code = ragged_offsets_status(p.offsets, p.B, p.T);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
  return code == 0 && i64(blockIdx.x) < p.T;
}

constexpr int kBlock = 256;
constexpr int kHeadsMax = 4;    // q heads a lane group holds at once
constexpr int kLatentMax = 1;   // chunks of the latent row a thread holds (more are re-read)
constexpr int kStageMax = 512;  // batches of up to this many requests are searched in shared memory

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Decode: grid (T, splits): block (t, y) handles q heads [y * heads_per_block, ...) of token t, and block
// (t, 0) also its latent row. A q head row is cut into `items` chunks of RoPE pairs (neox: dims
// [jN, jN + N) and their partners R/2 further; interleaved: dims [jN, jN + N)); lane group s of
// kBlock / items lanes holds heads s, s + groups, ... (at most kHeadsMax), lane j chunk j. The
// latent row is L / N chunks then the rotary tail's `items` chunks, chunk c in thread c mod kBlock.
// Order, so that the dependent index loads overlap the data loads:
//   1. every q chunk and latent chunk this thread holds; 2. the offsets and cache lengths (batches
//   of at most kStageMax requests) into shared memory; the partial sums of squares of the
//   normalised latent dims; one barrier; 3. the request, position (a binary search) and page, the
//   cos/sin values, the RMSNorm weights; 4. the q rows roped and stored; 5. the latent row
//   normalised, its tail roped, both written to the page.
// A token outside every request or with a position outside [0, P) has its q row copied unrotated
// and writes nothing to the cache; a token whose page is out of range is roped, not written.
//   rms = 1 / sqrt(sum_{i < n} x_i^2 / n + epsilon), n = kv_norm_dim
//   ckv[i] = x_i * rms * gamma_i (i < n), x_i (n <= i < L);  kpe = rope(x[L:L+R])
template <typename CacheT, int N>
__device__ __forceinline__ void mla_clear_rest_of_page(const MlaParams& p, CacheT* ckv,
                                                       CacheT* kpe, int entry) {
  const int latent_chunks = p.L / N;
  for (int c = threadIdx.x; c < latent_chunks + p.R / N; c += kBlock) {
    if (c < latent_chunks) {
      zero_rest_of_page<CacheT, N>(ckv, p.ckv_se, entry, p.page_size, c * N);
    } else {
      zero_rest_of_page<CacheT, N>(kpe, p.kpe_se, entry, p.page_size, (c - latent_chunks) * N);
    }
  }
}

// OPTS: p.clear (clear_unused_last_page_rows) is read: the last token of a request also zeroes
// the rest of its page, ckv and kpe, after writing its own row (mla_clear_rest_of_page). Without
// OPTS it is compiled out (costs nothing when off).
template <typename T, typename CacheT, bool NEOX, int N, bool OPTS>
__global__ void __launch_bounds__(kBlock) mla_rope_rmsnorm_append_split(const MlaParams p) {
  __shared__ float partial[kBlock / 32];
  __shared__ unsigned s_offsets[kStageMax + 1];
  __shared__ int s_lengths[kStageMax];
  pdl_launch_dependents();
  const i64 t = blockIdx.x;
  const int half_r = p.R >> 1;
  const int items = NEOX ? half_r / N : p.R / N;
  const int groups = kBlock / items;
  const int j = threadIdx.x % items;
  const int h0 = blockIdx.y * p.heads_per_block + threadIdx.x / items;
  const int h_end = min(p.Hq, (blockIdx.y + 1) * p.heads_per_block);
  const bool active = threadIdx.x / items < groups;
  const int ea = j * N, eb = ea + half_r;
  const bool latent = blockIdx.y == 0;
  const int latent_chunks = p.L / N;
  const int norm_chunks = p.kv_norm_dim / N;
  const int row_chunks = latent ? latent_chunks + items : 0;
  const T* kv = static_cast<const T*>(p.kv) + t * p.kv_st;
  const T* q = static_cast<const T*>(p.q) + t * p.q_st;
  T* q_out = static_cast<T*>(p.q_out) + t * p.qo_st;

  pdl_wait();
  if (!mla_check<OPTS>(p)) return;
  // 1. q chunks and latent chunks
  Vec<T, N> qa[kHeadsMax], qb[kHeadsMax];
#pragma unroll
  for (int u = 0; u < kHeadsMax; ++u) {
    const int h = h0 + u * groups;
    if (!active || h >= h_end) continue;
    qa[u] = load<T, N>(q + h * p.q_sh + ea);
    if (NEOX) qb[u] = load<T, N>(q + h * p.q_sh + eb);
  }
  Vec<T, N> la[kLatentMax], lb[kLatentMax];
#pragma unroll
  for (int k = 0; k < kLatentMax; ++k) {
    const int c = threadIdx.x + k * kBlock;
    if (c >= row_chunks) continue;
    if (c < latent_chunks) {
      la[k] = load<T, N>(kv + c * N);
    } else {
      const int i0 = (c - latent_chunks) * N;
      la[k] = load<T, N>(kv + p.L + i0);
      if (NEOX) lb[k] = load<T, N>(kv + p.L + half_r + i0);
    }
  }

  // 2. offsets and lengths to shared memory (every load of a pass issued before any store)
  const bool staged = p.B <= kStageMax;
  const int n_stage = staged ? p.B + 1 : 0;
  for (int base = threadIdx.x; base < n_stage; base += 2 * kBlock) {
    unsigned off[2];
    int len[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = base + k * kBlock;
      if (i < n_stage) off[k] = p.offsets[i];
      if (i < n_stage - 1) len[k] = p.cache_lengths[i];
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = base + k * kBlock;
      if (i < n_stage) s_offsets[i] = off[k];
      if (i < n_stage - 1) s_lengths[i] = len[k];
    }
  }
  // partial sum of squares of the normalised dims
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kLatentMax; ++k) {
    const int c = threadIdx.x + k * kBlock;
    if (c >= norm_chunks || c >= row_chunks) continue;
    float x[N];
    to_floats<T, N>(la[k], x);
#pragma unroll
    for (int i = 0; i < N; ++i) ss += x[i] * x[i];
  }
  for (int c = threadIdx.x + kLatentMax * kBlock; c < norm_chunks && latent; c += kBlock) {
    float x[N];
    load_float<T, N>(kv + c * N, x);
#pragma unroll
    for (int i = 0; i < N; ++i) ss += x[i] * x[i];
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();

  // 3. request, position, page, cos/sin
  PagedSlot slot = staged ? ragged_position(s_offsets, s_lengths, p.B, t)
                          : ragged_position(p.offsets, p.cache_lengths, p.B, t);
  const bool roped = slot.request >= 0 && slot.pos >= 0 && slot.pos < p.P;
  if (roped && latent)
    page_of(slot, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
  const float* cos_sin = p.cos_sin + (roped ? slot.pos : 0) * p.cs_sp;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (roped && active) {
    const float* cs = cos_sin + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }
  // the held latent chunk's weights (normalised dims) or cos/sin (rotary tail), beside the page
  static_assert(kLatentMax == 1, "one held latent chunk per thread");
  const int c0 = threadIdx.x;
  float lw[N], lc[M], ls[M];
  if (roped && c0 < row_chunks) {
    if (c0 < norm_chunks) {
      load_weight<T, N>(p.gamma, p.gamma_f32, c0 * N, lw);
    } else if (c0 >= latent_chunks) {
      const int e = (c0 - latent_chunks) * N;
      load_float<float, M>(cos_sin + (NEOX ? e : e / 2), lc);
      load_float<float, M>(cos_sin + half_r + (NEOX ? e : e / 2), ls);
    }
  }

  // 4. the q rows
#pragma unroll
  for (int u = 0; u < kHeadsMax; ++u) {
    const int h = h0 + u * groups;
    if (!active || h >= h_end) continue;
    float a[N], b[N];
    to_floats<T, N>(qa[u], a);
    if (NEOX) to_floats<T, N>(qb[u], b);
    if (roped) rotate_chunk<NEOX, N, M>(a, b, c, sn);
    store_float<T, N>(q_out + h * p.qo_sh + ea, a);
    if (NEOX) store_float<T, N>(q_out + h * p.qo_sh + eb, b);
  }

  // 5. the latent row
  if (slot.page < 0) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kBlock / 32; ++w) total += partial[w];
  const float rms = rsqrtf(total * __fdividef(1.f, float(p.kv_norm_dim)) + p.epsilon);
  CacheT* ckv = static_cast<CacheT*>(p.ckv) + slot.page * p.ckv_sp + slot.entry * p.ckv_se;
  CacheT* kpe = static_cast<CacheT*>(p.kpe) + slot.page * p.kpe_sp + slot.entry * p.kpe_se;
  auto write_chunk = [&](int c, float (&a)[N], float (&b)[N]) {
    if (c < latent_chunks) {
      if (c < norm_chunks) {
        float g[N];
        load_weight<T, N>(p.gamma, p.gamma_f32, c * N, g);
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = a[k] * rms * g[k];
      }
      store_float<CacheT, N>(ckv + c * N, a, p.inv_kv_scale);
      return;
    }
    const int i0 = (c - latent_chunks) * N;
    if constexpr (NEOX) {
      rotate_neox<N>(a, b, cos_sin, half_r, i0);
      store_float<CacheT, N>(kpe + half_r + i0, b, p.inv_kv_scale);
    } else {
      rotate_interleaved<N>(a, cos_sin, half_r, i0);
    }
    store_float<CacheT, N>(kpe + i0, a, p.inv_kv_scale);
  };
  if (c0 < row_chunks) {
    float a[N], b[N];
    to_floats<T, N>(la[0], a);
    if (NEOX) to_floats<T, N>(lb[0], b);
    if (c0 < latent_chunks) {
      if (c0 < norm_chunks) {
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = a[k] * rms * lw[k];
      }
      store_float<CacheT, N>(ckv + c0 * N, a, p.inv_kv_scale);
    } else {
      const int i0 = (c0 - latent_chunks) * N;
      rotate_chunk<NEOX, N, M>(a, b, lc, ls);
      if (NEOX) store_float<CacheT, N>(kpe + half_r + i0, b, p.inv_kv_scale);
      store_float<CacheT, N>(kpe + i0, a, p.inv_kv_scale);
    }
  }
  for (int c = threadIdx.x + kLatentMax * kBlock; c < row_chunks; c += kBlock) {
    float a[N], b[N];
    const int i0 = (c - latent_chunks) * N;
    load_float<T, N>(c < latent_chunks ? kv + c * N : kv + p.L + i0, a);
    if (NEOX && c >= latent_chunks) load_float<T, N>(kv + p.L + half_r + i0, b);
    write_chunk(c, a, b);
  }
  if (OPTS && p.clear && last_of_request(staged ? s_offsets : p.offsets, slot, t))
    mla_clear_rest_of_page<CacheT, N>(p, ckv, kpe, slot.entry);
}

// Prefill: one block per token, in an order that keeps loads in flight while the token's request and
// position are looked up (a binary search over the offsets: a chain of dependent loads):
//   1. each thread loads its chunks of the latent row's normalised dims and sums their squares;
//   2. each thread starts loading its first two q head chunks: thread t owns chunk j = t % items
//      of a head row (items = chunks of RoPE pairs per head) and walks the heads t / items,
//      t / items + hp, ... two at a time (hp = blockDim.x / items);
//   3. the request, position and page; then the cos/sin values, once per thread, and the q row is
//      roped and stored, the next two heads loaded behind each pair -- the bulk of the bytes, and
//      no barrier in the way;
//   4. one barrier completes the sum of squares, and the latent row is normalised, roped and
//      written to its page.
// A token outside every request or with a position outside [0, P) has its q row copied unrotated
// and writes nothing to the cache; a token whose page is out of range is roped, not written.
//   rms = 1 / sqrt(sum_{i < n} x_i^2 / n + epsilon), n = kv_norm_dim
//   ckv[i] = x_i * rms * gamma_i (i < n), x_i (n <= i < L);  kpe = rope(x[L:L+R])
template <typename T, typename CacheT, bool NEOX, int N, bool OPTS>
__global__ void __launch_bounds__(kBlock) mla_rope_rmsnorm_append(const MlaParams p) {
  __shared__ float partial[kBlock / 32];
  pdl_launch_dependents();
  const i64 t = blockIdx.x;
  const int half_r = p.R >> 1;
  const T* kv = static_cast<const T*>(p.kv) + t * p.kv_st;
  pdl_wait();
  if (!mla_check<OPTS>(p)) return;

  // 1. partial sum of squares of the normalised dims
  const int norm_chunks = p.kv_norm_dim / N;
  float ss = 0.f;
  for (int c = threadIdx.x; c < norm_chunks; c += kBlock) {
    float x[N];
    load_float<T, N>(kv + c * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) ss += x[k] * x[k];
  }

  // 2. the first q chunks
  const int items = NEOX ? half_r / N : p.R / N;
  const int hp = kBlock / items;
  const int j = threadIdx.x % items;
  const int h0 = threadIdx.x / items;
  const bool active = h0 < hp;
  const int ea = j * N, eb = ea + half_r;
  const T* q = static_cast<const T*>(p.q) + t * p.q_st;
  T* q_out = static_cast<T*>(p.q_out) + t * p.qo_st;
  float xa[2][N], xb[2][N];
  auto load_heads = [&](int h) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int hu = h + u * hp;
      if (hu >= p.Hq) continue;
      load_float<T, N>(q + hu * p.q_sh + ea, xa[u]);
      if (NEOX) load_float<T, N>(q + hu * p.q_sh + eb, xb[u]);
    }
  };
  if (active) load_heads(h0);

  // 3. request, position, page; the q row
  PagedSlot slot = ragged_position(p.offsets, p.cache_lengths, p.B, t);
  const bool roped = slot.request >= 0 && slot.pos >= 0 && slot.pos < p.P;
  if (roped) page_of(slot, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
  const float* cos_sin = p.cos_sin + (roped ? slot.pos : 0) * p.cs_sp;
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  if (active) {
    constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
    float c[M], sn[M];
    if (roped) {
      const float* cs = cos_sin + (NEOX ? ea : ea / 2);
      load_float<float, M>(cs, c);
      load_float<float, M>(cs + half_r, sn);
    }
    for (int h = h0; h < p.Hq; h += 2 * hp) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int hu = h + u * hp;
        if (hu >= p.Hq) continue;
        if (roped) {
          rotate_chunk<NEOX, N, M>(xa[u], xb[u], c, sn);
        }
        store_float<T, N>(q_out + hu * p.qo_sh + ea, xa[u]);
        if (NEOX) store_float<T, N>(q_out + hu * p.qo_sh + eb, xb[u]);
      }
      if (h + 2 * hp < p.Hq) load_heads(h + 2 * hp);
    }
  }

  // 4. the latent row
  __syncthreads();
  if (slot.page < 0) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kBlock / 32; ++w) total += partial[w];
  const float rms = rsqrtf(total * __fdividef(1.f, float(p.kv_norm_dim)) + p.epsilon);
  CacheT* ckv = static_cast<CacheT*>(p.ckv) + slot.page * p.ckv_sp + slot.entry * p.ckv_se;
  CacheT* kpe = static_cast<CacheT*>(p.kpe) + slot.page * p.kpe_sp + slot.entry * p.kpe_se;
  const int latent_chunks = p.L / N;
  const T* pe = kv + p.L;
  for (int c = threadIdx.x; c < latent_chunks + items; c += kBlock) {
    float a[N];
    if (c < latent_chunks) {
      load_float<T, N>(kv + c * N, a);
      if (c < norm_chunks) {
        float g[N];
        load_weight<T, N>(p.gamma, p.gamma_f32, c * N, g);
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = a[k] * rms * g[k];
      }
      store_float<CacheT, N>(ckv + c * N, a, p.inv_kv_scale);
    } else {
      const int i0 = (c - latent_chunks) * N;
      load_float<T, N>(pe + i0, a);
      if constexpr (NEOX) {
        float b[N];
        load_float<T, N>(pe + half_r + i0, b);
        rotate_neox<N>(a, b, cos_sin, half_r, i0);
        store_float<CacheT, N>(kpe + half_r + i0, b, p.inv_kv_scale);
      } else {
        rotate_interleaved<N>(a, cos_sin, half_r, i0);
      }
      store_float<CacheT, N>(kpe + i0, a, p.inv_kv_scale);
    }
  }
  if (OPTS && p.clear && last_of_request(p.offsets, slot, t))
    mla_clear_rest_of_page<CacheT, N>(p, ckv, kpe, slot.entry);
}

// The lean decode kernel (plain calls: no status=, no clear_unused_last_page_rows): one chunk of
// one row per thread, no block barrier for batches of fewer than 32 requests, no runtime
// division but the page index. Block (items, S): threadIdx.x the chunk j of a row, threadIdx.y
// the row; grid (T, 1 + ceil(Hq / S)). Block (t, 0) holds token t's kv row: its first warp the
// latent row (lane l chunks l and l + 32: L / N <= 32 kLeanLatent, the host checks), the sum of
// squares reduced by shuffles within that warp; threads 32 .. 32 + items - 1 the rotary tail's
// chunks. Block (t, y >= 1) holds q heads (y - 1) S + threadIdx.y. Order: the request search's
// loads first (fewer than 32 requests: offsets[lane] and cache_lengths[lane], one per lane, the
// request then found by lane_position, as qk_decode_rows does; up to kStageMax staged in shared
// memory behind one barrier; past that, global memory), the row chunks (and the RMSNorm weights)
// right behind them; then the position, the page (kv block) and the cos/sin values; then the
// stores. Same semantics as the split kernel: a token outside every request or with a position
// outside [0, P) has its q rows copied unrotated and writes nothing to the cache; a token whose
// page is out of range is roped, not written. The host sets blockDim.x = items (a power of two at
// most 32) and blockDim.x * blockDim.y a multiple of 32, at least 64.
constexpr int kLeanLatent = 2;

template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(kBlock) mla_rope_rmsnorm_append_lean(const MlaParams p) {
  __shared__ unsigned s_offsets[kStageMax + 1];
  __shared__ int s_lengths[kStageMax];
  pdl_launch_dependents();
  const int t = blockIdx.x;
  const int items = blockDim.x;
  const int tid = threadIdx.y * items + threadIdx.x;
  const int lane = tid & 31;
  const bool latent = blockIdx.y == 0;
  const bool ckv_warp = latent && tid < 32;  // warp-uniform
  const int jk = tid - 32;                   // rotary tail chunk (kv block)
  const bool tail = latent && jk >= 0 && jk < items;
  const int h = (int(blockIdx.y) - 1) * int(blockDim.y) + int(threadIdx.y);
  const bool qrow = !latent && h < p.Hq;
  const int half_r = p.R >> 1;
  const int j = tail ? jk : int(threadIdx.x);  // the chunk of a q row or of the rotary tail
  const int ea = j * N, eb = ea + half_r;
  const int latent_chunks = p.L / N;
  const int norm_chunks = p.kv_norm_dim / N;
  const int B = p.B;
  const T* kv = static_cast<const T*>(p.kv) + i64(t) * p.kv_st;

  pdl_wait();
  // 1. the search's arrays, then the row chunks and weights (nothing waits yet)
  unsigned lane_off = 0;
  int lane_len = 0;
  if (B < 32) {
    if (lane <= B) lane_off = p.offsets[lane];
    if (lane < B) lane_len = p.cache_lengths[lane];
  }
  Vec<T, N> va, vb;
  Vec<T, N> la[kLeanLatent];
  float g[kLeanLatent][N];
  if (qrow) {
    const T* q = static_cast<const T*>(p.q) + (i64(t) * p.q_st + i64(h) * p.q_sh);
    va = load<T, N>(q + ea);
    if (NEOX) vb = load<T, N>(q + eb);
  } else if (tail) {
    va = load<T, N>(kv + p.L + ea);
    if (NEOX) vb = load<T, N>(kv + p.L + eb);
  } else if (ckv_warp) {
#pragma unroll
    for (int k = 0; k < kLeanLatent; ++k) {
      const int c = lane + 32 * k;
      if (c < latent_chunks) la[k] = load<T, N>(kv + c * N);
      if (c < norm_chunks) load_weight<T, N>(p.gamma, p.gamma_f32, c * N, g[k]);
    }
  }

  // 2. request and position (every branch block-uniform)
  int req;
  i64 pos = -1;
  if (B < 32) {  // over the warp's lanes (every lane the block's token)
    const PagedSlot s = lane_position<1>(lane_off, lane_len, B, t);
    req = s.request;
    pos = s.pos;
  } else {
    PagedSlot s;
    if (B <= kStageMax) {
      const int threads = items * int(blockDim.y);
      for (int i = tid; i <= B; i += threads) {
        s_offsets[i] = p.offsets[i];
        if (i < B) s_lengths[i] = p.cache_lengths[i];
      }
      __syncthreads();
      s = ragged_position(s_offsets, s_lengths, B, t);
    } else {
      s = ragged_position(p.offsets, p.cache_lengths, B, t);
    }
    req = s.request;
    pos = s.pos;
  }
  const bool roped = req >= 0 && pos >= 0 && pos < p.P;

  // 3. the page (kv block), then the cos/sin values
  i64 page = -1;
  int entry = 0;
  if (roped && latent) {
    const unsigned index = unsigned(pos) / unsigned(p.page_size);  // 0 <= pos < P < 2^31
    if (index < unsigned(p.max_pages)) {
      const i64 id = p.block_table[i64(req) * p.bt_sb + i64(index)];
      if (id >= 0 && id < p.num_pages) {
        page = id;
        entry = int(pos) - int(index) * p.page_size;
      }
    }
  }
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (roped && (qrow || tail)) {
    const float* cs = p.cos_sin + (pos * p.cs_sp + (NEOX ? ea : ea / 2));
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }

  // 4. the q row: roped, or copied unrotated
  if (qrow) {
    T* q_out = static_cast<T*>(p.q_out) + (i64(t) * p.qo_st + i64(h) * p.qo_sh);
    if (!roped) {
      store<T, N>(q_out + ea, va);
      if (NEOX) store<T, N>(q_out + eb, vb);
      return;
    }
    float a[N], b[N];
    to_floats<T, N>(va, a);
    if (NEOX) to_floats<T, N>(vb, b);
    rotate_chunk<NEOX, N, M>(a, b, c, sn);
    store_float<T, N>(q_out + ea, a);
    if (NEOX) store_float<T, N>(q_out + eb, b);
    return;
  }

  // 5. the rotary tail
  if (tail) {
    if (page < 0) return;
    CacheT* kpe = static_cast<CacheT*>(p.kpe) + (page * p.kpe_sp + i64(entry) * p.kpe_se);
    float a[N], b[N];
    to_floats<T, N>(va, a);
    if (NEOX) to_floats<T, N>(vb, b);
    rotate_chunk<NEOX, N, M>(a, b, c, sn);
    if (NEOX) store_float<CacheT, N>(kpe + eb, b, p.inv_kv_scale);
    store_float<CacheT, N>(kpe + ea, a, p.inv_kv_scale);
    return;
  }

  // 6. the latent row: the sum of squares over the warp, normalised, written to the page
  if (!ckv_warp) return;
  float x[kLeanLatent][N];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kLeanLatent; ++k) {
    const int c0 = lane + 32 * k;
    if (c0 >= latent_chunks) continue;
    to_floats<T, N>(la[k], x[k]);
    if (c0 < norm_chunks) {
#pragma unroll
      for (int i = 0; i < N; ++i) ss += x[k][i] * x[k][i];
    }
  }
  ss = warp_sum(ss);
  if (page < 0) return;
  const float rms = rsqrtf(ss * __fdividef(1.f, float(p.kv_norm_dim)) + p.epsilon);
  CacheT* ckv = static_cast<CacheT*>(p.ckv) + (page * p.ckv_sp + i64(entry) * p.ckv_se);
#pragma unroll
  for (int k = 0; k < kLeanLatent; ++k) {
    const int c0 = lane + 32 * k;
    if (c0 >= latent_chunks) continue;
    if (c0 < norm_chunks) {
#pragma unroll
      for (int i = 0; i < N; ++i) x[k][i] = x[k][i] * rms * g[k][i];
    }
    store_float<CacheT, N>(ckv + c0 * N, x[k], p.inv_kv_scale);
  }
}
