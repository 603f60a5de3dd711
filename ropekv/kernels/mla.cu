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
  i64 q_st, q_sh, qo_st, qo_sh, kv_st, cs_sp, bt_sb;  // strides in elements
  i64 ckv_sp, ckv_se, kpe_sp, kpe_se;
  i64 num_pages;
  float epsilon;
  float inv_kv_scale;  // 1 / kv_scale: stored = fp8(x * inv_kv_scale); 1 for 16-bit caches
  int T, B, Hq, L, R, P, kv_norm_dim, max_pages, page_size, gamma_f32;
  int tokens_per_block;
  int staged;    // offsets and cache_lengths are staged in shared memory (at byte 0)
  int q_staged;  // q rows are staged too (else read straight from global memory)
  // Shared-memory layout in bytes (ropekv.mla.smem_layout): gamma, per-token (pos, page, entry),
  // then two stages, each [q row (Hq, R) T | kv row (L + R) T | cos/sin row (R) float32].
  int gamma_at, meta_at, stage_at, stage_bytes, kv_at, cos_at;
};

constexpr int kBlock = 256;

template <typename T, int N>
__device__ __forceinline__ void load_gamma(const void* gamma, bool f32, int i0, float (&g)[N]) {
  if (f32) {
    load_float<float, N>(static_cast<const float*>(gamma) + i0, g);
  } else {
    load_float<T, N>(static_cast<const T*>(gamma) + i0, g);
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Copy units, in bytes: N elements of T; gamma and cos/sin rows in float32 chunks of the same
// count (N for neox, N/2 cos values for interleaved), 16 bytes at most. The host checks that every
// row is aligned to its unit.
template <typename T, int N>
__host__ __device__ constexpr int row_unit() {
  return N * int(sizeof(T));
}
__host__ __device__ constexpr int f32_unit(int n) { return 4 * n > 16 ? 16 : 4 * n; }

// Starts copying token t's kv row, q row (when staged) and cos/sin row (when it has a position)
// into stage `st`. The q row is packed (Hq, R) in shared memory whatever its global strides.
template <typename T, bool NEOX, int N>
__device__ __forceinline__ void stage_token(const MlaParams& p, i64 t, int pos, char* st) {
  constexpr int kUnit = row_unit<T, N>();
  stage_async<kUnit>(st + p.kv_at, static_cast<const T*>(p.kv) + t * p.kv_st,
                     (p.L + p.R) * int(sizeof(T)));
  if (p.q_staged) {
    const T* q = static_cast<const T*>(p.q) + t * p.q_st;
    T* sq = reinterpret_cast<T*>(st);
    const int per_head = p.R / N;
    for (int c = threadIdx.x; c < p.Hq * per_head; c += kBlock) {
      const int h = c / per_head;
      const int e = (c - h * per_head) * N;
      copy_async<kUnit>(sq + h * p.R + e, q + h * p.q_sh + e);
    }
  }
  if (pos >= 0) {
    stage_async<f32_unit(NEOX ? N : N / 2)>(st + p.cos_at, p.cos_sin + i64(pos) * p.cs_sp,
                                                p.R * 4);
  }
}

// The latent row of one token, by one warp, from shared memory (kv: the staged row, gamma: the
// staged weights). Chunk j < L/N is latent dims [jN, jN + N); chunk L/N + r is rotary chunk r.
//   rms = 1 / sqrt(sum_{i < n} x_i^2 / n + epsilon), n = kv_norm_dim
//   ckv[i] = x_i * rms * gamma_i (i < n), x_i (n <= i < L);  kpe = rope(x[L:L+R])
template <typename T, typename CacheT, bool NEOX, int N>
__device__ __forceinline__ void latent_row(const MlaParams& p, const T* kv, const void* gamma,
                                           CacheT* ckv, CacheT* kpe, const float* cos_sin,
                                           int lane) {
  const int norm_chunks = p.kv_norm_dim / N;
  float ss = 0.f;
  for (int j = lane; j < norm_chunks; j += 32) {
    float x[N];
    load_float<T, N>(kv + j * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) ss += x[k] * x[k];
  }
  ss = warp_sum(ss);
  const float rms = rsqrtf(ss / float(p.kv_norm_dim) + p.epsilon);

  const int latent_chunks = p.L / N;
  const int half_r = p.R >> 1;
  const int rope_chunks = NEOX ? half_r / N : p.R / N;
  const T* pe = kv + p.L;
  for (int j = lane; j < latent_chunks + rope_chunks; j += 32) {
    float a[N];
    if (j < latent_chunks) {
      load_float<T, N>(kv + j * N, a);
      if (j < norm_chunks) {
        float g[N];
        load_gamma<T, N>(gamma, p.gamma_f32, j * N, g);
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = a[k] * rms * g[k];
      }
      store_float<CacheT, N>(ckv + j * N, a, p.inv_kv_scale);
    } else {
      const int i0 = (j - latent_chunks) * N;
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
}

// The q row of one token: chunk w of head h covers dims [i0, i0 + N) (and, neox,
// [R/2 + i0, R/2 + i0 + N)); q is the staged row (head stride R) or the global one.
template <typename T, bool NEOX, int N>
__device__ __forceinline__ void q_row(const MlaParams& p, const T* q, i64 q_sh, T* q_out,
                                      const float* cos_sin, bool rotate) {
  const int half_r = p.R >> 1;
  const int head_chunks = NEOX ? half_r / N : p.R / N;
  for (int w = threadIdx.x; w < p.Hq * head_chunks; w += kBlock) {
    const int h = w / head_chunks;
    const int i0 = (w - h * head_chunks) * N;
    const T* src = q + h * q_sh + i0;
    T* dst = q_out + h * p.qo_sh + i0;
    float a[N];
    load_float<T, N>(src, a);
    if constexpr (NEOX) {
      float b[N];
      load_float<T, N>(src + half_r, b);
      if (rotate) rotate_neox<N>(a, b, cos_sin, half_r, i0);
      store_float<T, N>(dst + half_r, b);
    } else {
      if (rotate) rotate_interleaved<N>(a, cos_sin, half_r, i0);
    }
    store_float<T, N>(dst, a);
  }
}

// A block handles tokens_per_block consecutive tokens through a two-stage cp.async pipeline: the
// rows of token k + 1 are in flight while token k is processed from shared memory, so the
// latency of global memory is paid once per block, not once per token.
//   prologue: gamma and the ragged index arrays, with token 0's rows; positions of the block's
//     tokens by binary search in shared memory; then token 0's cos/sin row beside the
//     block-table lookups (pages).
//   token k: warp 0 normalises, ropes and writes the latent row (when the token has a page);
//     every thread ropes q chunks.
// A token outside every request or with a position outside [0, P) has its q row copied
// unrotated and writes nothing to the cache.
template <typename T, typename CacheT, bool NEOX, int N>
__global__ void __launch_bounds__(kBlock, 5) mla_rope_rmsnorm_append(const MlaParams p) {
  extern __shared__ __align__(16) char smem[];
  const i64 t0 = i64(blockIdx.x) * p.tokens_per_block;
  const int n = int(min(i64(p.tokens_per_block), i64(p.T) - t0));
  const char* gamma = smem + p.gamma_at;
  int* meta = reinterpret_cast<int*>(smem + p.meta_at);  // (pos or -1, page or -1, entry)
  char* stage0 = smem + p.stage_at;

  constexpr int kUnit = row_unit<T, N>();
  if (p.gamma_f32) {
    stage_async<f32_unit(N)>(smem + p.gamma_at, p.gamma, p.kv_norm_dim * 4);
  } else {
    stage_async<kUnit>(smem + p.gamma_at, p.gamma, p.kv_norm_dim * int(sizeof(T)));
  }
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
  for (int i = threadIdx.x; i < n; i += kBlock) {
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
  for (int i = threadIdx.x; i < n; i += kBlock) {
    PagedSlot s{meta[3 * i + 1], meta[3 * i], -1, 0};
    if (s.pos >= 0) page_of(s, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
    meta[3 * i + 1] = int(s.page);
    meta[3 * i + 2] = s.entry;
  }
  __syncthreads();

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
    if (threadIdx.x < 32 && page >= 0) {
      CacheT* ckv = static_cast<CacheT*>(p.ckv) + page * p.ckv_sp + entry * p.ckv_se;
      CacheT* kpe = static_cast<CacheT*>(p.kpe) + page * p.kpe_sp + entry * p.kpe_se;
      latent_row<T, CacheT, NEOX, N>(p, reinterpret_cast<const T*>(st + p.kv_at), gamma, ckv,
                                     kpe, cos_sin, threadIdx.x);
    }
    T* q_out = static_cast<T*>(p.q_out) + t * p.qo_st;
    if (p.q_staged) {
      q_row<T, NEOX, N>(p, reinterpret_cast<const T*>(st), p.R, q_out, cos_sin, pos >= 0);
    } else {
      q_row<T, NEOX, N>(p, static_cast<const T*>(p.q) + t * p.q_st, p.q_sh, q_out, cos_sin,
                        pos >= 0);
    }
    __syncthreads();  // stage (k & 1) is refilled next iteration
  }
}
