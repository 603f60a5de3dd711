// Fused QKV projection whose K/V rows land directly in a paged KV cache (MAX's
// generic_fused_qkv_matmul_kv_cache_paged_ragged), with RoPE on Q and K in the epilogue.
//
//   qkv_mma        small batches (sm_90): tensor-core weight streaming, split-K over a cluster
//                  reduced through distributed shared memory, epilogue fused; one launch.
//   qkv_mma_tiled  larger batches (sm_90): the same split and epilogue, the weights and hidden
//                  rows staged in shared memory and shared by the warps.
//   qkv_wgmma      16-bit weights, 1-256 tokens (sm_90a): the same split, staging and epilogue,
//                  the products taken by Hopper's warpgroup MMA from the staged tiles (fp8 and
//                  4-bit weights: staged as codes, converted to T into the wgmmas' A registers
//                  an atom at a time, or, for 4-bit groups of 32, in shared memory a stage at
//                  a time).
//   qkv_gemv       decode: weight-streaming skinny GEMM (token tiles of up to 16), epilogue fused
//                  (GPUs without clusters, shapes the mma kernel does not take).
//   qkv_epilogue   prefill: after cuBLAS wrote Q, K, V into temporaries, rope Q into `out` and
//                  rope K / scatter K, V into their pages, in one launch.
//   qkv_dequant    prefill with quantized weights: weights -> the input dtype, for cuBLAS.
//
// OPTS (qkv_gemv, qkv_mma, qkv_mma_tiled, qkv_wgmma, qkv_epilogue): the kernel reads the options, status= (p.check: the
// offsets validated on the device before anything is written) and clear_unused_last_page_rows
// (p.clear); without OPTS none of their code is compiled, so the options cost nothing when off.
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/qkv.py.
struct QkvParams {
  const void* hidden;           // (T, K) T_in; gemv only
  const void* weight;           // (N, K) T_in or fp8 e4m3, or (N, K/2) uint8 (two 4-bit values)
  const void* weight_scales;    // fp8: (N,) float32; int4: (N, K/G) T_in; else null
  const void* zero_points;      // int4: (N, K/G) uint8 (low 4 bits used), or null for 8
  const void* q_tmp;            // epilogue: (T, Hq D) T_in from cuBLAS (may be `out` itself)
  const void* k_tmp;            // epilogue: (T, Hkv D) KT (float32 or T_in), from cuBLAS
  const void* v_tmp;            // epilogue: (T, Hkv D) KT
  const unsigned* offsets;      // (B + 1,) int32 or uint32, read as uint32
  const int* cache_lengths;     // (B,)
  const int* block_table;       // (B, max_pages)
  const float* cos_sin;         // (P, R) cos half then sin half, or null: no RoPE
  void* out;                    // (T, Hq D) T_in: Q
  void* k_cache;                // NHD (pages, page_size, Hkv, D) or HND (pages, Hkv, page_size, D)
  void* v_cache;
  int* status;                  // status= (OPTS kernels): (1,) int32, the offsets' code, or null
  i64 hidden_s0, weight_row_bytes, ws_s0, zp_s0, qt_s0, kt_s0, vt_s0, bt_s0, cs_s0, out_s0;
  i64 k_page, k_entry, k_head;  // cache strides in elements (the head dim is contiguous)
  i64 v_page, v_entry, v_head;
  i64 num_pages;
  int T, K, N, B, Hq, Hkv, D, R, P, page_size, max_pages, group_size, kc;
  int is_neox, cache_code;      // cache_code: 0 the input dtype, 1 e4m3, 2 e5m2
  float k_inv_scale, v_inv_scale;
  int check;                    // OPTS kernels: status= given, validate the offsets first
  int clear;                    // OPTS kernels: clear_unused_last_page_rows
  unsigned g_magic;             // qkv_mma FORM bit 3: k / group_size by fast_div
  int g_shift;
};

enum { W_DENSE = 0, W_FP8 = 1, W_INT4 = 2, W_INT4_REG = 3, W_FP8_REG = 4 };

// ---- Token addressing -----------------------------------------------------------------------

// Where token t goes: its RoPE position (-1: no valid position, so Q is written unrotated and K/V
// are not written) and the element offsets of its K and V cache rows at head 0 (-1: not written).
struct TokenSlot {
  int pos;
  i64 k_off, v_off;
};

__device__ __forceinline__ PagedSlot qkv_paged_slot(const QkvParams& p, int t) {
  return paged_slot(p.offsets, p.cache_lengths, p.block_table, p.bt_s0, p.B, p.max_pages,
                    p.page_size, p.num_pages, t);
}

__device__ __forceinline__ TokenSlot token_slot_of(const QkvParams& p, const PagedSlot& s) {
  TokenSlot r{-1, -1, -1};
  const bool valid = s.request >= 0 && s.pos >= 0 && (!p.cos_sin || s.pos < p.P) &&
                     s.pos <= 0x7fffffff;
  if (!valid) return r;
  r.pos = int(s.pos);
  if (s.page >= 0) {
    r.k_off = s.page * p.k_page + i64(s.entry) * p.k_entry;
    r.v_off = s.page * p.v_page + i64(s.entry) * p.v_entry;
  }
  return r;
}

__device__ __forceinline__ TokenSlot token_slot(const QkvParams& p, int t) {
  return token_slot_of(p, qkv_paged_slot(p, t));
}

// status= (OPTS kernels): every block validates the offsets (all its threads call this, at a
// block-uniform point before any of its writes); block (0, 0) stores the code. Every block
// computes the same code, so a block that finds the offsets malformed returns at once and none
// waits for another (nor, in qkv_mma, for its cluster: all of the cluster's CTAs return).
// Returns whether the block may write.
template <bool OPTS>
__device__ __forceinline__ bool qkv_check(const QkvParams& p, const unsigned* offsets) {
  if (!OPTS || !p.check) return true;
  const int code = ragged_offsets_status(offsets, p.B, p.T);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
  return code == 0;
}

// clear_unused_last_page_rows (OPTS kernels): the rows after token t's own on its page that are
// zeroed at its K/V elements: page_size - entry - 1 when t is the last token
// of its request and is written (tok.k_off >= 0), else 0 (s from ragged_position / paged_slot,
// entry its row on the page).
__device__ __forceinline__ int rest_of_page(const QkvParams& p, const unsigned* offsets,
                                            const PagedSlot& s, const TokenSlot& tok, int entry,
                                            int t) {
  return p.clear && tok.k_off >= 0 && last_of_request(offsets, s, t) ? p.page_size - 1 - entry
                                                                     : 0;
}

template <typename T>
__device__ __forceinline__ void store_cache(void* cache, i64 off, float x, int code) {
  if (code == 0) {
    static_cast<T*>(cache)[off] = from_float<T>(x);
  } else if (code == 1) {
    static_cast<__nv_fp8_e4m3*>(cache)[off] = from_float<__nv_fp8_e4m3>(x);
  } else {
    static_cast<__nv_fp8_e5m2*>(cache)[off] = from_float<__nv_fp8_e5m2>(x);
  }
}

// Output rows come in pairs that RoPE rotates together, so one thread can finish both. Pair g of
// [0, N/2) lies in head h = g / (D/2) (Q heads, then K, then V). neox: pairs (i, i + R/2) for
// i < R/2, then the pass-through dims [R, D) two by two; interleaved (and V, or no RoPE):
// (2i, 2i + 1). rot is the frequency index of a rotated pair, -1 for one that passes through.
struct RowPair {
  int head, da, db, rot;
};

// Pair i of head `head` (i < D / 2).
__device__ __forceinline__ RowPair row_pair_in(int head, int i, int R, int Hq, int Hkv, bool rope,
                                               bool neox) {
  RowPair r;
  r.head = head;
  const bool roped = rope && r.head < Hq + Hkv;
  r.rot = -1;
  if (roped && neox) {
    if (i < (R >> 1)) {
      r.da = i;
      r.db = i + (R >> 1);
      r.rot = i;
    } else {
      r.da = R + 2 * (i - (R >> 1));
      r.db = r.da + 1;
    }
  } else {
    r.da = 2 * i;
    r.db = r.da + 1;
    if (roped && r.da < R) r.rot = i;
  }
  return r;
}

__device__ __forceinline__ RowPair row_pair(int g, int D, int R, int Hq, int Hkv, bool rope,
                                            bool neox) {
  const int half_d = D >> 1;
  const int head = g / half_d;
  return row_pair_in(head, g - head * half_d, R, Hq, Hkv, rope, neox);
}

// write_pair's stores: the pair (a, b), rotated already, Q to out, K / V to their cache rows.
template <typename T>
__device__ __forceinline__ void store_pair(const QkvParams& p, const TokenSlot& tok, int t,
                                           const RowPair& rp, float a, float b) {
  if (rp.head < p.Hq) {
    T* q = static_cast<T*>(p.out) + i64(t) * p.out_s0 + i64(rp.head) * p.D;
    q[rp.da] = from_float<T>(a);
    q[rp.db] = from_float<T>(b);
  } else if (rp.head < p.Hq + p.Hkv) {
    if (tok.k_off < 0) return;
    const i64 row = tok.k_off + i64(rp.head - p.Hq) * p.k_head;
    store_cache<T>(p.k_cache, row + rp.da, a * p.k_inv_scale, p.cache_code);
    store_cache<T>(p.k_cache, row + rp.db, b * p.k_inv_scale, p.cache_code);
  } else {
    if (tok.v_off < 0) return;
    const i64 row = tok.v_off + i64(rp.head - p.Hq - p.Hkv) * p.v_head;
    store_cache<T>(p.v_cache, row + rp.da, a * p.v_inv_scale, p.cache_code);
    store_cache<T>(p.v_cache, row + rp.db, b * p.v_inv_scale, p.cache_code);
  }
}

// The pair (a, b) rotated by (cos, sin) = (c, s).
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
  const float x = a, y = b;
  a = x * c - y * s;
  b = y * c + x * s;
}

// Writes the pair (a, b) of token t: rotated at tok.pos when it is a rotary pair, then Q to out,
// K / V to their cache rows (scaled for fp8 caches).
template <typename T>
__device__ __forceinline__ void write_pair(const QkvParams& p, const TokenSlot& tok, int t,
                                           const RowPair& rp, float a, float b) {
  if (rp.rot >= 0 && tok.pos >= 0) {
    const float* cs = p.cos_sin + i64(tok.pos) * p.cs_s0;
    rotate_pair(a, b, cs[rp.rot], cs[(p.R >> 1) + rp.rot]);
  }
  store_pair<T>(p, tok, t, rp, a, b);
}

// Writes N consecutive elements [d0, d0 + N) of token t's row of one head (RoPE already
// applied): Q to out, K / V to their cache rows (scaled for fp8 caches), as write_pair stores
// them, but in one vector store where the address is aligned to it, else element by element.
template <typename T, int N>
__device__ __forceinline__ void write_run(const QkvParams& p, const TokenSlot& tok, int t,
                                          int head, int d0, const float (&v)[N]) {
  if (head < p.Hq) {
    T* q = static_cast<T*>(p.out) + i64(t) * p.out_s0 + i64(head) * p.D + d0;
    if ((reinterpret_cast<unsigned long long>(q) & (N * sizeof(T) - 1)) == 0) {
      store_float<T, N>(q, v);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) q[j] = from_float<T>(v[j]);
    }
    return;
  }
  const bool is_k = head < p.Hq + p.Hkv;
  const i64 row = is_k ? tok.k_off : tok.v_off;
  if (row < 0) return;
  const i64 e = row + (is_k ? i64(head - p.Hq) * p.k_head : i64(head - p.Hq - p.Hkv) * p.v_head) +
                d0;
  void* cache = is_k ? p.k_cache : p.v_cache;
  const float scale = is_k ? p.k_inv_scale : p.v_inv_scale;
  float w[N];
#pragma unroll
  for (int j = 0; j < N; ++j) w[j] = v[j] * scale;
  const int es = p.cache_code == 0 ? int(sizeof(T)) : 1;
  if (((reinterpret_cast<unsigned long long>(cache) + e * es) & (N * es - 1)) != 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) store_cache<T>(cache, e + j, w[j], p.cache_code);
  } else if (p.cache_code == 0) {
    store_float<T, N>(static_cast<T*>(cache) + e, w);
  } else if (p.cache_code == 1) {
    store_float<__nv_fp8_e4m3, N>(static_cast<__nv_fp8_e4m3*>(cache) + e, w);
  } else {
    store_float<__nv_fp8_e5m2, N>(static_cast<__nv_fp8_e5m2*>(cache) + e, w);
  }
}

// clear_unused_last_page_rows: the cache row of head h (a K or V head, h >= Hq), r rows after
// token tok's own (tok written: rest_of_page > 0 only then), as a byte pointer (r = 0: the
// token's own row, from which clear_rests steps).
template <typename T>
__device__ __forceinline__ unsigned char* rest_row(const QkvParams& p, const TokenSlot& tok,
                                                   int h, int r) {
  const bool is_k = h < p.Hq + p.Hkv;
  const i64 off = is_k ? tok.k_off + i64(h - p.Hq) * p.k_head + i64(r) * p.k_entry
                       : tok.v_off + i64(h - p.Hq - p.Hkv) * p.v_head + i64(r) * p.v_entry;
  const int es = p.cache_code == 0 ? int(sizeof(T)) : 1;
  return static_cast<unsigned char*>(is_k ? p.k_cache : p.v_cache) + off * es;
}

// The pair's two elements of the row r rows after token tok's own, zeroed (zero bits are +0 in
// every cache dtype); Q pairs have no cache row.
template <typename T>
__device__ __forceinline__ void zero_pair_rest(const QkvParams& p, const TokenSlot& tok,
                                               const RowPair& rp, int r) {
  if (rp.head < p.Hq || rp.head >= p.Hq + 2 * p.Hkv) return;
  unsigned char* row = rest_row<T>(p, tok, rp.head, r);
  if (p.cache_code == 0) {
    reinterpret_cast<T*>(row)[rp.da] = from_float<T>(0.f);
    reinterpret_cast<T*>(row)[rp.db] = from_float<T>(0.f);
  } else {
    row[rp.da] = 0;
    row[rp.db] = 0;
  }
}

// ---- Register-level conversions (qkv_gemv and the tensor-core kernels) ----------------------

template <typename T>
struct is_half {
  static constexpr bool value = false;
};
template <>
struct is_half<__half> {
  static constexpr bool value = true;
};

__device__ __forceinline__ unsigned ldg_u16(const unsigned short* ptr) {
  unsigned short r;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(ptr));
  return r;
}

__device__ __forceinline__ unsigned ldg_u8(const unsigned char* ptr) {
  unsigned r;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(r) : "l"(ptr));
  return r;
}

__device__ __forceinline__ uint4 ldg_stream(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// ldg_stream with L2 fetching the 256 bytes around the 16 read (qkv_lean_mma: a round reads 256
// bytes of each of a lane's rows in four instructions of 8 rows x 64 bytes). Side by side on the
// H200 (graph replay, tools/device_ab.py, Llama-3-8B's projection): qkv_lean_mma fp8 weights at
// 4 / 8 / 16 tokens 0.96-0.97x the time, 16-bit at 4 tokens 0.98x, 4-bit 0.99-1.00x; the same
// hint on qkv_gemv_lean (512 contiguous bytes a warp's load) cost 1.01-1.05x at one token, and on
// qkv_wgmma's weight copies 1.01-1.02x, so they keep ldg_stream / cp_async16.
__device__ __forceinline__ uint4 ldg_stream_l2(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
  if constexpr (is_half<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Two e4m3 codes (the low 16 bits of x, k order) as a T pair, exactly.
template <typename T>
__device__ __forceinline__ unsigned fp8x2_to(unsigned x) {
  unsigned h;
  asm("{ .reg .b16 lo; mov.b32 {lo, _}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(h) : "r"(x));
  if constexpr (is_half<T>::value) {
    return h;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const unsigned*>(&b);
  }
}

// Two e4m3 codes (the low 16 bits of x, k order) as float32, exactly (one cvt to an fp16 pair on
// sm_89+, where the instruction exists).
__device__ __forceinline__ float2 fp8x2_to_float2(unsigned x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const unsigned h = fp8x2_to<__half>(x);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
#else
  __nv_fp8_e4m3 a, b;
  a.__x = static_cast<__nv_fp8_storage_t>(x & 0xFFu);
  b.__x = static_cast<__nv_fp8_storage_t>((x >> 8) & 0xFFu);
  return make_float2(to_float(a), to_float(b));
#endif
}

// 4-bit: the T pair (2^10, 2^10) (fp16) or (2^7, 2^7) (bf16), whose low mantissa bits take a
// nibble q exactly (2^10 + q, 2^7 + q).
template <typename T>
constexpr unsigned INT4_MAGIC = is_half<T>::value ? 0x64006400u : 0x43004300u;

// 4-bit: nibbles i and i + 4 of word w (k values i, i + 4 of its 8) as a T pair of
// (q - zero) * scale. magic holds 2^10 + q (fp16) or 2^7 + q (bf16) exactly; sub = magic's
// offset + zero, so the difference q - zero is exact and the product is rounded once.
// (x & MASK) | BITS in one instruction (the compiler emits two LOP3s for the C form; int4_pair
// keeps that form: in qkv_mma and qkv_mma_tiled the asm cost registers and spills).
template <unsigned MASK, unsigned BITS>
__device__ __forceinline__ unsigned and_or(unsigned x) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(MASK), "n"(BITS));
  return r;
}

template <typename T>
__device__ __forceinline__ unsigned int4_pair(unsigned w, int i, unsigned sub, unsigned scale) {
  constexpr unsigned MAGIC = INT4_MAGIC<T>;
  const unsigned m = ((w >> (4 * i)) & 0x000F000Fu) | MAGIC;
  if constexpr (is_half<T>::value) {
    const __half2 r = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&m),
                                      *reinterpret_cast<const __half2*>(&sub)),
                              *reinterpret_cast<const __half2*>(&scale));
    return *reinterpret_cast<const unsigned*>(&r);
  } else {
    const __nv_bfloat162 r =
        __hmul2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&m),
                        *reinterpret_cast<const __nv_bfloat162*>(&sub)),
                *reinterpret_cast<const __nv_bfloat162*>(&scale));
    return *reinterpret_cast<const unsigned*>(&r);
  }
}

// 4-bit: the four pairs int4_pair(w, i, sub, scale), i < 4, with fewer instructions for fp16
// (qkv_wgmma's conversion): nibbles i + 1 and i + 5 are taken in place (bits 4-7 of a byte) as
// 2^10 + 16 q, which one fma scales by 1/16 and offsets by -(64 + zero) to q - zero exactly
// (sub16: that offset as a pair); one shift serves i = 2 and 3. bf16 has too few mantissa bits
// for 16 q: there int4_pair as it is.
template <typename T>
__device__ __forceinline__ void int4_pairs(unsigned w, unsigned sub, unsigned sub16,
                                           unsigned scale, unsigned (&r)[4]) {
  if constexpr (is_half<T>::value) {
    constexpr unsigned MAGIC = INT4_MAGIC<T>;
    const unsigned w8 = w >> 8;
    const unsigned m[4] = {and_or<0x000F000Fu, MAGIC>(w), and_or<0x00F000F0u, MAGIC>(w),
                           and_or<0x000F000Fu, MAGIC>(w8), and_or<0x00F000F0u, MAGIC>(w8)};
    const __half2 h_sub = *reinterpret_cast<const __half2*>(&sub);
    const __half2 h_sub16 = *reinterpret_cast<const __half2*>(&sub16);
    const __half2 h_scale = *reinterpret_cast<const __half2*>(&scale);
    const __half2 sixteenth = __halves2half2(__ushort_as_half(0x2C00), __ushort_as_half(0x2C00));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 x = *reinterpret_cast<const __half2*>(&m[i]);
      const __half2 d = (i & 1) ? __hfma2(x, sixteenth, h_sub16) : __hsub2(x, h_sub);
      const __half2 y = __hmul2(d, h_scale);
      r[i] = *reinterpret_cast<const unsigned*>(&y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = int4_pair<T>(w, i, sub, scale);
  }
}

// 4-bit, fp16: the four pairs of q - zero (exact) of word w, in int4_pairs' order, unscaled
// (qkv_gemv with the scale on the sums).
__device__ __forceinline__ void int4_diffs(unsigned w, unsigned sub, unsigned sub16,
                                           unsigned (&r)[4]) {
  constexpr unsigned MAGIC = INT4_MAGIC<__half>;
  const unsigned w8 = w >> 8;
  const unsigned m[4] = {and_or<0x000F000Fu, MAGIC>(w), and_or<0x00F000F0u, MAGIC>(w),
                         and_or<0x000F000Fu, MAGIC>(w8), and_or<0x00F000F0u, MAGIC>(w8)};
  const __half2 h_sub = *reinterpret_cast<const __half2*>(&sub);
  const __half2 h_sub16 = *reinterpret_cast<const __half2*>(&sub16);
  const __half2 sixteenth = __halves2half2(__ushort_as_half(0x2C00), __ushort_as_half(0x2C00));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 x = *reinterpret_cast<const __half2*>(&m[i]);
    const __half2 d = (i & 1) ? __hfma2(x, sixteenth, h_sub16) : __hsub2(x, h_sub);
    r[i] = *reinterpret_cast<const unsigned*>(&d);
  }
}

// 4-bit: a 16-byte load of 8 T values (k = 8c .. 8c + 7 of a chunk) as the pairs that
// int4_pair's words multiply: (0, 4), (1, 5), (2, 6), (3, 7).
__device__ __forceinline__ uint4 int4_order(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

// The 4 T pairs of unit u (8 k values) of a 16-byte weight load w4, as qkv_mma and qkv_lean_mma
// feed them to an mma: 16-bit weights as loaded; fp8 two codes a cvt, exactly (units 0 and 1);
// 4-bit (q - zero) * scale rounded once to T (units 0-3; sub, scale: the load's group's offset +
// zero and scale as T pairs), by int4_pairs (PAIRS4) or int4_pair (its order, its values).
template <typename T, int WF, bool PAIRS4>
__device__ __forceinline__ void unit_pairs(const uint4& w4, int u, unsigned sub, unsigned scale,
                                           unsigned (&r)[4]) {
  if constexpr (WF == W_DENSE) {
    r[0] = w4.x; r[1] = w4.y; r[2] = w4.z; r[3] = w4.w;
  } else if constexpr (WF == W_FP8) {
    const unsigned w0 = u == 0 ? w4.x : w4.z, w1 = u == 0 ? w4.y : w4.w;
    r[0] = fp8x2_to<T>(w0);
    r[1] = fp8x2_to<T>(w0 >> 16);
    r[2] = fp8x2_to<T>(w1);
    r[3] = fp8x2_to<T>(w1 >> 16);
  } else {
    const unsigned w = u == 0 ? w4.x : u == 1 ? w4.y : u == 2 ? w4.z : w4.w;
    if constexpr (PAIRS4) {  // -(64 + zero) as an fp16 pair (bf16: unused)
      const unsigned sub16 = (0xD400u | ((sub & 0xFu) << 4)) * 0x10001u;
      int4_pairs<T>(w, sub, sub16, scale, r);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) r[i] = int4_pair<T>(w, i, sub, scale);
    }
  }
}

template <typename T>
__device__ __forceinline__ unsigned pair_of(float x) {
  const T h = from_float<T>(x);
  const unsigned short bits = *reinterpret_cast<const unsigned short*>(&h);
  return unsigned(bits) | (unsigned(bits) << 16);
}

// ---- Decode: weight-streaming skinny GEMM ---------------------------------------------------

constexpr int GEMV_WARPS = 4;  // per block
constexpr int GEMV_PAIRS = 2;  // row pairs per warp: 4 rows share each x read from shared memory
constexpr int GEMV_ROWS = 2 * GEMV_PAIRS;

__device__ __forceinline__ float bits16_to_float(const __half*, unsigned bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
__device__ __forceinline__ float bits16_to_float(const __nv_bfloat16*, unsigned bits) {
  return __uint_as_float(bits << 16);  // bf16 is the top half of a float32
}

// VB bytes of weight storage per load, kept as 32-bit words (byte arrays would be split into
// one register per byte); VALS k values they hold.
template <typename T, int WF, int VB>
struct WeightVec {
  static constexpr int VALS = WF == W_DENSE ? VB / int(sizeof(T)) : WF == W_FP8 ? VB : 2 * VB;
  struct alignas(VB >= 4 ? VB : 4) Raw {
    unsigned w[(VB + 3) / 4];
  };
  static __device__ __forceinline__ Raw load(const unsigned char* p) {
    Raw r;
    if constexpr (VB >= 4) {
      r = *reinterpret_cast<const Raw*>(p);
    } else if constexpr (VB == 2) {
      r.w[0] = *reinterpret_cast<const unsigned short*>(p);
    } else {
      r.w[0] = *p;
    }
    return r;
  }
  static __device__ __forceinline__ Raw zero() {
    Raw r;
#pragma unroll
    for (int i = 0; i < (VB + 3) / 4; ++i) r.w[i] = 0;
    return r;
  }
  // k value i of the load (int4: q - zero given bias = 2^23 + zero, before the scale)
  static __device__ __forceinline__ float value(const Raw& r, int i, float bias) {
    if constexpr (WF == W_DENSE) {
      const unsigned bits = (r.w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
      return bits16_to_float(static_cast<const T*>(nullptr), bits);
    } else if constexpr (WF == W_FP8) {
      __nv_fp8_e4m3 e;
      e.__x = static_cast<__nv_fp8_storage_t>((r.w[i >> 2] >> ((i & 3) * 8)) & 0xFFu);
      return to_float(e);
    } else {
      // 2^23 + q as a float is exact; subtracting 2^23 + zero leaves q - zero exactly
      const unsigned nib = (r.w[i >> 3] >> ((i & 7) * 4)) & 0xFu;
      return __uint_as_float(0x4B000000u | nib) - bias;
    }
  }
};

// One block owns GEMV_WARPS * GEMV_PAIRS row pairs; each warp owns GEMV_PAIRS of them and streams
// their weight rows once, lanes striding over k with VB-byte loads. The hidden rows of all TT
// tokens are staged in shared memory as float32, p.kc k values at a time (tokens >= T are zero).
// Accumulation is float32 per (row, token); a butterfly reduction gives every lane the sums and
// lane t finishes token t (RoPE, Q store, paged K/V store).
//   int4: value q of k = 2j + h is nibble h of byte j; w = (q - zero) * scale in float32, with
//   one (scale, zero) per load (a load lies inside one group: the host makes VALS divide G).
//   OPTS: status= validates the offsets once the first weight loads are in flight (a batch of no
//   tokens launches one block, which only validates); the last token of a request clears the
//   rest of its page at the warp's pairs, the (token, row) items spread over the lanes.
//   PACKED (16-byte loads, token tiles of up to 4; the host picks it, GEMV_PACKED in qkv.py):
//   4-bit weights with fp16 (P4): the hidden rows are staged as fp16 pairs in int4_pairs' order
//   ((k, k + 4) of each 8 values), a word of 8 codes becomes 4 pairs of (q - zero) * scale with
//   5 LOP3 / shift and 8 half2 ops (q - zero exact, the product rounded once to fp16, as the
//   tensor-core kernels do), then one hfma2 a pair and token into fp16 sums of one 32-value load
//   (16 products a half), added to the float32 sums after every load; the load's (scale, zero)
//   are one 32-bit word, read as the load is issued. fp8 weights (P8): two codes a cvt to an
//   exact fp16 pair, then to float32 (the same float32 products and sums as before). PACKED 2
//   (4-bit): q - zero times x summed in fp16, the scale applied to each load's sums in float32
//   (4 fewer half2 ops a word, a closer scale; the fp16 sums of up to 16 products of |q - zero|
//   <= 15 and x overflow where |x| reaches about 270). Both issue
//   4 loads a row at 1-2 tokens (U = 4: 256 bytes a lane in flight, a 4096-wide 4-bit row's
//   whole chunk), 3 blocks an SM (one wave of 384 blocks on 132 SMs).
//   FORM (P4 only; 0 elsewhere, GEMV_FORM in qkv.py): bit 0: the load's word kept as scale |
//   (2^10 + zero) << 16, its pairs built by two byte permutes and one exact hsub2 (960 - (2^10 +
//   zero) = -(64 + zero)) where 8 integer ops did; bit 1 (with bit 0): each row's scale and
//   zero-point offsets computed once, as 32-bit element offsets (the host sets the bit only
//   where they, plus K / G, stay below 2^31), and a load's group by one unsigned division
//   shared by the rows (was: a signed division and 64-bit row products per row and load). The
//   same pairs, so the same results bit for bit.
template <typename T, int WF, int VB, int TT, bool FAST_INT4, int FORM, int PACKED, bool OPTS>
__global__ void __launch_bounds__(GEMV_WARPS * 32, PACKED ? 3 : 1) qkv_gemv(const QkvParams p) {
  pdl_launch_dependents();
  pdl_wait();
  using WV = WeightVec<T, WF, VB>;
  constexpr int VALS = WV::VALS;
  constexpr bool P4 = PACKED && WF == W_INT4 && VB == 16 && is_half<T>::value && TT <= 4;
  constexpr bool P8 = PACKED && WF == W_FP8 && VB == 16 && TT <= 4;
  constexpr bool LATE = P4 && PACKED == 2;  // 4-bit: the scale on each load's sums
  constexpr bool F1 = P4 && (FORM & 1);    // FORM bit 0, above
  constexpr bool F2 = F1 && (FORM & 2);    // FORM bit 1
  // loads in flight per row and lane: enough bytes in flight, few enough registers
  constexpr int U = (P4 || P8) ? (TT <= 2 ? 4 : 2)
                    : TT <= 2 ? (WF == W_DENSE ? 4 : 2)
                              : (TT <= 4 && WF == W_DENSE ? 2 : 1);
  // fp8: a slot refilled as soon as it is consumed (4-bit at 1-2 tokens holds a 4096-wide row's
  // whole chunk in flight already, and refilling spilled at its 168 registers)
  constexpr bool ROLL = P8;
  constexpr int SUB = VALS < 8 ? VALS : 8;  // k values decoded at once
  // int4 with 16-byte loads at small token tiles: the cheaper decode below
  constexpr bool FAST4 = WF == W_INT4 && VB == 16 && TT <= 4 && FAST_INT4 && !P4;
  // (TT, kc) float32, then FAST4: xsum (TT, kc / 32); P4: (TT, kc / 2) fp16 pairs instead
  extern __shared__ float xs[];
  unsigned* xw = reinterpret_cast<unsigned*>(xs);
  float* xsum = xs + TT * p.kc;
  __shared__ TokenSlot slots[TT];
  __shared__ int rests[OPTS ? TT : 1];  // OPTS: the rows each token clears (rest_of_page)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pairs_total = p.N >> 1;
  const int g0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_PAIRS;
  const bool rope = p.cos_sin != nullptr;
  const int t0 = blockIdx.y * TT;  // this block's token tile [t0, t0 + TT)
  const int nt = min(TT, p.T - t0);

  RowPair rps[GEMV_PAIRS];
  const unsigned char* wrow[GEMV_ROWS];
  int rown[GEMV_ROWS];
  bool live[GEMV_PAIRS];
#pragma unroll
  for (int i = 0; i < GEMV_PAIRS; ++i) {
    live[i] = g0 + i < pairs_total;
    rps[i] = row_pair(live[i] ? g0 + i : 0, p.D, p.R, p.Hq, p.Hkv, rope, p.is_neox);
    rown[2 * i] = rps[i].head * p.D + rps[i].da;
    rown[2 * i + 1] = rps[i].head * p.D + rps[i].db;
  }
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r) {
    wrow[r] = static_cast<const unsigned char*>(p.weight) + i64(rown[r]) * p.weight_row_bytes;
  }
  // F2: each row's group scales and zero points as 32-bit element offsets, computed once (the
  // host sets bit 1 only where every row's offsets, plus K / G, stay below 2^31)
  const bool has_zp = p.zero_points != nullptr;
  unsigned soff[F2 ? GEMV_ROWS : 1], zoff[F2 ? GEMV_ROWS : 1];
  if constexpr (F2) {
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      soff[r] = unsigned(i64(rown[r]) * p.ws_s0);
      zoff[r] = unsigned(i64(rown[r]) * p.zp_s0);
    }
  }

  float acc[GEMV_ROWS][TT];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.f;

  const T* hidden = static_cast<const T*>(p.hidden) + i64(t0) * p.hidden_s0;
  // 16-byte loads of the hidden rows when every row start of every chunk is 16-byte aligned
  const bool x_vec = (reinterpret_cast<unsigned long long>(hidden) & 15) == 0 &&
                     p.hidden_s0 % 8 == 0 && p.kc % 8 == 0 && p.K % 8 == 0;
  for (int k0 = 0; k0 < p.K; k0 += p.kc) {
    const int kc = min(p.kc, p.K - k0);
    const int nv = kc / VALS;  // the host makes kc and K multiples of VALS
    const i64 byte0 = WF == W_INT4 ? k0 / 2 : i64(k0) * (WF == W_DENSE ? int(sizeof(T)) : 1);
    // Weight loads (and, for int4, their group's scale and zero) of U * 32 vectors from base.
    typename WV::Raw raw[U][GEMV_ROWS];
    float scale[U][GEMV_ROWS], bias[U][GEMV_ROWS];  // int4: bias = 2^23 + zero
    unsigned sz[U][GEMV_ROWS];  // P4: the scale's fp16 bits | the zero point << 16
    auto issue_one = [&](int u, int base) {  // slot u: vector base + u * 32 + lane
      {
        const int v = base + u * 32 + lane;
        // F2: the load's group, one unsigned division for every row (k0 + v * VALS >= 0)
        const unsigned fgrp = F2 ? unsigned(k0 + v * VALS) / unsigned(p.group_size) : 0u;
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
          const bool on = v < nv && live[r >> 1];
          if constexpr (P4 || P8) {  // read once: not kept in L1 (as qkv_mma's loads)
            const uint4 w = on ? ldg_stream(wrow[r] + byte0 + i64(v) * VB) : make_uint4(0, 0, 0, 0);
            raw[u][r].w[0] = w.x;
            raw[u][r].w[1] = w.y;
            raw[u][r].w[2] = w.z;
            raw[u][r].w[3] = w.w;
          } else {
            raw[u][r] = on ? WV::load(wrow[r] + byte0 + i64(v) * VB) : WV::zero();
          }
          if constexpr (F2) {  // the scale's bits | (2^10 + zero as fp16) << 16
            const unsigned sb =
                on ? unsigned(static_cast<const unsigned short*>(p.weight_scales)[soff[r] + fgrp])
                   : 0u;  // scale 0: the vector sums to 0
            const unsigned z =
                on && has_zp
                    ? unsigned(static_cast<const unsigned char*>(p.zero_points)[zoff[r] + fgrp]) &
                          0xFu
                    : 8u;
            sz[u][r] = sb | ((0x6400u | z) << 16);
          } else if constexpr (P4) {
            const int grp = (k0 + v * VALS) / p.group_size;
            const unsigned sb =
                on ? unsigned(static_cast<const unsigned short*>(
                         p.weight_scales)[i64(rown[r]) * p.ws_s0 + grp])
                   : 0u;  // scale 0: the (never consumed) vector sums to 0
            const unsigned z = on && p.zero_points
                                   ? unsigned(static_cast<const unsigned char*>(
                                         p.zero_points)[i64(rown[r]) * p.zp_s0 + grp]) &
                                         0xFu
                                   : 8u;
            sz[u][r] = sb | ((F1 ? 0x6400u | z : z) << 16);
          } else if constexpr (WF == W_INT4) {
            const int grp = (k0 + v * VALS) / p.group_size;
            scale[u][r] = on ? to_float(static_cast<const T*>(
                                   p.weight_scales)[i64(rown[r]) * p.ws_s0 + grp])
                             : 0.f;
            bias[u][r] = 8388608.f + (on && p.zero_points
                                          ? float(static_cast<const unsigned char*>(
                                                      p.zero_points)[i64(rown[r]) * p.zp_s0 +
                                                                     grp] &
                                                  0xF)
                                          : 8.f);
          }
        }
      }
    };
    auto issue = [&](int base) {
#pragma unroll
      for (int u = 0; u < U; ++u) issue_one(u, base);
    };
    issue(0);  // the first loads go out before the hidden rows are staged, overlapping the two
    if constexpr (OPTS) {
      if (k0 == 0 && (!qkv_check<OPTS>(p, p.offsets) || nt <= 0)) return;
    }
    if (k0 == 0 && threadIdx.x < TT) {  // token addressing, in the shadow of those loads
      if constexpr (OPTS) {
        const int tl = threadIdx.x;
        const PagedSlot s = tl < nt ? qkv_paged_slot(p, t0 + tl) : PagedSlot{-1, -1, -1, 0};
        const TokenSlot tok = token_slot_of(p, s);
        slots[tl] = tok;
        rests[tl] = rest_of_page(p, p.offsets, s, tok, s.entry, t0 + tl);
      } else {
        slots[threadIdx.x] =
            int(threadIdx.x) < nt ? token_slot(p, t0 + threadIdx.x) : TokenSlot{-1, -1, -1};
      }
    }
    __syncthreads();  // the previous chunk is consumed
    // Stage x (TT, kc) as float32, XU independent loads in flight per thread.
    constexpr int XU = 4;
    if constexpr (P4) {  // fp16 pairs (k, k + 4) of each 8 values: word j * 4 + i of group j
      const int xrow = p.kc >> 1;  // words a token row
      if (x_vec) {
        const int per_row = kc >> 3, total = TT * per_row;
        for (int i0 = threadIdx.x; i0 < total; i0 += XU * blockDim.x) {
          uint4 xv[XU];
#pragma unroll
          for (int j = 0; j < XU; ++j) {
            const int i = i0 + j * blockDim.x;
            const int t = i / per_row, k = (i - t * per_row) * 8;
            xv[j] = i < total && t < nt ? *reinterpret_cast<const uint4*>(
                                              hidden + i64(t) * p.hidden_s0 + k0 + k)
                                        : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int j = 0; j < XU; ++j) {
            const int i = i0 + j * blockDim.x;
            const int t = i / per_row, grp8 = i - t * per_row;
            if (i < total) *reinterpret_cast<uint4*>(xw + t * xrow + grp8 * 4) = int4_order(xv[j]);
          }
        }
      } else {
        unsigned short* xh = reinterpret_cast<unsigned short*>(xs);
        const T* hid = hidden;
        const int total = TT * kc;
        for (int i = threadIdx.x; i < total; i += blockDim.x) {
          const int t = i / kc, k = i - t * kc;
          const T x = t < nt ? hid[i64(t) * p.hidden_s0 + k0 + k] : from_float<T>(0.f);
          xh[t * p.kc + ((k >> 3) * 4 + (k & 3)) * 2 + ((k >> 2) & 1)] =
              *reinterpret_cast<const unsigned short*>(&x);
        }
      }
    } else if (x_vec) {
      const int per_row = kc >> 3, total = TT * per_row;
      for (int i0 = threadIdx.x; i0 < total; i0 += XU * blockDim.x) {
        Vec<T, 8> xv[XU];
#pragma unroll
        for (int j = 0; j < XU; ++j) {
          const int i = i0 + j * blockDim.x;
          const int t = i / per_row, k = (i - t * per_row) * 8;
          if (i < total && t < nt) {
            xv[j] = load<T, 8>(hidden + i64(t) * p.hidden_s0 + k0 + k);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) xv[j].v[e] = from_float<T>(0.f);
          }
        }
#pragma unroll
        for (int j = 0; j < XU; ++j) {
          const int i = i0 + j * blockDim.x;
          const int t = i / per_row, k = (i - t * per_row) * 8;
          if (i < total) {
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = to_float(xv[j].v[e]);
            store_float<float, 8>(xs + t * p.kc + k, f);
          }
        }
      }
    } else {
      const int total = TT * kc;
      for (int i0 = threadIdx.x; i0 < total; i0 += XU * blockDim.x) {
        float f[XU];
#pragma unroll
        for (int j = 0; j < XU; ++j) {
          const int i = i0 + j * blockDim.x;
          const int t = i / kc, k = i - t * kc;
          f[j] = i < total && t < nt ? to_float(hidden[i64(t) * p.hidden_s0 + k0 + k]) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < XU; ++j) {
          const int i = i0 + j * blockDim.x;
          const int t = i / kc, k = i - t * kc;
          if (i < total) xs[t * p.kc + k] = f[j];
        }
      }
    }
    __syncthreads();
    if constexpr (FAST4) {  // sum of x over each 32-value load, per token
      const int per_row = p.kc / 32;
      for (int i = threadIdx.x; i < TT * per_row; i += blockDim.x) {
        const int t = i / per_row, c = i - t * per_row;
        float sx = 0.f;
        if (c * 32 < kc) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float x[8];
            load_float<float, 8>(xs + t * p.kc + c * 32 + j * 8, x);
#pragma unroll
            for (int e = 0; e < 8; ++e) sx += x[e];
          }
        }
        xsum[i] = sx;
      }
      __syncthreads();
    }
    for (int base = 0;;) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * 32 + lane;
        if (v >= nv) break;
        if constexpr (P4) {
          // (q - zero) * scale as fp16 pairs, word by word; fp16 sums of this load's 32 values
          unsigned sub[GEMV_ROWS], sub16[GEMV_ROWS], sc[GEMV_ROWS];
#pragma unroll
          for (int r = 0; r < GEMV_ROWS; ++r) {
            if constexpr (F1) {  // the same pairs: two byte permutes and one exact hsub2
              sub[r] = __byte_perm(sz[u][r], 0u, 0x3232);  // 2^10 + zero, both halves
              sc[r] = __byte_perm(sz[u][r], 0u, 0x1010);
              const __half2 d = __hsub2(__halves2half2(__ushort_as_half(0x6380),  // 960
                                                       __ushort_as_half(0x6380)),
                                        *reinterpret_cast<const __half2*>(&sub[r]));
              sub16[r] = *reinterpret_cast<const unsigned*>(&d);  // -(64 + zero), exact
            } else {
              const unsigned z = sz[u][r] >> 16;
              sub[r] = (0x6400u | z) * 0x10001u;           // 2^10 + zero, both halves
              sub16[r] = (0xD400u | (z << 4)) * 0x10001u;  // -(64 + zero), both halves
              sc[r] = (sz[u][r] & 0xFFFFu) * 0x10001u;
            }
          }
          __half2 hsum[GEMV_ROWS][TT];
#pragma unroll
          for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) hsum[r][t] = __float2half2_rn(0.f);
#pragma unroll
          for (int c = 0; c < 4; ++c) {  // word c: k values 8c .. 8c + 7 of the load
            unsigned wp[GEMV_ROWS][4];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
              if constexpr (LATE) {
                int4_diffs(raw[u][r].w[c], sub[r], sub16[r], wp[r]);
              } else {
                int4_pairs<T>(raw[u][r].w[c], sub[r], sub16[r], sc[r], wp[r]);
              }
            }
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              const uint4 xq =
                  *reinterpret_cast<const uint4*>(xw + t * (p.kc >> 1) + (v * 4 + c) * 4);
              const unsigned xp[4] = {xq.x, xq.y, xq.z, xq.w};
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r)
                  hsum[r][t] = __hfma2(*reinterpret_cast<const __half2*>(&wp[r][i]),
                                       *reinterpret_cast<const __half2*>(&xp[i]), hsum[r][t]);
            }
          }
#pragma unroll
          for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              const float2 f = __half22float2(hsum[r][t]);
              if constexpr (LATE) {
                const auto bits = static_cast<unsigned short>(sz[u][r] & 0xFFFFu);
                acc[r][t] = fmaf(__half2float(__ushort_as_half(bits)), f.x + f.y, acc[r][t]);
              } else {
                acc[r][t] += f.x + f.y;
              }
            }
        } else if constexpr (P8) {
          // two codes a cvt (an exact fp16 pair), then float32 products as before
#pragma unroll
          for (int c = 0; c < VALS / SUB; ++c) {  // 8 values: words 2c, 2c + 1
            float w[GEMV_ROWS][SUB];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
#pragma unroll
              for (int h = 0; h < 4; ++h) {
                const unsigned word = raw[u][r].w[2 * c + (h >> 1)];
                const float2 f = fp8x2_to_float2((h & 1) ? word >> 16 : word);
                w[r][2 * h] = f.x;
                w[r][2 * h + 1] = f.y;
              }
            }
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              float x[SUB];
              load_float<float, SUB>(xs + t * p.kc + v * VALS + c * SUB, x);
#pragma unroll
              for (int i = 0; i < SUB; ++i)
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] = fmaf(w[r][i], x[i], acc[r][t]);
            }
          }
        } else if constexpr (FAST4) {
          // 1 + q/16 is the float with q in the top 4 mantissa bits: one shift and one LOP3 per
          // value, no conversion. sum (q - zero) x = 16 sum (1 + q/16) x - (16 + zero) sum x.
          float part[GEMV_ROWS][TT];
#pragma unroll
          for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) part[r][t] = 0.f;
#pragma unroll
          for (int c = 0; c < VALS / 8; ++c) {
            float w[GEMV_ROWS][8];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
              const unsigned word = raw[u][r].w[c];
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                const unsigned m = i <= 4 ? word << (19 - 4 * i) : word >> (4 * i - 19);
                w[r][i] = __uint_as_float((m & 0x00780000u) | 0x3F800000u);
              }
            }
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              float x[8];
              load_float<float, 8>(xs + t * p.kc + v * VALS + c * 8, x);
#pragma unroll
              for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) part[r][t] = fmaf(w[r][i], x[i], part[r][t]);
            }
          }
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            const float sx = xsum[t * (p.kc / 32) + v];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
              const float z16 = bias[u][r] - 8388592.f;  // (2^23 + zero) - (2^23 - 16), exact
              acc[r][t] = fmaf(scale[u][r], fmaf(16.f, part[r][t], -z16 * sx), acc[r][t]);
            }
          }
        } else {
          // SUB k values at a time: decode them for every row, then one x read serves all rows.
#pragma unroll
          for (int c = 0; c < VALS / SUB; ++c) {
            float w[GEMV_ROWS][SUB];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
#pragma unroll
              for (int i = 0; i < SUB; ++i) {
                w[r][i] = WV::value(raw[u][r], c * SUB + i, bias[u][r]);
                if constexpr (WF == W_INT4) w[r][i] *= scale[u][r];
              }
            }
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              float x[SUB];
              load_float<float, SUB>(xs + t * p.kc + v * VALS + c * SUB, x);
#pragma unroll
              for (int i = 0; i < SUB; ++i)
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r][t] = fmaf(w[r][i], x[i], acc[r][t]);
            }
          }
        }
        // packed: slot u refilled as soon as it is consumed (U loads a row always in flight)
        if constexpr (ROLL) issue_one(u, base + 32 * U);
      }
      base += 32 * U;
      if (base >= nv) break;
      if constexpr (!ROLL) issue(base);
    }
  }

#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], off);

  if constexpr (OPTS) {
    // The rows the tokens clear (rests), as (token, row) items spread over the warp's lanes: each
    // zeroes the warp's pairs in one row, rather than each token's lane row after row.
    const int per = p.clear ? p.page_size - 1 : 0;
    for (int u = lane; u < nt * per; u += 32) {
      const int t = u / per, r = u - t * per + 1;
      if (r > rests[t]) continue;
#pragma unroll
      for (int i = 0; i < GEMV_PAIRS; ++i)
        if (live[i]) zero_pair_rest<T>(p, slots[t], rps[i], r);
    }
  }
  if (lane >= nt) return;
  const TokenSlot tok = slots[lane];
#pragma unroll
  for (int i = 0; i < GEMV_PAIRS; ++i) {
    if (!live[i]) continue;
    float a = acc[2 * i][0], b = acc[2 * i + 1][0];
#pragma unroll
    for (int t = 1; t < TT; ++t) {  // lane t takes token t's sums (no dynamic register index)
      a = lane == t ? acc[2 * i][t] : a;
      b = lane == t ? acc[2 * i + 1][t] : b;
    }
    if constexpr (WF == W_FP8) {
      const float* ws = static_cast<const float*>(p.weight_scales);
      a *= ws[rown[2 * i]];
      b *= ws[rown[2 * i + 1]];
    }
    write_pair<T>(p, tok, t0 + lane, rps[i], a, b);
  }
}

// ---- Decode, lean: K split over a block's warps, the hidden values in registers -------------
//
// qkv_gemv_lean<T, WF, TT, FORM>: plain calls (no options) of 16-bit or fp8 weights, or of 4-bit
// weights with fp16 inputs, with 16-byte loads (the host's conditions: lean_applies in qkv.py),
// up to TT tokens a block. A block owns lean_pairs(TT) row pairs (16 rows at TT <= 2, 8 at TT 4;
// a pair is two RoPE partners, as in qkv_gemv) and its 4 warps split K: warp w's lane takes the
// 16-byte load v = (4 j + w) 32 + lane of every row of the block, the rows' loads of a round j
// issued together. A 4096-wide 4-bit row is one round (one load a lane of the 4 warps), an fp8
// row two, a 16-bit row four. In the source a round's loads come before its arithmetic; ptxas
// (sm_90, nvcc 13.0) keeps 4 of a lane's 16 in flight at 4-bit, 8 at fp8, all 16 at 16-bit
// (one token), issuing each later one as the arithmetic frees its registers. Staging them by
// cp.async put all 16 in flight and was slower, with the hidden values and scales staged too
// slower still (docs/design/qkv.md). A lane reads its loads' hidden values from global memory
// into registers (no shared stage, no barrier before the arithmetic). The arithmetic is
// qkv_gemv's: 4-bit the packed decode's same fp16 pairs of (q - zero) * scale and fp16 sums of
// each 32-value load, fp8 two codes a cvt and float32 products, 16-bit float32 products; the
// float32 sums are added in another order: a lane's loads, then over the warp by a
// reduce-scatter (lane l ends with one (row, token) sum: 31 shuffles for 32 sums, not 5 a sum),
// then over the warps in shared memory. One thread a (pair, token) finishes: RoPE, Q to out, K /
// V to their pages.
//   Every load issued behind the weight stream waits for the SM's whole share of it (about 96 KB
// at 4-bit), so what the arithmetic and the epilogue need comes first. FORM bit 0: warp 0 loads
// the tokens' cache rows, the pairs' cos / sin values and fp8 scales before its weight loads,
// staged in shared memory for the epilogue (without it: the cache rows behind warp 0's weight
// loads, the rest after the reduction); bit 1: a lane's hidden values before its weight loads.
// The block's row numbers are found one a lane and shuffled, not once a row by every lane, so the
// first weight load issues early; the rows' addresses are formed in the round (hoisted out of
// the loop as 64-bit products they spilled).
//   FORM bit 2: blocks of half the row pairs (8 rows at TT <= 2), twice as many an SM in the
// launch bounds (6: 768 blocks, one wave; at most 80 registers). Bit 3: every row's arithmetic waits for
// all of the round's weight loads (a zero computed from each), so ptxas issues them all before
// the first row's arithmetic; with bit 2 (8 loads a lane) that is every 4-bit / fp8 load of a
// 4096-wide row at one token (at two, the quantized forms with bit 2 spill). sm_90 SASS (nvcc
// 13.0), 4-bit at one token: form 7 issues 3 of its 8 loads ahead of the arithmetic, form 15 all
// 8. The forms each weight format and tile take: qkv.py's GEMV_LEAN_FORM / GEMV_LEAN_WIDE_FORM.
template <int WF>
struct LeanShape {
  static constexpr int WARPS = 4;
  static constexpr int VALS = WF == W_INT4 ? 32 : WF == W_FP8 ? 16 : 8;  // k values a 16-byte load
};
__host__ __device__ constexpr int lean_pairs(int tt) { return tt <= 2 ? 8 : 4; }
constexpr int LEAN_MIN_BLOCKS = 3;  // blocks an SM in the launch bounds: 384 blocks, one wave
// qkv_gemv_lean's FORM bit 2: blocks of half the row pairs, twice as many an SM
__host__ __device__ constexpr int lean_block_pairs(int tt, int form) {
  return form & 4 ? lean_pairs(tt) / 2 : lean_pairs(tt);
}

// One step of warp_reduce_scatter: lanes whose bit O is set keep the upper half of the CNT
// values, the others the lower half, each adding its partner's (lane ^ O) copy of what it keeps.
template <int CNT, int O, int M>
__device__ __forceinline__ void reduce_scatter_step(float (&a)[M], int lane, int& idx) {
  if constexpr (CNT > 1) {
    constexpr int HALF = CNT / 2;
    const bool up = lane & O;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      const float keep = up ? a[i + HALF] : a[i];
      const float send = up ? a[i] : a[i + HALF];
      a[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    if (up) idx += HALF;
    reduce_scatter_step<HALF, O / 2, M>(a, lane, idx);
  } else if constexpr (O > 0) {
    a[0] += __shfl_xor_sync(0xffffffffu, a[0], O);
    reduce_scatter_step<1, O / 2, M>(a, lane, idx);
  }
}

// The sums over the warp's lanes of M values (M a power of two, at most 32): lane l gets the sum
// of value idx, idx = l / (32 / M), from M - 1 + log2(32 / M) shuffles.
template <int M>
__device__ __forceinline__ float warp_reduce_scatter(float (&a)[M], int lane, int& idx) {
  static_assert(M >= 1 && M <= 32 && (M & (M - 1)) == 0, "M: a power of two up to 32");
  idx = 0;
  reduce_scatter_step<M, 16, M>(a, lane, idx);
  return a[0];
}

// Pair ii of head h0 (a qkv_gemv_lean block's pair i0 + i), or pair ii - half_d of the next
// head when ii is past head h0's half_d pairs.
__device__ __forceinline__ RowPair lean_pair(const QkvParams& p, int h0, int ii, int half_d,
                                             bool rope) {
  const bool next = ii >= half_d;
  return row_pair_in(h0 + next, next ? ii - half_d : ii, p.R, p.Hq, p.Hkv, rope, p.is_neox);
}

template <typename T, int WF, int TT, int FORM>
__global__ void __launch_bounds__(LeanShape<WF>::WARPS * 32,
                                  FORM & 4 ? 2 * LEAN_MIN_BLOCKS : LEAN_MIN_BLOCKS)
    qkv_gemv_lean(const QkvParams p) {
  pdl_launch_dependents();
  pdl_wait();
  static_assert(WF == W_FP8 || WF == W_DENSE || (WF == W_INT4 && is_half<T>::value),
                "16-bit or fp8 weights, or 4-bit with fp16");
  constexpr int WARPS = LeanShape<WF>::WARPS, VALS = LeanShape<WF>::VALS;
  constexpr int PAIRS = lean_block_pairs(TT, FORM), ROWS = 2 * PAIRS, M = ROWS * TT;
  static_assert(M <= 32, "one reduce-scatter a warp");
  __shared__ float red[WARPS][M];
  __shared__ TokenSlot slots[FORM & 1 ? PAIRS * TT : TT];
  __shared__ float4 factors[FORM & 1 ? PAIRS * TT : 1];  // FORM bit 0: cos, sin, fp8 scales

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pairs_total = p.N >> 1;
  const int g0 = blockIdx.x * PAIRS;
  const int t0 = blockIdx.y * TT, nt = min(TT, p.T - t0);
  const bool rope = p.cos_sin != nullptr;
  // The block's pairs: pair i is pair i0 + i of head h0, or of the next head (the host makes
  // D / 2 >= PAIRS). Row r of the block (member r % 2 of pair r / 2) is found by lane r and
  // handed to every lane by a shuffle: the rows' logic once a lane, not once a row, before the
  // first load. Pairs past the last read row 0 (their sums are never stored).
  const int half_d = p.D >> 1, h0 = g0 / half_d, i0 = g0 - h0 * half_d;
  int own_row;
  {
    const int i = (lane >> 1) & (PAIRS - 1);
    const RowPair rp = lean_pair(p, h0, i0 + i, half_d, rope);
    own_row = g0 + i < pairs_total ? rp.head * p.D + ((lane & 1) ? rp.db : rp.da) : 0;
  }
  unsigned rown[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) rown[r] = __shfl_sync(0xffffffffu, own_row, r);
  // 32-bit strides (the host's condition: lean_strides in qkv.py)
  const unsigned row_bytes = unsigned(p.weight_row_bytes), ws_s0 = unsigned(p.ws_s0),
                 zp_s0 = unsigned(p.zp_s0);
  const unsigned char* weight = static_cast<const unsigned char*>(p.weight);
  using u64 = unsigned long long;
  const T* hidden = static_cast<const T*>(p.hidden) + i64(t0) * p.hidden_s0;
  // 16-byte loads of the hidden values where every load's start is 16-byte aligned
  const bool x_vec =
      (reinterpret_cast<unsigned long long>(hidden) & 15) == 0 && p.hidden_s0 % 8 == 0;
  const int nv = p.K / VALS;  // loads a row (the host makes K a multiple of VALS)

  if constexpr (FORM & 1) {
    // the epilogue's loads first, one lane of warp 0 a (pair, token) item: its token's slot, its
    // pair's cos / sin and fp8 scales, staged for after the barrier (its loads ahead of the
    // weight stream's, not queued behind them)
    if (warp == 0 && lane < PAIRS * TT && g0 + lane / TT < pairs_total) {  // live pairs only
      const int i = lane / TT, t = lane - i * TT, ii = i0 + i;
      const TokenSlot tok = t < nt ? token_slot(p, t0 + t) : TokenSlot{-1, -1, -1};
      const RowPair rp = lean_pair(p, h0, ii, half_d, rope);
      float4 f = make_float4(1.f, 0.f, 1.f, 1.f);
      if (rp.rot >= 0 && tok.pos >= 0) {
        const float* cs = p.cos_sin + i64(tok.pos) * p.cs_s0;
        f.x = cs[rp.rot];
        f.y = cs[(p.R >> 1) + rp.rot];
      }
      if constexpr (WF == W_FP8) {
        const float* ws = static_cast<const float*>(p.weight_scales);
        f.z = ws[rp.head * p.D + rp.da];
        f.w = ws[rp.head * p.D + rp.db];
      }
      slots[lane] = tok;
      factors[lane] = f;
    }
  }
  float part[M];
#pragma unroll
  for (int i = 0; i < M; ++i) part[i] = 0.f;

  for (int vb = warp * 32; vb < nv; vb += WARPS * 32) {
    const int v = vb + lane;
    const bool on = v < nv;
    // A lane past the row's end loads the row's last vector again (no predicates, no zeroing)
    // and multiplies it by zeros (its hidden values): it adds +0, or NaN where the row's own
    // last vector already makes the row's sum NaN. Not at 16-bit: an infinite weight there
    // makes the row's sum +-Inf, and Inf * 0 would make it NaN, so the lane adds nothing.
    const unsigned vl = unsigned(on ? v : nv - 1);
    // the rows' addresses computed in the round, not hoisted out of the loop as 64-bit products
    // (three a row: spilled, and before the first load)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) asm volatile("" : "+r"(rown[r]));
    // This lane's hidden values: 4-bit as fp16 pairs in int4_pairs' order, fp8 as float32; zero
    // for tokens past the tile's and lanes past the row's end. Aligned rows: every 16-byte load
    // issued at once, no branch between them (a branch a load made each wait for the last).
    constexpr int XW = WF == W_INT4 ? VALS / 2 : VALS;
    unsigned xs[TT][XW];
    auto load_hidden = [&]() {
      uint4 q[TT][VALS / 8];
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const T* xr = hidden + i64(min(t, nt - 1)) * p.hidden_s0 + i64(vl) * VALS;
#pragma unroll
        for (int c = 0; c < VALS / 8; ++c) {
          if (x_vec) {
            q[t][c] = *reinterpret_cast<const uint4*>(xr + 8 * c);
          } else {
            const unsigned short* h = reinterpret_cast<const unsigned short*>(xr) + 8 * c;
            q[t][c] = make_uint4(h[0] | unsigned(h[1]) << 16, h[2] | unsigned(h[3]) << 16,
                                 h[4] | unsigned(h[5]) << 16, h[6] | unsigned(h[7]) << 16);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const bool here = on && t < nt;
#pragma unroll
        for (int c = 0; c < VALS / 8; ++c) {
          const uint4 v4 = here ? q[t][c] : make_uint4(0, 0, 0, 0);
          if constexpr (WF == W_INT4) {
            const uint4 o = int4_order(v4);
            xs[t][4 * c] = o.x;
            xs[t][4 * c + 1] = o.y;
            xs[t][4 * c + 2] = o.z;
            xs[t][4 * c + 3] = o.w;
          } else {
            const unsigned w[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
              xs[t][8 * c + e] = __float_as_uint(bits16_to_float(
                  static_cast<const T*>(nullptr), (w[e >> 1] >> (16 * (e & 1))) & 0xFFFFu));
          }
        }
      }
    };
    if constexpr (FORM & 2) load_hidden();  // FORM bit 1: ahead of the weight stream
    const unsigned char* wl = weight + vl * 16u;
    uint4 raw[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) raw[r] = ldg_stream(wl + u64(rown[r]) * row_bytes);
    unsigned sz[WF == W_INT4 ? ROWS : 1];  // 4-bit: the scale's fp16 bits | (2^10 + zero) << 16
    if constexpr (WF == W_INT4) {
      const unsigned grp = vl * VALS / unsigned(p.group_size);
      const unsigned short* ws = static_cast<const unsigned short*>(p.weight_scales) + grp;
      const unsigned char* zp = static_cast<const unsigned char*>(p.zero_points);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const unsigned sb = ldg_u16(ws + u64(rown[r]) * ws_s0);
        const unsigned z = zp != nullptr ? ldg_u8(zp + grp + u64(rown[r]) * zp_s0) & 0xFu : 8u;
        sz[r] = sb | ((0x6400u | z) << 16);
      }
    }
    if constexpr (FORM & 8) {
      // FORM bit 3: every row's arithmetic waits for all of the round's weight loads (a zero
      // that depends on each: T is never negative), so ptxas issues them all first
      unsigned j = 0;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) j ^= raw[r].x ^ raw[r].y ^ raw[r].z ^ raw[r].w;
      j &= unsigned(p.T) >> 31;
      if constexpr (WF == W_INT4) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) sz[r] ^= j;
      } else {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) raw[r].x ^= j;
      }
    }
    if ((FORM & 1) == 0 && vb == 0 && lane < TT) {  // warp 0, first round: behind its loads
      slots[lane] = lane < nt ? token_slot(p, t0 + lane) : TokenSlot{-1, -1, -1};
    }
    if constexpr ((FORM & 2) == 0) load_hidden();
    if (WF == W_DENSE && !on) continue;  // the last round alone: a warp-uniform test before it
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const unsigned w[4] = {raw[r].x, raw[r].y, raw[r].z, raw[r].w};
      if constexpr (WF == W_INT4) {
        // qkv_gemv's packed decode, FORM bit 0: the same pairs, the same fp16 sums
        const unsigned sub = __byte_perm(sz[r], 0u, 0x3232), sc = __byte_perm(sz[r], 0u, 0x1010);
        const __half2 d = __hsub2(__halves2half2(__ushort_as_half(0x6380),  // 960
                                                 __ushort_as_half(0x6380)),
                                  *reinterpret_cast<const __half2*>(&sub));
        const unsigned sub16 = *reinterpret_cast<const unsigned*>(&d);  // -(64 + zero), exact
        __half2 hsum[TT];
#pragma unroll
        for (int t = 0; t < TT; ++t) hsum[t] = __float2half2_rn(0.f);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          unsigned wp[4];
          int4_pairs<T>(w[c], sub, sub16, sc, wp);
#pragma unroll
          for (int t = 0; t < TT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              hsum[t] = __hfma2(*reinterpret_cast<const __half2*>(&wp[i]),
                                *reinterpret_cast<const __half2*>(&xs[t][4 * c + i]), hsum[t]);
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          const float2 f = __half22float2(hsum[t]);
          part[r * TT + t] += f.x + f.y;
        }
      } else if constexpr (WF == W_DENSE) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // values 2h, 2h + 1: float32 products and sums
          const float lo = bits16_to_float(static_cast<const T*>(nullptr), w[h] & 0xFFFFu);
          const float hi = bits16_to_float(static_cast<const T*>(nullptr), w[h] >> 16);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            part[r * TT + t] = fmaf(lo, __uint_as_float(xs[t][2 * h]), part[r * TT + t]);
            part[r * TT + t] = fmaf(hi, __uint_as_float(xs[t][2 * h + 1]), part[r * TT + t]);
          }
        }
      } else {
#pragma unroll
        for (int h = 0; h < 8; ++h) {  // codes 2h, 2h + 1
          const float2 f = fp8x2_to_float2((h & 1) ? w[h >> 1] >> 16 : w[h >> 1]);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            part[r * TT + t] = fmaf(f.x, __uint_as_float(xs[t][2 * h]), part[r * TT + t]);
            part[r * TT + t] = fmaf(f.y, __uint_as_float(xs[t][2 * h + 1]), part[r * TT + t]);
          }
        }
      }
    }
  }

  int idx;
  const float s = warp_reduce_scatter<M>(part, lane, idx);
  if (lane % (32 / M) == 0) red[warp][idx] = s;
  __syncthreads();
  if (threadIdx.x >= PAIRS * TT) return;
  const int i = threadIdx.x / TT, t = threadIdx.x - i * TT;
  if (g0 + i >= pairs_total || t >= nt) return;
  float a = 0.f, b = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    a += red[w][2 * i * TT + t];
    b += red[w][(2 * i + 1) * TT + t];
  }
  const RowPair rp = lean_pair(p, h0, i0 + i, half_d, rope);
  if constexpr (FORM & 1) {
    const float4 f = factors[threadIdx.x];
    const TokenSlot tok = slots[threadIdx.x];
    a *= f.z;  // the fp8 scales (1 for 4-bit)
    b *= f.w;
    if (rp.rot >= 0 && tok.pos >= 0) rotate_pair(a, b, f.x, f.y);
    store_pair<T>(p, tok, t0 + t, rp, a, b);
    return;
  }
  if constexpr (WF == W_FP8) {
    const float* ws = static_cast<const float*>(p.weight_scales);
    a *= ws[rp.head * p.D + rp.da];
    b *= ws[rp.head * p.D + rp.db];
  }
  write_pair<T>(p, slots[t], t0 + t, rp, a, b);
}

// ---- A few tokens on tensor cores, without a cluster: qkv_lean_mma ---------------------------
//
// qkv_lean_mma<T, WF, NT, MT, WARPS>: qkv_gemv_lean's block (K split over WARPS warps and
// reduced in shared memory, the epilogue's loads first) with the products on mma.sync
// m16n8k16. The block owns 8 MT row pairs: MT m16 tiles, row g of tile m pair 8 m + g's first
// member and row g + 8 its second (so a pair's two sums meet in one thread at the end), its
// NT * 8 tokens NT n8 tiles. Lane (g, c) of warp w loads 16 bytes of each of its 2 MT rows at
// loads v = r + 4 j + c, j < J (lean_mma_loads: 2 in the (8, 1) block, 4 otherwise), of each of
// its warp's rounds r (a warp's load instruction: 8 rows x 64 bytes; every load of a round
// issued before its arithmetic), and its B fragments straight
// from global memory: the hidden values of token g (and g + 8) at the same k values, in the
// order qkv_mma stages them (the k order inside an mma does not change the sum), shared by the
// MT tiles. fp8 and 4-bit weights are dequantized as in qkv_mma (fp8 exactly; 4-bit (q - zero) *
// scale rounded once to T), float32 sums; the fp8 row scale is applied to the sums. No cluster,
// no shared-memory stage, one barrier. Lanes past a row's end load its last 16 bytes again with
// zero hidden values (16-bit weights: zero weights too, as an infinite weight times zero would
// be NaN).
template <int MT, int WARPS>
__host__ __device__ constexpr int lean_mma_min_blocks() {
  return MT == 1 && WARPS <= 8 ? LEAN_MIN_BLOCKS : 1;
}
// a lane's 16-byte loads of each of its rows a round: 2 for the (8, 1) block (3 blocks of 8
// warps an SM in the launch bounds: at most 85 registers), 4 otherwise
template <int MT, int WARPS>
__host__ __device__ constexpr int lean_mma_loads() {
  return MT == 1 && WARPS == 8 ? 2 : 4;
}

template <typename T, int WF, int NT, int MT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, (lean_mma_min_blocks<MT, WARPS>()))
    qkv_lean_mma(const QkvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_launch_dependents();
  pdl_wait();
  constexpr int PAIRS = 8 * MT, TT = 8 * NT, J = lean_mma_loads<MT, WARPS>(), RW = 4 * J;
  constexpr int VALS = LeanShape<WF>::VALS, UNITS = VALS / 8;    // 16-byte B units a load
  __shared__ float red[WARPS][16 * MT][TT + 1];
  __shared__ TokenSlot slots[TT];
  __shared__ float4 factors[PAIRS * TT];  // cos, sin, fp8 scales of a (pair, token) item

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int pairs_total = p.N >> 1;
  const int g0 = blockIdx.x * PAIRS;
  const int t0 = blockIdx.y * TT, nt = min(TT, p.T - t0);
  const bool rope = p.cos_sin != nullptr;
  const int half_d = p.D >> 1, h0 = g0 / half_d, i0 = g0 - h0 * half_d;
  using u64 = unsigned long long;
  // this lane's rows: pair 8 m + g's two members (pairs past the last read row 0, never stored)
  unsigned rows[MT][2];
  const unsigned char* wrow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    rows[m][0] = rows[m][1] = 0;
    if (g0 + 8 * m + g < pairs_total) {
      const RowPair rp = lean_pair(p, h0, i0 + 8 * m + g, half_d, rope);
      rows[m][0] = unsigned(rp.head * p.D + rp.da);
      rows[m][1] = unsigned(rp.head * p.D + rp.db);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[m][h] = static_cast<const unsigned char*>(p.weight) +
                   u64(rows[m][h]) * unsigned(p.weight_row_bytes);
  }
  const T* hidden = static_cast<const T*>(p.hidden) + i64(t0) * p.hidden_s0;
  const bool x_vec =
      (reinterpret_cast<unsigned long long>(hidden) & 15) == 0 && p.hidden_s0 % 8 == 0;
  const int nv = p.K / VALS;

  // the epilogue's loads first (warp 0): the tokens' cache rows (lane t < TT finds token t's
  // and hands its position to the items by a shuffle), each (pair, token) item's cos / sin and
  // fp8 scales
  if (warp == 0) {
    const TokenSlot mine = lane < nt ? token_slot(p, t0 + lane) : TokenSlot{-1, -1, -1};
    if (lane < TT) slots[lane] = mine;
#pragma unroll
    for (int it0 = 0; it0 < PAIRS * TT; it0 += 32) {
      const int it = it0 + lane, i = it / TT, t = it % TT;
      const int pos = __shfl_sync(0xffffffffu, mine.pos, t);
      float4 f = make_float4(1.f, 0.f, 1.f, 1.f);
      if (g0 + i < pairs_total) {
        const RowPair rp = lean_pair(p, h0, i0 + i, half_d, rope);
        if (rp.rot >= 0 && pos >= 0) {
          const float* cs = p.cos_sin + i64(pos) * p.cs_s0;
          f.x = cs[rp.rot];
          f.y = cs[(p.R >> 1) + rp.rot];
        }
        if constexpr (WF == W_FP8) {
          const float* ws = static_cast<const float*>(p.weight_scales);
          f.z = ws[rp.head * p.D + rp.da];
          f.w = ws[rp.head * p.D + rp.db];
        }
      }
      factors[it] = f;
    }
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;

  for (int vb = warp * RW; vb < nv; vb += WARPS * RW) {
    uint4 a[J][MT][2];
    [[maybe_unused]] unsigned sz[WF == W_INT4 ? J : 1][MT][2];  // 4-bit: scale | zero << 16
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int v = vb + 4 * j + c;
      const unsigned vl = unsigned(v < nv ? v : nv - 1);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[j][m][h] = ldg_stream_l2(wrow[m][h] + u64(vl) * 16u);
      if constexpr (WF == W_INT4) {
        const unsigned grp = vl * VALS / unsigned(p.group_size);
        const unsigned short* ws = static_cast<const unsigned short*>(p.weight_scales) + grp;
        const unsigned char* zp = static_cast<const unsigned char*>(p.zero_points);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned sb = ldg_u16(ws + u64(rows[m][h]) * unsigned(p.ws_s0));
            const unsigned z =
                zp != nullptr ? ldg_u8(zp + grp + u64(rows[m][h]) * unsigned(p.zp_s0)) & 0xFu
                              : 8u;
            sz[j][m][h] = sb | (z << 16);
          }
      }
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int v = vb + 4 * j + c;
      const bool on = v < nv;
      const unsigned vl = unsigned(on ? v : nv - 1);
      // B: the hidden values of tokens g (+ 8 n) at this load's k values; zero past the tile's
      // tokens and the row's end
      uint4 b[NT][UNITS];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int t = n * 8 + g;
        const bool here = on && t < nt;
        const T* xr = hidden + i64(min(t, nt - 1)) * p.hidden_s0 + i64(vl) * VALS;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
          uint4 q;
          if (x_vec) {
            q = *reinterpret_cast<const uint4*>(xr + 8 * u);
          } else {
            const unsigned short* hs = reinterpret_cast<const unsigned short*>(xr) + 8 * u;
            q = make_uint4(hs[0] | unsigned(hs[1]) << 16, hs[2] | unsigned(hs[3]) << 16,
                           hs[4] | unsigned(hs[5]) << 16, hs[6] | unsigned(hs[7]) << 16);
          }
          b[n][u] = here ? q : make_uint4(0, 0, 0, 0);
          if constexpr (WF == W_INT4) b[n][u] = int4_order(b[n][u]);
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if constexpr (WF == W_DENSE) {
          if (!on) a[j][m][0] = a[j][m][1] = make_uint4(0, 0, 0, 0);
        }
        unsigned csub[2] = {0, 0}, cscale[2] = {0, 0};
        if constexpr (WF == W_INT4) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            csub[h] = ((is_half<T>::value ? 0x6400u : 0x4300u) | (sz[j][m][h] >> 16)) * 0x10001u;
            cscale[h] = (sz[j][m][h] & 0xFFFFu) * 0x10001u;
          }
        }
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
          unsigned r[2][4];  // [h][pair]: unit u's 4 T pairs of rows g (h 0) and g + 8 (h 1)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            unit_pairs<T, WF, true>(a[j][m][h], u, csub[h], cscale[h], r[h]);
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const uint4 bb = b[n][u];
            mma16816<T>(acc[m][n], r[0][0], r[1][0], r[0][1], r[1][1], bb.x, bb.y);
            mma16816<T>(acc[m][n], r[0][2], r[1][2], r[0][3], r[1][3], bb.z, bb.w);
          }
        }
      }
    }
  }

  // the warps' sums to shared memory: red[w][16 m + row][token]
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int t = n * 8 + 2 * c;
      red[warp][16 * m + g][t] = acc[m][n][0];
      red[warp][16 * m + g][t + 1] = acc[m][n][1];
      red[warp][16 * m + g + 8][t] = acc[m][n][2];
      red[warp][16 * m + g + 8][t + 1] = acc[m][n][3];
    }
  __syncthreads();
  for (int it = threadIdx.x; it < PAIRS * TT; it += WARPS * 32) {
    const int i = it / TT, t = it % TT, ra = 16 * (i >> 3) + (i & 7);
    if (g0 + i >= pairs_total || t >= nt) continue;
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      a += red[w][ra][t];
      b += red[w][ra + 8][t];
    }
    const RowPair rp = lean_pair(p, h0, i0 + i, half_d, rope);
    const float4 f = factors[it];
    const TokenSlot tok = slots[t];
    a *= f.z;  // the fp8 scales (1 otherwise)
    b *= f.w;
    if (rp.rot >= 0 && tok.pos >= 0) rotate_pair(a, b, f.x, f.y);
    store_pair<T>(p, tok, t0 + t, rp, a, b);
  }
#endif
}

// ---- Small batches: tensor-core weight streaming, split-K over a thread-block cluster ------
//
// qkv_mma<T, WF, TN, S>: one cluster of S CTAs per tile of MMA_ROWS output rows (whole heads:
// the host makes D divide MMA_ROWS) and TN tokens; CTA `rank` of the cluster owns the K slice
// [rank * kc, (rank + 1) * kc). mma.sync m16n8k16 with the weight rows as M (16 rows a tile) and
// the tokens as N (8 a tile), float32 accumulation.
//
// Fragments straight from global memory: lane l (g = l / 4, c = l % 4) loads 16 bytes of weight
// row g and of row g + 8 (ld.global.nc, no shuffles) holding VALS consecutive k values
// [c * VALS, (c + 1) * VALS) of a chunk of 4 * VALS. The k order inside an mma does not change the
// sum, so each lane's A values (rows g, g + 8) and B values (token g) need only name the same k
// values at the same slots: the hidden rows are staged in shared memory in exactly that order, and
// every B fragment is one 16-byte shared load. fp8 and 4-bit weights are dequantized in registers
// to T before the mma (fp8 exactly, its per-row scale applied to the float32 sum; 4-bit as
// (q - zero) * scale rounded once to T, as the cuBLAS path's dequantization does).
//
// The cluster then reduces its S partial sums through distributed shared memory: each CTA
// stores its (TN, MMA_ROWS) float32 partial in its shared memory, and after a cluster barrier
// every CTA finishes a 1/S share of the tile's (token, row pair) items: the sum over the
// cluster, the fp8 weight scale, RoPE, Q to out, K/V to their pages (write_pair).
constexpr int MMA_WARPS = 4;
constexpr int MMA_ROWS = 128;          // rows per tile: 32 per warp (two m16 tiles)
constexpr int MMA_MT = MMA_ROWS / (16 * MMA_WARPS);
constexpr int MMA_PART_STRIDE = MMA_ROWS + 4;  // float32 partial row (conflict-free stores)
constexpr int MMA_REQ_CAP = 256;       // requests whose offsets and lengths go to shared memory

// ---- Shared by the two tensor-core kernels: token slots of a tile, the cluster's reduction ----

// 16 bytes from global to shared memory, asynchronously (cp.async); zeros and no read when !on.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool on) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(on ? 16 : 0) : "memory");
}


// The tile a CTA works on: rows [row0, row0 + MMA_ROWS), tokens [t0, t0 + nt), the K slice
// [kbeg, kbeg + klen) of its rank in the cluster (cluster dims (S, 1, 1)). The token tiles of a
// row tile are adjacent in the grid, so they share the weights in L2.
struct ClusterTile {
  int rank, row0, t0, nt, kbeg, klen;
};

template <int TN>
__device__ __forceinline__ ClusterTile cluster_tile(const QkvParams& p) {
  ClusterTile r;
  r.rank = blockIdx.x;
  const int tiles_t = (p.T + TN - 1) / TN;
  r.row0 = (blockIdx.y / tiles_t) * MMA_ROWS;
  r.t0 = (blockIdx.y % tiles_t) * TN;
  r.nt = min(TN, p.T - r.t0);
  r.kbeg = r.rank * p.kc;
  r.klen = max(0, min(p.kc, p.K - r.kbeg));
  return r;
}

// Offsets and cache lengths into shared memory when B is small (MMA_REQ_CAP requests at most),
// so that the request search runs there: whether they went.
__device__ __forceinline__ bool stage_requests(const QkvParams& p, unsigned* off, int* len) {
  if (p.B > MMA_REQ_CAP) return false;
  for (int i = threadIdx.x; i <= p.B; i += blockDim.x) {
    off[i] = p.offsets[i];
    if (i < p.B) len[i] = p.cache_lengths[i];
  }
  return true;
}

// Token t's request search (threads < TN, before the main loop) and its block-table load, issued
// at once but first used after the main loop (finish_slot), so that neither stalls the stream.
struct PendingSlot {
  PagedSlot s;
  i64 bt_index;
  int bt_page;
};

__device__ __forceinline__ PendingSlot pending_slot(const QkvParams& p, const unsigned* offsets,
                                                    const int* lengths, int t, bool live) {
  PendingSlot r{live ? ragged_position(offsets, lengths, p.B, t) : PagedSlot{-1, -1, -1, 0}, 0,
                -1};
  if (r.s.request >= 0 && r.s.pos >= 0) {
    r.bt_index = div_pos(r.s.pos, p.page_size);
    if (r.bt_index < p.max_pages) r.bt_page = p.block_table[r.s.request * p.bt_s0 + r.bt_index];
  }
  return r;
}

// The token's slot (slots[i]) and, OPTS, the rows it clears (rests[i]); offsets as the search
// read them (shared or global memory).
template <bool OPTS>
__device__ __forceinline__ void finish_slot(const QkvParams& p, const PendingSlot& ps,
                                            const unsigned* offsets, int i, int t,
                                            TokenSlot* slots, int* rests) {
  const PagedSlot& slot = ps.s;
  TokenSlot r{-1, -1, -1};
  int entry = 0;
  if (slot.request >= 0 && slot.pos >= 0 && (!p.cos_sin || slot.pos < p.P) &&
      slot.pos <= 0x7fffffff) {
    r.pos = int(slot.pos);
    if (ps.bt_index < p.max_pages && ps.bt_page >= 0 && ps.bt_page < p.num_pages) {
      entry = int(slot.pos - ps.bt_index * p.page_size);
      r.k_off = i64(ps.bt_page) * p.k_page + i64(entry) * p.k_entry;
      r.v_off = i64(ps.bt_page) * p.v_page + i64(entry) * p.v_entry;
    }
  }
  slots[i] = r;
  if constexpr (OPTS) rests[i] = rest_of_page(p, offsets, slot, r, entry, t);
}

// Token addressing of a tile while its first stages land (qkv_mma_tiled, qkv_wgmma): offsets and
// cache lengths into shared memory (when B is small), status= validated before anything is
// written, and threads < TN start their token's request search and block-table load (finished
// after the main loop by finish_slot). `offsets` is where the search reads them. False when the
// check fails: every CTA of the cluster must then return, its copies drained here.
template <bool OPTS, int TN>
__device__ __forceinline__ bool tile_addressing(const QkvParams& p, unsigned* req_off,
                                                int* req_len, int t0, int nt,
                                                const unsigned*& offsets, PendingSlot& slot) {
  const bool req_smem = stage_requests(p, req_off, req_len);
  __syncthreads();
  offsets = req_smem ? req_off : p.offsets;
  if (!qkv_check<OPTS>(p, offsets)) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    return false;
  }
  if (threadIdx.x < TN) {
    slot = pending_slot(p, offsets, req_smem ? req_len : p.cache_lengths, t0 + threadIdx.x,
                        int(threadIdx.x) < nt);
  }
  return true;
}

// clear_unused_last_page_rows in the cluster epilogue: the rows each token of the tile clears
// (rests[t], after its own on its page) at every K and V head, zeroed in 16-byte chunks. A token
// tile's rows are shared by the CTAs of all its row tiles (they reach their epilogues together,
// and no cleared row is any tile's output), not left to the few that own K / V rows: warp w of
// those W warps takes the (token, head) rows w, w + W, ... Its lanes cover 32 / chunks rows of
// `chunks` 16-byte chunks at a time (chunks = D x element size / 16: a power of two up to 16, as
// D divides MMA_ROWS), with no division in the row loop. A row that does not start 16-byte
// aligned (a strided cache view) is zeroed byte by byte.
template <typename T>
__device__ __forceinline__ void clear_rests(const QkvParams& p, const TokenSlot* slots,
                                            const int* rests, int row0, int nt, int rank,
                                            int S) {
  const int es = p.cache_code == 0 ? int(sizeof(T)) : 1;
  const int row_bytes = p.D * es;
  const int lc = row_bytes > 16 ? __ffs(row_bytes >> 4) - 1 : 0;  // log2(chunks)
  const int lane = threadIdx.x & 31;
  const int sub = lane >> lc, b0 = (lane & ((1 << lc) - 1)) << 4;  // the lane's row, bytes
  const int nb = min(16, row_bytes - b0);
  const int warps = blockDim.x >> 5;
  const int tiles_r = (p.N + MMA_ROWS - 1) / MMA_ROWS;
  const int W = tiles_r * S * warps;
  const int heads = 2 * p.Hkv;
  for (int w = ((row0 / MMA_ROWS) * S + rank) * warps + (threadIdx.x >> 5); w < nt * heads;
       w += W) {
    const int t = w / heads, h = w - t * heads;
    const int rest = rests[t];
    if (rest <= 0) continue;
    const i64 step = (h < p.Hkv ? p.k_entry : p.v_entry) * es;
    unsigned char* base = rest_row<T>(p, slots[t], p.Hq + h, 0);
    for (int r = 1 + sub; r <= rest; r += 32 >> lc) {
      unsigned char* row = base + r * step;
      if (nb == 16 && (reinterpret_cast<unsigned long long>(row) & 15) == 0) {
        *reinterpret_cast<uint4*>(row + b0) = make_uint4(0u, 0u, 0u, 0u);
      } else {
        for (int b = 0; b < nb; ++b) row[b0 + b] = 0;
      }
    }
  }
}

// The cluster's reduction and the epilogue. Every CTA has stored its (TN, MMA_ROWS) float32
// partial sums in `part` (row stride MMA_PART_STRIDE) and its token slots; after a cluster
// barrier each CTA finishes a 1/S share of the tile's (token, row pair) items: the sum over the
// cluster (mapa + ld.shared::cluster), the fp8 weight scale, RoPE, Q to out, K/V to their pages
// (write_pair); OPTS, the rows the tokens clear (clear_rests). A last cluster barrier keeps
// every CTA's shared memory alive until all have read. VEC: items of four pairs where the head
// allows (below), their runs stored as vectors (write_run: scalar stores were 3.3 of the 7.7 us
// the epilogue took at 256 tokens); qkv_mma keeps one pair an item: its tiles are of at most 16
// tokens at the token counts it serves, and the vector loop's registers made it spill more (8%
// slower at 16 tokens with fp8 weights).
template <typename T, int WF, int S, bool OPTS, bool VEC>
__device__ __forceinline__ void cluster_epilogue(const QkvParams& p, const float* part,
                                                 const TokenSlot* slots, const int* rests,
                                                 int row0, int t0, int nt, int rank) {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
  const bool rope = p.cos_sin != nullptr;
  const unsigned part_addr = static_cast<unsigned>(__cvta_generic_to_shared(part));
  unsigned remote[S];
#pragma unroll
  for (int r = 0; r < S; ++r)
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote[r]) : "r"(part_addr), "r"(r));
  constexpr int PAIRS = MMA_ROWS / 2;
  const int pairs_total = p.N >> 1;
  // Four pairs an item where they come as two runs of 4 rows (neox, rotated pairs: rows
  // da .. da + 3 and db .. db + 3) or one run of 8 (interleaved and pass-through pairs: da, db
  // alternating): every head a whole number of 8-row runs (D % 8 == 0) and the rotated dims too
  // (R % 8 == 0), so no run crosses a head or the rotary boundary. Their partial sums are read as
  // float4s from each CTA of the cluster, and all loads of an item are issued before its first
  // use: a quarter of the items, each waiting once.
  if (VEC && p.D % 8 == 0 && (!rope || p.R % 8 == 0)) {
    constexpr int V = 4, ITEMS = PAIRS / V;
    for (int w = rank * blockDim.x + threadIdx.x; w < nt * ITEMS; w += S * blockDim.x) {
      const int t = w / ITEMS, m = w - t * ITEMS;
      const int gp = (row0 >> 1) + m * V;
      if (gp >= pairs_total) continue;  // (N / 2 is a multiple of 4: the item is whole)
      const RowPair rp = row_pair(gp, p.D, p.R, p.Hq, p.Hkv, rope, p.is_neox);
      const bool split = rp.db != rp.da + 1;  // two runs of 4, else one of 8
      const int na = rp.head * p.D + rp.da;
      const int nb = split ? rp.head * p.D + rp.db : na + 4;
      const unsigned oa = unsigned(t * MMA_PART_STRIDE + na - row0) * 4u;
      const unsigned ob = unsigned(t * MMA_PART_STRIDE + nb - row0) * 4u;
      const TokenSlot tok = slots[t];
      const bool rot = rp.rot >= 0 && tok.pos >= 0;
      float c[V], sn[V];
      if (rot) {
        const float* cs = p.cos_sin + i64(tok.pos) * p.cs_s0 + rp.rot;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          c[j] = cs[j];
          sn[j] = cs[(p.R >> 1) + j];
        }
      }
      float4 x[S], y[S];
#pragma unroll
      for (int r = 0; r < S; ++r) {
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(x[r].x), "=f"(x[r].y), "=f"(x[r].z), "=f"(x[r].w)
                     : "r"(remote[r] + oa));
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(y[r].x), "=f"(y[r].y), "=f"(y[r].z), "=f"(y[r].w)
                     : "r"(remote[r] + ob));
      }
      float4 sx = x[0], sy = y[0];
#pragma unroll
      for (int r = 1; r < S; ++r) {
        sx.x += x[r].x; sx.y += x[r].y; sx.z += x[r].z; sx.w += x[r].w;
        sy.x += y[r].x; sy.y += y[r].y; sy.z += y[r].z; sy.w += y[r].w;
      }
      // the pairs' (a, b): split, rows na + j and nb + j; else rows na + 2j and na + 2j + 1
      float a[V] = {sx.x, sx.y, sx.z, sx.w}, b[V] = {sy.x, sy.y, sy.z, sy.w};
      if (!split) {
        a[0] = sx.x; b[0] = sx.y; a[1] = sx.z; b[1] = sx.w;
        a[2] = sy.x; b[2] = sy.y; a[3] = sy.z; b[3] = sy.w;
      }
      if constexpr (WF == W_FP8) {
        const float* ws = static_cast<const float*>(p.weight_scales);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          a[j] *= ws[split ? na + j : na + 2 * j];
          b[j] *= ws[split ? nb + j : na + 2 * j + 1];
        }
      }
      if (rot) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xa = a[j], yb = b[j];
          a[j] = xa * c[j] - yb * sn[j];
          b[j] = yb * c[j] + xa * sn[j];
        }
      }
      if (split) {  // rows na .. na + 3 and nb .. nb + 3
        write_run<T, V>(p, tok, t0 + t, rp.head, rp.da, a);
        write_run<T, V>(p, tok, t0 + t, rp.head, rp.db, b);
      } else {  // rows na .. na + 7, the pairs' elements alternating
        const float v[2 * V] = {a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]};
        write_run<T, 2 * V>(p, tok, t0 + t, rp.head, rp.da, v);
      }
    }
  } else {
    for (int w = rank * blockDim.x + threadIdx.x; w < nt * PAIRS; w += S * blockDim.x) {
      const int t = w / PAIRS, pl = w - t * PAIRS;
      const int gp = (row0 >> 1) + pl;
      if (gp >= pairs_total) continue;
      const RowPair rp = row_pair(gp, p.D, p.R, p.Hq, p.Hkv, rope, p.is_neox);
      const int na = rp.head * p.D + rp.da, nb = rp.head * p.D + rp.db;
      const unsigned oa = unsigned(t * MMA_PART_STRIDE + na - row0) * 4u;
      const unsigned ob = unsigned(t * MMA_PART_STRIDE + nb - row0) * 4u;
      float va[S], vb[S];
#pragma unroll
      for (int r = 0; r < S; ++r) {
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(va[r]) : "r"(remote[r] + oa));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(vb[r]) : "r"(remote[r] + ob));
      }
      float sa = 0.f, sb = 0.f;
#pragma unroll
      for (int r = 0; r < S; ++r) {
        sa += va[r];
        sb += vb[r];
      }
      if constexpr (WF == W_FP8) {
        const float* ws = static_cast<const float*>(p.weight_scales);
        sa *= ws[na];
        sb *= ws[nb];
      }
      write_pair<T>(p, slots[t], t0 + t, rp, sa, sb);
    }
  }
  if constexpr (OPTS) {
    if (p.clear) clear_rests<T>(p, slots, rests, row0, nt, rank, S);
  }
  // no CTA leaves while another may still read its shared memory
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

// clusters exist from sm_90 on; the sm_80 build keeps an empty kernel (the host never picks it)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MMA_CLUSTER_DIMS
#else
#define MMA_CLUSTER_DIMS __cluster_dims__(S, 1, 1)
#endif

// S: CTAs per cluster, along K (the host picks it to fill the GPCs, see qkv.py).
// OPTS: status= validates the offsets once the first weight loads are in flight, before the main
// loop (every CTA of every cluster, so all of a cluster's CTAs return together on failure); the
// last token of a request clears the rest of its page in the epilogue (clear_rests).
// FORM (4-bit weights; 0 for the others, where it changes nothing), MMA_FORM in qkv.py:
//   bit 0 (4-bit): a load's group scale and zero point kept as one 32-bit word (the scale's bits
//     | the zero << 16) until its chunk is consumed, its T pairs (offset + zero, scale) built
//     there with two integer ops each (as the float conversion of 0 did per load: I2F, FADD,
//     F2F and a pack); the same pairs, so the same results bit for bit. Holds 8 registers fewer.
//   bit 2 (4-bit): a word of 8 codes dequantized four pairs at once (int4_pairs: one LOP3 a
//     pair, the odd pairs' q - zero by one exact hfma2, fp16; bf16 as int4_pair), the same pairs.
template <typename T, int WF, int TN, int S, bool OPTS, int FORM>
__global__ void MMA_CLUSTER_DIMS
__launch_bounds__(MMA_WARPS * 32, WF != W_DENSE && TN == 64 ? 3 : 4)
    qkv_mma(const QkvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_launch_dependents();
  pdl_wait();
  constexpr int VALS = WF == W_DENSE ? 8 : WF == W_FP8 ? 16 : 32;  // k values per 16-byte load
  constexpr int CH = 4 * VALS;                                    // k values per chunk (a quad)
  constexpr int UNITS = VALS / 8;  // 16-byte units (8 T values) of B per lane and chunk
  constexpr int NT = TN / 8;
  // chunks in flight per lane (registers: 168 at most for 3 CTAs an SM)
  constexpr int U = WF == W_INT4 ? 2 : TN <= 32 ? 4 : 2;
  extern __shared__ __align__(16) unsigned char mma_smem[];
  T* xs = reinterpret_cast<T*>(mma_smem);           // (TN, xs_stride): the hidden slice
  float* part = reinterpret_cast<float*>(mma_smem);  // after the main loop: (TN, PART_STRIDE)
  __shared__ TokenSlot slots[TN];
  __shared__ int rests[OPTS ? TN : 1];  // OPTS: the rows each token clears (rest_of_page)
  __shared__ unsigned req_off[MMA_REQ_CAP + 1];  // offsets and cache lengths when B is small
  __shared__ int req_len[MMA_REQ_CAP];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const ClusterTile tile = cluster_tile<TN>(p);
  const int rank = tile.rank, row0 = tile.row0, t0 = tile.t0, nt = tile.nt, kbeg = tile.kbeg;
  const int klen = tile.klen;
  const int nchunks = (klen + CH - 1) / CH;
  // The hidden slice is staged sw k values at a time (shared memory for 4 CTAs an SM at TN 64);
  // sw is a multiple of the U chunks a step consumes, or the whole slice. Row stride 64 bytes
  // mod 128, so the 8 token rows of a B load hit distinct banks.
  constexpr int XW = TN <= 16 ? 1024 : TN == 32 ? 512 : 256;
  const int sw = min(XW, p.kc);
  const int xs_stride = sw % 64 == 0 ? sw + 32 : sw;

  // ---- weight loads: U chunks in flight, refilled as they are consumed
  const unsigned char* wrow[MMA_MT][2];
  bool wlive[MMA_MT][2];
  int wn[MMA_MT][2];
#pragma unroll
  for (int m = 0; m < MMA_MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row0 + warp * (16 * MMA_MT) + m * 16 + h * 8 + g;
      wn[m][h] = n;
      wlive[m][h] = n < p.N;
      wrow[m][h] = static_cast<const unsigned char*>(p.weight) +
                   i64(wlive[m][h] ? n : 0) * p.weight_row_bytes;
    }
  uint4 a[U][MMA_MT][2];
  constexpr bool SZ = WF == W_INT4 && (FORM & 1);  // 4-bit: scale | zero << 16, one word a load
  // SZ and FORM bit 3: each row's scale and zero-point offsets once, 32-bit (the host drops the
  // bit where one could reach 2^31), a load's group by fast_div: no 64-bit products, parameter
  // reloads or division a load
  constexpr bool SZ32 = SZ && (FORM & 8);
  unsigned zsub[U][MMA_MT][2], zscale[U][MMA_MT][2];  // 4-bit: (offset + zero, scale) T pairs
  unsigned sz[U][MMA_MT][2];                          // SZ: instead of those
  unsigned srow[SZ32 ? MMA_MT : 1][2], zrow[SZ32 ? MMA_MT : 1][2];  // SZ32: row offsets
  if constexpr (SZ32) {
#pragma unroll
    for (int m = 0; m < MMA_MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        srow[m][h] = unsigned(wlive[m][h] ? wn[m][h] : 0) * unsigned(p.ws_s0);
        zrow[m][h] = unsigned(wlive[m][h] ? wn[m][h] : 0) * unsigned(p.zp_s0);
      }
  }
  auto issue = [&](int u, int ci) {
    const int k = kbeg + ci * CH + c * VALS;
    const bool on = ci < nchunks && k < kbeg + klen;
    [[maybe_unused]] unsigned grp32 = 0;
    if constexpr (SZ32) grp32 = fast_div(unsigned(k), p.g_magic, p.g_shift);
#pragma unroll
    for (int m = 0; m < MMA_MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool live = on && wlive[m][h];
        const i64 byte = WF == W_DENSE ? i64(k) * 2 : WF == W_FP8 ? i64(k) : i64(k >> 1);
        a[u][m][h] = live ? ldg_stream(wrow[m][h] + byte) : make_uint4(0, 0, 0, 0);
        if constexpr (SZ32) {
          const unsigned sb =
              live ? unsigned(static_cast<const unsigned short*>(
                         p.weight_scales)[srow[m][h] + grp32])
                   : 0u;  // scale 0: the (never consumed) chunk's products are 0
          const unsigned z =
              live && p.zero_points
                  ? unsigned(static_cast<const unsigned char*>(p.zero_points)[zrow[m][h] + grp32]) &
                        0xFu
                  : 8u;
          sz[u][m][h] = sb | (z << 16);
        } else if constexpr (SZ) {
          const int grp = k / p.group_size;
          const unsigned sb =
              live ? unsigned(static_cast<const unsigned short*>(
                         p.weight_scales)[i64(wn[m][h]) * p.ws_s0 + grp])
                   : 0u;  // scale 0: the (never consumed) chunk's products are 0
          const unsigned z = live && p.zero_points
                                 ? unsigned(static_cast<const unsigned char*>(
                                       p.zero_points)[i64(wn[m][h]) * p.zp_s0 + grp]) &
                                       0xFu
                                 : 8u;
          sz[u][m][h] = sb | (z << 16);
        } else if constexpr (WF == W_INT4) {
          const int grp = k / p.group_size;
          const T s = live ? static_cast<const T*>(p.weight_scales)[i64(wn[m][h]) * p.ws_s0 + grp]
                           : from_float<T>(0.f);
          const float z = live && p.zero_points
                              ? float(static_cast<const unsigned char*>(
                                          p.zero_points)[i64(wn[m][h]) * p.zp_s0 + grp] &
                                      0xF)
                              : 8.f;
          const unsigned short sb = *reinterpret_cast<const unsigned short*>(&s);
          zscale[u][m][h] = unsigned(sb) | (unsigned(sb) << 16);
          zsub[u][m][h] = pair_of<T>((is_half<T>::value ? 1024.f : 128.f) + z);
        }
      }
  };
#pragma unroll
  for (int u = 0; u < U; ++u) issue(u, u);

  // Token addressing without stalling the stream: offsets and cache lengths are read into shared
  // memory with the first hidden stage (one round trip for all), the request search runs there,
  // and the block-table load of each token is issued at once but first used in the epilogue.
  const bool req_smem = stage_requests(p, req_off, req_len);
  if constexpr (OPTS) {
    if (p.check) {
      __syncthreads();  // the staged offsets are readable
      if (!qkv_check<OPTS>(p, req_smem ? req_off : p.offsets)) return;
    }
  }
  // Stage the slice offsets [s0, s0 + sw) of the hidden rows (cp.async, zero past T and K): the
  // 16-byte unit of k values [8u, 8u + 8) of lane c's share of chunk ch lands at
  // ch * CH + u * 32 + c * 8, where lane c's B load of unit u finds it.
  auto stage = [&](int s0) {
    const T* hidden = static_cast<const T*>(p.hidden);
    const int units_row = sw >> 3;
    for (int i = threadIdx.x; i < TN * units_row; i += blockDim.x) {
      const int t = i / units_row, kq = (i - t * units_row) * 8;  // offset in the stage
      const bool on = t < nt && s0 + kq < klen;
      const T* src = on ? hidden + i64(t0 + t) * p.hidden_s0 + kbeg + s0 + kq : hidden;
      const int ch = kq / CH, pos = kq - ch * CH, lc = pos / VALS, j = (pos - lc * VALS) >> 3;
      const unsigned dst = static_cast<unsigned>(
          __cvta_generic_to_shared(xs + t * xs_stride + ch * CH + j * 32 + lc * 8));
      cp_async16(dst, src, on);
    }
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
  };

  float acc[MMA_MT][NT][4] = {};

  PendingSlot slot{{-1, -1, -1, 0}, 0, -1};  // threads < TN: token t0 + threadIdx.x
  if (nchunks == 0 && threadIdx.x < TN) {  // an empty K slice
    slot = pending_slot(p, p.offsets, p.cache_lengths, t0 + threadIdx.x, int(threadIdx.x) < nt);
  }
  int sbase = 0;  // slice offset of the staged k values
  for (int base = 0; base < nchunks; base += U) {
    if ((base * CH) % sw == 0) {  // the next sw values (the weights keep streaming meanwhile)
      if (base) __syncthreads();
      sbase = base * CH;
      stage(sbase);
      __syncthreads();
      if (base == 0 && threadIdx.x < TN) {  // the request search, the block-table load issued
        slot = pending_slot(p, req_smem ? req_off : p.offsets,
                            req_smem ? req_len : p.cache_lengths, t0 + threadIdx.x,
                            int(threadIdx.x) < nt);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ci = base + u;
      if (ci >= nchunks) break;
      unsigned csub[MMA_MT][2], cscale[MMA_MT][2];  // 4-bit: this chunk's T pairs
      if constexpr (WF == W_INT4) {
#pragma unroll
        for (int m = 0; m < MMA_MT; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (SZ) {  // 2^10 + zero (fp16) or 2^7 + zero (bf16): exact, ulp 1 there
              csub[m][h] = ((is_half<T>::value ? 0x6400u : 0x4300u) | (sz[u][m][h] >> 16)) *
                           0x10001u;
              cscale[m][h] = (sz[u][m][h] & 0xFFFFu) * 0x10001u;
            } else {
              csub[m][h] = zsub[u][m][h];
              cscale[m][h] = zscale[u][m][h];
            }
          }
      }
#pragma unroll
      for (int j = 0; j < UNITS; ++j) {
        // A fragments of unit j (two mmas): af[m][s][0..3] for mma s of the unit
        unsigned af[MMA_MT][2][4];
#pragma unroll
        for (int m = 0; m < MMA_MT; ++m) {
          unsigned r[2][4];  // [h][pair]: the unit's 4 T pairs of rows g (h 0) and g + 8 (h 1)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            unit_pairs<T, WF, (FORM & 4) != 0>(a[u][m][h], j, csub[m][h], cscale[m][h], r[h]);
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            af[m][s][0] = r[0][2 * s];
            af[m][s][1] = r[1][2 * s];
            af[m][s][2] = r[0][2 * s + 1];
            af[m][s][3] = r[1][2 * s + 1];
          }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          uint4 b = *reinterpret_cast<const uint4*>(xs + (n * 8 + g) * xs_stride +
                                                    ci * CH - sbase + j * 32 + c * 8);
          if constexpr (WF == W_INT4) b = int4_order(b);
#pragma unroll
          for (int m = 0; m < MMA_MT; ++m) {
            mma16816<T>(acc[m][n], af[m][0][0], af[m][0][1], af[m][0][2], af[m][0][3], b.x, b.y);
            mma16816<T>(acc[m][n], af[m][1][0], af[m][1][1], af[m][1][2], af[m][1][3], b.z, b.w);
          }
        }
      }
      issue(u, ci + U);
    }
  }

  // ---- token slots finished (the block-table load has long landed), partial sums to shared
  // memory, then the cluster's reduction and the epilogue
  if (threadIdx.x < TN) {
    finish_slot<OPTS>(p, slot, req_smem && nchunks > 0 ? req_off : p.offsets, threadIdx.x,
                      t0 + threadIdx.x, slots, rests);
  }
  __syncthreads();  // every warp is done with xs
#pragma unroll
  for (int m = 0; m < MMA_MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int rl = warp * (16 * MMA_MT) + m * 16 + g, tt = n * 8 + 2 * c;
      part[tt * MMA_PART_STRIDE + rl] = acc[m][n][0];
      part[(tt + 1) * MMA_PART_STRIDE + rl] = acc[m][n][1];
      part[tt * MMA_PART_STRIDE + rl + 8] = acc[m][n][2];
      part[(tt + 1) * MMA_PART_STRIDE + rl + 8] = acc[m][n][3];
    }
  cluster_epilogue<T, WF, S, OPTS, false>(p, part, slots, rests, row0, t0, nt, rank);
#endif
}

// ---- Larger batches: both operands staged in shared memory --------------------------------
//
// qkv_mma_tiled<T, WF, TN, S, STAGES, KG>: the tiles, the cluster split of K and the epilogue of
// qkv_mma, but the weights are no longer held by one warp each: a CTA stages BK k values of its
// MMA_ROWS weight rows (128 bytes a row: 64 fp16 / bf16 values or 128 fp8 ones) and of its TN
// hidden rows per stage (cp.async, STAGES stages in the ring), and its 2 x TN / 32 x KG warps
// share them, each computing 64 rows x 32 tokens of a 1/KG share of each stage's k values from
// ldmatrix fragments (the KG groups' sums added at the end). Each staged weight byte feeds
// TN / 32 warps, where qkv_mma streams every token tile's weights through registers again.
// Staged rows hold 16-byte chunks, chunk c of row r at c ^ (r % 8): the 8 rows an ldmatrix phase
// reads fall in 8 different bank groups. Rows past N, tokens past the tile and k values past the
// slice are zero-filled (no read); the host makes every slice a whole number of stages.
//
// fp8 weights: an ldmatrix of the fp8 tile gives lane (g, c) the 4 values k = 4c .. 4c + 3 of
// rows g and g + 8 (and 16 + 4c .. of the next 16 k values), converted exactly to T pairs. The k
// order inside an mma does not change its sum, so the mma's k slots (2c, 2c + 1) and (2c + 8,
// 2c + 9) stand for k = (4c, 4c + 1) and (4c + 2, 4c + 3): the hidden values of those k are one
// 8-byte shared load. The per-row scale is applied to the float32 sum (cluster_epilogue).
//
// 4-bit weights: a stage holds BK = 128 k values as 64-byte weight rows (4 chunks of 32 values;
// chunk c of row r at c ^ (r / 2 % 4): the 8 rows of an ldmatrix phase, two per 128 bytes, fall
// in 8 bank groups). An ldmatrix 32-bit element gives lane (g, c) the 8 nibbles k = 8c .. 8c + 7
// of a chunk (rows g and g + 8), which int4_pair turns into the T pairs (8c + i, 8c + i + 4),
// i < 4: two mmas, whose k slots (2c, 2c + 1) and (2c + 8, 2c + 9) stand for k (8c + 2s,
// 8c + 2s + 4) and (8c + 2s + 1, 8c + 2s + 5) in mma s. The hidden values of k 8c .. 8c + 7 are one
// 16-byte shared load (chunk c ^ (4 (r % 2) + r / 2 % 4) of token row r: the two rows of a
// quarter warp in different bank groups), permuted as in qkv_mma. Each stage also holds, per
// weight row and chunk, the chunk's group's scale and offset + zero as T pairs (8 bytes; the
// chunk lies in one group, G being a multiple of 32), which the threads load from global memory
// a stage ahead (when they issue the stage's copies) and store when the next stage is issued.
// w = (q - zero) * scale is rounded once to T, as in qkv_mma; rows past N have scale 0.
constexpr int TILED_WM = 64, TILED_WN = 32;  // a warp's rows and tokens

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint2 lds64(unsigned addr) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(addr));
  return r;
}

__device__ __forceinline__ uint4 lds128(unsigned addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr));
  return r;
}

// Byte offset of 16-byte chunk ch of row r in a staged tile of ROW-byte rows.
template <int ROW>
__device__ __forceinline__ unsigned tiled_at(int r, int ch) {
  return unsigned(r * ROW + ((ch ^ (r & 7)) << 4));
}

// 4-bit stages: the same for the 64-byte weight rows and for the 256-byte hidden rows (see above).
__device__ __forceinline__ unsigned int4_a_at(int r, int ch) {
  return unsigned(r * 64 + ((ch ^ ((r >> 1) & 3)) << 4));
}
__device__ __forceinline__ unsigned int4_b_at(int r, int ch) {
  return unsigned(r * 256 + ((ch ^ (((r & 1) << 2) | ((r >> 1) & 3))) << 4));
}
template <int WF, int ROW>
__device__ __forceinline__ unsigned a_at(int r, int ch) {
  if constexpr (WF == W_INT4) {
    return int4_a_at(r, ch);
  } else {
    return tiled_at<ROW>(r, ch);
  }
}
template <int WF, int ROW>
__device__ __forceinline__ unsigned b_at(int r, int ch) {
  if constexpr (WF == W_INT4) {
    return int4_b_at(r, ch);
  } else {
    return tiled_at<ROW>(r, ch);
  }
}

template <typename T, int WF, int TN, int S, int STAGES, int KG, bool OPTS>
__global__ void MMA_CLUSTER_DIMS
__launch_bounds__(TN * 2 * KG,
                  TN * KG >= (WF == W_INT4 ? 128 : 256) ? 1 : TN * KG >= 64 ? 2 : 4)
    qkv_mma_tiled(const QkvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_launch_dependents();
  pdl_wait();
  constexpr bool FP8 = WF == W_FP8, INT4 = WF == W_INT4;
  constexpr int BK = WF == W_DENSE ? 64 : 128;  // k values per stage
  constexpr int A_ROW = INT4 ? 64 : 128, B_ROW = BK * 2;  // staged row bytes
  constexpr int THREADS = TN * 2 * KG;
  constexpr int WARPS_N = TN / TILED_WN;               // warps along the tokens (2 along rows)
  // k steps of a stage per warp (32 bytes of a weight row: 16 k values, 32 fp8, 64 4-bit)
  constexpr int KSTEPS = A_ROW / 32 / KG;
  constexpr int MT = TILED_WM / 16, NT = TILED_WN / 8;  // mma tiles of a warp
  constexpr int A_CHUNKS = A_ROW / 16, B_CHUNKS = B_ROW / 16;
  constexpr int A_BYTES = MMA_ROWS * A_ROW;
  // 4-bit: per weight row and chunk of 32 k values, {scale, offset + zero} as T pairs
  constexpr int S_CHUNKS = INT4 ? BK / 32 : 0, S_ENTRIES = MMA_ROWS * S_CHUNKS;
  constexpr int S_LOADS = INT4 ? S_ENTRIES / THREADS : 0;  // entries per thread and stage
  constexpr int STAGE_BYTES = A_BYTES + TN * B_ROW + S_ENTRIES * 8;
  constexpr int A_STEP = THREADS / A_CHUNKS, B_STEP = THREADS / B_CHUNKS;  // rows apart
  constexpr int A_LOADS = MMA_ROWS / A_STEP, B_LOADS = TN / B_STEP;
  static_assert(MMA_ROWS == 2 * TILED_WM && A_LOADS * A_STEP == MMA_ROWS &&
                B_LOADS * B_STEP == TN && KSTEPS * KG * 32 == A_ROW &&
                S_LOADS * THREADS == S_ENTRIES && THREADS % 4 == 0, "tile shape");
  extern __shared__ __align__(16) unsigned char mma_smem[];
  float* part = reinterpret_cast<float*>(mma_smem);  // after the main loop: (TN, PART_STRIDE)
  __shared__ TokenSlot slots[TN];
  __shared__ int rests[OPTS ? TN : 1];
  __shared__ unsigned req_off[MMA_REQ_CAP + 1];
  __shared__ int req_len[MMA_REQ_CAP];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int kg = warp / (2 * WARPS_N), wk = warp - kg * 2 * WARPS_N;
  const int wm = wk / WARPS_N, wn = wk - wm * WARPS_N;
  const ClusterTile tile = cluster_tile<TN>(p);
  const int rank = tile.rank, row0 = tile.row0, t0 = tile.t0, nt = tile.nt, kbeg = tile.kbeg;
  const int kend = kbeg + tile.klen;
  const int nk = (kend - kbeg + BK - 1) / BK;
  const unsigned smem0 = static_cast<unsigned>(__cvta_generic_to_shared(mma_smem));

  // Each thread copies one chunk column of rows r, r + STEP, ... of every stage, k advancing by
  // a stage: the weights' chunk of BK / A_CHUNKS k values, the hidden rows' of 8.
  const int ra = threadIdx.x / A_CHUNKS, ca = threadIdx.x % A_CHUNKS;
  const int rb = threadIdx.x / B_CHUNKS, cb = threadIdx.x % B_CHUNKS;
  const int ka = kbeg + ca * (BK / A_CHUNKS), kb = kbeg + cb * 8;
  const unsigned char* a_src = static_cast<const unsigned char*>(p.weight) +
                               i64(row0 + ra) * p.weight_row_bytes +
                               (INT4 ? i64(ka) / 2 : i64(ka) * (FP8 ? 1 : 2));
  const i64 a_step = i64(A_STEP) * p.weight_row_bytes;
  const unsigned char* b_src = static_cast<const unsigned char*>(p.hidden) +
                               (i64(t0 + rb) * p.hidden_s0 + kb) * 2;
  const i64 b_step = i64(B_STEP) * p.hidden_s0 * 2;
  auto load = [&](int stage, int ks) {
    const unsigned base = smem0 + stage * STAGE_BYTES;
    const int dk = ks * BK;
#pragma unroll
    for (int j = 0; j < A_LOADS; ++j) {
      const bool on = ka + dk < kend && row0 + ra + j * A_STEP < p.N;
      cp_async16(base + a_at<WF, A_ROW>(ra + j * A_STEP, ca),
                 on ? a_src + j * a_step + (INT4 ? dk / 2 : dk * (FP8 ? 1 : 2)) : p.weight, on);
    }
#pragma unroll
    for (int j = 0; j < B_LOADS; ++j) {
      const bool on = kb + dk < kend && rb + j * B_STEP < nt;
      cp_async16(base + A_BYTES + b_at<WF, B_ROW>(rb + j * B_STEP, cb),
                 on ? b_src + j * b_step + dk * 2 : p.hidden, on);
    }
  };
  // 4-bit: thread i loads the entries of chunk i % 4 of rows i / 4 + j * THREADS / 4 of a stage
  // (the scale's bits and the zero point; 0 and anything past N or the slice) into registers
  // (scale_issue), and stores them as T pairs when the next stage is issued (scale_store).
  unsigned s_bits[S_LOADS > 0 ? S_LOADS : 1], s_zero[S_LOADS > 0 ? S_LOADS : 1];
  auto scale_issue = [&](int ks) {
    if constexpr (INT4) {
      const int k = kbeg + ks * BK + (threadIdx.x & 3) * 32;
      const int grp = k / p.group_size;
#pragma unroll
      for (int j = 0; j < S_LOADS; ++j) {
        const int n = row0 + (threadIdx.x >> 2) + j * (THREADS / 4);
        const bool on = k < kend && n < p.N;
        s_bits[j] = on ? unsigned(__ldg(static_cast<const unsigned short*>(p.weight_scales) +
                                        i64(n) * p.ws_s0 + grp))
                       : 0u;
        s_zero[j] = on && p.zero_points
                        ? unsigned(__ldg(static_cast<const unsigned char*>(p.zero_points) +
                                         i64(n) * p.zp_s0 + grp))
                        : 8u;
      }
    }
  };
  auto scale_store = [&](int stage) {
    if constexpr (INT4) {
      constexpr unsigned MAGIC = INT4_MAGIC<T>;  // 1024, 128
      const unsigned base = smem0 + stage * STAGE_BYTES + A_BYTES + TN * B_ROW +
                            (threadIdx.x >> 2) * (S_CHUNKS * 8) + (threadIdx.x & 3) * 8;
#pragma unroll
      for (int j = 0; j < S_LOADS; ++j) {
        // offset + zero as a T pair: 1024 + z (fp16) or 128 + z (bf16) is the bits MAGIC + z
        const unsigned sub = MAGIC + (s_zero[j] & 0xFu) * 0x00010001u;
        const unsigned scale = s_bits[j] * 0x00010001u;
        asm volatile("st.shared.v2.u32 [%0], {%1, %2};"
                     :: "r"(base + j * (THREADS / 4) * (S_CHUNKS * 8)), "r"(scale), "r"(sub)
                     : "memory");
      }
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load(s, s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  if constexpr (INT4) {  // the first stages' scales: all but the last stored at once
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
      if (s < nk) {
        scale_issue(s);
        scale_store(s);
      }
    }
    if (STAGES - 2 < nk) scale_issue(STAGES - 2);
  }

  // Token addressing while the first stages land.
  const unsigned* offsets;
  PendingSlot slot{{-1, -1, -1, 0}, 0, -1};
  if (!tile_addressing<OPTS, TN>(p, req_off, req_len, t0, nt, offsets, slot)) return;

  float acc[MT][NT][4] = {};

  // ldmatrix rows: A tiles of 16 rows (lanes 0-15 the low 16 bytes of a k step, 16-31 the high
  // 16); dense B: pairs of 8-token tiles (lanes 0-7 / 8-15: tokens 0-7 low / high k, 16-31:
  // tokens 8-15); fp8 B: token g of each 8-token tile, 8 bytes at 8c of each 32-byte half;
  // 4-bit B: token g, 16 bytes at 16c of each 64-byte half.
  const int a_row = wm * TILED_WM + (lane & 15), a_half = lane >> 4;
  const int b_row = wn * TILED_WN + ((lane >> 4) << 3) + (lane & 7), b_half = (lane >> 3) & 1;
  for (int ks = 0; ks < nk; ++ks) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
    // 4-bit: the scales of stage ks + STAGES - 2, loaded when it was issued (its buffer was
    // last read at ks - 2; read first after this iteration's barrier)
    if (INT4 && ks + STAGES - 2 < nk) scale_store((ks + STAGES - 2) % STAGES);
    __syncthreads();  // stage ks landed for every thread; stage ks - 1 is free again
    if (ks + STAGES - 1 < nk) {
      load((ks + STAGES - 1) % STAGES, ks + STAGES - 1);
      scale_issue(ks + STAGES - 1);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const unsigned a_base = smem0 + (ks % STAGES) * STAGE_BYTES, b_base = a_base + A_BYTES;
    const unsigned s_base = b_base + TN * B_ROW;  // 4-bit: the scale entries
    // fragments double-buffered: the loads of k step kk + 1 are in flight during kk's mmas
    unsigned af[2][MT][4], bf[2][NT][INT4 ? 8 : 2 * (FP8 ? 2 : 1)];
    uint4 sf[INT4 ? 2 : 1][MT][2];  // 4-bit: rows g, g + 8: {scale, sub} of the k step's chunks
    auto fragments = [&](int buf, int kk) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
        ldmatrix_x4(af[buf][m], a_base + a_at<WF, A_ROW>(a_row + m * 16, 2 * kk + a_half));
      if constexpr (INT4) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int t = wn * TILED_WN + n * 8 + g;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 v = int4_order(lds128(b_base + int4_b_at(t, 8 * kk + 4 * h + c)));
            bf[buf][n][4 * h] = v.x;
            bf[buf][n][4 * h + 1] = v.y;
            bf[buf][n][4 * h + 2] = v.z;
            bf[buf][n][4 * h + 3] = v.w;
          }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sf[buf][m][h] = lds128(s_base + (wm * TILED_WM + m * 16 + h * 8 + g) * (S_CHUNKS * 8) +
                                   kk * 16);
      } else if constexpr (FP8) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int t = wn * TILED_WN + n * 8 + g;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint2 v = lds64(b_base + tiled_at<B_ROW>(t, 4 * kk + 2 * h + (c >> 1)) +
                                  (c & 1) * 8);
            bf[buf][n][2 * h] = v.x;
            bf[buf][n][2 * h + 1] = v.y;
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
          unsigned r[4];
          ldmatrix_x4(r, b_base + tiled_at<B_ROW>(b_row + j * 16, 2 * kk + b_half));
          bf[buf][2 * j][0] = r[0];
          bf[buf][2 * j][1] = r[1];
          bf[buf][2 * j + 1][0] = r[2];
          bf[buf][2 * j + 1][1] = r[3];
        }
      }
    };
    fragments(0, kg * KSTEPS);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      if (kk + 1 < KSTEPS) fragments((kk + 1) & 1, kg * KSTEPS + kk + 1);
      const int u = kk & 1;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const unsigned* x = af[u][m];
        if constexpr (INT4) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // chunk 2 kk + h: x[2h] row g, x[2h + 1] row g + 8
            const uint4 sg = sf[u][m][0], s8 = sf[u][m][1];
            const unsigned scale_g = h ? sg.z : sg.x, sub_g = h ? sg.w : sg.y;
            const unsigned scale_8 = h ? s8.z : s8.x, sub_8 = h ? s8.w : s8.y;
            unsigned wg[4], w8[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              wg[i] = int4_pair<T>(x[2 * h], i, sub_g, scale_g);
              w8[i] = int4_pair<T>(x[2 * h + 1], i, sub_8, scale_8);
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              const unsigned* b = bf[u][n] + 4 * h;
              mma16816<T>(acc[m][n], wg[0], w8[0], wg[1], w8[1], b[0], b[1]);
              mma16816<T>(acc[m][n], wg[2], w8[2], wg[3], w8[3], b[2], b[3]);
            }
          }
        } else if constexpr (FP8) {
          const unsigned lo[4] = {fp8x2_to<T>(x[0]), fp8x2_to<T>(x[1]), fp8x2_to<T>(x[0] >> 16),
                                  fp8x2_to<T>(x[1] >> 16)};
          const unsigned hi[4] = {fp8x2_to<T>(x[2]), fp8x2_to<T>(x[3]), fp8x2_to<T>(x[2] >> 16),
                                  fp8x2_to<T>(x[3] >> 16)};
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            mma16816<T>(acc[m][n], lo[0], lo[1], lo[2], lo[3], bf[u][n][0], bf[u][n][1]);
            mma16816<T>(acc[m][n], hi[0], hi[1], hi[2], hi[3], bf[u][n][2], bf[u][n][3]);
          }
        } else {
#pragma unroll
          for (int n = 0; n < NT; ++n)
            mma16816<T>(acc[m][n], x[0], x[1], x[2], x[3], bf[u][n][0], bf[u][n][1]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");

  if (threadIdx.x < TN) finish_slot<OPTS>(p, slot, offsets, threadIdx.x, t0 + threadIdx.x, slots,
                                          rests);
  __syncthreads();  // every warp is done with the stages
#pragma unroll
  for (int g2 = 0; g2 < KG; ++g2) {  // the k groups' sums, one group after the other
    if (kg == g2) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int rl = wm * TILED_WM + m * 16 + g, tt = wn * TILED_WN + n * 8 + 2 * c;
          float* d = part + tt * MMA_PART_STRIDE + rl;
          const float* a = acc[m][n];
          d[0] = g2 ? d[0] + a[0] : a[0];
          d[MMA_PART_STRIDE] = g2 ? d[MMA_PART_STRIDE] + a[1] : a[1];
          d[8] = g2 ? d[8] + a[2] : a[2];
          d[MMA_PART_STRIDE + 8] = g2 ? d[MMA_PART_STRIDE + 8] + a[3] : a[3];
        }
    }
    if (KG > 1) __syncthreads();
  }
  cluster_epilogue<T, WF, S, OPTS, true>(p, part, slots, rests, row0, t0, nt, rank);
#endif
}

// ---- qkv_wgmma: 16-bit weights at 1-256 tokens (fp8 at 48-128, 4-bit at 17-224), Hopper's
// warpgroup MMA
//
// qkv_wgmma<T, TN, S, STAGES, KA, OPTS, DEEP, WQ>: qkv_mma_tiled's tiles, cluster split of K and
// epilogue for fp16 / bf16 weights, with the products taken by wgmma (sm_90a) straight from the
// staged tiles: no ldmatrix, no fragments in registers. FP8: the weights are staged as fp8 codes
// (rows of 64 codes an atom, plain) and each stage is converted to T into one of two swizzled
// buffers after the stages before its wgmmas (a second barrier a k step); the per-row scales
// are applied in the epilogue. WQ == W_INT4: the same with 4-bit codes (rows of 32 bytes an atom,
// plain), dequantized as (q - zero) * scale rounded once to T (the group's scale and zero point
// read into registers two stages ahead), so each weight is dequantized once a CTA where
// qkv_mma_tiled dequantizes it in every warp along the tokens. W_FP8_REG / W_INT4_REG (fp8
// weights; 4-bit ones in groups of a multiple of 64): staged alike, but each warpgroup converts
// the codes of its own rows into the registers of its wgmmas' A operand, an atom at a time, with
// no buffers and no second barrier (see INT4R / FP8R below). A CTA is two warpgroups;
// warpgroup h owns weight rows [64 h, 64 h + 64) of the 128-row tile and all TN tokens: per k16
// step one wgmma.m64nTNk16 whose A (64 weight rows) and B (TN hidden rows) are read from
// shared memory through matrix descriptors. The float32 sums stay in registers (TN / 2 a thread) until the
// cluster reduction. Token tiles of 32, 64, 96, 128, 192 or 256. DEEP (the host's choice up to
// WGMMA_DEEP_MAX_TOKENS, all tokens one tile): one CTA an SM with as many stages as its shared
// memory holds (4-8) and one group of wgmmas left running across each barrier; a tile of 192 or
// 256 tokens reads the weights from L2 once where two of 128 read them twice (the hidden rows
// are read once a row tile either way); else two CTAs an SM (launch bound; 3 stages at tiles
// of 96 and 128 tokens so that both fit), which hide each other's waits and win where the grid
// has more CTAs than SMs (docs/design/qkv.md).
//
// Stages: KA atoms of 64 k values; an atom is 128-byte rows (the weights' MMA_ROWS, then the
// hidden rows' TN), 16-byte chunk c of row r at c ^ (r % 8), every atom 1024-byte aligned: the
// 128-byte swizzle that a K-major wgmma descriptor names (layout type 1, 8-row groups 1024 bytes
// apart). The k16 step j of an atom starts 32 j bytes into it; the hardware applies the swizzle
// to the address it forms, which is why the atoms sit on 1024-byte boundaries.
//
// Pipeline (all 256 threads copy, cp.async, AHEAD = STAGES - 1 - INFLIGHT stages ahead): wait
// for this thread's copies of stage ks, make them visible to the async proxy
// (fence.proxy.async), wait until at most INFLIGHT (DEEP: 1, else 0) of this warpgroup's wgmma
// groups run (so stage ks - 1 - INFLIGHT is no longer read), barrier (stage ks landed for
// everyone, that stage free for all), issue the copies of stage ks + AHEAD into its buffer, issue
// stage ks's wgmmas and commit them; they run while the next iteration waits for its copies (and,
// DEEP, while it issues the next stage's: wgmmas into the same accumulators are ordered).
//
// Accumulator layout of wgmma.m64nNk16 (f32): thread (warp w of the warpgroup, lane g * 4 + c)
// holds, for n8 tile j, d[4j] = (row 16w + g, token 8j + 2c), d[4j + 1] = (16w + g, 8j + 2c + 1),
// d[4j + 2] = (16w + g + 8, 8j + 2c), d[4j + 3] = (16w + g + 8, 8j + 2c + 1): mma.sync's C
// fragments, one m16 tile a warp. They go to `part` as qkv_mma_tiled's do.
// The wgmma instructions exist on sm_90a only: the kernel has a body only there (the host picks
// it only on sm_90 devices, whose module it compiles for sm_90a; see qkv.py).

// wgmma.m64nNk16 (N = 32, 64, 96, 128, 192, 256), d += A B^T with both operands K-major and read
// through the shared-memory descriptors a and b; T picks the input type. Inline asm needs its
// operand lists spelled out: the N / 2 accumulators (%0 ..) from these pieces, then the two
// descriptors.
#define QKV_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define QKV_D16(i) QKV_D8(i), QKV_D8(i + 8)
#define QKV_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QKV_R16 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QKV_R32 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define QKV_R48 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QKV_R64 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define QKV_R80 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define QKV_R96 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define QKV_R112 \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define QKV_ASM(N, TY, REGS, DESCS, ...) \
  asm volatile("{.reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n" #N \
               "k16.f32." TY "." TY " {" REGS "}, " DESCS ", p, 1, 1, 0, 0;}" \
               : __VA_ARGS__ : "l"(a), "l"(b))
#define QKV_WGMMA(N, REGS, DESCS, ...) \
  if constexpr (is_half<T>::value) { \
    QKV_ASM(N, "f16", REGS, DESCS, __VA_ARGS__); \
  } else { \
    QKV_ASM(N, "bf16", REGS, DESCS, __VA_ARGS__); \
  }
template <int N, typename T>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], unsigned long long a,
                                             unsigned long long b) {
  static_assert(N == 32 || N == 64 || N == 96 || N == 128 || N == 192 || N == 256, "wgmma tile");
  if constexpr (N == 32) {
    QKV_WGMMA(32, QKV_R0, "%16, %17", QKV_D16(0))
  } else if constexpr (N == 64) {
    QKV_WGMMA(64, QKV_R0 ", " QKV_R16, "%32, %33", QKV_D16(0), QKV_D16(16))
  } else if constexpr (N == 96) {
    QKV_WGMMA(96, QKV_R0 ", " QKV_R16 ", " QKV_R32, "%48, %49", QKV_D16(0), QKV_D16(16),
              QKV_D16(32))
  } else if constexpr (N == 128) {
    QKV_WGMMA(128, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48, "%64, %65", QKV_D16(0),
              QKV_D16(16), QKV_D16(32), QKV_D16(48))
  } else if constexpr (N == 192) {
    QKV_WGMMA(192, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48 ", " QKV_R64 ", " QKV_R80,
              "%96, %97", QKV_D16(0), QKV_D16(16), QKV_D16(32), QKV_D16(48), QKV_D16(64),
              QKV_D16(80))
  } else {
    QKV_WGMMA(256, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48 ", " QKV_R64 ", " QKV_R80 ", "
              QKV_R96 ", " QKV_R112, "%128, %129", QKV_D16(0), QKV_D16(16), QKV_D16(32),
              QKV_D16(48), QKV_D16(64), QKV_D16(80), QKV_D16(96), QKV_D16(112))
  }
}
#undef QKV_WGMMA
#undef QKV_ASM


// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address,
// leading byte offset 16 (unused by this layout), 8-row groups 1024 bytes apart, layout type 1.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// wgmma.m64nNk16 with A from registers (W_INT4_REG): a[4] is mma.sync's A fragment of this
// thread's warp (rows 16 w + g and + 8 of the warpgroup's 64, k values 2 c, 2 c + 1 and + 8), B
// read through the shared-memory descriptor b as above.
#define QKV_ASM_RS(N, TY, REGS, AB, ...) \
  asm volatile("{.reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n" #N \
               "k16.f32." TY "." TY " {" REGS "}, " AB ", p, 1, 1, 0;}" \
               : __VA_ARGS__ : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define QKV_WGMMA_RS(N, REGS, AB, ...) \
  if constexpr (is_half<T>::value) { \
    QKV_ASM_RS(N, "f16", REGS, AB, __VA_ARGS__); \
  } else { \
    QKV_ASM_RS(N, "bf16", REGS, AB, __VA_ARGS__); \
  }
template <int N, typename T>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const unsigned (&a)[4],
                                                unsigned long long b) {
  static_assert(N == 32 || N == 64 || N == 96 || N == 128 || N == 192 || N == 256, "wgmma tile");
  if constexpr (N == 32) {
    QKV_WGMMA_RS(32, QKV_R0, "{%16, %17, %18, %19}, %20", QKV_D16(0))
  } else if constexpr (N == 64) {
    QKV_WGMMA_RS(64, QKV_R0 ", " QKV_R16, "{%32, %33, %34, %35}, %36", QKV_D16(0), QKV_D16(16))
  } else if constexpr (N == 96) {
    QKV_WGMMA_RS(96, QKV_R0 ", " QKV_R16 ", " QKV_R32, "{%48, %49, %50, %51}, %52", QKV_D16(0),
                 QKV_D16(16), QKV_D16(32))
  } else if constexpr (N == 128) {
    QKV_WGMMA_RS(128, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48,
                 "{%64, %65, %66, %67}, %68", QKV_D16(0), QKV_D16(16), QKV_D16(32), QKV_D16(48))
  } else if constexpr (N == 192) {
    QKV_WGMMA_RS(192, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48 ", " QKV_R64 ", " QKV_R80,
                 "{%96, %97, %98, %99}, %100", QKV_D16(0), QKV_D16(16), QKV_D16(32), QKV_D16(48),
                 QKV_D16(64), QKV_D16(80))
  } else {
    QKV_WGMMA_RS(256, QKV_R0 ", " QKV_R16 ", " QKV_R32 ", " QKV_R48 ", " QKV_R64 ", " QKV_R80 ", "
                 QKV_R96 ", " QKV_R112, "{%128, %129, %130, %131}, %132", QKV_D16(0),
                 QKV_D16(16), QKV_D16(32), QKV_D16(48), QKV_D16(64), QKV_D16(80), QKV_D16(96),
                 QKV_D16(112))
  }
}
#undef QKV_WGMMA_RS
#undef QKV_ASM_RS
#undef QKV_R112
#undef QKV_R96
#undef QKV_R80
#undef QKV_R64
#undef QKV_R48
#undef QKV_R32
#undef QKV_R16
#undef QKV_R0
#undef QKV_D16
#undef QKV_D8

// W_INT4_REG: the two A-fragment registers of one k16 step from the 4-bit words lo and hi (k 8 i
// .. 8 i + 7 and the next 8): byte c of each (k 2 c, 2 c + 1 of the word: sel picks it into
// bytes 0 and 2, lo's then hi's), as the T pairs (q - zero) * scale rounded once, as int4_pair.
// fp16: the low nibble in place (2^10 + q), the high one at bits 4-7 of its half (2^10 + 16 q),
// one fma with (1, 1/16) and -(2^10 + zero, 64 + zero) (sub) makes q - zero exactly; bf16: the
// high nibble shifted down first (too few mantissa bits for 16 q), then as int4_pair.
template <typename T>
__device__ __forceinline__ void int4_frag(unsigned lo, unsigned hi, unsigned sel, unsigned sub,
                                          unsigned scale, unsigned& r_lo, unsigned& r_hi) {
  constexpr unsigned MAGIC = INT4_MAGIC<T>;
  const unsigned x = __byte_perm(lo, hi, sel);  // bytes: lo's, hi's, lo's, hi's
  if constexpr (is_half<T>::value) {
    const unsigned m[2] = {and_or<0x00F0000Fu, MAGIC>(x), and_or<0x00F0000Fu, MAGIC>(x >> 8)};
    const __half2 mul = __halves2half2(__ushort_as_half(0x3C00), __ushort_as_half(0x2C00));
    const __half2 h_sub = *reinterpret_cast<const __half2*>(&sub);
    const __half2 h_scale = *reinterpret_cast<const __half2*>(&scale);
    unsigned r[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __half2 y =
          __hmul2(__hfma2(*reinterpret_cast<const __half2*>(&m[i]), mul, h_sub), h_scale);
      r[i] = *reinterpret_cast<const unsigned*>(&y);
    }
    r_lo = r[0];
    r_hi = r[1];
  } else {
    const unsigned y = x >> 4;  // byte 2: lo's high nibble low; byte 3: hi's
    const unsigned m[2] = {and_or<0x000F000Fu, MAGIC>(__byte_perm(x, y, 0x7610)),
                           and_or<0x000F000Fu, MAGIC>(__byte_perm(x, y, 0x0701))};
    const __nv_bfloat162 b_sub = *reinterpret_cast<const __nv_bfloat162*>(&sub);
    const __nv_bfloat162 b_scale = *reinterpret_cast<const __nv_bfloat162*>(&scale);
    unsigned r[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __nv_bfloat162 v =
          __hmul2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&m[i]), b_sub), b_scale);
      r[i] = *reinterpret_cast<const unsigned*>(&v);
    }
    r_lo = r[0];
    r_hi = r[1];
  }
}

// W_INT4_REG: the offset pair int4_frag subtracts for zero point z.
template <typename T>
__device__ __forceinline__ unsigned int4_frag_sub(unsigned z) {
  if constexpr (is_half<T>::value) return (0xE400u + z) | ((0xD400u | (z << 4)) << 16);
  return (INT4_MAGIC<T> & 0xFFFFu) * 0x10001u + z * 0x10001u;
}

template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {  // keep d out of reordering
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

constexpr int WGMMA_THREADS = 256;  // two warpgroups: 64 weight rows each

template <typename T, int TN, int S, int STAGES, int KA, bool OPTS, bool DEEP, int WQ>
__global__ void MMA_CLUSTER_DIMS __launch_bounds__(WGMMA_THREADS, DEEP ? 1 : 2)
    qkv_wgmma(const QkvParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_launch_dependents();
  pdl_wait();
  // WQ: the weight format (W_DENSE, W_FP8, W_INT4; a bool true is W_FP8); the quantized ones are
  // staged as codes and converted to T in shared memory before each stage's wgmmas
  // W_INT4_REG / W_FP8_REG: codes staged as for W_INT4 / W_FP8 (fp8 rows with their 16-byte
  // chunks swizzled, see a_dst), converted by each warpgroup into the registers of its wgmmas' A
  // operand (no 16-bit buffers, no second barrier a k step)
  constexpr bool INT4R = WQ == W_INT4_REG, FP8R = WQ == W_FP8_REG, REG = INT4R || FP8R;
  constexpr bool FP8 = WQ == W_FP8 || FP8R, INT4 = WQ == W_INT4 || INT4R;
  constexpr bool QUANT = FP8 || INT4;
  constexpr int INFLIGHT = DEEP ? 1 : 0;           // wgmma groups left running a k step
  constexpr int AHEAD = STAGES - 1 - INFLIGHT;     // stages copied ahead of the one multiplied
  static_assert(AHEAD >= 1, "qkv_wgmma needs STAGES >= 2, DEEP ones >= 3");
  constexpr int BK = 64 * KA;                       // k values per stage
  // an atom's weights as wgmma reads them (16-bit, swizzled) and as they are staged (FP8: rows
  // of 64 codes, plain), its hidden rows
  constexpr int A_ROW = FP8 ? 64 : INT4 ? 32 : 128;  // staged weight row bytes (an atom)
  constexpr int A_ATOM = MMA_ROWS * 128, A_STAGED = MMA_ROWS * A_ROW;
  constexpr int B_ATOM = TN * 128;
  constexpr int STAGE_BYTES = KA * (A_STAGED + B_ATOM);
  constexpr int A_CHUNKS = A_ROW / 16;  // 16-byte chunks of a staged weight row (an atom)
  constexpr int A_STEP = WGMMA_THREADS / A_CHUNKS, B_STEP = WGMMA_THREADS / 8;  // rows apart
  constexpr int A_LOADS = MMA_ROWS / A_STEP, B_LOADS = TN / B_STEP;
  constexpr int R = TN / 2;  // accumulators a thread
  static_assert(TN % 32 == 0 && B_LOADS * B_STEP == TN && B_ATOM % 1024 == 0, "tile shape");
  extern __shared__ __align__(16) unsigned char mma_smem[];
  __shared__ TokenSlot slots[TN];
  __shared__ int rests[OPTS ? TN : 1];
  __shared__ unsigned req_off[MMA_REQ_CAP + 1];
  __shared__ int req_len[MMA_REQ_CAP];

  // the stages start at the first 1024-byte boundary (the host adds 1 KB to the size)
  const unsigned raw0 = static_cast<unsigned>(__cvta_generic_to_shared(mma_smem));
  const unsigned smem0 = (raw0 + 1023u) & ~1023u;
  float* part = reinterpret_cast<float*>(mma_smem + (smem0 - raw0));

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int wg = warp >> 2, w4 = warp & 3;
  const ClusterTile tile = cluster_tile<TN>(p);
  const int rank = tile.rank, row0 = tile.row0, t0 = tile.t0, nt = tile.nt, kbeg = tile.kbeg;
  const int kend = kbeg + tile.klen;
  const int nk = (kend - kbeg + BK - 1) / BK;

  // Each thread copies chunk column cc (8 k values) of hidden rows rr, rr + B_STEP, ... of every
  // atom, and chunk column ac (8 k values; FP8 16, INT4 32) of weight rows ar, ar + A_STEP, ... Their
  // sources are set up here and a k step only adds its offset: recomputed per step, the addresses
  // took about 215 instructions a stage at tiles of 256 tokens, which stalled beside the wgmmas.
  // A row past the matrix or the tile reads nothing, from row 0's address (and a k chunk past the
  // slice, from offset 0). A_STEP and B_STEP are multiples of 8 rows, so row j's chunk sits
  // j * STEP rows after row 0's in the swizzled layout. Tiles of 32 and 64 tokens keep the
  // per-step addresses with 16-bit weights (SETUP false): NVRTC 12.9's ptxas crashes (SIGSEGV) on
  // the set-up form of their deep 8-stage kernels, and they measured the same either way (the
  // copies are few there). Quantized weights set them up at every tile.
  constexpr bool SETUP = TN >= 96 || QUANT;
  const int rr = threadIdx.x >> 3, cc = threadIdx.x & 7;
  const int ar = threadIdx.x / A_CHUNKS, ac = threadIdx.x % A_CHUNKS;
  const int kc0 = kbeg + cc * 8, ka0 = kbeg + ac * (64 / A_CHUNKS);
  // bytes of k weight values of a row (k even: a 4-bit stage's chunks hold 32)
  auto kbytes = [](int k) { return INT4 ? i64(k >> 1) : FP8 ? i64(k) : i64(k) * 2; };
  static_assert(A_STEP % 8 == 0 && B_STEP % 8 == 0, "rows j * STEP apart keep the swizzle");
  const unsigned char* const weight = static_cast<const unsigned char*>(p.weight);
  const unsigned char* const hidden = static_cast<const unsigned char*>(p.hidden);
  // rows j < a_rows (b_rows) of this thread's exist: one compare with a constant a copy
  const int a_rows = (p.N - row0 - ar + A_STEP - 1) / A_STEP;
  const int b_rows = (nt - rr + B_STEP - 1) / B_STEP;
  const unsigned char* a_src[A_LOADS];
  const unsigned char* b_src[B_LOADS];
#pragma unroll
  for (int j = 0; j < A_LOADS; ++j) {
    a_src[j] = j < a_rows ? weight + i64(row0 + ar + j * A_STEP) * p.weight_row_bytes +
                                kbytes(ka0)
                          : weight;
  }
#pragma unroll
  for (int j = 0; j < B_LOADS; ++j)
    b_src[j] = j < b_rows ? hidden + (i64(t0 + rr + j * B_STEP) * p.hidden_s0 + kc0) * 2 : hidden;
  // (!SETUP: the first rows' sources and the rows' strides, as before the set-up form)
  const unsigned char* a_first = weight + i64(row0 + ar) * p.weight_row_bytes + kbytes(ka0);
  const i64 a_step = i64(A_STEP) * p.weight_row_bytes;
  const unsigned char* b_first = hidden + (i64(t0 + rr) * p.hidden_s0 + kc0) * 2;
  const i64 b_step = i64(B_STEP) * p.hidden_s0 * 2;
  // FP8R: chunk ac of row ar at chunk (ac ^ (ar / 2)) % 4, so that a load instruction reading
  // one chunk of 8 rows 64 bytes apart finds them in 8 different bank groups (rows j * A_STEP
  // apart keep it: A_STEP is a multiple of 8)
  const unsigned a_dst = FP8R    ? ar * A_ROW + ((ac ^ (ar >> 1)) & 3) * 16
                         : QUANT ? ar * A_ROW + ac * 16
                                 : tiled_at<128>(ar, ac);
  const unsigned b_dst = tiled_at<128>(rr, cc);
  auto load = [&](int stage, int ks) {
    const unsigned base = smem0 + stage * STAGE_BYTES;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const int dk = ks * BK + a * 64;
      const bool a_in = ka0 + dk < kend, b_in = kc0 + dk < kend;
      const i64 da = a_in ? kbytes(dk) : 0;
      const int db = b_in ? dk * 2 : 0;
      const unsigned abase = base + a * A_STAGED + a_dst;
      const unsigned bbase = base + KA * A_STAGED + a * B_ATOM + b_dst;
#pragma unroll
      for (int j = 0; j < A_LOADS; ++j) {
        if constexpr (SETUP) {
          cp_async16(abase + j * A_STEP * A_ROW, a_src[j] + da, a_in && j < a_rows);
        } else {
          const bool on = ka0 + dk < kend && row0 + ar + j * A_STEP < p.N;
          const unsigned dst = QUANT ? base + a * A_STAGED + (ar + j * A_STEP) * A_ROW + ac * 16
                                     : base + a * A_STAGED + tiled_at<128>(ar + j * A_STEP, ac);
          cp_async16(dst, on ? a_first + j * a_step + kbytes(dk) : p.weight, on);
        }
      }
#pragma unroll
      for (int j = 0; j < B_LOADS; ++j) {
        if constexpr (SETUP) {
          cp_async16(bbase + j * B_STEP * 128, b_src[j] + db, b_in && j < b_rows);
        } else {
          const bool on = kc0 + dk < kend && rr + j * B_STEP < nt;
          cp_async16(base + KA * A_STAGED + a * B_ATOM + tiled_at<128>(rr + j * B_STEP, cc),
                     on ? b_first + j * b_step + dk * 2 : p.hidden, on);
        }
      }
    }
  };
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < nk) load(s, s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // Token addressing while the first stages land.
  const unsigned* offsets;
  PendingSlot slot{{-1, -1, -1, 0}, 0, -1};
  if (!tile_addressing<OPTS, TN>(p, req_off, req_len, t0, nt, offsets, slot)) return;

  // INT4: thread (row, half) converts 32 values of weight row `row` an atom (k = 32 half .. of
  // the atom's 64), which lie in one group (G a multiple of 32, a slice whole stages): the
  // group's scale (T bits) and zero point (8 without zero points; scale 0 past N or the slice)
  // are loaded into registers two k steps before the stage is converted (s_cur: stage ks,
  // s_next: ks + 1). scale_load runs for ks = 0, 1, 2, ... in turn: the group of each atom's k
  // (s_grp) and its offset in it (s_rem) advance by a stage a call, no division.
  constexpr bool INT4S = INT4 && !INT4R;
  unsigned s_cur[INT4S ? KA : 1][2], s_next[INT4S ? KA : 1][2];
  int s_grp[INT4S ? KA : 1], s_rem[INT4S ? KA : 1];
  if constexpr (INT4S) {
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const int k = kbeg + a * 64 + (threadIdx.x & 1) * 32;
      s_grp[a] = k / p.group_size;
      s_rem[a] = k - s_grp[a] * p.group_size;
    }
  }
  auto scale_load = [&](int ks, unsigned (&s)[INT4S ? KA : 1][2]) {
    if constexpr (INT4S) {
      const int n = row0 + (threadIdx.x >> 1);
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        const int k = kbeg + ks * BK + a * 64 + (threadIdx.x & 1) * 32;
        const bool on = ks < nk && k < kend && n < p.N;
        const int grp = s_grp[a];  // k / group_size
        s[a][0] = on ? unsigned(__ldg(static_cast<const unsigned short*>(p.weight_scales) +
                                      i64(n) * p.ws_s0 + grp))
                     : 0u;
        s[a][1] = on && p.zero_points
                      ? unsigned(__ldg(static_cast<const unsigned char*>(p.zero_points) +
                                       i64(n) * p.zp_s0 + grp))
                      : 8u;
        for (s_rem[a] += BK; s_rem[a] >= p.group_size; s_rem[a] -= p.group_size) ++s_grp[a];
      }
    }
  };
  scale_load(0, s_cur);
  scale_load(1, s_next);

  // INT4R: thread (warp w4 of warpgroup wg, lane g * 4 + c) converts rows r0 = 64 wg + 16 w4 + g
  // and r0 + 8, each atom's 16 k values of its A fragments; groups of a multiple of 64 (the host
  // checks), so an atom lies in one group. The (scale, zero point) word pairs of each atom and row
  // are loaded two k steps ahead as above (r_cur: stage ks, r_next: ks + 1); row past N: scale 0.
  const int r0 = wg * 64 + w4 * 16 + g;
  unsigned r_cur[INT4R ? KA : 1][2][2], r_next[INT4R ? KA : 1][2][2];
  int r_grp[INT4R ? KA : 1], r_rem[INT4R ? KA : 1];
  if constexpr (INT4R) {
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const int k = kbeg + a * 64;
      r_grp[a] = k / p.group_size;
      r_rem[a] = k - r_grp[a] * p.group_size;
    }
  }
  // the two rows' scale and zero-point rows (null past N; zero points: null without them)
  const unsigned short* ws_row[INT4R ? 2 : 1];
  const unsigned char* zp_row[INT4R ? 2 : 1];
  if constexpr (INT4R) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = row0 + r0 + 8 * i;
      ws_row[i] = n < p.N ? static_cast<const unsigned short*>(p.weight_scales) + i64(n) * p.ws_s0
                          : nullptr;
      zp_row[i] = n < p.N && p.zero_points
                      ? static_cast<const unsigned char*>(p.zero_points) + i64(n) * p.zp_s0
                      : nullptr;
    }
  }
  auto row_scale_load = [&](int ks, unsigned (&s)[INT4R ? KA : 1][2][2]) {
    if constexpr (INT4R) {
#pragma unroll
      for (int a = 0; a < KA; ++a) {  // (the slice is whole stages: k < kend while ks < nk)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          s[a][i][0] = ks < nk && ws_row[i] ? unsigned(__ldg(ws_row[i] + r_grp[a])) : 0u;
          s[a][i][1] = ks < nk && zp_row[i] ? unsigned(__ldg(zp_row[i] + r_grp[a])) : 8u;
        }
        for (r_rem[a] += BK; r_rem[a] >= p.group_size; r_rem[a] -= p.group_size) ++r_grp[a];
      }
    }
  };
  row_scale_load(0, r_cur);
  row_scale_load(1, r_next);
  // byte c of two words into bytes 0 and 2 (the first word's) and 1 and 3 (the second's); FP8R:
  // bytes 2 c and 2 c + 1 of two words into bytes 0 and 1
  const unsigned sel = unsigned(c) | unsigned(c + 4) << 4 | unsigned(c) << 8 | unsigned(c + 4) << 12;
  const unsigned sel8 = unsigned(2 * c) | unsigned(2 * c + 1) << 4;
  unsigned afrag[REG ? 2 : 1][REG ? 16 : 1] = {};  // two atoms' A fragments (4 k16 steps)
  // A wgmma reads its A registers after it is issued, until the wait that retires its group;
  // ptxas reused such registers for other values before that wait (results wrong at tiles of
  // 128+ tokens, where registers are scarce). So each fragment's last use is an xor into `keep`
  // after that wait, and `keep` is stored where no call looks (a negative N), which keeps the
  // registers of a running group out of reach.
  unsigned keep = 0;
  auto retire = [&](const unsigned (&f)[REG ? 16 : 1]) {
#pragma unroll
    for (int i = 0; i + 1 < (REG ? 16 : 1); i += 2) keep = keep ^ f[i] ^ f[i + 1];
  };

  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.f;
  for (int ks = 0; ks < nk; ++ks) {
    asm volatile("cp.async.wait_group %0;" :: "n"(AHEAD - 1) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // REG commits a group an atom: at most KA (DEEP; else 0) left running retires stage
    // ks - 1 - INFLIGHT's
    constexpr int RUNNING = REG ? (INFLIGHT ? KA : 0) : INFLIGHT;
    fence_regs(acc);
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(RUNNING) : "memory");
    fence_regs(acc);
    // stage ks landed for every thread; stage ks - 1 - INFLIGHT (the one the copies below
    // refill) is no longer read by any warpgroup's wgmma
    __syncthreads();
    if (ks + AHEAD < nk) load((ks + AHEAD) % STAGES, ks + AHEAD);
    asm volatile("cp.async.commit_group;" ::: "memory");
    const unsigned base = smem0 + (ks % STAGES) * STAGE_BYTES;
    // the weights wgmma reads: the stage's own (16-bit), or (FP8) the codes of stage ks converted
    // to T into buffer ks % 2 after the stages (its last reader, the wgmmas of stage ks - 2, has
    // retired in both warpgroups: the wait and the barrier above)
    unsigned abase = base;
    if constexpr (FP8 && !FP8R) {
      abase = smem0 + STAGES * STAGE_BYTES + (ks & 1) * (KA * A_ATOM);
      const int row = threadIdx.x >> 1, half = threadIdx.x & 1;  // 32 codes of a row a thread
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        const unsigned src = base + a * A_STAGED + row * 64 + half * 32;
        const uint4 v[2] = {lds128(src), lds128(src + 16)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // 8 codes -> the 16-byte chunk half * 4 + j of the row
          const unsigned lo = (j & 1) ? v[j >> 1].z : v[j >> 1].x;
          const unsigned hi = (j & 1) ? v[j >> 1].w : v[j >> 1].y;
          const unsigned dst = abase + a * A_ATOM + tiled_at<128>(row, half * 4 + j);
          asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                       :: "r"(dst), "r"(fp8x2_to<T>(lo)), "r"(fp8x2_to<T>(lo >> 16)),
                          "r"(fp8x2_to<T>(hi)), "r"(fp8x2_to<T>(hi >> 16)) : "memory");
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // for wgmma's reads
      __syncthreads();
    } else if constexpr (REG) {
      // each atom: wait until at most one wgmma group of this warpgroup runs (the atom before's,
      // whose fragments are the other set), convert the atom's codes of rows r0 and r0 + 8 into
      // its fragments, then its four wgmmas as one group
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        const int set = (ks * KA + a) & 1;
        fence_regs(acc);
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        fence_regs(acc);
        // the atom's codes of rows r0 and r0 + 8: INT4R two 16-byte loads a row, FP8R four
        // (k16 step j's chunk, swizzled as a_dst)
        const unsigned src = base + a * A_STAGED + r0 * A_ROW;
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int u = 0; u < A_ROW / 16; ++u) {
            const int chunk = FP8R ? (u ^ (r0 >> 1)) & 3 : u;
            v[i * 4 + u] = lds128(src + i * 8 * A_ROW + chunk * 16);
          }
        }
        unsigned sub[2], scale[2];
        if constexpr (INT4R) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            sub[i] = int4_frag_sub<T>(r_cur[a][i][1] & 0xFu);
            scale[i] = r_cur[a][i][0] * 0x00010001u;
          }
        }
        auto convert = [&](unsigned (&f)[16]) {
          retire(f);  // its group (two atoms back) has retired: the wait above
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // row r0 + 8 i: fragment registers i and i + 2
              if constexpr (INT4R) {  // k16 step j: words 2 j and 2 j + 1 of the row
                const uint4& lo = v[i * 4 + (j >> 1)];
                const unsigned w0 = (j & 1) ? lo.z : lo.x, w1 = (j & 1) ? lo.w : lo.y;
                int4_frag<T>(w0, w1, sel, sub[i], scale[i], f[4 * j + i], f[4 * j + 2 + i]);
              } else {  // chunk j: codes 2 c, 2 c + 1 in words 0-1, the same + 8 in words 2-3
                const uint4& w = v[i * 4 + j];
                f[4 * j + i] = fp8x2_to<T>(__byte_perm(w.x, w.y, sel8));
                f[4 * j + 2 + i] = fp8x2_to<T>(__byte_perm(w.z, w.w, sel8));
              }
            }
          }
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
          const unsigned long long db = sw128_desc(base + KA * A_STAGED + a * B_ATOM);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const unsigned fj[4] = {f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3]};
            wgmma_m64k16_rs<TN, T>(acc, fj, db + 2 * j);
          }
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        };
        if (set) {
          convert(afrag[1]);
        } else {
          convert(afrag[0]);
        }
      }
#pragma unroll
      for (int a = 0; a < KA; ++a) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          r_cur[a][i][0] = r_next[a][i][0];
          r_cur[a][i][1] = r_next[a][i][1];
        }
      }
      row_scale_load(ks + 2, r_next);
      continue;  // the atoms' wgmmas are issued
    } else if constexpr (INT4) {
      // the same for 4-bit codes: w = (q - zero) * scale rounded once to T (int4_pair, as
      // qkv_mma_tiled), the pairs (i, i + 4) that int4_pair makes put back in k order
      abase = smem0 + STAGES * STAGE_BYTES + (ks & 1) * (KA * A_ATOM);
      const int row = threadIdx.x >> 1, half = threadIdx.x & 1;  // 32 codes of a row a thread
      constexpr unsigned MAGIC = INT4_MAGIC<T>;
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        const uint4 v = lds128(base + a * A_STAGED + row * 32 + half * 16);
        const unsigned z = s_cur[a][1] & 0xFu;
        const unsigned scale = s_cur[a][0] * 0x00010001u;
        const unsigned sub = MAGIC + z * 0x00010001u;
        // fp16 -(64 + z): sign, exponent of 64, z in the top 4 of the 10 mantissa bits
        const unsigned sub16 = (0xD400u | (z << 4)) * 0x00010001u;
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // 8 codes (k = 8 j ..) -> chunk half * 4 + j of the row
          unsigned q[4];  // the pairs (0, 4), (1, 5), (2, 6), (3, 7)
          int4_pairs<T>(words[j], sub, sub16, scale, q);
          const unsigned dst = abase + a * A_ATOM + tiled_at<128>(row, half * 4 + j);
          asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                       :: "r"(dst), "r"(__byte_perm(q[0], q[1], 0x5410)),
                          "r"(__byte_perm(q[2], q[3], 0x5410)), "r"(__byte_perm(q[0], q[1], 0x7632)),
                          "r"(__byte_perm(q[2], q[3], 0x7632)) : "memory");
        }
      }
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        s_cur[a][0] = s_next[a][0];
        s_cur[a][1] = s_next[a][1];
      }
      scale_load(ks + 2, s_next);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // for wgmma's reads
      __syncthreads();
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const unsigned long long da = sw128_desc(abase + a * A_ATOM + wg * 64 * 128);
      const unsigned long long db = sw128_desc(base + KA * A_STAGED + a * B_ATOM);
#pragma unroll
      for (int j = 0; j < 4; ++j)  // k16 step j: 32 bytes into the rows (2 in 16-byte units)
        wgmma_m64k16<TN, T>(acc, da + 2 * j, db + 2 * j);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  }
  fence_regs(acc);
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  fence_regs(acc);
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if constexpr (REG) {
    retire(afrag[0]);
    retire(afrag[1]);
    if (p.N < 0) part[threadIdx.x] = __uint_as_float(keep);  // (never: see `keep`)
  }

  if (threadIdx.x < TN) finish_slot<OPTS>(p, slot, offsets, threadIdx.x, t0 + threadIdx.x, slots,
                                          rests);
  __syncthreads();  // every warpgroup is done with the stages (part overlays them)
  const int rl = wg * 64 + w4 * 16 + g;
#pragma unroll
  for (int j = 0; j < TN / 8; ++j) {
    float* d = part + (8 * j + 2 * c) * MMA_PART_STRIDE + rl;
    d[0] = acc[4 * j];
    d[MMA_PART_STRIDE] = acc[4 * j + 1];
    d[8] = acc[4 * j + 2];
    d[MMA_PART_STRIDE + 8] = acc[4 * j + 3];
  }
  cluster_epilogue<T, FP8 ? W_FP8 : W_DENSE, S, OPTS, true>(p, part, slots, rests, row0, t0, nt,
                                                          rank);
#endif
}

// ---- Prefill epilogue: RoPE on Q into out, K/V from temporaries into their pages -------------

// One block per token. Work items are N-wide chunks of head rows, as in contiguous.cu: for a
// roped head, items [0, rot_items) rotate N pairs (neox: i0.. and R/2 + i0..; interleaved: N
// consecutive elements), the rest copy N pass-through dims of [R, D).
// clear_entry (clear_unused_last_page_rows, cache rows only): the rows of c_dst's page after
// entry clear_entry (entry_stride elements apart) are zeroed at the same elements;
// p.page_size - 1 clears nothing.
template <typename SrcT, typename T, typename CacheT, int N>
__device__ __forceinline__ void epilogue_item(const SrcT* src, T* q_dst, CacheT* c_dst, int j,
                                              int rot_items, const QkvParams& p, const float* cs,
                                              float scale, i64 entry_stride = 0,
                                              int clear_entry = 0) {
  const int half_r = p.R >> 1;
  float a[N], b[N];
  int e0, e1 = -1;
  if (j < rot_items) {
    if (p.is_neox) {
      e0 = j * N;
      e1 = half_r + e0;
      load_float<SrcT, N>(src + e0, a);
      load_float<SrcT, N>(src + e1, b);
      rotate_neox<N>(a, b, cs, half_r, e0);
    } else {
      e0 = j * N;
      load_float<SrcT, N>(src + e0, a);
      if constexpr (N % 2 == 0) rotate_interleaved<N>(a, cs, half_r, e0);
    }
  } else {
    e0 = p.R + (j - rot_items) * N;
    load_float<SrcT, N>(src + e0, a);
  }
  if (q_dst) {
    store_float<T, N>(q_dst + e0, a);
    if (e1 >= 0) store_float<T, N>(q_dst + e1, b);
  } else {
    store_float<CacheT, N>(c_dst + e0, a, scale);
    if (e1 >= 0) store_float<CacheT, N>(c_dst + e1, b, scale);
    if (entry_stride) {
      zero_rest_of_page<CacheT, N>(c_dst, entry_stride, clear_entry, p.page_size, e0);
      if (e1 >= 0) zero_rest_of_page<CacheT, N>(c_dst, entry_stride, clear_entry, p.page_size, e1);
    }
  }
}

// KT: the dtype cuBLAS wrote K and V in (float32 for fp8 caches with RoPE: rounding K to 16 bits
// before a rotation that cancels would move fp8 codes by more than one).
// OPTS: status= validates the offsets first (the temporaries cuBLAS wrote are the op's own, so
// nothing the caller sees has changed yet); the last token of a request clears the rest of its
// page, K and V, each thread at the elements it writes.
template <typename T, typename CacheT, typename KT, int N, bool OPTS>
__global__ void __launch_bounds__(256) qkv_epilogue(const QkvParams p) {
  pdl_launch_dependents();
  pdl_wait();
  const int t = blockIdx.x;
  if (!qkv_check<OPTS>(p, p.offsets)) return;
  __shared__ TokenSlot slot;
  __shared__ int rest_s;  // OPTS: the rows this token clears (rest_of_page)
  if (threadIdx.x == 0) {
    if constexpr (OPTS) {
      const PagedSlot s = qkv_paged_slot(p, t);
      slot = token_slot_of(p, s);
      rest_s = rest_of_page(p, p.offsets, s, slot, s.entry, t);
    } else {
      slot = token_slot(p, t);
    }
  }
  __syncthreads();
  const TokenSlot tok = slot;
  // OPTS: the entry after which the page is cleared (page_size - 1: nothing to clear)
  const int clear_entry = OPTS ? p.page_size - 1 - rest_s : 0;
  const bool rope = p.cos_sin != nullptr && tok.pos >= 0;
  const float* cs = rope ? p.cos_sin + i64(tok.pos) * p.cs_s0 : nullptr;
  // A roped head row is rot_items rotating items then pass-through items; an unroped one copies.
  const int rot_items = rope ? (p.is_neox ? (p.R >> 1) / N : p.R / N) : 0;
  const int r_items = rope ? rot_items + (p.D - p.R) / N : p.D / N;
  const int v_items = p.D / N;
  const int q_end = p.Hq * r_items;
  const int k_end = q_end + (tok.k_off >= 0 ? p.Hkv * r_items : 0);
  const int end = k_end + (tok.v_off >= 0 ? p.Hkv * v_items : 0);
  QkvParams pr = p;
  if (!rope) pr.R = 0;  // unroped K rows copy all D dims
  T* q = static_cast<T*>(p.out) + i64(t) * p.out_s0;
  const T* qt = static_cast<const T*>(p.q_tmp) + i64(t) * p.qt_s0;
  const KT* kt = static_cast<const KT*>(p.k_tmp) + i64(t) * p.kt_s0;
  const KT* vt = static_cast<const KT*>(p.v_tmp) + i64(t) * p.vt_s0;
  for (int w = threadIdx.x; w < end; w += blockDim.x) {
    if (w < q_end) {
      const int h = w / r_items;
      epilogue_item<T, T, CacheT, N>(qt + i64(h) * p.D, q + i64(h) * p.D, nullptr,
                                     w - h * r_items, rot_items, pr, cs, 1.f);
    } else if (w < k_end) {
      const int h = (w - q_end) / r_items;
      CacheT* dst = static_cast<CacheT*>(p.k_cache) + tok.k_off + i64(h) * p.k_head;
      epilogue_item<KT, T, CacheT, N>(kt + i64(h) * p.D, nullptr, dst, w - q_end - h * r_items,
                                      rot_items, pr, cs, p.k_inv_scale, OPTS ? p.k_entry : 0,
                                      clear_entry);
    } else {
      const int h = (w - k_end) / v_items;
      const int e0 = (w - k_end - h * v_items) * N;
      float x[N];
      load_float<KT, N>(vt + i64(h) * p.D + e0, x);
      CacheT* dst = static_cast<CacheT*>(p.v_cache) + tok.v_off + i64(h) * p.v_head;
      store_float<CacheT, N>(dst + e0, x, p.v_inv_scale);
      if constexpr (OPTS) {
        zero_rest_of_page<CacheT, N>(dst, p.v_entry, clear_entry, p.page_size, e0);
      }
    }
  }
}

// ---- Prefill with quantized weights: dequantize to the input dtype for cuBLAS -----------------

// dst (N, K) T, contiguous. One thread per weight byte (fp8: one value; int4: two values).
template <typename T, int WF>
__global__ void __launch_bounds__(256) qkv_dequant(const QkvParams p) {
  pdl_launch_dependents();
  pdl_wait();
  const i64 per_row = WF == W_INT4 ? p.K / 2 : p.K;
  const i64 total = i64(p.N) * per_row;
  T* dst = static_cast<T*>(p.out);
  const unsigned char* w = static_cast<const unsigned char*>(p.weight);
  for (i64 i = blockIdx.x * i64(blockDim.x) + threadIdx.x; i < total;
       i += i64(gridDim.x) * blockDim.x) {
    const i64 n = i / per_row, j = i - n * per_row;
    const unsigned char byte = w[n * p.weight_row_bytes + j];
    if constexpr (WF == W_FP8) {
      __nv_fp8_e4m3 e;
      e.__x = byte;
      dst[n * p.K + j] = from_float<T>(to_float(e) * static_cast<const float*>(p.weight_scales)[n]);
    } else {
      const i64 grp = (2 * j) / p.group_size;
      const float scale = to_float(static_cast<const T*>(p.weight_scales)[n * p.ws_s0 + grp]);
      const float zero =
          p.zero_points
              ? float(static_cast<const unsigned char*>(p.zero_points)[n * p.zp_s0 + grp] & 0xF)
              : 8.f;
      dst[n * p.K + 2 * j] = from_float<T>((float(byte & 0xF) - zero) * scale);
      dst[n * p.K + 2 * j + 1] = from_float<T>((float(byte >> 4) - zero) * scale);
    }
  }
}
