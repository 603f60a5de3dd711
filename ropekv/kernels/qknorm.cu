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
  int group;   // lanes per head row, a power of two <= 32 (blockDim.x is a multiple of it)
  int tokens_per_block;
  int staged;       // offsets and cache_lengths are staged in shared memory (at byte 0)
  int rows_staged;  // q/k/v rows are staged too (else read straight from global memory)
  // Shared-memory layout in bytes (ropekv.qknorm.smem_layout): q_gamma, k_gamma, per-token
  // (pos, page, entry), then two stages, each [q (Hq, D) | k (Hkv, D) | v (Hkv, D) T |
  // cos/sin row (R) float32].
  int q_gamma_at, k_gamma_at, meta_at, stage_at, stage_bytes, k_at, v_at, cos_at;
};

constexpr int kMaxBlock = 512;
constexpr int kHeld = 4;  // chunks a lane keeps in registers between its loads and its stores

// A head row is cut into chunks of N dims. With rope, chunk j < rope_chunks is rotary: neox holds
// dims [jN, jN + N) in a and [R/2 + jN, ...) in b, interleaved holds [jN, jN + N) in a; the other
// chunks hold pass-through dims R + (j - rope_chunks)N... Rows without rope (V) are D/N plain
// chunks.
struct Chunking {
  int rope_chunks, chunks, half_r, R;
  __device__ __forceinline__ int dim(int j, int N) const {
    return j < rope_chunks ? j * N : R + (j - rope_chunks) * N;
  }
};

template <typename T, int N>
__device__ __forceinline__ float sum_squares(const Vec<T, N>& v) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) ss += to_float(v.v[k]) * to_float(v.v[k]);
  return ss;
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&x)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = to_float(v.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void scale_by_gamma(const void* gamma, bool f32, int d, float rms,
                                               float (&x)[N]) {
  float g[N];
  if (f32) {
    load_float<float, N>(static_cast<const float*>(gamma) + d, g);
  } else {
    load_float<T, N>(static_cast<const T*>(gamma) + d, g);
  }
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = x[k] * rms * g[k];
}

// Where one token's q, k and v rows are read from: a stage in shared memory (head stride D) or
// global memory (the arrays' own strides).
template <typename T>
struct TokenRows {
  const T *q, *k, *v;
  i64 q_sh, k_sh, v_sh;
};

// What one lane group does with one head row: Q rows (normed and roped into q_out), K rows
// (normed and roped into the cache) and V rows (copied into the cache).
enum RowKind { kNone, kQ, kK, kV };

template <typename T, bool NEOX, int N>
struct RowWork {
  RowKind kind;
  int head;
  const T* src;
  Chunking c;
  Vec<T, N> a[kHeld], b[kHeld];

  __device__ __forceinline__ void load_chunk(int j, Vec<T, N>& x, Vec<T, N>& y) const {
    const int d = c.dim(j, N);
    x = load<T, N>(src + d);
    if (NEOX && j < c.rope_chunks) y = load<T, N>(src + c.half_r + d);
  }

  // Starts the loads of row `row` (kNone past the last row) from `rows`: the token's q, k and v
  // rows, staged in shared memory or in global memory.
  __device__ __forceinline__ void load_row(const QKNormParams& p, const TokenRows<T>& rows,
                                           int row, int lane, const Chunking& normed,
                                           const Chunking& plain) {
    kind = row < p.Hq ? kQ : row < p.Hq + p.Hkv ? kK : row < p.Hq + 2 * p.Hkv ? kV : kNone;
    if (kind == kNone) return;
    if (kind == kQ) {
      head = row;
      src = rows.q + head * rows.q_sh;
    } else if (kind == kK) {
      head = row - p.Hq;
      src = rows.k + head * rows.k_sh;
    } else {
      head = row - p.Hq - p.Hkv;
      src = rows.v + head * rows.v_sh;
    }
    c = kind == kV ? plain : normed;
#pragma unroll
    for (int u = 0; u < kHeld; ++u) {
      const int j = lane + u * p.group;
      if (j < c.chunks) load_chunk(j, a[u], b[u]);
    }
  }

  // y = rope(x / sqrt(mean(x^2) + eps) * gamma) for a normed row (gamma non-null), x for V.
  template <typename OutT>
  __device__ __forceinline__ void store_chunk(OutT* dst, int j, const Vec<T, N>& x,
                                              const Vec<T, N>& y, const void* gamma,
                                              bool gamma_f32, float rms, const float* cos_sin,
                                              bool rotate, float scale) const {
    const int d = c.dim(j, N);
    const bool rotary = j < c.rope_chunks;
    float va[N], vb[N];
    to_floats<T, N>(x, va);
    if (NEOX && rotary) to_floats<T, N>(y, vb);
    if (gamma) {
      scale_by_gamma<T, N>(gamma, gamma_f32, d, rms, va);
      if (NEOX && rotary) scale_by_gamma<T, N>(gamma, gamma_f32, c.half_r + d, rms, vb);
    }
    if (rotary && rotate) {
      if constexpr (NEOX) {
        rotate_neox<N>(va, vb, cos_sin, c.half_r, d);
      } else {
        rotate_interleaved<N>(va, cos_sin, c.half_r, d);
      }
    }
    store_float<OutT, N>(dst + d, va, scale);
    if (NEOX && rotary) store_float<OutT, N>(dst + c.half_r + d, vb, scale);
  }

  template <typename OutT>
  __device__ __forceinline__ void store_row(OutT* dst, int lane, int G, const void* gamma,
                                            bool gamma_f32, float rms, const float* cos_sin,
                                            bool rotate, float scale) const {
#pragma unroll
    for (int u = 0; u < kHeld; ++u) {
      const int j = lane + u * G;
      if (j < c.chunks) {
        store_chunk<OutT>(dst, j, a[u], b[u], gamma, gamma_f32, rms, cos_sin, rotate, scale);
      }
    }
    for (int j = lane + kHeld * G; j < c.chunks; j += G) {  // rows wider than kHeld * G chunks
      Vec<T, N> x, y;
      load_chunk(j, x, y);
      store_chunk<OutT>(dst, j, x, y, gamma, gamma_f32, rms, cos_sin, rotate, scale);
    }
  }

  // Sums the squares over the group (every lane of the warp takes part), then writes the row.
  template <typename CacheT>
  __device__ __forceinline__ void finish(const QKNormParams& p, i64 t, int lane, int page,
                                         int entry, bool valid, const float* cos_sin,
                                         const void* q_gamma, const void* k_gamma) const {
    const int G = p.group;
    float ss = 0.f;
    if (kind == kQ || kind == kK) {
#pragma unroll
      for (int u = 0; u < kHeld; ++u) {
        const int j = lane + u * G;
        if (j < c.chunks) {
          ss += sum_squares<T, N>(a[u]);
          if (NEOX && j < c.rope_chunks) ss += sum_squares<T, N>(b[u]);
        }
      }
      for (int j = lane + kHeld * G; j < c.chunks; j += G) {
        Vec<T, N> x, y;
        load_chunk(j, x, y);
        ss += sum_squares<T, N>(x);
        if (NEOX && j < c.rope_chunks) ss += sum_squares<T, N>(y);
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, ss, o);
      if (o < G) ss += other;
    }
    const float rms = rsqrtf(ss / float(p.D) + p.epsilon);
    if (kind == kQ) {
      // A token with no valid position is copied through: no norm, no rope.
      T* dst = static_cast<T*>(p.q_out) + t * p.qo_st + head * p.qo_sh;
      store_row<T>(dst, lane, G, valid ? q_gamma : nullptr, p.q_gamma_f32, rms, cos_sin, valid,
                   1.f);
    } else if ((kind == kK || kind == kV) && page >= 0) {
      CacheT* dst;
      if (kind == kK) {
        dst = static_cast<CacheT*>(p.k_cache) + page * p.kc_sp + entry * p.kc_se +
              head * p.kc_sh;
        store_row<CacheT>(dst, lane, G, k_gamma, p.k_gamma_f32, rms, cos_sin, true,
                          p.inv_k_scale);
      } else {
        dst = static_cast<CacheT*>(p.v_cache) + page * p.vc_sp + entry * p.vc_se +
              head * p.vc_sh;
        store_row<CacheT>(dst, lane, G, nullptr, false, rms, cos_sin, false, p.inv_v_scale);
      }
    }
  }
};

__host__ __device__ constexpr int f32_unit(int n) { return 4 * n > 16 ? 16 : 4 * n; }

template <int UNIT_T, int UNIT_F32>
__device__ __forceinline__ void stage_gamma(void* shared, const void* gamma, bool f32, int D,
                                            int itemsize) {
  if (f32) {
    stage_async<UNIT_F32>(shared, gamma, D * 4);
  } else {
    stage_async<UNIT_T>(shared, gamma, D * itemsize);
  }
}

// Starts copying token t's q, k and v rows (when staged; packed with head stride D) and its
// cos/sin row (when it has a position) into stage `st`.
template <typename T, bool NEOX, int N>
__device__ __forceinline__ void stage_token(const QKNormParams& p, i64 t, int pos, char* st) {
  constexpr int kUnit = N * int(sizeof(T));
  if (p.rows_staged) {
    const int per_row = p.D / N;
    const int rows = p.Hq + 2 * p.Hkv;
    for (int c = threadIdx.x; c < rows * per_row; c += blockDim.x) {
      const int row = c / per_row;
      const int e = (c - row * per_row) * N;
      const T* src;
      if (row < p.Hq) {
        src = static_cast<const T*>(p.q) + t * p.q_st + row * p.q_sh;
      } else if (row < p.Hq + p.Hkv) {
        src = static_cast<const T*>(p.k) + t * p.k_st + (row - p.Hq) * p.k_sh;
      } else {
        src = static_cast<const T*>(p.v) + t * p.v_st + (row - p.Hq - p.Hkv) * p.v_sh;
      }
      copy_async<kUnit>(reinterpret_cast<T*>(st) + row * p.D + e, src + e);
    }
  }
  if (pos >= 0) {
    stage_async<f32_unit(NEOX ? N : N / 2)>(st + p.cos_at, p.cos_sin + i64(pos) * p.cs_sp,
                                             p.R * 4);
  }
}

// A block handles tokens_per_block consecutive tokens through a two-stage cp.async pipeline (as
// in kernels/mla.cu): the rows of token k + 1 are in flight while token k is processed.
//   prologue: both gammas and the ragged index arrays, with token 0's rows; positions of the
//     block's tokens by binary search in shared memory; token 0's cos/sin row beside the
//     block-table lookups.
//   token k: a group of p.group lanes per head row (Q rows, then K, then V; several passes when
//     the block is smaller than the rows): loads, sums of squares by shuffles, norm, rope, store.
// Every lane of a warp runs the same passes (rows past the end are idle), so the shuffles stay
// converged. A token outside every request or with a position outside [0, P) has its q row
// copied unchanged and writes nothing to the cache.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(kMaxBlock) qk_rmsnorm_rope_append(const QKNormParams p) {
  extern __shared__ __align__(16) char smem[];
  const i64 t0 = i64(blockIdx.x) * p.tokens_per_block;
  const int n = int(min(i64(p.tokens_per_block), i64(p.T) - t0));
  int* meta = reinterpret_cast<int*>(smem + p.meta_at);  // (pos or -1, page or -1, entry)
  char* stage0 = smem + p.stage_at;

  constexpr int kUnit = N * int(sizeof(T));
  stage_gamma<kUnit, f32_unit(N)>(smem + p.q_gamma_at, p.q_gamma, p.q_gamma_f32, p.D,
                                  int(sizeof(T)));
  stage_gamma<kUnit, f32_unit(N)>(smem + p.k_gamma_at, p.k_gamma, p.k_gamma_f32, p.D,
                                  int(sizeof(T)));
  if (p.staged) {
    stage_ragged_async(p.offsets, p.cache_lengths, p.B, reinterpret_cast<unsigned*>(smem));
  }
  cp_async_commit();
  stage_token<T, NEOX, N>(p, t0, -1, stage0);  // the cos/sin row follows once pos is known
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  const unsigned* offsets = p.staged ? reinterpret_cast<const unsigned*>(smem) : p.offsets;
  const int* lengths =
      p.staged ? reinterpret_cast<const int*>(smem) + p.B + 1 : p.cache_lengths;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const PagedSlot s = ragged_position(offsets, lengths, p.B, t0 + i);
    const bool valid = s.request >= 0 && s.pos >= 0 && s.pos < p.P;
    meta[3 * i] = valid ? int(s.pos) : -1;
    meta[3 * i + 1] = s.request;
  }
  __syncthreads();
  if (meta[0] >= 0) {
    stage_async<f32_unit(NEOX ? N : N / 2)>(stage0 + p.cos_at,
                                             p.cos_sin + i64(meta[0]) * p.cs_sp, p.R * 4);
  }
  cp_async_commit();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    PagedSlot s{meta[3 * i + 1], meta[3 * i], -1, 0};
    if (s.pos >= 0) page_of(s, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
    meta[3 * i + 1] = int(s.page);
    meta[3 * i + 2] = s.entry;
  }
  __syncthreads();

  const int half_r = p.R >> 1;
  const int rope_chunks = NEOX ? half_r / N : p.R / N;
  const Chunking normed{rope_chunks, rope_chunks + (p.D - p.R) / N, half_r, p.R};
  const Chunking plain{0, p.D / N, half_r, 0};
  const int G = p.group;
  const int lane = threadIdx.x & (G - 1);
  const int groups = blockDim.x / G;
  const int rows = p.Hq + 2 * p.Hkv;
  const void* q_gamma = smem + p.q_gamma_at;
  const void* k_gamma = smem + p.k_gamma_at;

  for (int k = 0; k < n; ++k) {
    if (k + 1 < n) {
      stage_token<T, NEOX, N>(p, t0 + k + 1, meta[3 * (k + 1)],
                              stage0 + ((k + 1) & 1) * p.stage_bytes);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const i64 t = t0 + k;
    const int pos = meta[3 * k], page = meta[3 * k + 1], entry = meta[3 * k + 2];
    const char* st = stage0 + (k & 1) * p.stage_bytes;
    const float* cos_sin = reinterpret_cast<const float*>(st + p.cos_at);
    TokenRows<T> src;
    if (p.rows_staged) {
      const T* q = reinterpret_cast<const T*>(st);
      src = {q, reinterpret_cast<const T*>(st + p.k_at), reinterpret_cast<const T*>(st + p.v_at),
             p.D, p.D, p.D};
    } else {
      src = {static_cast<const T*>(p.q) + t * p.q_st, static_cast<const T*>(p.k) + t * p.k_st,
             static_cast<const T*>(p.v) + t * p.v_st, p.q_sh, p.k_sh, p.v_sh};
    }
    for (int base = 0; base < rows; base += groups) {
      RowWork<T, NEOX, N> work;
      work.load_row(p, src, base + int(threadIdx.x) / G, lane, normed, plain);
      work.template finish<CacheT>(p, t, lane, page, entry, pos >= 0, cos_sin, q_gamma,
                                   k_gamma);
    }
    __syncthreads();  // stage (k & 1) is refilled next iteration
  }
}
