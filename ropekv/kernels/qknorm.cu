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
  const void* position_ids;  // mRoPE: (3, T) int32 or int64 positions (temporal, height, width)
  int* status;               // status=: (1,) int32, the offsets' code (0 valid), or null
  float* q_scale_out;        // fp8 q, dynamic scales: (T, Hq) float32, each q row's scale; or null
  float* k_scales;           // per-token-head KV scales: the caches' shape without D, float32
  float* v_scales;           //   NHD (num_pages, page_size, Hkv), HND (num_pages, Hkv, page_size)
  i64 q_st, q_sh, qo_st, qo_sh, k_st, k_sh, v_st, v_sh, cs_sp, bt_sb;  // strides in elements
  i64 kc_sp, kc_se, kc_sh, vc_sp, vc_se, vc_sh;  // page, entry, head strides (layout-free)
  i64 num_pages;
  i64 pid_st;  // position_ids row stride (T)
  float epsilon;
  float weight_offset;             // added to every q_gamma and k_gamma value (Gemma: 1)
  float inv_k_scale, inv_v_scale;  // stored = fp8(x * inv_scale); 1 for 16-bit caches
  int T, B, Hq, Hkv, D, R, P, max_pages, page_size, q_gamma_f32, k_gamma_f32;
  int group;  // lanes per head row: a power of two <= 32 dividing blockDim.x
  int rows;   // head rows each lane group holds, 1 ..= ROWS
  int post;   // norm_order="after_rope": RoPE, then the norm
  int clear;  // clear_unused_last_page_rows
  int mrope;  // rope from position_ids by sections (MRope); 0: from the cache position
  int mrope_t, mrope_h, mrope_w, mrope_interleaved;
  int pos64;  // position_ids is int64
  int check;  // status=: validate the offsets first (the grid has at least one token block)
  // the quantizing kernels' fields, last (placed before the others, they moved the fields the
  // plain kernels read and cost those two registers)
  int q_dynamic;      // q_scale_out: each q row quantized with its computed scale
  int kv_dynamic;     // k_scales, v_scales: each written K and V row likewise
  float inv_q_scale;  // fp8 q, static scale: stored = fp8(q * inv_q_scale)
  i64 qs_st, qs_sh;   // q_scale_out strides in elements
  i64 ks_sp, ks_se, ks_sh, vs_sp, vs_se, vs_sh;  // scale arrays: page, entry, head strides
  // the decode kernels' divisions by a call's constants (fast_div): by a token's head rows (Hq +
  // 2 Hkv) and by page_size
  unsigned h_magic, pg_magic;
  int h_shift, pg_shift;
};

constexpr int kStageMax = 512;  // batches of up to this many requests are searched in shared memory
// the decode guess's path probes (RequestGuess) cover the search over offsets[0..kStageMax]
static_assert(kStageMax + 1 < (1 << kGuessSteps), "kGuessSteps steps cover kStageMax requests");
constexpr int kMaxD = 512;      // the largest head dim (32 lanes of 8 neox pairs; the host checks)

// The RMSNorm weight element i as float32, whichever its storage.
template <typename T>
__device__ __forceinline__ float weight_at(const void* w, int f32, int i) {
  return f32 ? static_cast<const float*>(w)[i] : to_float(static_cast<const T*>(w)[i]);
}

struct QKNormShared {
  float gamma[3][kMaxD];  // q weights, k weights, ones (rows that are not normalised)
  unsigned offsets[kStageMax + 1];
  int lengths[kStageMax];
};

// The quantizing kernels' computed scale of a row y = rms * y' whose largest |y'| is amax:
// a = max(rms * amax, 1e-6), returns the scale a / max_code and sets mul (what y' is multiplied
// by before rounding) to rms * max_code / a, by a fast division (no IEEE slow path on the chain;
// within 2 ulp): a >= 1e-6 is inside its range up to 2^126, beyond it both sides are scaled by
// 2^-4 (an infinite amax: scale inf, values times 0, as the IEEE division gives).
template <typename C>
__device__ __forceinline__ float computed_scale(float rms, float amax, float& mul) {
  const float a = fmaxf(rms * amax, 1e-6f);
  const float k = a < 0x1p126f ? 1.f : 0x1p-4f;
  mul = rms * __fdividef(max_code<C>() * k, a * k);
  return a * (1.f / max_code<C>());
}

// A token's head rows are Q (Hq), K (Hkv) and V (Hkv): H = Hq + 2 Hkv rows of D dims. A row is cut
// into `items` chunks: chunk j < rot_items holds RoPE pairs (neox: dims [jN, jN + N) and their
// partners R/2 further; interleaved: dims [jN, jN + N)), the rest N pass-through dims of [R, D);
// V rows are cut the same way. A group of G >= items lanes (G = p.group, a power of two <= 32)
// holds one row, lane j chunk j; a block of blockDim.x / G groups takes p.rows rows per group, so
// grid (T, splits) with splits = ceil(H / (blockDim.x / G * p.rows)): decode splits a token's rows
// over several blocks (one row per group), prefill gives a block a whole token.
//   y = rope(x / sqrt(mean(x^2) + epsilon) * gamma), in float32, rounded once; with p.post (norm
//   after RoPE) y = rope(x) / sqrt(mean(x^2) + epsilon) * gamma: a rotation keeps the row's sum
//   of squares, so the sums are the same and only the order of gamma and the rotation changes.
//   gamma is the weight plus p.weight_offset (Gemma's (1 + w)), added once when it is staged.
// Order, so that the dependent index loads overlap the row loads:
//   1. the rows (they depend on nothing); 2. the RMSNorm weights and, for batches of at most
//   kStageMax requests, the offsets and cache lengths, into shared memory; the sums of squares;
//   3. the token's request and position (a binary search over the offsets), then its page and its
//   cos/sin values; 4. normalise, rope, store.
// Step 4 is the same arithmetic for every row (V rows and rows of tokens without a position take
// weights of one, no norm and the identity rotation), the stores predicated: the ROWS rows of a
// thread are independent instruction streams the compiler interleaves. ROWS (1, 2 or 4) is
// the rows a thread can hold, p.rows <= ROWS those it does (the others predicated off).
// A token outside every request, or with a position outside [0, P), has its q row copied
// unchanged and writes nothing; a token whose page is out of range is normalised and roped but
// writes nothing.
// OPTS 0: the plain kernel, every option compiled out (an option costs nothing when off); 1: the
// light options are read (p.post, p.weight_offset, p.clear, p.check); 2: mRoPE too (its three
// positions and cos/sin rows cost registers the others should not pay for).
// QUANT (with OPTS 0 or 2): q is stored as QT (fp8 with a static scale, or with p.q_dynamic a
// computed scale per row) and, with p.kv_dynamic, K and V rows with computed scales. A computed
// scale needs the row's largest magnitude after the norm and RoPE: one more max-shuffle over the
// row's G lanes, beside the row sum's (these kernels defer the norm's 1/rms to the store, so the
// maximum does not wait for the sum; step 4 says how). Without QUANT, QT is T and none of it is
// compiled.
template <typename T, typename CacheT, typename QT, bool NEOX, int N, int ROWS, int OPTS,
          bool QUANT>
__device__ __forceinline__ void qk_rows(const QKNormParams& p, QKNormShared& sh) {
  const i64 t = blockIdx.x;
  const int G = p.group;
  const int U = ROWS == 1 ? 1 : p.rows;  // <= ROWS
  const int slots = blockDim.x / G;
  const int j = threadIdx.x & (G - 1);
  const int first = blockIdx.y * slots * U + threadIdx.x / G;  // row of u = 0; u adds u * slots
  const int H = p.Hq + 2 * p.Hkv;
  const int half_r = p.R >> 1;
  const int rot_items = NEOX ? half_r / N : p.R / N;
  const int items = rot_items + (p.D - p.R) / N;
  // with status= a batch of no tokens still launches one block: it only validates
  const bool has_chunk = j < items && (!OPTS || t < p.T);
  const bool rotary = j < rot_items;
  const bool pair = NEOX && rotary;  // two vectors per chunk
  const int ea = rotary ? j * N : p.R + (j - rot_items) * N;
  const int eb = ea + half_r;
  const float inv_d = __fdividef(1.f, float(p.D));  // fast: no IEEE slow path on the chain

  // 1. this lane's chunks of its rows (and mRoPE's three positions: they depend on nothing)
  const bool mrope = OPTS == 2 && p.mrope;
  i64 mpos[3] = {0, 0, 0};
  if (mrope && t < p.T) mrope_positions(p.position_ids, p.pos64, t, p.pid_st, mpos);
  Vec<T, N> va[ROWS], vb[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H || !has_chunk) continue;
    const T* row = h < p.Hq ? static_cast<const T*>(p.q) + t * p.q_st + h * p.q_sh
                   : h < p.Hq + p.Hkv
                       ? static_cast<const T*>(p.k) + t * p.k_st + (h - p.Hq) * p.k_sh
                       : static_cast<const T*>(p.v) + t * p.v_st + (h - p.Hq - p.Hkv) * p.v_sh;
    // the ROWS 4 kernel (3-4 rows a lane group: calls past a wave at fewer, Qwen3-32B prefill
    // among them) streams its rows, 0.96-0.99x the time at Qwen3-32B 8 x 1024; at 2 rows (Llama
    // heads' prefill) streaming read 1.01x slower, so the others load plainly
    constexpr bool kStream = ROWS >= 4;
    va[u] = kStream ? load_stream<T, N>(row + ea) : load<T, N>(row + ea);
    if (pair) vb[u] = kStream ? load_stream<T, N>(row + eb) : load<T, N>(row + eb);
  }

  // 2. weights and index arrays to shared memory: every load issued before any store
  const bool staged = p.B <= kStageMax;
  const int n_stage = staged ? p.B + 1 : 0;
  {
    const int i = threadIdx.x;
    float gq = 1.f, gk = 1.f;
    unsigned off = 0;
    int len = 0;
    if (i < p.D) {
      gq = weight_at<T>(p.q_gamma, p.q_gamma_f32, i) + (OPTS ? p.weight_offset : 0.f);
      gk = weight_at<T>(p.k_gamma, p.k_gamma_f32, i) + (OPTS ? p.weight_offset : 0.f);
    }
    if (i < n_stage) off = p.offsets[i];
    if (i < n_stage - 1) len = p.cache_lengths[i];
    if (i < p.D) {
      sh.gamma[0][i] = gq;
      sh.gamma[1][i] = gk;
      sh.gamma[2][i] = 1.f;
    }
    if (i < n_stage) sh.offsets[i] = off;
    if (i < n_stage - 1) sh.lengths[i] = len;
  }
  for (int i = threadIdx.x + blockDim.x; i < p.D; i += blockDim.x) {  // D > blockDim.x
    sh.gamma[0][i] = weight_at<T>(p.q_gamma, p.q_gamma_f32, i) + (OPTS ? p.weight_offset : 0.f);
    sh.gamma[1][i] = weight_at<T>(p.k_gamma, p.k_gamma_f32, i) + (OPTS ? p.weight_offset : 0.f);
    sh.gamma[2][i] = 1.f;
  }
  for (int i = threadIdx.x + blockDim.x; i < n_stage; i += blockDim.x) {  // B >= blockDim.x
    sh.offsets[i] = p.offsets[i];
    if (i < n_stage - 1) sh.lengths[i] = p.cache_lengths[i];
  }

  // partial sums of squares of the rows
  float ss[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
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
  if (OPTS && p.check) {  // status=: malformed offsets write nothing (every block agrees)
    const int code = ragged_offsets_status(staged ? sh.offsets : p.offsets, p.B, p.T);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
    if (code) return;
  }

  // 3. request, position, page, cos/sin
  PagedSlot slot = staged ? ragged_position(sh.offsets, sh.lengths, p.B, t)
                          : ragged_position(p.offsets, p.cache_lengths, p.B, t);
  // mRoPE: the rotation from the three positions, the slot still from the cache position
  const bool roped = slot.request >= 0 && slot.pos >= 0 &&
                     (mrope ? mrope_in_range(mpos, p.P) : slot.pos < p.P);
  if (roped && first + (U - 1) * slots >= p.Hq)  // this group holds a K or V row
    page_of(slot, p.block_table, p.bt_sb, p.max_pages, p.page_size, p.num_pages);
  const bool write = slot.page >= 0;
  // p.clear: the last token of a request also zeroes the rest of its page, each lane its chunks
  const bool clear = OPTS && p.clear && write &&
                     last_of_request(staged ? sh.offsets : p.offsets, slot, t);
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    c[i] = 1.f;
    sn[i] = 0.f;
  }
  if (roped && rotary) {
    if (mrope) {
      const MRope m{p.mrope_t, p.mrope_h, p.mrope_w, p.mrope_interleaved};
      load_mrope_cos_sin<M>(p.cos_sin, p.cs_sp, mpos, m, half_r, NEOX ? ea : ea / 2, c, sn);
    } else {
      const float* cs = p.cos_sin + slot.pos * p.cs_sp + (NEOX ? ea : ea / 2);
      load_float<float, M>(cs, c);
      load_float<float, M>(cs + half_r, sn);
    }
  }
  // the row sums: shuffles within each G-lane group (U and G are block-uniform: every lane takes
  // part). The quantizing kernels do them later, beside the row maxima's.
  if constexpr (!QUANT) {
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      if (u >= U) break;
      for (int o = G >> 1; o; o >>= 1) ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
    }
  }

  // 4. normalise, rope, store
  CacheT* const k_row = static_cast<CacheT*>(p.k_cache) + slot.page * p.kc_sp +
                        slot.entry * p.kc_se;
  CacheT* const v_row = static_cast<CacheT*>(p.v_cache) + slot.page * p.vc_sp +
                        slot.entry * p.vc_se;
  QT* const q_row = static_cast<QT*>(p.q_out) + t * p.qo_st;
  if constexpr (!QUANT) {
    // the loop as it was before the quantizing kernels existed, kept apart (not through the
    // lambdas above, which cost the plain kernels registers): options off cost nothing
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      const int h = first + u * slots;
      const bool live = u < U && h < H && has_chunk;
      const bool is_q = h < p.Hq;
      const bool is_v = h >= p.Hq + p.Hkv;
      const bool norm = roped && !is_v;  // V rows and rows without a position: copied
      const float rms = norm ? rsqrtf(ss[u] * inv_d + p.epsilon) : 1.f;
      const float* g = sh.gamma[norm ? (is_q ? 0 : 1) : 2];
      float a[N], b[N], ga[N], gb[N];
      to_floats<T, N>(va[u], a);
      if (pair) to_floats<T, N>(vb[u], b);
      float cu[M], su[M];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        cu[i] = norm ? c[i] : 1.f;
        su[i] = norm ? sn[i] : 0.f;
      }
      const bool post = OPTS && p.post;
      if (post && rotary) rotate_chunk<NEOX, N, M>(a, b, cu, su);
      load_float<float, N>(g + ea, ga);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] *= rms * ga[i];
      if (pair) {
        load_float<float, N>(g + eb, gb);
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] *= rms * gb[i];
      }
      if (!post && rotary) rotate_chunk<NEOX, N, M>(a, b, cu, su);
      if (!live) continue;
      if (is_q) {
        T* dst = q_row + h * p.qo_sh;
        store_float<T, N>(dst + ea, a);
        if (pair) store_float<T, N>(dst + eb, b);
      } else if (write) {
        CacheT* dst = is_v ? v_row + (h - p.Hq - p.Hkv) * p.vc_sh : k_row + (h - p.Hq) * p.kc_sh;
        const float scale = is_v ? p.inv_v_scale : p.inv_k_scale;
        store_float<CacheT, N>(dst + ea, a, scale);
        if (pair) store_float<CacheT, N>(dst + eb, b, scale);
        if (clear) {
          const i64 se = is_v ? p.vc_se : p.kc_se;
          zero_rest_of_page<CacheT, N>(dst, se, slot.entry, p.page_size, ea);
          if (pair) zero_rest_of_page<CacheT, N>(dst, se, slot.entry, p.page_size, eb);
        }
      }
    }
  } else {
    // The quantizing kernels defer the norm's 1/rms: a row is y' = rope(x * gamma) (or
    // rope(x) * gamma after RoPE), its largest magnitude amax' = max|y'| needs no row sum, so the
    // row maxima and the row sums are reduced in one set of shuffles (independent chains), and
    // the stored value is y' times one multiplier per row, m = rms * (the output's scale): the
    // 1/rms product costs no pass of its own (1 multiply per element less than normalising
    // first). y = rms * y', so the row's amax is rms * amax' (the float32 rounding moves by an
    // ulp, well inside the tolerances: codes equal or adjacent, scales within 1e-4).
    // row u's chunk times its weights and roped (not normalised), in float32
    auto weigh_rope = [&](int u, float (&a)[N], float (&b)[N]) {
      const int h = first + u * slots;
      const bool is_q = h < p.Hq;
      const bool is_v = h >= p.Hq + p.Hkv;
      const bool norm = roped && !is_v;  // V rows and rows without a position: copied
      const float* g = sh.gamma[norm ? (is_q ? 0 : 1) : 2];
      float ga[N], gb[N];
      to_floats<T, N>(va[u], a);
      if (pair) to_floats<T, N>(vb[u], b);
      float cu[M], su[M];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        cu[i] = norm ? c[i] : 1.f;
        su[i] = norm ? sn[i] : 0.f;
      }
      const bool post = OPTS && p.post;
      if (post && rotary) rotate_chunk<NEOX, N, M>(a, b, cu, su);
      load_float<float, N>(g + ea, ga);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] *= ga[i];
      if (pair) {
        load_float<float, N>(g + eb, gb);
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] *= gb[i];
      }
      if (!post && rotary) rotate_chunk<NEOX, N, M>(a, b, cu, su);
    };
    // whether row u is stored with a computed scale (only those need their amax)
    auto computed = [&](int u) {
      const int h = first + u * slots;
      return h < p.Hq ? is_quantized<QT>::value && p.q_dynamic
                      : is_quantized<CacheT>::value && p.kv_dynamic;
    };
    // this lane's largest |y'| of row u: a tree (depth log2 of the values, not their count);
    // fmaxf drops NaN. 0 for rows without a computed scale or a chunk.
    auto chunk_max = [&](int u, const float (&a)[N], const float (&b)[N]) {
      if (!(u < U && first + u * slots < H && has_chunk && computed(u))) return 0.f;
      float m[N];
#pragma unroll
      for (int i = 0; i < N; ++i) m[i] = pair ? fmaxf(fabsf(a[i]), fabsf(b[i])) : fabsf(a[i]);
#pragma unroll
      for (int w = N / 2; w > 0; w >>= 1) {
#pragma unroll
        for (int i = 0; i < w; ++i) m[i] = fmaxf(m[i], m[i + w]);
      }
      return m[0];
    };
    // row u's stores: y' times m (rms times the output's scale); ss and amax reduced
    auto store_row = [&](int u, float (&a)[N], float (&b)[N], float ss_u, float amax) {
      const int h = first + u * slots;
      if (!(u < U && h < H && has_chunk)) return;
      const bool is_q = h < p.Hq;
      const bool is_v = h >= p.Hq + p.Hkv;
      const float rms = roped && !is_v ? rsqrtf(ss_u * inv_d + p.epsilon) : 1.f;
      if (is_q) {
        QT* dst = q_row + h * p.qo_sh;
        float mul = rms;
        if constexpr (is_quantized<QT>::value) {
          mul = rms * p.inv_q_scale;
          if (p.q_dynamic) {
            const float scale = computed_scale<QT>(rms, amax, mul);
            if (j == 0) p.q_scale_out[t * p.qs_st + h * p.qs_sh] = scale;
          }
        } else {  // 16-bit q: stored as it is (store_float applies no multiplier)
#pragma unroll
          for (int i = 0; i < N; ++i) a[i] *= mul;
          if (pair) {
#pragma unroll
            for (int i = 0; i < N; ++i) b[i] *= mul;
          }
        }
        store_float<QT, N>(dst + ea, a, mul);
        if (pair) store_float<QT, N>(dst + eb, b, mul);
      } else if (write) {
        const int kh = is_v ? h - p.Hq - p.Hkv : h - p.Hq;  // the KV head
        CacheT* dst = is_v ? v_row + kh * p.vc_sh : k_row + kh * p.kc_sh;
        float mul = rms;
        float* scale_slot = nullptr;  // per-token-head KV scales: this row's slot
        if constexpr (is_quantized<CacheT>::value) {
          mul = rms * (is_v ? p.inv_v_scale : p.inv_k_scale);
          if (p.kv_dynamic) {
            const float scale = computed_scale<CacheT>(rms, amax, mul);
            scale_slot = is_v ? p.v_scales + slot.page * p.vs_sp + slot.entry * p.vs_se +
                                    kh * p.vs_sh
                              : p.k_scales + slot.page * p.ks_sp + slot.entry * p.ks_se +
                                    kh * p.ks_sh;
            if (j == 0) *scale_slot = scale;
          }
        } else {  // 16-bit cache (with fp8 q)
#pragma unroll
          for (int i = 0; i < N; ++i) a[i] *= mul;
          if (pair) {
#pragma unroll
            for (int i = 0; i < N; ++i) b[i] *= mul;
          }
        }
        store_float<CacheT, N>(dst + ea, a, mul);
        if (pair) store_float<CacheT, N>(dst + eb, b, mul);
        if (clear) {
          const i64 se = is_v ? p.vc_se : p.kc_se;
          zero_rest_of_page<CacheT, N>(dst, se, slot.entry, p.page_size, ea);
          if (pair) zero_rest_of_page<CacheT, N>(dst, se, slot.entry, p.page_size, eb);
          if (scale_slot && j == 0) {  // a stale NaN scale times a zero code is NaN
            const i64 sse = is_v ? p.vs_se : p.ks_se;
            for (int r = 1; r < p.page_size - slot.entry; ++r) scale_slot[r * sse] = 0.f;
          }
        }
      }
    };
    if constexpr (ROWS <= 2) {
      // every row of the thread first (independent chains), then the row sums' and maxima's
      // shuffles together (every lane takes part: U and G are block-uniform; lanes without a
      // chunk bring 0), then the stores (at ROWS 4 the rows would not fit in registers)
      float a[ROWS][N], b[ROWS][N], amax[ROWS];
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        weigh_rope(u, a[u], b[u]);
        amax[u] = chunk_max(u, a[u], b[u]);
      }
      for (int o = G >> 1; o; o >>= 1) {
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
          if (u < U) {
            ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
            amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], o));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < ROWS; ++u) store_row(u, a[u], b[u], ss[u], amax[u]);
    } else {
      // row by row (fewer registers)
#pragma unroll
      for (int u = 0; u < ROWS; ++u) {
        float a[N], b[N];
        weigh_rope(u, a, b);
        float amax = chunk_max(u, a, b);
        if (u < U) {
          for (int o = G >> 1; o; o >>= 1) {
            ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          }
        }
        store_row(u, a, b, ss[u], amax);
      }
    }
  }
}

// One kernel per ROWS (1, 2 or 4): the register budget follows the rows a thread holds. OPTS:
// with the options (norm after RoPE, weight offset, tail clearing, mRoPE) read at run time.
// QUANT: fp8 q (QT) and computed scales (per q row, per K/V row) compiled in.
template <typename T, typename CacheT, typename QT, bool NEOX, int N, int ROWS, int OPTS,
          bool QUANT>
__global__ void __launch_bounds__(512) qk_rmsnorm_rope_append(const QKNormParams p) {
  __shared__ __align__(16) QKNormShared sh;
  pdl_launch_dependents();
  pdl_wait();
  qk_rows<T, CacheT, QT, NEOX, N, ROWS, OPTS, QUANT>(p, sh);
}

// ---- Decode: the head geometry as template constants ----------------------------------------
// The plain kernel (OPTS 0, no QUANT) specialised for decode-sized calls of full-width RoPE
// (R == D) at 16-byte lanes (N = 8 elements of T): D is a constant (the lanes of a row, G = D / 16
// neox or D / 8 interleaved, hold the row exactly: no idle lanes, the 1/D a constant), the RMSNorm
// weights are read by each lane straight from global memory (no staging, no barrier), offsets are
// 32-bit (IX unsigned) when the host found every array's extent below 2^31 elements, and the row
// kind (Q, K, V) picks pointers and strides by selects, not branches. A block of blockDim.x / G
// rows, grid (T, ceil(H / rows)): a token's rows over several blocks, as Cake's kernel does.
// The request search: batches of fewer than 32 requests load offsets[0..B] and cache_lengths[0..B)
// one per lane (with the rows, before anything waits) and find the request among the lanes
// (lane_position, common.cuh: a ballot where the offsets are sorted, else the binary search by
// shuffles; the request's length then comes from a lane: no dependent load); with GUESS (the
// host sets it for calls of one token a request, 32 to kStageMax requests) the decode guess
// (RequestGuess, common.cuh: token t in request t, checked against the search's own path, its
// probes loaded with the rows), the search in global memory where the path fails; other batches
// stage them in shared memory (as qk_rows does) or, past kStageMax, search global memory.
// The block-table entry is loaded as soon as the position is known and only checked at the
// store, after the norm and RoPE arithmetic. The semantics are qk_rows's: a token outside every
// request or with a position outside [0, P) has its q row copied and writes nothing; a token whose
// page is out of range is normalised and roped but writes nothing.
// The decode kernels' record: only the fields they read, in the order of QKNormParams (whose
// fields they share by name: the host packs both from one dict). A kernel's parameters are read
// through the constant cache: from QKNormParams the flat kernel's SASS (sm_90a) read 7 lines of
// 64 bytes (0x208-0x3ec, constant-cache misses were 18% of its stall samples at 16 tokens), from
// these 288 bytes 5. Side by side on the H200 every decode case took 3-6% less time.
// Field order and types mirror DECODE_PARAMS in ropekv/qknorm.py.
struct QKDecodeParams {
  const void* q;
  void* q_out;
  const void* k;
  const void* v;
  const void* q_gamma;
  const void* k_gamma;
  const float* cos_sin;
  const unsigned* offsets;
  const int* cache_lengths;
  const int* block_table;
  void* k_cache;
  void* v_cache;
  i64 q_st, q_sh, qo_st, qo_sh, k_st, k_sh, v_st, v_sh, cs_sp, bt_sb;
  i64 kc_sp, kc_se, kc_sh, vc_sp, vc_se, vc_sh;
  i64 num_pages;
  float epsilon;
  float inv_k_scale, inv_v_scale;
  int T, B, Hq, Hkv, P, max_pages, page_size;
  unsigned h_magic, pg_magic;
  int h_shift, pg_shift;
};

// The decode kernels that store fp8 q (QT an fp8 type: a static scale, or with q_dynamic a
// computed scale per q row) take QKDecodeQParams: QKDecodeParams's fields and the q scale's, in
// QKNormParams's order (the plain decode kernels' record and constant lines are unchanged).
// Field order and types mirror QDECODE_PARAMS in ropekv/qknorm.py.
struct QKDecodeQParams {
  const void* q;
  void* q_out;
  const void* k;
  const void* v;
  const void* q_gamma;
  const void* k_gamma;
  const float* cos_sin;
  const unsigned* offsets;
  const int* cache_lengths;
  const int* block_table;
  void* k_cache;
  void* v_cache;
  float* q_scale_out;  // q_dynamic: (T, Hq) float32, each q row's scale
  i64 q_st, q_sh, qo_st, qo_sh, k_st, k_sh, v_st, v_sh, cs_sp, bt_sb;
  i64 kc_sp, kc_se, kc_sh, vc_sp, vc_se, vc_sh;
  i64 num_pages;
  float epsilon;
  float inv_k_scale, inv_v_scale;
  int T, B, Hq, Hkv, P, max_pages, page_size;
  int q_dynamic;       // each q row stored with its computed scale (computed_scale)
  float inv_q_scale;   // a static scale: stored = fp8(q * inv_q_scale)
  i64 qs_st, qs_sh;    // q_scale_out's strides in elements
  unsigned h_magic, pg_magic;
  int h_shift, pg_shift;
};

// The record of a decode kernel storing q as QT: QKDecodeQParams for fp8 q, else QKDecodeParams.
template <typename QT>
struct DecodeRecord {
  using type = typename pick_type<is_quantized<QT>::value, QKDecodeQParams, QKDecodeParams>::type;
};

struct QKDecodeShared {
  unsigned offsets[kStageMax + 1];
  int lengths[kStageMax];
};

// Whether a decode kernel built with GUESS takes the decode guess for this call: one token a
// request, 32 (below: the search among the lanes) to kStageMax requests. The host sets GUESS by the
// same rule (qknorm.guesses); rechecked here, so a call outside it takes the other searches.
template <bool GUESS, typename P>
__device__ __forceinline__ bool takes_guess(const P& p) {
  return GUESS && p.B >= 32 && p.B <= kStageMax && p.T == p.B;
}

// FLAT (qk_rmsnorm_rope_decode_flat): the rows of every token in one sequence, row r = t H + h
// (H = Hq + 2 Hkv), blockDim.x / G consecutive rows a block, grid ceil(T H / rows): no idle lane
// but in the last block whatever H (Tensor-parallel 8 / 1 heads: 10 rows, which a (T, splits)
// grid pads to 16), and many tokens give many blocks. A warp may then hold rows of two tokens:
// lane_position takes a ballot for each (the search, converged, where a warp holds more).
// N: elements per lane, 8 (16-byte lanes of T) or 4 (twice the lanes, half the work per lane, for
// the fewest tokens).
// QT: q's stored type, T, or fp8 (the record is then QKDecodeQParams): a static scale, or with
// p.q_dynamic a computed scale per q row from the row's largest |y'| (y' = rope(x * gamma), the
// 1/rms applied at the store, as the quantizing generic kernel's), reduced by max-shuffles over
// the row's G lanes beside the row sum's.
template <typename T, typename CacheT, bool NEOX, int D, bool GF32, bool I32, bool FLAT, int N,
          bool GUESS, typename QT, typename P>
__device__ __forceinline__ void qk_decode_rows(const P& p, QKDecodeShared& sh) {
  using ix = typename pick_type<I32, unsigned, i64>::type;
  constexpr int G = NEOX ? D / (2 * N) : D / N;  // lanes per head row
  constexpr int HALF = D / 2;
  constexpr int M = NEOX ? N : N / 2;  // angles per lane
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a row within a warp, power of two");
  static_assert(!FLAT || I32, "the flat row index is 32-bit");
  const int Hq = p.Hq, Hkv = p.Hkv;
  int t, h;
  bool live;
  if constexpr (FLAT) {
    const unsigned r = blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const unsigned H = unsigned(Hq + 2 * Hkv);
    t = int(fast_div(r, p.h_magic, p.h_shift));  // r / H
    h = int(r - unsigned(t) * H);
    live = t < p.T;
  } else {
    t = blockIdx.x;
    h = blockIdx.y * (blockDim.x / G) + threadIdx.x / G;
    live = h < Hq + 2 * Hkv;
  }
  const int j = threadIdx.x & (G - 1);
  const bool is_q = h < Hq;
  const bool is_v = h >= Hq + Hkv;
  const int hh = is_q ? h : is_v ? h - Hq - Hkv : h - Hq;  // the head within q, k or v
  const int ea = j * N;
  const int eb = ea + HALF;

  // 1. the row's chunks, its RMSNorm weights and the search's arrays (nothing waits yet)
  Vec<T, N> va{}, vb{};
  {
    const T* base = static_cast<const T*>(is_q ? p.q : is_v ? p.v : p.k);
    const ix st = ix(is_q ? p.q_st : is_v ? p.v_st : p.k_st);
    const ix sh_ = ix(is_q ? p.q_sh : is_v ? p.v_sh : p.k_sh);
    const T* row = base + (ix(t) * st + ix(hh) * sh_);
    if (live) {
      va = load<T, N>(row + ea);
      if (NEOX) vb = load<T, N>(row + eb);
    }
  }
  float ga[N], gb[N];
  {
    const void* w = is_q ? p.q_gamma : p.k_gamma;  // V rows: k's, unused
    if constexpr (GF32) {
      load_float<float, N>(static_cast<const float*>(w) + ea, ga);
      if (NEOX) load_float<float, N>(static_cast<const float*>(w) + eb, gb);
    } else {
      load_float<T, N>(static_cast<const T*>(w) + ea, ga);
      if (NEOX) load_float<T, N>(static_cast<const T*>(w) + eb, gb);
    }
  }
  const int B = p.B;
  const int lane = threadIdx.x & 31;
  unsigned lane_off = 0;
  int lane_len = 0;
  if (B < 32) {
    if (lane <= B) lane_off = p.offsets[lane];
    if (lane < B) lane_len = p.cache_lengths[lane];
  }
  const bool guess = takes_guess<GUESS>(p);
  RequestGuess<G> guessed;
  if (guess) guessed.load(p.offsets, p.cache_lengths, B, t);

  // the row's partial sum of squares
  float a[N], b[N];
  to_floats<T, N>(va, a);
  if (NEOX) to_floats<T, N>(vb, b);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) ss += a[i] * a[i];
  if (NEOX) {
#pragma unroll
    for (int i = 0; i < N; ++i) ss += b[i] * b[i];
  }

  // 2. request and position (every branch block-uniform)
  int req;
  i64 pos = -1;
  if (B < 32) {  // over the warp's lanes (FLAT: the lanes' tokens may differ, two at most)
    const PagedSlot s = lane_position<FLAT ? 2 : 1>(lane_off, lane_len, B, t);
    req = s.request;
    pos = s.pos;
  } else {
    PagedSlot s;
    if (guess) {  // the search only where the guess's path did not hold
      if (!guessed.resolve(t, s) && (!FLAT || live)) {
        s = ragged_position(p.offsets, p.cache_lengths, B, t);
      }
    } else if (B <= kStageMax) {
      for (int i = threadIdx.x; i <= B; i += blockDim.x) {
        sh.offsets[i] = p.offsets[i];
        if (i < B) sh.lengths[i] = p.cache_lengths[i];
      }
      __syncthreads();
      s = ragged_position(sh.offsets, sh.lengths, B, t);
    } else {
      s = ragged_position(p.offsets, p.cache_lengths, B, t);
    }
    req = s.request;
    pos = s.pos;
  }
  const bool roped = (!FLAT || live) && req >= 0 && pos >= 0 && pos < p.P;
  const int posi = int(pos);  // used only when roped

  // 3. the block-table entry (K and V rows), then cos/sin (Q and K rows)
  int page = -1, entry = 0;
  if (roped && !is_q) {
    const unsigned index = fast_div(unsigned(posi), p.pg_magic, p.pg_shift);  // / page_size
    entry = posi - int(index) * p.page_size;
    if (index < unsigned(p.max_pages)) page = p.block_table[ix(req) * ix(p.bt_sb) + ix(index)];
  }
  float c[M], sn[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    c[i] = 1.f;
    sn[i] = 0.f;
  }
  const bool norm = roped && !is_v;  // V rows and rows without a position: copied
  if (norm) {
    const float* cs = p.cos_sin + ix(posi) * ix(p.cs_sp) + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + HALF, sn);
  }
#pragma unroll
  for (int o = G >> 1; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);

  // 4. weights, rotation (linear: the 1/rms is applied at the store), store
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] *= norm ? ga[i] : 1.f;
  if (NEOX) {
#pragma unroll
    for (int i = 0; i < N; ++i) b[i] *= norm ? gb[i] : 1.f;
  }
  rotate_chunk<NEOX, N, M>(a, b, c, sn);
  const float rms = norm ? rsqrtf(ss * (1.f / D) + p.epsilon) : 1.f;
  if constexpr (is_quantized<QT>::value) {  // fp8 q: Q rows stored here
    float amax = 0.f;
    if (p.q_dynamic) {
      // the row's largest |y'|: a tree over the lane's values (fmaxf drops NaN), then over the
      // row's lanes (every lane shuffles, whatever its row's kind)
      float m[N];
#pragma unroll
      for (int i = 0; i < N; ++i) m[i] = NEOX ? fmaxf(fabsf(a[i]), fabsf(b[i])) : fabsf(a[i]);
#pragma unroll
      for (int w = N / 2; w > 0; w >>= 1) {
#pragma unroll
        for (int i = 0; i < w; ++i) m[i] = fmaxf(m[i], m[i + w]);
      }
      amax = m[0];
#pragma unroll
      for (int o = G >> 1; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    if (is_q) {
      if (live) {  // FLAT: a row past the last token is a Q row, not live
        float mul = rms * p.inv_q_scale;
        if (p.q_dynamic) {
          const float scale = computed_scale<QT>(rms, amax, mul);
          if (j == 0) p.q_scale_out[ix(t) * ix(p.qs_st) + ix(h) * ix(p.qs_sh)] = scale;
        }
        QT* const dst = static_cast<QT*>(p.q_out) + (ix(t) * ix(p.qo_st) + ix(h) * ix(p.qo_sh));
        store_float<QT, N>(dst + ea, a, mul);
        if (NEOX) store_float<QT, N>(dst + eb, b, mul);
      }
      return;
    }
  }
  const bool write = page >= 0 && ix(page) < ix(p.num_pages);
  CacheT* const cache = static_cast<CacheT*>(is_v ? p.v_cache : p.k_cache);
  const ix c_sp = ix(is_v ? p.vc_sp : p.kc_sp);
  const ix c_se = ix(is_v ? p.vc_se : p.kc_se);
  const ix c_sh = ix(is_v ? p.vc_sh : p.kc_sh);
  if constexpr (!is_quantized<CacheT>::value) {  // a 16-bit cache: T, one store path
    T* const dst = is_q ? static_cast<T*>(p.q_out) + (ix(t) * ix(p.qo_st) + ix(h) * ix(p.qo_sh))
                        : reinterpret_cast<T*>(cache) +
                              (ix(page) * c_sp + ix(entry) * c_se + ix(hh) * c_sh);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] *= rms;
    if (NEOX) {
#pragma unroll
      for (int i = 0; i < N; ++i) b[i] *= rms;
    }
    if (live && (is_q || write)) {
      store_float<T, N>(dst + ea, a);
      if (NEOX) store_float<T, N>(dst + eb, b);
    }
  } else {
    if (is_q && (!FLAT || live)) {  // FLAT: a row past the last token is a Q row, not live
      T* const dst = static_cast<T*>(p.q_out) + (ix(t) * ix(p.qo_st) + ix(h) * ix(p.qo_sh));
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] *= rms;
      if (NEOX) {
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] *= rms;
      }
      store_float<T, N>(dst + ea, a);
      if (NEOX) store_float<T, N>(dst + eb, b);
    } else if (live && write) {
      CacheT* const dst = cache + (ix(page) * c_sp + ix(entry) * c_se + ix(hh) * c_sh);
      const float scale = rms * (is_v ? p.inv_v_scale : p.inv_k_scale);
      store_float<CacheT, N>(dst + ea, a, scale);
      if (NEOX) store_float<CacheT, N>(dst + eb, b, scale);
    }
  }
}

// QT (last, T by default): q's stored type (fp8: the q-quantizing record, QKDecodeQParams).
template <typename T, typename CacheT, bool NEOX, int D, bool GF32, bool I32, bool GUESS,
          typename QT = T>
__global__ void __launch_bounds__(512)
    qk_rmsnorm_rope_decode(const typename DecodeRecord<QT>::type p) {
  __shared__ QKDecodeShared sh;
  pdl_launch_dependents();
  pdl_wait();
  qk_decode_rows<T, CacheT, NEOX, D, GF32, I32, false, 8, GUESS, QT>(p, sh);
}

template <typename T, typename CacheT, bool NEOX, int D, bool GF32, int N, bool GUESS,
          typename QT = T>
__global__ void __launch_bounds__(512)
    qk_rmsnorm_rope_decode_flat(const typename DecodeRecord<QT>::type p) {
  __shared__ QKDecodeShared sh;
  pdl_launch_dependents();
  pdl_wait();
  qk_decode_rows<T, CacheT, NEOX, D, GF32, true, true, N, GUESS, QT>(p, sh);
}

// ---- Decode: a warp per token, several rows a lane --------------------------------------------
// (qk_rmsnorm_rope_decode_rows) A warp holds rows of ONE token: G = D / 16 (neox) or D / 8
// (interleaved) lanes of 8 elements a row, S = 32 / G rows a step, U = ROWS steps, so
// S U consecutive head rows of the token (Q, then K, then V); block x of the grid holds warps of
// tokens blockIdx.x * warps + w, blockIdx.y the token's chunk of S U rows. What depends only on
// the token (the request search, the position, the block-table entry) is done once per warp and
// the cos/sin values and both RMSNorm weights once per lane, for all its U rows (U = ROWS, 1-4) (the other decode
// kernels pay them per row): at 64 / 8 heads and 4 steps a lane's position, page and angles serve
// 4 rows. Rows are loaded first (all U in flight), V rows of a 16-bit cache are stored as loaded.
// The arithmetic and the semantics are qk_decode_rows's (32-bit offsets): a token outside every
// request or with a position outside [0, P) has its q rows copied and writes nothing; a token
// whose page is out of range is normalised and roped but writes nothing.
template <typename T, typename CacheT, bool NEOX, int D, bool GF32, int ROWS, bool GUESS>
__device__ __forceinline__ void qk_decode_token_rows(const QKDecodeParams& p, QKDecodeShared& sh) {
  constexpr int N = 8;
  constexpr int G = NEOX ? D / (2 * N) : D / N;  // lanes per head row
  constexpr int S = 32 / G;                      // rows of a warp per step
  constexpr int HALF = D / 2;
  constexpr int M = NEOX ? N : N / 2;  // angles per lane
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a row within a warp, power of two");
  const int Hq = p.Hq, Hkv = p.Hkv;
  const int H = Hq + 2 * Hkv;
  constexpr int U = ROWS;  // steps
  const int lane = threadIdx.x & 31;
  const int t = int(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  const bool live_t = t < p.T;
  const int h0 = int(blockIdx.y) * S * U + lane / G;  // the row of step 0; step u adds u S
  const int j = lane & (G - 1);
  const int ea = j * N;
  const int eb = ea + HALF;
  const int first = int(blockIdx.y) * S * U;   // the warp's first row
  const int last = min(first + S * U, H) - 1;  // and its last
  const bool has_q = first < Hq, has_k = first < Hq + Hkv && last >= Hq;
  const bool has_kv = last >= Hq;

  // 1. the rows' chunks (U loads in flight), the search's arrays
  Vec<T, N> va[ROWS], vb[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    va[u] = Vec<T, N>{};
    vb[u] = Vec<T, N>{};
    const int h = h0 + u * S;
    if (u >= U || h >= H || !live_t) continue;
    const bool is_q = h < Hq;
    const bool is_v = h >= Hq + Hkv;
    const int hh = is_q ? h : is_v ? h - Hq - Hkv : h - Hq;
    const T* base = static_cast<const T*>(is_q ? p.q : is_v ? p.v : p.k);
    const unsigned st = unsigned(is_q ? p.q_st : is_v ? p.v_st : p.k_st);
    const unsigned sh_ = unsigned(is_q ? p.q_sh : is_v ? p.v_sh : p.k_sh);
    const T* row = base + (unsigned(t) * st + unsigned(hh) * sh_);
    va[u] = load<T, N>(row + ea);
    if (NEOX) vb[u] = load<T, N>(row + eb);
  }
  const int B = p.B;
  unsigned lane_off = 0;
  int lane_len = 0;
  if (B < 32) {
    if (lane <= B) lane_off = p.offsets[lane];
    if (lane < B) lane_len = p.cache_lengths[lane];
  }
  const bool guess = takes_guess<GUESS>(p);
  RequestGuess<32> guessed;
  if (guess) guessed.load(p.offsets, p.cache_lengths, B, t);
  // the rows' partial sums of squares
  float ss[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    ss[u] = 0.f;
    if (u >= U) continue;
    float x[N];
    to_floats<T, N>(va[u], x);
#pragma unroll
    for (int i = 0; i < N; ++i) ss[u] += x[i] * x[i];
    if (NEOX) {
      to_floats<T, N>(vb[u], x);
#pragma unroll
      for (int i = 0; i < N; ++i) ss[u] += x[i] * x[i];
    }
  }

  // 2. request and position, once for the warp (every lane the same token: converged steps)
  int req;
  int pos = -1;
  if (B < 32) {  // ragged_request's binary search by shuffles: lane_position (as the other decode
    // kernels take it) compiled in here cost this kernel's guess path 1.02-1.05x (256 tokens)
    int lo = 0, hi = B + 1;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (__shfl_sync(0xffffffffu, lane_off, mid) <= unsigned(t)) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    req = lo - 1;
    const int r0 = req < 0 ? 0 : req;
    const unsigned o0 = __shfl_sync(0xffffffffu, lane_off, r0);
    const unsigned o1 = __shfl_sync(0xffffffffu, lane_off, r0 + 1 > B ? B : r0 + 1);
    const int len = __shfl_sync(0xffffffffu, lane_len, r0);
    const i64 ps = i64(len) + (i64(t) - i64(o0));
    if (req < 0 || req >= B || unsigned(t) < o0 || unsigned(t) >= o1) {
      req = -1;
    } else {
      pos = ps < 0 || ps >= p.P ? -1 : int(ps);
    }
  } else {
    PagedSlot s;
    if (guess) {  // the search only where the guess's path did not hold
      if (!guessed.resolve(t, s) && live_t) {
        s = ragged_position(p.offsets, p.cache_lengths, B, t);
      }
    } else if (B <= kStageMax) {  // block-uniform: every warp of the block reaches the barrier
      for (int i = threadIdx.x; i <= B; i += blockDim.x) {
        sh.offsets[i] = p.offsets[i];
        if (i < B) sh.lengths[i] = p.cache_lengths[i];
      }
      __syncthreads();
      s = ragged_position(sh.offsets, sh.lengths, B, t);
    } else {
      s = ragged_position(p.offsets, p.cache_lengths, B, t);
    }
    req = s.request;
    pos = s.pos < 0 || s.pos >= p.P ? -1 : int(s.pos);
  }
  const bool roped = live_t && req >= 0 && pos >= 0;

  // 3. the block-table entry (a warp with K or V rows), then cos/sin (a warp with Q or K rows)
  int page = -1, entry = 0;
  if (roped && has_kv) {
    const unsigned index = fast_div(unsigned(pos), p.pg_magic, p.pg_shift);  // / page_size
    entry = pos - int(index) * p.page_size;
    if (index < unsigned(p.max_pages)) {
      page = p.block_table[unsigned(req) * unsigned(p.bt_sb) + index];
    }
  }
  float c[M], sn[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    c[i] = 1.f;
    sn[i] = 0.f;
  }
  if (roped && (has_q || has_k)) {
    const float* cs = p.cos_sin + unsigned(pos) * unsigned(p.cs_sp) + (NEOX ? ea : ea / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + HALF, sn);
  }
  // the RMSNorm weights (ones without a position: the row is copied), beside cos/sin
  float gqa[N], gqb[N], gka[N], gkb[N];
#pragma unroll
  for (int i = 0; i < N; ++i) gqa[i] = gqb[i] = gka[i] = gkb[i] = 1.f;
  if (roped && has_q) {
    if constexpr (GF32) {
      load_float<float, N>(static_cast<const float*>(p.q_gamma) + ea, gqa);
      if (NEOX) load_float<float, N>(static_cast<const float*>(p.q_gamma) + eb, gqb);
    } else {
      load_float<T, N>(static_cast<const T*>(p.q_gamma) + ea, gqa);
      if (NEOX) load_float<T, N>(static_cast<const T*>(p.q_gamma) + eb, gqb);
    }
  }
  if (roped && has_k) {
    if constexpr (GF32) {
      load_float<float, N>(static_cast<const float*>(p.k_gamma) + ea, gka);
      if (NEOX) load_float<float, N>(static_cast<const float*>(p.k_gamma) + eb, gkb);
    } else {
      load_float<T, N>(static_cast<const T*>(p.k_gamma) + ea, gka);
      if (NEOX) load_float<T, N>(static_cast<const T*>(p.k_gamma) + eb, gkb);
    }
  }

  // the row sums: shuffles within each G-lane group, the U rows' chains interleaved
#pragma unroll
  for (int o = G >> 1; o; o >>= 1) {
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      if (u < U) ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], o);
    }
  }
  const bool write = page >= 0 && i64(page) < p.num_pages;

  // 4. per row: weights, rotation (linear: the 1/rms is applied at the store), store
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    const int h = h0 + u * S;
    if (u >= U || h >= H || !live_t) continue;
    const bool is_q = h < Hq;
    const bool is_v = h >= Hq + Hkv;
    const int hh = is_q ? h : is_v ? h - Hq - Hkv : h - Hq;
    CacheT* const cache = static_cast<CacheT*>(is_v ? p.v_cache : p.k_cache);
    const unsigned c_sp = unsigned(is_v ? p.vc_sp : p.kc_sp);
    const unsigned c_se = unsigned(is_v ? p.vc_se : p.kc_se);
    const unsigned c_sh = unsigned(is_v ? p.vc_sh : p.kc_sh);
    if (is_v) {  // copied into the cache
      if (!write) continue;
      CacheT* const dst =
          cache + (unsigned(page) * c_sp + unsigned(entry) * c_se + unsigned(hh) * c_sh);
      if constexpr (!is_quantized<CacheT>::value) {
        store<T, N>(reinterpret_cast<T*>(dst) + ea, va[u]);
        if (NEOX) store<T, N>(reinterpret_cast<T*>(dst) + eb, vb[u]);
      } else {
        float a[N], b[N];
        to_floats<T, N>(va[u], a);
        store_float<CacheT, N>(dst + ea, a, p.inv_v_scale);
        if (NEOX) {
          to_floats<T, N>(vb[u], b);
          store_float<CacheT, N>(dst + eb, b, p.inv_v_scale);
        }
      }
      continue;
    }
    if (!is_q && !write) continue;
    float a[N], b[N];
    to_floats<T, N>(va[u], a);
    if (NEOX) to_floats<T, N>(vb[u], b);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] *= is_q ? gqa[i] : gka[i];
    if (NEOX) {
#pragma unroll
      for (int i = 0; i < N; ++i) b[i] *= is_q ? gqb[i] : gkb[i];
    }
    rotate_chunk<NEOX, N, M>(a, b, c, sn);  // the identity without a position
    const float rms = roped ? rsqrtf(ss[u] * (1.f / D) + p.epsilon) : 1.f;
    if (is_q || !is_quantized<CacheT>::value) {
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] *= rms;
      if (NEOX) {
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] *= rms;
      }
    }
    if (is_q) {
      T* const dst = static_cast<T*>(p.q_out) +
                     (unsigned(t) * unsigned(p.qo_st) + unsigned(h) * unsigned(p.qo_sh));
      store_float<T, N>(dst + ea, a);
      if (NEOX) store_float<T, N>(dst + eb, b);
    } else {
      CacheT* const dst =
          cache + (unsigned(page) * c_sp + unsigned(entry) * c_se + unsigned(hh) * c_sh);
      if constexpr (!is_quantized<CacheT>::value) {
        store_float<T, N>(reinterpret_cast<T*>(dst) + ea, a);
        if (NEOX) store_float<T, N>(reinterpret_cast<T*>(dst) + eb, b);
      } else {
        const float scale = rms * p.inv_k_scale;
        store_float<CacheT, N>(dst + ea, a, scale);
        if (NEOX) store_float<CacheT, N>(dst + eb, b, scale);
      }
    }
  }
}

template <typename T, typename CacheT, bool NEOX, int D, bool GF32, int ROWS, bool GUESS>
__global__ void __launch_bounds__(512) qk_rmsnorm_rope_decode_rows(const QKDecodeParams p) {
  __shared__ QKDecodeShared sh;
  pdl_launch_dependents();
  pdl_wait();
  qk_decode_token_rows<T, CacheT, NEOX, D, GF32, ROWS, GUESS>(p, sh);
}
