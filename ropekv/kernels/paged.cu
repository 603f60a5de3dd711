// RoPE on Q and K, optional fp8 quantization, and the append of K/V into a paged cache
// (FlashInfer's rope_quantize_fp8_append_paged_kv_cache, and the same without quantization).
//
// One block (or grid.y blocks) per token handles every head of it. The token's work is a flat list
// of items, each one vector of N input elements (16 bytes at most), in five sections:
//   Q rotary (Hq x R/N items; neox: R/2N, each a pair of vectors), Q pass-through (Hq x Dn/N)
//     -> the q outputs
//   K rotary (Hkv x ...), K pass-through (Hkv x Dn/N) -> the cache rows of the token's page slot
//   V (Hkv x D/N; GQA/MHA only) -> the V cache row
// Thread g of the token's blocks takes the items i = g (mod threads); within a section it loads U
// items before it stores any, so several 16-byte loads are in flight per thread.
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/paged.py.
struct PagedParams {
  const void* q_rope;         // (T, Hq, R) T
  const void* q_nope;         // (T, Hq, Dn) T, null when Dn == 0
  const void* k_rope;         // (T, Hkv, R) T; MLA (T, R) with Hkv = 1 and kr_sh = 0
  const void* k_nope;         // (T, Hkv, Dn) T; MLA (T, Dn)
  const void* v;              // (T, Hkv, R + Dn) T, null for MLA (Hv = 0)
  void* q_rope_out;           // (T, Hq, R) OutT
  void* q_nope_out;           // (T, Hq, Dn) OutT
  void* kr_cache;             // rows of roped K: k_cache (GQA) or kpe_cache (MLA), OutT
  void* kn_cache;             // rows of K nope: k_cache + R (GQA) or ckv_cache (MLA), OutT
  void* v_cache;              // v_cache (GQA) or null
  const float* cos_sin;       // (P, R) float32: cos in [0, R/2), sin in [R/2, R)
  const void* pos_ids;        // (T,) RoPE position of each token; mRoPE: (3, T)
  const void* batch_indices;  // (T,) request of each token, < 0: padding (no cache write)
  const void* positions;      // (T,) position of each token inside its request
  const void* kv_indptr;      // (B + 1,) first page-table entry of each request
  const void* kv_indices;     // (I,) page-table entries: page ids
  const float* q_scales;      // (Hq,) per-head quantization scales, or null (q_scale for all)
  const float* kv_scales;     // (Hkv,) likewise for K and V
  i64 qr_sn, qr_sh, qn_sn, qn_sh;      // input strides in elements (token, head)
  i64 kr_sn, kr_sh, kn_sn, kn_sh, v_sn, v_sh;
  i64 qro_sn, qro_sh, qno_sn, qno_sh;  // q output strides
  i64 krc_sp, krc_se, krc_sh;          // cache strides (page, entry, head)
  i64 knc_sp, knc_se, knc_sh;
  i64 vc_sp, vc_se, vc_sh;
  i64 cs_sp;                           // cos_sin row stride
  i64 num_pages, num_indices;
  i64 pid_st;                          // pos_ids row stride (T) for mRoPE; T for the row kernel
  float q_scale, kv_scale;
  int Hq, Hkv, Hv, R, Dn, B, page_size, P;
  int index64;  // bit k set: index array k is int64 (pos_ids, batch_indices, positions,
                //   kv_indptr, kv_indices)
  int group;    // row kernel: lanes per head row (one chunk each)
  int rows;     // row kernel: head rows each lane group holds, 1 ..= ROWS
  int mrope;    // pos_ids is (3, T): mRoPE by sections (MRope in common.cuh)
  int mrope_t, mrope_h, mrope_w, mrope_interleaved;
  int guess;    // lean kernels: the decode guess (LeanSlot), set where T == B
};

// The option kernel's parameters: PagedParams's fields (same names and meanings) with the
// options' pointers and strides added. A struct of its own keeps the plain kernel's parameter
// record (and the constant-bank lines its first instructions read) exactly as before the options.
// Field order and types mirror OPTS_PARAMS in ropekv/paged.py.
struct PagedOptsParams {
  const void* q_rope;
  const void* q_nope;
  const void* k_rope;
  const void* k_nope;
  const void* v;
  void* q_rope_out;
  void* q_nope_out;
  void* kr_cache;
  void* kn_cache;
  void* v_cache;
  const float* cos_sin;
  const void* pos_ids;
  const void* batch_indices;
  const void* positions;
  const void* kv_indptr;
  const void* kv_indices;
  const float* q_scales;
  const float* kv_scales;
  float* q_scale_out;  // (T, Hq) float32: computed dequantization scale of each Q row, or null
  float* k_scales;     // per-token-head K scales, (page, entry, head) strides ks_*, or null
  float* v_scales;     // likewise for V (strides vs_*)
  int* status;         // (1,) int32: kv_indptr's code (0 valid, 4-6), or null
  i64 qr_sn, qr_sh, qn_sn, qn_sh;
  i64 kr_sn, kr_sh, kn_sn, kn_sh, v_sn, v_sh;
  i64 qro_sn, qro_sh, qno_sn, qno_sh;
  i64 krc_sp, krc_se, krc_sh;
  i64 knc_sp, knc_se, knc_sh;
  i64 vc_sp, vc_se, vc_sh;
  i64 cs_sp;
  i64 num_pages, num_indices;
  i64 pid_st;
  i64 qso_sn, qso_sh;                            // q_scale_out strides (token, head)
  i64 ks_sp, ks_se, ks_sh, vs_sp, vs_se, vs_sh;  // scale array strides (page, entry, head)
  float q_scale, kv_scale;
  int Hq, Hkv, Hv, R, Dn, B, page_size, P;
  int index64;
  int group;
  int rows;
  int mrope;
  int mrope_t, mrope_h, mrope_w, mrope_interleaved;
  int T;  // tokens (a batch of none with status= launches one block that only validates)
};

// The lean kernels' record where their offsets are 32-bit (I = int; the host then also keeps
// every stride within int32): PagedParams's fields that they read, in its order, strides and
// extents as int. A kernel reads its parameters through the constant cache; from PagedParams the
// lean kernel's SASS (sm_90a) read 8 lines of 64 bytes, from these 304 bytes 5 (QKDecodeParams in
// qknorm.cu: the same change took 3-6% off its decode calls). 64-bit offsets keep PagedParams.
// Field order and types mirror LEAN_PARAMS in ropekv/paged.py.
struct PagedLeanParams {
  const void* q_rope;
  const void* q_nope;
  const void* k_rope;
  const void* k_nope;
  const void* v;
  void* q_rope_out;
  void* q_nope_out;
  void* kr_cache;
  void* kn_cache;
  void* v_cache;
  const float* cos_sin;
  const void* pos_ids;
  const void* batch_indices;
  const void* positions;
  const void* kv_indptr;
  const void* kv_indices;
  const float* q_scales;
  const float* kv_scales;
  int qr_sn, qr_sh, qn_sn, qn_sh;
  int kr_sn, kr_sh, kn_sn, kn_sh, v_sn, v_sh;
  int qro_sn, qro_sh, qno_sn, qno_sh;
  int krc_sp, krc_se, krc_sh;
  int knc_sp, knc_se, knc_sh;
  int vc_sp, vc_se, vc_sh;
  int cs_sp;
  int num_pages, num_indices;
  int pid_st;
  float q_scale, kv_scale;
  int Hq, Hkv, Hv, R, B, page_size, P;
  int index64;
  int group;
  int guess;
};

template <typename I>
using LeanParams = typename pick_type<sizeof(I) == 4, PagedLeanParams, PagedParams>::type;

__device__ __forceinline__ i64 read_index(const void* p, i64 i, int is64) {
  return is64 ? static_cast<const i64*>(p)[i] : i64(static_cast<const int*>(p)[i]);
}

template <class P>
__device__ __forceinline__ MRope mrope_of(const P& p) {
  return MRope{p.mrope_t, p.mrope_h, p.mrope_w, p.mrope_interleaved};
}

// The RoPE position of token t (pos_ids[t]); with mRoPE (pos_ids (3, T)) its three positions in
// mpos and 0 when all lie in [0, P), else -1 (the token has no position: q unrotated, no row).
// MROPE: the kernel reads p.mrope; without it mRoPE is compiled out (it costs nothing when off).
template <bool MROPE, class P>
__device__ __forceinline__ i64 rope_position(const P& p, i64 t, i64 (&mpos)[3]) {
  if (!MROPE || !p.mrope) return read_index(p.pos_ids, t, p.index64 & 1);
  mrope_positions(p.pos_ids, p.index64 & 1, t, p.pid_st, mpos);
  return mrope_in_range(mpos, p.P) ? 0 : -1;
}

// The cache slot (page, entry) of a token at `pos` of request `b`, page = -1 when it has none:
// padding (b < 0), b outside [0, B), a negative position, kv_indptr[b] outside [0, I], a page-table
// index kv_indptr[b] + pos / page_size outside [kv_indptr[b], min(kv_indptr[b + 1], I)), or a page
// id outside [0, num_pages). Every read uses a clamped, always valid index and is checked after.
// The lookup in two steps, so that other work can go between the two dependent loads: begin reads
// kv_indptr[b] and kv_indptr[b + 1] (clamped), end checks them and reads the page id.
struct SlotLookup {
  bool ok;
  i64 first, last, idx, pos;
};

template <class P>
__device__ __forceinline__ SlotLookup slot_begin(const P& p, i64 b, i64 pos) {
  SlotLookup s{false, 0, 0, 0, pos};
  if (p.B <= 0 || p.num_indices <= 0) return s;
  s.ok = b >= 0 && b < p.B && pos >= 0;
  const i64 bc = s.ok ? b : 0;
  s.first = read_index(p.kv_indptr, bc, p.index64 & 8);
  s.last = read_index(p.kv_indptr, bc + 1, p.index64 & 8);
  s.idx = div_pos(s.ok ? pos : 0, p.page_size);
  return s;
}

template <class P>
__device__ __forceinline__ void slot_end(const P& p, const SlotLookup& s, i64& page, i64& entry) {
  page = -1;
  entry = 0;
  const bool first_ok = s.first >= 0 && s.first <= p.num_indices;
  const i64 hi = s.last < s.first ? s.first : (s.last < p.num_indices ? s.last : p.num_indices);
  const bool it_ok = s.ok && first_ok && s.idx < hi - s.first;  // no overflow: 0 <= first <= hi
  if (p.B <= 0 || p.num_indices <= 0) return;
  const i64 pg = read_index(p.kv_indices, it_ok ? s.first + s.idx : 0, p.index64 & 16);
  if (it_ok && pg >= 0 && pg < p.num_pages) {
    page = pg;
    entry = s.pos - s.idx * p.page_size;
  }
}

// slot_end in two steps, so that other work can go between the page id's load and its use:
// slot_page issues the load (the raw id, ok false: no page), slot_check validates it.
struct SlotPage {
  bool ok;
  i64 pg, entry;
};

template <class P>
__device__ __forceinline__ SlotPage slot_page(const P& p, const SlotLookup& s) {
  SlotPage r{false, -1, 0};
  const bool first_ok = s.first >= 0 && s.first <= p.num_indices;
  const i64 hi = s.last < s.first ? s.first : (s.last < p.num_indices ? s.last : p.num_indices);
  const bool it_ok = s.ok && first_ok && s.idx < hi - s.first;  // no overflow: 0 <= first <= hi
  if (p.B <= 0 || p.num_indices <= 0) return r;
  r.pg = read_index(p.kv_indices, it_ok ? s.first + s.idx : 0, p.index64 & 16);
  r.ok = it_ok;
  r.entry = s.pos - s.idx * p.page_size;
  return r;
}

template <class P>
__device__ __forceinline__ void slot_check(const P& p, const SlotPage& r, i64& page, i64& entry) {
  const bool ok = r.ok && r.pg >= 0 && r.pg < p.num_pages;
  page = ok ? r.pg : -1;
  entry = ok ? r.entry : 0;
}

template <class P>
__device__ __forceinline__ void find_slot(const P& p, i64 b, i64 pos, i64& page, i64& entry) {
  slot_end(p, slot_begin(p, b, pos), page, entry);
}

// q = x / d, r = x % d for 0 <= x, 0 < d: shifts when d is a power of two (the usual chunk and
// thread counts), the division otherwise.
__device__ __forceinline__ void divmod(int x, int d, int& q, int& r) {
  if ((d & (d - 1)) == 0) {
    const int s = __ffs(d) - 1;
    q = x >> s;
    r = x & (d - 1);
  } else {
    q = x / d;
    r = x - q * d;
  }
}

// This thread's first index in a section of the token's flat item list that starts at `base`:
// thread g (0 <= g < stride) handles the items i with i = g (mod stride).
__device__ __forceinline__ int first_index(int g, int base, int stride) {
  int q, rb;
  divmod(base, stride, q, rb);
  return g >= rb ? g - rb : g - rb + stride;
}

// Where a section writes: row `a` (stride sa) and entry `b` (stride sb) of `base`. Q outputs: a =
// token, b = 0; cache rows: a = page, b = entry, both filled by find_slot (page -1: nowhere) once
// the section's first input loads are issued, so those loads overlap the index loads.
template <typename OutT>
struct Dest {
  OutT* base;
  i64 a, sa, b, sb, sh;
};

// The token's cache slot, looked up by the first K/V section that runs in this thread.
struct Slot {
  bool found;
  i64 page, entry;
};

// Fills dst.a / dst.b with the token's slot (looked up once per thread); false: no cache row.
template <typename OutT, class P>
__device__ __forceinline__ bool cache_row(const P& p, Dest<OutT>& dst, Slot& slot, i64 b,
                                          i64 pos) {
  if (!slot.found) {
    find_slot(p, b, pos, slot.page, slot.entry);
    slot.found = true;
  }
  dst.a = slot.page;
  dst.b = slot.entry;
  return slot.page >= 0;
}

// One section: `heads` rows of `per_row` items, item (h, j) = N elements at src + h*src_sh + j*N
// (and + R/2 for a neox rotary item) -> dst row + h*sh + j*N, times the head's scale when OutT is
// fp8. ROT: rotated by cos/sin row `pos_id` of the table when that lies in [0, P), else written
// unrotated. KV: cache rows, the slot looked up (into `slot`) after the section's first loads are
// issued, so they overlap the index loads; nothing is written without a slot (the caller skips K/V
// when pos_id is outside the table).
// When the stride is a multiple of per_row (power-of-two rows: every usual shape) a thread's chunk
// j never changes: it loads U items (2U vectors for neox rotary items) before it stores any, and
// its cos/sin values once. Otherwise it walks its items one at a time.
template <typename T, typename OutT, bool NEOX, int N, bool ROT, bool KV, int U, bool MROPE,
          class P>
__device__ __forceinline__ void section(const P& p, const T* src, i64 src_sh,
                                        Dest<OutT> dst, int heads, int per_row,
                                        const float* scales, float scale, i64 pos_id,
                                        const i64 (&mpos)[3], Slot& slot,
                                        i64 b, i64 pos, int first, int stride) {
  const int count = heads * per_row;
  if (first >= count) return;
  const int half_r = p.R >> 1;
  constexpr bool PAIR = ROT && NEOX;  // two loads per item
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  const bool rope = ROT && pos_id >= 0 && pos_id < p.P;
  const float* cos_sin = p.cos_sin + (rope ? pos_id : 0) * p.cs_sp;
  int dh, dj, h0, j;
  divmod(stride, per_row, dh, dj);
  divmod(first, per_row, h0, j);
  if (dj == 0) {
    const T* s0 = src + j * N;
    float fc[M], fs[M];
    bool have_cs = false;
    for (int h = h0; h < heads; h += U * dh) {
      // raw vectors in flight (half the registers of floats); converted once all are issued
      Vec<T, N> va[U], vb[PAIR ? U : 1];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (h + u * dh < heads) {
          va[u] = load<T, N>(s0 + (h + u * dh) * src_sh);
          if constexpr (PAIR) vb[u] = load<T, N>(s0 + (h + u * dh) * src_sh + half_r);
        }
      }
      if constexpr (KV) {
        if (!cache_row(p, dst, slot, b, pos)) return;
      }
      if (rope && !have_cs) {
        const int e = NEOX ? j * N : j * N / 2;
        if (MROPE && p.mrope) {
          load_mrope_cos_sin<M>(p.cos_sin, p.cs_sp, mpos, mrope_of(p), half_r, e, fc, fs);
        } else {
          load_float<float, M>(cos_sin + e, fc);
          load_float<float, M>(cos_sin + half_r + e, fs);
        }
        have_cs = true;
      }
      OutT* d0 = dst.base + dst.a * dst.sa + dst.b * dst.sb + j * N;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hu = h + u * dh;
        if (hu < heads) {
          const float sc = scales ? __ldg(scales + hu) : scale;
          float a[N], bb[N];
          to_floats<T, N>(va[u], a);
          if constexpr (PAIR) to_floats<T, N>(vb[PAIR ? u : 0], bb);
          if (rope) rotate_chunk<NEOX, N, M>(a, bb, fc, fs);
          if constexpr (PAIR) store_float<OutT, N>(d0 + hu * dst.sh + half_r, bb, sc);
          store_float<OutT, N>(d0 + hu * dst.sh, a, sc);
        }
      }
    }
    return;
  }
  for (int w = first; w < count; w += stride) {
    int h;
    divmod(w, per_row, h, j);
    const T* s = src + h * src_sh + j * N;
    float a[N], bb[N];
    load_float<T, N>(s, a);
    if constexpr (PAIR) load_float<T, N>(s + half_r, bb);
    if constexpr (KV) {
      if (!cache_row(p, dst, slot, b, pos)) return;
    }
    if (MROPE && rope && p.mrope) {
      float fc[M], fs[M];
      load_mrope_cos_sin<M>(p.cos_sin, p.cs_sp, mpos, mrope_of(p), half_r,
                            NEOX ? j * N : j * N / 2, fc, fs);
      rotate_chunk<NEOX, N, M>(a, bb, fc, fs);
    } else if (rope) {
      if constexpr (PAIR) {
        rotate_neox<N>(a, bb, cos_sin, half_r, j * N);
      } else if constexpr (ROT) {
        rotate_interleaved<N>(a, cos_sin, half_r, j * N);
      }
    }
    const float sc = scales ? __ldg(scales + h) : scale;
    OutT* d = dst.base + dst.a * dst.sa + dst.b * dst.sb + h * dst.sh + j * N;
    if constexpr (PAIR) store_float<OutT, N>(d + half_r, bb, sc);
    store_float<OutT, N>(d, a, sc);
  }
}

// ---- status=: on-device validation of kv_indptr (graph-capturable, no host sync) -------------
// The code of kv_indptr[0..B]: 4 kv_indptr[0] != 0, 5 an entry below the one before it, 6
// kv_indptr[B] > I (the length of kv_indices), 0 valid (then every entry lies in [0, I]). Entries
// are compared as signed 64-bit values. B <= 32: a warp's lanes hold every pair and vote, no
// barrier; else the block's threads share the pairs and meet at a barrier. Every warp or block
// reaches the same code, so none waits for another. In two steps, so that the table's loads go
// out beside the page lookup's and the vote comes after the rows arrive: status_begin, then
// status_end, each called by every thread of the block.
struct StatusCheck {
  bool first, last, dec;
};

__device__ __forceinline__ unsigned warp_lanes_mask() {
  const int base = threadIdx.x & ~31;  // lanes of this warp inside the block
  const int lanes = blockDim.x - base < 32 ? blockDim.x - base : 32;
  return lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
}

template <class P>
__device__ __forceinline__ StatusCheck status_begin(const P& p) {
  const int is64 = p.index64 & 8;
  const bool warp = p.B <= 32;  // uniform
  bool decreasing = false;
  for (int i = warp ? threadIdx.x & 31 : threadIdx.x; i < p.B; i += warp ? 32 : blockDim.x)
    decreasing |= read_index(p.kv_indptr, i + 1, is64) < read_index(p.kv_indptr, i, is64);
  // every thread reads the two ends itself (one address each: broadcast loads)
  return {read_index(p.kv_indptr, 0, is64) != 0,
          read_index(p.kv_indptr, p.B, is64) > p.num_indices, decreasing};
}

template <class P>
__device__ __forceinline__ int status_end(const P& p, const StatusCheck& c) {
  const bool dec = p.B <= 32 ? __any_sync(warp_lanes_mask(), c.dec) : __syncthreads_or(c.dec);
  return c.first ? 4 : dec ? 5 : c.last ? 6 : 0;
}

// grid (T, splits): block x handles token x, its items split over the grid.y blocks; block: a
// multiple of 32 up to 256 threads. U: pass-through items per batch, UR: rotary items per batch,
// MINB: blocks of 256 threads per SM the register allocation must allow (__launch_bounds__;
// neox and mRoPE at most 4: section_min_blocks).
// Order: the token's index loads; the Q sections (rotary ones need only pos_id, pass-through ones
// no index at all); the K/V sections, whose first loads are issued before the page lookup.
// A token whose pos_id lies outside [0, P) has its q outputs written unrotated and no cache row.
// STATUS (rope_append_paged_kv_cache_status, the section kernel of a call whose only option is
// status=): every block checks kv_indptr (status_begin / status_end, below) beside its index
// loads and before its first store; with a nonzero code no block stores anything and block (0, 0)
// writes the code. The plain kernel has it compiled out.
template <typename T, typename OutT, bool NEOX, int N, int U, int UR, bool MROPE, bool STATUS,
          class P>
__device__ __forceinline__ void paged_sections(const P p) {
  pdl_launch_dependents();
  const int t = blockIdx.x;
  const int ri = NEOX ? p.R / (2 * N) : p.R / N;  // rotary items per head row
  const int ni = p.Dn / N;                         // pass-through items per head row
  const int g = blockIdx.y * blockDim.x + threadIdx.x;
  const int stride = gridDim.y * blockDim.x;

  pdl_wait();
  StatusCheck check{false, false, false};
  if constexpr (STATUS) check = status_begin(p);  // beside the token's index loads
  i64 mpos[3];
  const i64 pos_id = rope_position<MROPE>(p, t, mpos);
  const i64 b = read_index(p.batch_indices, t, p.index64 & 2);
  const i64 pos = read_index(p.positions, t, p.index64 & 4);
  if constexpr (STATUS) {  // the vote before any store
    const int code = status_end(p, check);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
    if (code) return;
  }
  Slot slot{false, -1, 0};

  int base = 0;
  section<T, OutT, NEOX, N, true, false, UR, MROPE>(
      p, static_cast<const T*>(p.q_rope) + t * p.qr_sn, p.qr_sh,
      Dest<OutT>{static_cast<OutT*>(p.q_rope_out), t, p.qro_sn, 0, 0, p.qro_sh}, p.Hq, ri,
      p.q_scales, p.q_scale, pos_id, mpos, slot, b, pos, first_index(g, base, stride), stride);
  base += p.Hq * ri;
  if (ni) {
    section<T, OutT, NEOX, N, false, false, U, MROPE>(
        p, static_cast<const T*>(p.q_nope) + t * p.qn_sn, p.qn_sh,
        Dest<OutT>{static_cast<OutT*>(p.q_nope_out), t, p.qno_sn, 0, 0, p.qno_sh}, p.Hq, ni,
        p.q_scales, p.q_scale, pos_id, mpos, slot, b, pos, first_index(g, base, stride), stride);
    base += p.Hq * ni;
  }
  if (pos_id < 0 || pos_id >= p.P) return;  // no cache row
  section<T, OutT, NEOX, N, true, true, UR, MROPE>(
      p, static_cast<const T*>(p.k_rope) + t * p.kr_sn, p.kr_sh,
      Dest<OutT>{static_cast<OutT*>(p.kr_cache), -1, p.krc_sp, 0, p.krc_se, p.krc_sh}, p.Hkv, ri,
      p.kv_scales, p.kv_scale, pos_id, mpos, slot, b, pos, first_index(g, base, stride), stride);
  base += p.Hkv * ri;
  if (ni) {
    section<T, OutT, NEOX, N, false, true, U, MROPE>(
        p, static_cast<const T*>(p.k_nope) + t * p.kn_sn, p.kn_sh,
        Dest<OutT>{static_cast<OutT*>(p.kn_cache), -1, p.knc_sp, 0, p.knc_se, p.knc_sh}, p.Hkv,
        ni, p.kv_scales, p.kv_scale, pos_id, mpos, slot, b, pos, first_index(g, base, stride),
        stride);
    base += p.Hkv * ni;
  }
  if (p.Hv)
    section<T, OutT, NEOX, N, false, true, U, MROPE>(
        p, static_cast<const T*>(p.v) + t * p.v_sn, p.v_sh,
        Dest<OutT>{static_cast<OutT*>(p.v_cache), -1, p.vc_sp, 0, p.vc_se, p.vc_sh}, p.Hv,
        (p.R + p.Dn) / N, p.kv_scales, p.kv_scale, pos_id, mpos, slot, b, pos,
        first_index(g, base, stride), stride);
}

// RoPE on a row kernel's chunk; V rows (is_v) take the identity, as the same arithmetic for every
// row lets a thread's rows interleave.
template <bool NEOX, int N, int M>
__device__ __forceinline__ void rotate_row_chunk(float (&a)[N], float (&bb)[N], const float (&c)[M],
                                                 const float (&sn)[M], bool is_v) {
  float cu[M], su[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    cu[i] = is_v ? 1.f : c[i];
    su[i] = is_v ? 0.f : sn[i];
  }
  rotate_chunk<NEOX, N, M>(a, bb, cu, su);
}

// Where head row h of token t goes (Q rows: the q outputs; K / V rows: their cache row in `page`,
// `entry`), the element of the row's part at which chunk `col` lands; null when the K / V row has
// no slot (page < 0).
template <typename OutT>
__device__ __forceinline__ OutT* row_dest(const PagedOptsParams& p, int t, int h, i64 page,
                                          i64 entry, bool rotary, int col, int vcol) {
  const int Hk = p.Hq + p.Hkv;
  if (h < p.Hq) {
    return rotary ? static_cast<OutT*>(p.q_rope_out) + t * p.qro_sn + h * p.qro_sh
                  : static_cast<OutT*>(p.q_nope_out) + t * p.qno_sn + h * p.qno_sh;
  }
  if (page < 0) return nullptr;
  if (h < Hk) {
    return rotary ? static_cast<OutT*>(p.kr_cache) + page * p.krc_sp + entry * p.krc_se +
                        (h - p.Hq) * p.krc_sh
                  : static_cast<OutT*>(p.kn_cache) + page * p.knc_sp + entry * p.knc_se +
                        (h - p.Hq) * p.knc_sh;
  }
  return static_cast<OutT*>(p.v_cache) + page * p.vc_sp + entry * p.vc_se + (h - Hk) * p.vc_sh +
         (vcol - col);
}

// Where the computed scale of head row h goes (a stored row: K / V rows have page >= 0): Q rows
// with q_scale_out, K and V rows with per-token-head scales; null otherwise.
__device__ __forceinline__ float* scale_dest(const PagedOptsParams& p, int t, int h, i64 page,
                                             i64 entry) {
  const int Hk = p.Hq + p.Hkv;
  if (h < p.Hq) return p.q_scale_out ? p.q_scale_out + t * p.qso_sn + h * p.qso_sh : nullptr;
  if (!p.k_scales) return nullptr;
  return h < Hk ? p.k_scales + page * p.ks_sp + entry * p.ks_se + (h - p.Hq) * p.ks_sh
                : p.v_scales + page * p.vs_sp + entry * p.vs_se + (h - Hk) * p.vs_sh;
}

// Computed scales: amax[u] = the largest |x| of row u of this thread's lane group after RoPE (0
// when the call computes no scale); ra / rb: the roped row (ROWS == 1: the stores take it; with
// more rows the stores rope them again, as holding every roped row in floats until its scale is
// known costs more registers than the arithmetic: 96 would spill). A lane group of G lanes, G a
// power of two up to 32, sits inside one warp (the block is a whole number of groups): xor
// shuffles over the group, every row's step at once. Other widths
// (lane groups that straddle warps: 12 lanes for D 128 with R 64, MLA's 68) meet in shared memory,
// where non-negative floats order as their bits do. fmaxf drops NaN, as row_scale expects. Every
// thread of the block calls it (shuffles, barriers).
template <typename T, typename OutT, bool NEOX, int N, int M, int ROWS>
__device__ __forceinline__ void row_maxima(const PagedOptsParams& p, const Vec<T, N> (&va)[ROWS],
                                           const Vec<T, N> (&vb)[ROWS], const float (&c)[M],
                                           const float (&sn)[M], bool pair, bool rotary,
                                           int first, int slots, int U, int H, int Hk,
                                           float (&amax)[ROWS], float (&ra)[ROWS][N],
                                           float (&rb)[ROWS][N]) {
  const auto rope_row = [&](int u) {
    to_floats<T, N>(va[u], ra[u]);
    if (pair) to_floats<T, N>(vb[u], rb[u]);
    if (rotary) rotate_row_chunk<NEOX, N, M>(ra[u], rb[u], c, sn, first + u * slots >= Hk);
  };
#pragma unroll
  for (int u = 0; u < ROWS; ++u) amax[u] = 0.f;
  if constexpr (ROWS == 1) rope_row(0);
  if (!is_quantized<OutT>::value || !(p.q_scale_out || p.k_scales)) return;  // uniform
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H) continue;
    if constexpr (ROWS > 1) rope_row(u);  // one row's floats live at a time
    float m[N];  // a tree of maxima: log2(N) + 1 dependent steps, not 2N
#pragma unroll
    for (int k = 0; k < N; ++k)
      m[k] = pair ? fmaxf(fabsf(ra[u][k]), fabsf(rb[u][k])) : fabsf(ra[u][k]);
#pragma unroll
    for (int w = N / 2; w > 0; w /= 2)
#pragma unroll
      for (int k = 0; k < w; ++k) m[k] = fmaxf(m[k], m[k + w]);
    amax[u] = m[0];
  }
  const int G = p.group;
  if (G <= 32 && (G & (G - 1)) == 0) {
    const unsigned mask = warp_lanes_mask();
    // one step for every row at once: log2(G) dependent shuffles, not ROWS times as many
    for (int o = G >> 1; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < ROWS; ++u) amax[u] = fmaxf(amax[u], __shfl_xor_sync(mask, amax[u], o));
    }
    return;
  }
  __shared__ float row_max[2048];  // slots * ROWS <= 512 * 4
  const int group = threadIdx.x / G;
  for (int i = threadIdx.x; i < slots * ROWS; i += blockDim.x) row_max[i] = 0.f;
  __syncthreads();
#pragma unroll
  for (int u = 0; u < ROWS; ++u)
    if (u < U && first + u * slots < H)
      atomicMax(reinterpret_cast<int*>(row_max) + group * ROWS + u, __float_as_int(amax[u]));
  __syncthreads();
#pragma unroll
  for (int u = 0; u < ROWS; ++u) amax[u] = row_max[group * ROWS + u];
}

// ---- The row kernel (heads whose chunks fit a lane group: GQA / MHA) ---------------------------
// A token's head rows are Q (Hq), K (Hkv) and V (Hv): H = Hq + Hkv + Hv rows. A row is cut into
// G = ri + ni chunks: chunk j < ri holds RoPE pairs (neox: dims [jN, jN + N) and their partners
// R/2 further; interleaved: dims [jN, jN + N)) of the rope part, chunk ri + i the N dims [iN,
// iN + N) of the nope part (V: dims R + iN). A group of G lanes holds one row, lane j chunk j; a
// block of blockDim.x / G groups takes p.rows rows per group: grid (T, splits), splits = ceil(H /
// (blockDim.x / G * p.rows)), so decode splits a token's rows over several blocks. The plain
// kernel's block may hold blockDim.y tokens (threadIdx.y: the token of the block; grid
// (ceil(T / blockDim.y), splits)): a token of few heads (GQA under tensor parallelism: 16-24
// lanes a token) would otherwise make blocks of less than a warp, and an SM holds at most 32
// blocks. The option kernel runs blockDim.y = 1 (its lane groups meet in shared memory by
// threadIdx.x).
// Order: every row this thread holds, its rows' scales and the token's three indices are loaded
// at once; then the cos/sin values (they need pos_id) and the cache slot (kv_indptr, then
// kv_indices); then every row is roped (V rows, pass-through chunks and tokens without a position:
// the identity) and stored, the same arithmetic for all rows so a thread's rows interleave. (Q
// rows stored before the slot lookup end no sooner: the K/V rows' chain is the kernel's length.)
// Q rows are always written (unrotated when pos_id lies outside [0, P)); K and V rows only when
// pos_id lies in [0, P) and the token has a slot.
// OPTS (the option variant; the plain kernel has all of this compiled out):
// - order: the rows, cos/sin and kv_indptr[b] loads, status='s kv_indptr loads beside them, the
//   page id's load (kv_indices), then the rows' maxima and scales while it is in flight, then the
//   status vote, the page id's checks and the stores.
// - status=: every warp or block checks kv_indptr (status_begin / status_end); with a nonzero
//   code no block stores anything, and block (0, 0) writes the code.
// - computed scales (q_scale_out: Q rows; k_scales / v_scales: K and V rows): the largest |x| of
//   each row after RoPE over its G lanes (row_maxima), the row stored as x * (max_code / a) (one
//   reciprocal) and a / max_code written by the row's lane 0 (docs/conventions.md "Computed
//   scales"). Rows without a computed scale keep the static one.
template <typename T, typename OutT, bool NEOX, int N, int ROWS, bool MROPE, bool OPTS, class P>
__device__ __forceinline__ void paged_rows(const P p) {
  pdl_launch_dependents();
  const int t = blockIdx.x * blockDim.y + threadIdx.y;
  if constexpr (!OPTS) {
    if (t >= p.pid_st) return;  // the last block's spare tokens (pid_st is T in every call)
  }
  const int G = p.group;
  const int U = ROWS == 1 ? 1 : p.rows;
  const int slots = blockDim.x / G;
  const int j = threadIdx.x % G;
  const int first = blockIdx.y * slots * U + threadIdx.x / G;  // row of u = 0; u adds u * slots
  const int half_r = p.R >> 1;
  const int ri = NEOX ? p.R / (2 * N) : p.R / N;
  const bool rotary = j < ri;
  const bool pair = NEOX && rotary;
  const int col = rotary ? j * N : (j - ri) * N;  // element of the rope / nope part
  const int vcol = rotary ? col : p.R + col;       // element of a V row
  const int Hk = p.Hq + p.Hkv;
  const int H = Hk + p.Hv;

  pdl_wait();
  if constexpr (OPTS) {
    if (t >= p.T) {  // status= with no tokens: the one block only validates
      const int code = p.status ? status_end(p, status_begin(p)) : 0;
      if (p.status && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
      return;
    }
  }
  i64 mpos[3];
  const i64 pos_id = rope_position<MROPE>(p, t, mpos);
  const i64 b = read_index(p.batch_indices, t, p.index64 & 2);
  const i64 pos = read_index(p.positions, t, p.index64 & 4);
  Vec<T, N> va[ROWS], vb[ROWS];
  float sc[ROWS];
#pragma unroll
  for (int u = 0; u < ROWS; ++u) {
    const int h = first + u * slots;
    sc[u] = 1.f;
    if (u >= U || h >= H) continue;
    const T* row;
    if (h < p.Hq) {
      row = rotary ? static_cast<const T*>(p.q_rope) + t * p.qr_sn + h * p.qr_sh
                   : static_cast<const T*>(p.q_nope) + t * p.qn_sn + h * p.qn_sh;
      if (is_quantized<OutT>::value) sc[u] = p.q_scales ? __ldg(p.q_scales + h) : p.q_scale;
    } else if (h < Hk) {
      row = rotary ? static_cast<const T*>(p.k_rope) + t * p.kr_sn + (h - p.Hq) * p.kr_sh
                   : static_cast<const T*>(p.k_nope) + t * p.kn_sn + (h - p.Hq) * p.kn_sh;
      if (is_quantized<OutT>::value)
        sc[u] = p.kv_scales ? __ldg(p.kv_scales + h - p.Hq) : p.kv_scale;
    } else {
      row = static_cast<const T*>(p.v) + t * p.v_sn + (h - Hk) * p.v_sh + (vcol - col);
      if (is_quantized<OutT>::value)
        sc[u] = p.kv_scales ? __ldg(p.kv_scales + h - Hk) : p.kv_scale;
    }
    va[u] = load<T, N>(row + col);
    if (pair) vb[u] = load<T, N>(row + col + half_r);
  }
  const bool rope = pos_id >= 0 && pos_id < p.P;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    c[i] = 1.f;
    sn[i] = 0.f;
  }
  if (MROPE && rope && rotary && p.mrope) {
    load_mrope_cos_sin<M>(p.cos_sin, p.cs_sp, mpos, mrope_of(p), half_r, NEOX ? col : col / 2, c,
                          sn);
  } else if (rope && rotary) {
    const float* cs = p.cos_sin + pos_id * p.cs_sp + (NEOX ? col : col / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }
  i64 page = -1, entry = 0;
  if constexpr (!OPTS) {  // the plain kernel, as before the options existed
    if (rope && first + (U - 1) * slots >= p.Hq) find_slot(p, b, pos, page, entry);
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      const int h = first + u * slots;
      const bool live = u < U && h < H;
      const bool is_q = h < p.Hq;
      const bool is_v = h >= Hk;
      float a[N], bb[N];
      to_floats<T, N>(va[u], a);
      if (pair) to_floats<T, N>(vb[u], bb);
      if (rotary) {
        float cu[M], su[M];
#pragma unroll
        for (int i = 0; i < M; ++i) {
          cu[i] = is_v ? 1.f : c[i];
          su[i] = is_v ? 0.f : sn[i];
        }
        rotate_chunk<NEOX, N, M>(a, bb, cu, su);
      }
      if (!live) continue;
      OutT* d;
      if (is_q) {
        d = rotary ? static_cast<OutT*>(p.q_rope_out) + t * p.qro_sn + h * p.qro_sh
                   : static_cast<OutT*>(p.q_nope_out) + t * p.qno_sn + h * p.qno_sh;
      } else if (page < 0) {
        continue;
      } else if (!is_v) {
        d = rotary ? static_cast<OutT*>(p.kr_cache) + page * p.krc_sp + entry * p.krc_se +
                         (h - p.Hq) * p.krc_sh
                   : static_cast<OutT*>(p.kn_cache) + page * p.knc_sp + entry * p.knc_se +
                         (h - p.Hq) * p.knc_sh;
      } else {
        d = static_cast<OutT*>(p.v_cache) + page * p.vc_sp + entry * p.vc_se +
            (h - Hk) * p.vc_sh + (vcol - col);
      }
      store_float<OutT, N>(d + col, a, sc[u]);
      if (pair) store_float<OutT, N>(d + col + half_r, bb, sc[u]);
    }
  } else {
    // kv_indptr[b] (the page lookup) and status='s kv_indptr loads go out together; the page id's
    // load then overlaps the rows' maxima and scales, and is checked only before the stores
    SlotLookup look{false, 0, 0, 0, pos};
    if (rope && first + (U - 1) * slots >= p.Hq) look = slot_begin(p, b, pos);
    StatusCheck check{false, false, false};
    if (p.status) check = status_begin(p);
    const SlotPage sp = slot_page(p, look);
    float amax[ROWS], ra[ROWS][N], rb[ROWS][N];
    row_maxima<T, OutT, NEOX, N, M, ROWS>(p, va, vb, c, sn, pair, rotary, first, slots, U, H, Hk,
                                          amax, ra, rb);
    if (p.status) {  // every block reaches the same code: a malformed table writes nothing
      const int code = status_end(p, check);
      if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.status = code;
      if (code) return;
    }
    slot_check(p, sp, page, entry);
    // the plain loop, with each row's computed scale where it has one
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      const int h = first + u * slots;
      if (u >= U || h >= H) continue;
      float a[N], bb[N];
      if constexpr (ROWS == 1) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          a[k] = ra[u][k];
          bb[k] = rb[u][k];
        }
      } else {
        to_floats<T, N>(va[u], a);
        if (pair) to_floats<T, N>(vb[u], bb);
        if (rotary) rotate_row_chunk<NEOX, N, M>(a, bb, c, sn, h >= Hk);
      }
      OutT* d = row_dest<OutT>(p, t, h, page, entry, rotary, col, vcol);
      if (!d) continue;
      float mul = sc[u];
      if constexpr (is_quantized<OutT>::value) {
        float* dst = scale_dest(p, t, h, page, entry);  // null: the row keeps its static scale
        if (dst) {
          // max_code / a through one reciprocal (the IEEE division's longer sequence sat on
          // every row's path to its stores); the scale written keeps a / max_code exactly
          const float a = fmaxf(amax[u], 1e-6f);
          mul = max_code<OutT>() * __frcp_rn(a);
          if (j == 0) *dst = a / max_code<OutT>();
        }
      }
      store_float<OutT, N>(d + col, a, mul);
      if (pair) store_float<OutT, N>(d + col + half_r, bb, mul);
    }
  }
}

// The plain row kernel (every option of the op off) and the option kernel. The option kernel's
// register cap keeps it at the plain kernel's occupancy (96 registers: 7 blocks of 96 threads an
// SM in prefill; uncapped, computed scales take 110 and cost an eighth of the blocks). mRoPE's
// three cos/sin rows need more (the plain mRoPE kernel takes 118; 96 would spill).
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define ROPEKV_OPTS_BOUNDS __maxnreg__(MROPE ? 128 : 96)
#else
#define ROPEKV_OPTS_BOUNDS __launch_bounds__(512)
#endif

// The section kernels' __launch_bounds__ min blocks: MINB for interleaved RoPE without mRoPE
// (MLA; 5 caps it at 48 registers, FlashInfer's count, ptxas sm_90 bf16 -> e4m3 spilling 8
// bytes), at most 4 (64 registers) for neox pairs and mRoPE, which hold twice the vectors or three
// cos/sin rows (ptxas at 5: 968 / 432 bytes of spills). MINB <= 4 is kept as it is, so TUNING's
// earlier shapes compile exactly as before.
__host__ __device__ constexpr int section_min_blocks(bool neox, bool mrope, int minb) {
  return (neox || mrope) && minb > 4 ? 4 : minb;
}

template <typename T, typename OutT, bool NEOX, int N, int U, int UR, int MINB, bool MROPE>
__global__ void __launch_bounds__(256, section_min_blocks(NEOX, MROPE, MINB))
    rope_append_paged_kv_cache(const PagedParams p) {
  paged_sections<T, OutT, NEOX, N, U, UR, MROPE, false>(p);
}

template <typename T, typename OutT, bool NEOX, int N, int U, int UR, int MINB, bool MROPE>
__global__ void __launch_bounds__(256, section_min_blocks(NEOX, MROPE, MINB))
    rope_append_paged_kv_cache_status(const PagedOptsParams p) {
  paged_sections<T, OutT, NEOX, N, U, UR, MROPE, true>(p);
}

template <typename T, typename OutT, bool NEOX, int N, int ROWS, bool MROPE>
__global__ void __launch_bounds__(512) rope_append_paged_rows(const PagedParams p) {
  paged_rows<T, OutT, NEOX, N, ROWS, MROPE, false>(p);
}

template <typename T, typename OutT, bool NEOX, int N, int ROWS, bool MROPE>
__global__ void ROPEKV_OPTS_BOUNDS rope_append_paged_rows_opts(const PagedOptsParams p) {
  paged_rows<T, OutT, NEOX, N, ROWS, MROPE, true>(p);
}

// store_float in two steps, so that a row's conversion runs before its destination is known:
// pack (x * scale rounded to OutT, store_float's arithmetic, instruction for instruction) and put
// (the one vector store). fp8 at N % 4 == 0 packs 32-bit words, as store_float does.
template <typename OutT, int N, bool WORDS = is_fp8<OutT>::value && N % 4 == 0>
struct Packer {
  using V = Vec<OutT, N>;
  static __device__ __forceinline__ V pack(const float (&x)[N], float scale) {
    V v;
    if constexpr (is_fp8<OutT>::value && N % 2 == 0) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
            make_float2(x[2 * i] * scale, x[2 * i + 1] * scale), __NV_SATFINITE,
            fp8_interpretation<OutT>::value);
        v.v[2 * i].__x = static_cast<__nv_fp8_storage_t>(two & 0xFF);
        v.v[2 * i + 1].__x = static_cast<__nv_fp8_storage_t>(two >> 8);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        v.v[i] = from_float<OutT>(is_quantized<OutT>::value ? x[i] * scale : x[i]);
      }
    }
    return v;
  }
  static __device__ __forceinline__ void put(OutT* p, const V& v) { store<OutT, N>(p, v); }
};

template <typename OutT, int N>
struct Packer<OutT, N, true> {
  using V = Vec<unsigned, N / 4>;
  static __device__ __forceinline__ V pack(const float (&x)[N], float scale) {
    V w;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const unsigned lo = __nv_cvt_float2_to_fp8x2(
          make_float2(x[4 * i] * scale, x[4 * i + 1] * scale), __NV_SATFINITE,
          fp8_interpretation<OutT>::value);
      const unsigned hi = __nv_cvt_float2_to_fp8x2(
          make_float2(x[4 * i + 2] * scale, x[4 * i + 3] * scale), __NV_SATFINITE,
          fp8_interpretation<OutT>::value);
      w.v[i] = lo | (hi << 16);
    }
    return w;
  }
  static __device__ __forceinline__ void put(OutT* p, const V& w) {
    store<unsigned, N / 4>(reinterpret_cast<unsigned*>(p), w);
  }
};

// An entry of an index array (int32 or int64) as the lean kernel reads it: its 32-bit words (the
// high one of int64 entries, else 0). below(n) says whether the entry lies in [0, n) for 0 <= n <
// 2^31 (the low word below n, as unsigned, and for int64 the high word 0), value() is the entry.
// Unlike read_index, the two widths' loads write the same registers and nothing merges them into
// a 64-bit value before its first use: that merge made the scheduler wait for the load there.
struct LeanIndex {
  unsigned lo, hi;
  int is64;
  __device__ __forceinline__ bool below(int n) const {
    return (lo < unsigned(n)) & (hi == 0u);  // hi is 0 for int32 entries: no branch on is64
  }
  __device__ __forceinline__ i64 value() const {
    return is64 ? i64((static_cast<unsigned long long>(hi) << 32) | lo) : i64(int(lo));
  }
};

__device__ __forceinline__ LeanIndex lean_index(const void* p, i64 i, int is64) {
  const unsigned* w = static_cast<const unsigned*>(p);
  LeanIndex r{0u, 0u, is64};
  if (is64) {
    r.lo = w[2 * i];
    r.hi = w[2 * i + 1];
  } else {
    r.lo = w[i];
  }
  return r;
}

// A word of an index entry. HERE: loaded where it is written in the program, by a volatile load,
// which the compiler neither drops nor sinks into the branch that uses it (a plain load used only
// behind a branch may be moved there, after the load the branch waits for).
template <bool HERE>
__device__ __forceinline__ unsigned index_word(const unsigned* a) {
  if constexpr (HERE) {
    unsigned v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(a));
    return v;
  } else {
    return *a;
  }
}

// lean_index of an entry below 2^31 (a token, or an index the 32-bit chain found in range): its
// address from 32-bit products (one wide multiply-add, not the 64-bit shifts and adds). HERE: its
// words loaded in place (index_word; the decode guess's kv_indptr entries).
template <bool HERE = false>
__device__ __forceinline__ LeanIndex lean_index32(const void* p, unsigned i, int is64) {
  const unsigned* e = static_cast<const unsigned*>(p) + (is64 ? 2u * i : i);  // 2i < 2^32
  LeanIndex r{index_word<HERE>(e), 0u, is64};  // the low word first (little-endian int64)
  if (is64) r.hi = index_word<HERE>(e + 1);
  return r;
}

// The K / V slot of token t as the lean kernels find it, in the order of its chain: begin (the
// batch index and position), indptr (kv_indptr[b] and kv_indptr[b + 1]), page_id (the page id's
// load), end (the id checked: page, entry; page -1 when the token has none, find_slot's rules:
// every read clamped or skipped). A kernel puts its own work between the steps. With 32-bit
// offsets (I = int) the host also guarantees that every index value a slot can use lies below
// 2^31 (B, num_pages and num_indices x page_size), so the chain runs on the entries' 32-bit
// words (LeanIndex: an int64 entry with a high word is out of range) instead of 64-bit values
// and compares; with 64-bit offsets it keeps the 64-bit form.
// The decode guess (32-bit form, p.guess: the host sets it where T == B, decode's one token a
// request): begin also loads kv_indptr[t] and kv_indptr[t + 1], the entries of request t, beside
// b and pos; where b turns out to be t, indptr takes them instead of loading kv_indptr[b] and
// kv_indptr[b + 1] after b lands. The chain to the page id is then two loads deep, not three;
// any other b takes the loads it took before (the guess's two loads wasted). Same values either
// way: the entries of request b.
template <typename I>
struct LeanSlot {
  static constexpr bool kNarrow = sizeof(I) == 4;
  LeanIndex b, pos, first, last, pgi;  // the 32-bit form's entries
  LeanIndex gfirst, glast;             // the decode guess: kv_indptr[t], kv_indptr[t + 1]
  unsigned tok = 0;                    // the decode guess: t, where it loaded its entries
  bool guessed = false;
  i64 b64 = -1, pos64 = -1, first64 = 0, last64 = 0;  // the 64-bit form's values
  unsigned idx = 0;                                    // 32-bit form: pos / page_size
  i64 idx64 = 0;
  bool ok = false, it_ok = false;

  template <class P>
  __device__ __forceinline__ void begin(const P& p, int t) {
    if constexpr (kNarrow) {
      b = lean_index32(p.batch_indices, unsigned(t), p.index64 & 2);
      pos = lean_index32(p.positions, unsigned(t), p.index64 & 4);
      if (p.guess && t < p.B) {  // t + 1 <= B: both entries exist
        tok = unsigned(t);
        guessed = true;
        gfirst = lean_index32<true>(p.kv_indptr, tok, p.index64 & 8);
        glast = lean_index32<true>(p.kv_indptr, tok + 1u, p.index64 & 8);
      }
    } else {
      b64 = read_index(p.batch_indices, t, p.index64 & 2);
      pos64 = read_index(p.positions, t, p.index64 & 4);
    }
  }

  template <class P>
  __device__ __forceinline__ void indptr(const P& p) {
    const int ps = p.page_size;
    const bool pow2 = (ps & (ps - 1)) == 0;
    if constexpr (kNarrow) {
      // a position of 2^31 or more has no slot: num_indices x page_size < 2^31
      ok = b.below(p.B) & pos.below(0x7fffffff) & (p.num_indices > 0);
      if (ok) {
        if (guessed && b.lo == tok) {  // the guess held (b.hi is 0: b.below)
          first = gfirst;
          last = glast;
        } else {
          first = lean_index32(p.kv_indptr, b.lo, p.index64 & 8);
          last = lean_index32(p.kv_indptr, b.lo + 1, p.index64 & 8);
        }
        idx = pow2 ? pos.lo >> (__ffs(ps) - 1) : pos.lo / unsigned(ps);
      }
    } else {
      ok = b64 >= 0 && b64 < p.B && pos64 >= 0 && p.num_indices > 0;
      if (ok) {
        first64 = read_index(p.kv_indptr, b64, p.index64 & 8);
        last64 = read_index(p.kv_indptr, b64 + 1, p.index64 & 8);
        idx64 = pow2 ? pos64 >> (__ffs(ps) - 1) : div_pos(pos64, ps);
      }
    }
  }

  template <class P>
  __device__ __forceinline__ void page_id(const P& p) {
    pgi = LeanIndex{0u, 0u, p.index64 & 16};
    if (!ok) return;
    if constexpr (kNarrow) {
      const unsigned ni = unsigned(p.num_indices);  // below 2^31 - 1 (the host's rule)
      // kv_indptr[b + 1] clamped to [kv_indptr[b], num_indices]: negative -> none, past -> ni
      const bool neg = (last.is64 ? last.hi : last.lo) >> 31;
      const unsigned lv = last.below(int(ni) + 1) ? last.lo : (neg ? 0u : ni);
      const unsigned hi = lv < first.lo ? first.lo : lv;
      it_ok = first.below(int(ni) + 1) & (idx < hi - first.lo);
      if (it_ok) pgi = lean_index32(p.kv_indices, first.lo + idx, p.index64 & 16);
    } else {
      const bool first_ok = first64 >= 0 && first64 <= p.num_indices;
      const i64 hi =
          last64 < first64 ? first64 : (last64 < p.num_indices ? last64 : p.num_indices);
      it_ok = first_ok && idx64 < hi - first64;  // no overflow: 0 <= first <= hi
      if (it_ok) pgi = lean_index(p.kv_indices, first64 + idx64, p.index64 & 16);
    }
  }

  // page -1 when the token has no slot
  template <class P>
  __device__ __forceinline__ void end(const P& p, i64& page, i64& entry) const {
    page = -1;
    entry = 0;
    if (!it_ok) return;
    if constexpr (kNarrow) {
      if (pgi.below(int(p.num_pages))) {  // num_pages below 2^31 (the host's rule)
        page = int(pgi.lo);
        entry = int(pos.lo - idx * unsigned(p.page_size));
      }
    } else {
      const i64 pg = pgi.value();
      if (pg >= 0 && pg < p.num_pages) {
        page = pg;
        entry = pos64 - idx64 * p.page_size;
      }
    }
  }
};

// ---- The lean kernel (plain decode calls) ------------------------------------------------------
// One chunk of one head row per thread: block (G, S, Tb), threadIdx.x the chunk j of the row (G =
// ri + Dn / N chunks, as the row kernel's lane group), threadIdx.y the row of blockIdx.y's group
// of S rows, threadIdx.z the token of blockIdx.x's group of Tb tokens; no division by a runtime
// value but the page's (a shift for powers of two). A token's rows are Q (Hq), K (Hkv) and V (Hv),
// chunk kinds and destinations as in the row kernel. Loads in the order of their chains, so that
// a Q row waits for two loads in a row (pos_id -> cos/sin) and a K / V row for three (b, pos ->
// kv_indptr -> kv_indices, its cos/sin loads beside the page id's; sm_90 SASS checked): the row's
// chunk, the token's indices, kv_indptr[b] and kv_indptr[b + 1], the cos/sin values, the page id,
// then the chunk rotated, scaled and rounded while the page id is in flight. The page lookup does
// not wait for pos_id (every read is clamped or skipped, so it is always in bounds). Same rules
// as the row kernel: Q rows always written
// (unrotated when pos_id lies outside [0, P)), K and V rows only when pos_id lies in [0, P) and
// the token has a slot (find_slot's checks); V rows and chunks without a rotation are converted
// as they came (the reference's copy; the row kernel rotates them by the identity). Static scales
// only (a scalar or per-head arrays); no mRoPE, no options (the host takes the row kernels for
// those). Offsets are of type I (int where every array's span fits in 31 bits, the host decides;
// long long otherwise).
constexpr int kLeanThreads = 256;  // blockDim.x * blockDim.y * blockDim.z (the host keeps to it)
// The lean kernel picks a row's source and destination by index: the five input pointers and
// their (token, head) strides, the five output pointers and their strides, must stay consecutive
// fields of PagedParams and PagedLeanParams in these orders (tests/test_paged.py checks PARAMS and
// LEAN_PARAMS, tests/test_compile.py that they are these structs).

// Head row h of a token as the lean kernels address it (rows Q, K, V in that order; chunk col
// of its rope part where rotary, else of its nope part): its kind, the index of its source among
// q_rope, q_nope, k_rope, k_nope, v and of its destination among q_rope_out, q_nope_out,
// kr_cache, kn_cache, v_cache; its head within its kind; the element of its source row that
// the chunk starts at (a V row's nope chunks lie past R).
struct LeanRow {
  bool is_q, is_v;
  int hh, e, kind;
};

__device__ __forceinline__ LeanRow lean_row(int h, int Hq, int Hk, int R, bool rotary, int col) {
  LeanRow r;
  r.is_q = h < Hq;
  r.is_v = h >= Hk;
  r.e = r.is_v && !rotary ? R + col : col;
  r.hh = r.is_q ? h : r.is_v ? h - Hk : h - Hq;
  r.kind = r.is_v ? 4 : (r.is_q ? 0 : 2) + (rotary ? 0 : 1);
  return r;
}

// The row's chunk in its source: the record's first five pointers and their (token, head)
// strides, consecutive from qr_sn, read by index (one constant load each, no branches).
template <typename T, typename I, class P>
__device__ __forceinline__ const T* lean_source(const P& p, const LeanRow& r, int t) {
  const T* src = static_cast<const T*>((&p.q_rope)[r.kind]);
  const auto s_sn = (&p.qr_sn)[2 * r.kind];
  const auto s_sh = (&p.qr_sn)[2 * r.kind + 1];
  return src + (I(t) * I(s_sn) + I(r.hh) * I(s_sh) + I(r.e));
}

// The row's destination, by index as the source: q_rope_out, q_nope_out (token, head strides
// from qro_sn), kr_cache, kn_cache, v_cache (page, entry, head strides from krc_sp); the start
// of the row's rope or nope part (the chunk adds col).
template <typename OutT, typename I, class P>
__device__ __forceinline__ OutT* lean_dest(const P& p, const LeanRow& r, int t, i64 page,
                                           i64 entry, int col) {
  OutT* d = static_cast<OutT*>((&p.q_rope_out)[r.kind]);
  if (r.is_q) {
    d += I(t) * I((&p.qro_sn)[2 * r.kind]) + I(r.hh) * I((&p.qro_sn)[2 * r.kind + 1]);
  } else {
    const auto* st = &p.krc_sp + 3 * (r.kind - 2);
    d += I(page) * I(st[0]) + I(entry) * I(st[1]) + I(r.hh) * I(st[2]) + I(r.e - col);
  }
  return d;
}

// Blocks of kLeanThreads an SM in the lean kernel's launch bounds: 5 (at most 48 registers) for
// fp16 -> fp16 with 32-bit offsets, which took 52 and fits 48 without spilling, so that prefill's
// blocks of 128 threads (`lean_split_block`, paged.py) hold 40 warps an SM as the e4m3 forms do;
// 0 (no bound) otherwise: the other forms take at most 48 already or spill at 48. Measured in
// docs/design/kernels.md, "Prefill blocks of 128 threads".
template <typename T, typename OutT, typename I>
struct lean_min_blocks {
  static constexpr int value = 0;
};
template <>
struct lean_min_blocks<__half, __half, int> {
  static constexpr int value = 5;
};

template <typename T, typename OutT, bool NEOX, int N, typename I>
__global__ void __launch_bounds__(kLeanThreads, lean_min_blocks<T, OutT, I>::value)
    rope_append_paged_rows_lean(const LeanParams<I> p) {
  pdl_launch_dependents();
  const int t = blockIdx.x * blockDim.z + threadIdx.z;
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  const int Hk = p.Hq + p.Hkv;
  if (t >= p.pid_st || h >= Hk + p.Hv) return;  // pid_st is T
  pdl_wait();
  // 1. this lane's chunk of its row, then the token's indices: K / V rows batch_indices and
  // positions (the head of their chain: b -> kv_indptr -> kv_indices), then every row pos_ids
  // (as words: a K / V row waits for b and pos, not for pos_id, before its kv_indptr loads)
  const int j = threadIdx.x;
  const int half_r = p.R >> 1;
  const int ri = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < ri;
  const bool pair = NEOX && rotary;  // two vectors per chunk: x[e] and its partner x[e + R/2]
  const int col = rotary ? j * N : (j - ri) * N;  // element of the rope / nope part
  const LeanRow r = lean_row(h, p.Hq, Hk, p.R, rotary, col);
  const bool is_q = r.is_q, is_v = r.is_v;
  const int hh = r.hh;
  const T* row = lean_source<T, I>(p, r, t);
  const Vec<T, N> va = load<T, N>(row);
  Vec<T, N> vb;
  if (pair) vb = load<T, N>(row + half_r);
  LeanSlot<I> slot;  // K / V rows: the token's slot, found in steps along the chain
  if (!is_q) slot.begin(p, t);
  const LeanIndex pid = lean_index32(p.pos_ids, unsigned(t), p.index64 & 1);
  float sc = 1.f;
  if constexpr (is_quantized<OutT>::value) {
    const float* scales = is_q ? p.q_scales : p.kv_scales;
    sc = scales ? __ldg(scales + hh) : (is_q ? p.q_scale : p.kv_scale);
  }

  // 2. K and V rows: kv_indptr[b] and kv_indptr[b + 1] (find_slot's rules: every read clamped
  // or skipped)
  if (!is_q) slot.indptr(p);

  // 3. Q and K rotary chunks with a position: their cos/sin values (one table row)
  const bool rope = pid.below(p.P);
  const bool turn = rotary && rope && !is_v;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (turn) {
    const float* cs = p.cos_sin + (I(pid.lo) * I(p.cs_sp) + I(NEOX ? col : col / 2));
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }

  // 4. K and V rows: the page id (kv_indices), issued before the rotation waits for cos/sin, its
  // words checked only after it
  slot.page_id(p);
  // 5. rotate, scale and round the chunk while the page id is in flight; then the stores
  float a[N], bb[N];
  to_floats<T, N>(va, a);
  if (pair) to_floats<T, N>(vb, bb);
  if (turn) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
  using Pack = Packer<OutT, N>;
  const typename Pack::V wa = Pack::pack(a, sc);
  typename Pack::V wb;
  if (pair) wb = Pack::pack(bb, sc);

  i64 page, entry;
  slot.end(p, page, entry);
  if (!is_q && (!rope || page < 0)) return;  // no cache row
  OutT* d = lean_dest<OutT, I>(p, r, t, page, entry, col);
  Pack::put(d + col, wa);
  if (pair) Pack::put(d + col + half_r, wb);
}

// ---- The lean kernel, C chunks of a row per thread (wide rows: MLA decode past one wave) -------
// The lean kernel's rules and order of loads (the comment above it), with C chunks of one head row
// per thread: block (X, S, Tb), X = ceil(G / C) lanes a row, lane j taking the chunks j, j + X,
// ..., j + (C - 1) X below G (consecutive lanes read consecutive 16-byte chunks). Every chunk's
// load is issued before the index loads, and the row's indices, page lookup, scale and addresses
// are found once for its C chunks: more bytes in flight per thread and fewer instructions a byte
// than one chunk a thread (ncu, H200, MLA 128 heads x 16 tokens: 914K instructions at 15 cycles an
// issue, latency-bound). Only a lane's first chunk can be rotary: the host takes this kernel only
// where ri <= X (the rotary chunks of a row, R / 2N neox, R / N interleaved), so chunks j + kX,
// k >= 1, are pass-through (q_nope, k_nope or V's), addressed from one base each.
// STREAM: the row loads carry the streaming hint (load_stream), which the host sets for calls
// that move more bytes than most of the L2 holds (paged.py, `lean_stream_l2`).
template <typename T, typename OutT, bool NEOX, int N, int C, bool STREAM, typename I>
__global__ void __launch_bounds__(kLeanThreads)
    rope_append_paged_rows_lean_multi(const LeanParams<I> p) {
  pdl_launch_dependents();
  const int t = blockIdx.x * blockDim.z + threadIdx.z;
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  const int Hk = p.Hq + p.Hkv;
  if (t >= p.pid_st || h >= Hk + p.Hv) return;  // pid_st is T
  pdl_wait();
  const bool is_q = h < p.Hq;
  const bool is_v = h >= Hk;
  const int j = threadIdx.x;
  const int X = blockDim.x;
  const int G = p.group;  // chunks of a row (ri + Dn / N)
  const int half_r = p.R >> 1;
  const int ri = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < ri;
  const bool pair = NEOX && rotary;
  const int hh = is_q ? h : is_v ? h - Hk : h - p.Hq;
  // kinds (the record's pointer index, as the lean kernel's): the pass-through one (q_nope,
  // k_nope, v) and the first chunk's (q_rope / k_rope for a rotary chunk of Q / K)
  const int kn = is_v ? 4 : (is_q ? 1 : 3);
  const int k0 = rotary && !is_v ? kn - 1 : kn;
  // pass-through chunk j' of a row lies at element nb + j' N of its kind's row (V: past R)
  const int nb = (is_v ? p.R : 0) - ri * N;
  const int off0 = rotary ? j * N : nb + j * N;  // the first chunk's element

  // 1. every chunk of this lane, then the token's indices (the lean kernel's order)
  const T* src0 = static_cast<const T*>((&p.q_rope)[k0]) +
                  (I(t) * I((&p.qr_sn)[2 * k0]) + I(hh) * I((&p.qr_sn)[2 * k0 + 1]) + I(off0));
  const T* srcn = static_cast<const T*>((&p.q_rope)[kn]) +
                  (I(t) * I((&p.qr_sn)[2 * kn]) + I(hh) * I((&p.qr_sn)[2 * kn + 1]) +
                   I(nb + j * N));
  const auto row_load = [](const T* q) {
    return STREAM ? load_stream<T, N>(q) : load<T, N>(q);
  };
  Vec<T, N> va[C];
  Vec<T, N> vb;
  va[0] = row_load(src0);
  if (pair) vb = row_load(src0 + half_r);
#pragma unroll
  for (int k = 1; k < C; ++k) {
    if (j + k * X < G) va[k] = row_load(srcn + k * X * N);
  }
  LeanSlot<I> slot;  // K / V rows: the token's slot, found in steps along the chain
  if (!is_q) slot.begin(p, t);
  const LeanIndex pid = lean_index32(p.pos_ids, unsigned(t), p.index64 & 1);
  float sc = 1.f;
  if constexpr (is_quantized<OutT>::value) {
    const float* scales = is_q ? p.q_scales : p.kv_scales;
    sc = scales ? __ldg(scales + hh) : (is_q ? p.q_scale : p.kv_scale);
  }

  // 2. K and V rows: kv_indptr[b] and kv_indptr[b + 1] (find_slot's rules)
  if (!is_q) slot.indptr(p);

  // 3. the first chunk, rotary on Q and K with a position: its cos/sin values
  const bool rope = pid.below(p.P);
  const bool turn = rotary && rope && !is_v;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (turn) {
    const float* cs = p.cos_sin + (I(pid.lo) * I(p.cs_sp) + I(NEOX ? j * N : j * N / 2));
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }

  // 4. K and V rows: the page id, issued before the rotation waits for cos/sin
  slot.page_id(p);
  // 5. rotate, scale and round every chunk while the page id is in flight; then the stores
  using Pack = Packer<OutT, N>;
  typename Pack::V w[C];
  typename Pack::V wb;
  {
    float a[N], bb[N];
    to_floats<T, N>(va[0], a);
    if (pair) to_floats<T, N>(vb, bb);
    if (turn) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
    w[0] = Pack::pack(a, sc);
    if (pair) wb = Pack::pack(bb, sc);
  }
#pragma unroll
  for (int k = 1; k < C; ++k) {
    float a[N];
    to_floats<T, N>(va[k], a);
    w[k] = Pack::pack(a, sc);
  }

  i64 page, entry;
  slot.end(p, page, entry);
  if (!is_q && (!rope || page < 0)) return;  // no cache row
  // the destinations, by index as the sources: q_rope_out, q_nope_out (token, head strides from
  // qro_sn), kr_cache, kn_cache, v_cache (page, entry, head strides from krc_sp)
  I o0, on;
  if (is_q) {
    o0 = I(t) * I((&p.qro_sn)[2 * k0]) + I(hh) * I((&p.qro_sn)[2 * k0 + 1]);
    on = I(t) * I((&p.qro_sn)[2 * kn]) + I(hh) * I((&p.qro_sn)[2 * kn + 1]);
  } else {
    const auto* s0 = &p.krc_sp + 3 * (k0 - 2);
    const auto* s1 = &p.krc_sp + 3 * (kn - 2);
    o0 = I(page) * I(s0[0]) + I(entry) * I(s0[1]) + I(hh) * I(s0[2]);
    on = I(page) * I(s1[0]) + I(entry) * I(s1[1]) + I(hh) * I(s1[2]);
  }
  OutT* d0 = static_cast<OutT*>((&p.q_rope_out)[k0]) + (o0 + I(off0));
  OutT* dn = static_cast<OutT*>((&p.q_rope_out)[kn]) + (on + I(nb + j * N));
  Pack::put(d0, w[0]);
  if (pair) Pack::put(d0 + half_r, wb);
#pragma unroll
  for (int k = 1; k < C; ++k) {
    if (j + k * X < G) Pack::put(dn + k * X * N, w[k]);
  }
}

// ---- The lean kernel, U head rows a thread (narrow rows: GQA / MHA prefill) -------------------
// The lean kernel's rules (the comment above it) with chunk j of U head rows of one token per
// thread: block (G, S, Tb), threadIdx.y taking rows y, y + S, ..., y + (U - 1) S of blockIdx.y's
// group of S U rows (consecutive lanes on consecutive 16-byte chunks of a row), rows past the
// token's H skipped. Every row's chunk load is issued first, then the token's indices once (pos_id;
// b and pos, kv_indptr and the page id when one of the rows is K / V: the same slot for all), the
// cos/sin values once (the same token and chunk for every Q and K row), then each row rotated,
// scaled, rounded and stored; a row's kind (source, destination, scale) by index as in the lean
// kernel. Why: one chunk a thread kept 32 bytes in flight through three dependent index loads
// (Llama 32 / 8 heads 8 x 1024 prefill at 74% of copy bandwidth with an e4m3 cache); U rows keep
// U times the bytes in flight for the same chain and find it once. U = 1 is the lean kernel.
// Blocks an SM in the launch bounds: U = 2 at most 64 registers (5 blocks of 192 threads, Llama's;
// 66-73 registers uncapped, sm_90; fp16 / bf16 -> e4m3 no spills at 64, fp16 -> fp16 6-12
// bytes); U >= 3 uncapped (79-105 registers; a cap of 64 spilled 80-390 bytes).
__host__ __device__ constexpr int lean_rows_min_blocks(int U) { return U == 2 ? 4 : 1; }

template <typename T, typename OutT, bool NEOX, int N, int U, typename I>
__global__ void __launch_bounds__(kLeanThreads, lean_rows_min_blocks(U))
    rope_append_paged_rows_lean_rows(const LeanParams<I> p) {
  pdl_launch_dependents();
  const int t = blockIdx.x * blockDim.z + threadIdx.z;
  const int S = blockDim.y;
  const int h0 = blockIdx.y * (S * U) + threadIdx.y;  // this thread's first row
  const int Hk = p.Hq + p.Hkv;
  const int H = Hk + p.Hv;
  if (t >= p.pid_st || h0 >= H) return;  // pid_st is T
  pdl_wait();
  const int j = threadIdx.x;
  const int half_r = p.R >> 1;
  const int ri = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < ri;
  const bool pair = NEOX && rotary;  // two vectors per chunk: x[e] and its partner x[e + R/2]
  const int col = rotary ? j * N : (j - ri) * N;  // element of the rope / nope part
  // the last row of this thread below H: K / V rows among them need the token's slot
  const int hl = min(h0 + (U - 1) * S, h0 + (H - 1 - h0) / S * S);
  const bool any_kv = hl >= p.Hq;

  // 1. every row's chunk (guarded: rows past H skipped), then the token's indices
  Vec<T, N> va[U], vb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int h = h0 + u * S;
    if (h < H) {
      const T* row = lean_source<T, I>(p, lean_row(h, p.Hq, Hk, p.R, rotary, col), t);
      va[u] = load<T, N>(row);
      if (pair) vb[u] = load<T, N>(row + half_r);
    }
  }
  LeanSlot<I> slot;  // K / V rows: the token's slot, found in steps along the chain
  if (any_kv) slot.begin(p, t);
  const LeanIndex pid = lean_index32(p.pos_ids, unsigned(t), p.index64 & 1);
  float sc[U];  // each row's scale (per-head arrays read per row)
#pragma unroll
  for (int u = 0; u < U; ++u) {
    sc[u] = 1.f;
    const int h = h0 + u * S;
    if constexpr (is_quantized<OutT>::value) {
      if (h < H) {
        const LeanRow r = lean_row(h, p.Hq, Hk, p.R, rotary, col);
        const float* scales = r.is_q ? p.q_scales : p.kv_scales;
        sc[u] = scales ? __ldg(scales + r.hh) : (r.is_q ? p.q_scale : p.kv_scale);
      }
    }
  }

  // 2. K and V rows: kv_indptr[b] and kv_indptr[b + 1] (find_slot's rules: every read clamped
  // or skipped)
  if (any_kv) slot.indptr(p);

  // 3. a rotary chunk with a position, some row Q or K (the first row is the lowest): its
  // cos/sin values, once for every row
  const bool rope = pid.below(p.P);
  const bool turn = rotary && rope && h0 < Hk;
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], sn[M];
  if (turn) {
    const float* cs = p.cos_sin + (I(pid.lo) * I(p.cs_sp) + I(NEOX ? col : col / 2));
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, sn);
  }

  // 4. K and V rows: the page id, issued before the rotations wait for cos/sin
  slot.page_id(p);

  // 5. every row rotated (Q and K rows), scaled and rounded while the page id is in flight
  using Pack = Packer<OutT, N>;
  typename Pack::V wa[U], wb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int h = h0 + u * S;
    if (h < H) {
      const bool is_v = h >= Hk;
      float a[N], bb[N];
      to_floats<T, N>(va[u], a);
      if (pair) to_floats<T, N>(vb[u], bb);
      if (turn && !is_v) rotate_chunk<NEOX, N, M>(a, bb, c, sn);
      wa[u] = Pack::pack(a, sc[u]);
      if (pair) wb[u] = Pack::pack(bb, sc[u]);
    }
  }

  i64 page, entry;
  slot.end(p, page, entry);
  const bool has_row = rope && page >= 0;  // K and V rows: a cache row to write
  // 6. the stores: Q rows always, K and V rows where the token has a slot (lean_dest)
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int h = h0 + u * S;
    const bool is_q = h < p.Hq;
    if (h < H && (is_q || has_row)) {
      OutT* d = lean_dest<OutT, I>(p, lean_row(h, p.Hq, Hk, p.R, rotary, col), t, page, entry, col);
      Pack::put(d + col, wa[u]);
      if (pair) Pack::put(d + col + half_r, wb[u]);
    }
  }
}
