// RoPE on Q and K from a cos/sin table, no cache: FlashInfer's apply_rope_with_cos_sin_cache
// (and its _inplace form), the rotation vLLM and SGLang call every step.
#include "common.cuh"

using namespace ropekv;

// Field order and types mirror PARAMS in ropekv/qk_rope.py.
struct QKRopeParams {
  const void* q;          // (T, Hq, D) T_: rows may be strided, the last dim contiguous
  const void* k;          // (T, Hk, D) T_
  void* q_out;            // (T, Hq, D) T_: q itself in place
  void* k_out;            // (T, Hk, D) T_: k itself in place
  const float* cos_sin;   // (P, R) float32, cos in [0, R/2), sin in [R/2, R)
  const void* positions;  // (T,) int32 or int64
  i64 q_st, q_sh;         // strides in elements
  i64 k_st, k_sh;
  i64 qo_st, qo_sh;
  i64 ko_st, ko_sh;
  i64 cs_sp;              // the table's row stride
  int T, Hq, Hk, D, R, P;
  int items;   // chunks per head row = lanes per lane group (blockDim.x is a multiple)
  int rows;    // head rows each lane group holds, 1 ..= kRowsMax
  int pos64;   // positions are int64
  int copy;    // out of place: the pass-through chunks [R, D) are copied, and a token without a
               // position has its rows copied unrotated
};

constexpr int kRowsMax = 4;
constexpr int kMaxThreads = 256;  // blockDim.x * blockDim.y (the host keeps to it)

// One token's head rows are Q's Hq rows then K's Hk rows, H = Hq + Hk, each cut into `items`
// chunks of N elements: chunk j < rot holds rotation pairs (neox: dims [jN, jN + N) and their
// partners R/2 further, so rot = R/2 / N; interleaved: dims [jN, jN + N), rot = R / N), the rest
// (only out of place) the pass-through dims [R + (j - rot) N, ...). A lane group of `items` lanes
// takes `rows` rows of one token (lane j: chunk j of each), loads them all, then the position,
// then its cos/sin values once for all its rows, rotates and stores: the table is read once per
// (token, chunk, lane group), not per head. Block (slots * items, tokens): threadIdx.y picks the
// token of blockIdx.x's group of blockDim.y tokens; blockIdx.y the group of slots * rows rows.
// A position outside [0, P) reads no table row: in place the token is left as it came; out of
// place its rows are copied unrotated. Offsets are of type I (int where every array's span fits
// in 31 bits, the host decides; long long otherwise).
template <typename T_, bool NEOX, int N, typename I>
__global__ void __launch_bounds__(kMaxThreads) qk_rope(const QKRopeParams p) {
  pdl_launch_dependents();
  const int token = blockIdx.x * blockDim.y + threadIdx.y;
  if (token >= p.T) return;
  const int G = p.items;
  const int U = p.rows;
  const int slots = blockDim.x / G;
  const int j = threadIdx.x % G;
  const int first = blockIdx.y * slots * U + threadIdx.x / G;  // row of u = 0; u adds u * slots
  const int H = p.Hq + p.Hk;
  const int half_r = p.R >> 1;
  const int rot = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < rot;
  const bool pair = NEOX && rotary;  // two vectors per chunk: x[e] and its partner x[e + R/2]
  const int e = rotary ? j * N : p.R + (j - rot) * N;

  const T_* q = static_cast<const T_*>(p.q) + I(token) * I(p.q_st);
  const T_* k = static_cast<const T_*>(p.k) + I(token) * I(p.k_st);

  pdl_wait();
  // 1. this lane's chunks of its rows
  Vec<T_, N> va[kRowsMax], vb[kRowsMax];
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H) continue;
    const T_* row = h < p.Hq ? q + I(h) * I(p.q_sh) : k + I(h - p.Hq) * I(p.k_sh);
    va[u] = load<T_, N>(row + e);
    if (pair) vb[u] = load<T_, N>(row + e + half_r);
  }

  // 2. the position, then its cos/sin values (one table row, read only when in range)
  const i64 pos = p.pos64 ? static_cast<const i64*>(p.positions)[token]
                          : i64(static_cast<const int*>(p.positions)[token]);
  const bool valid = pos >= 0 && pos < p.P;
  if (!valid && !p.copy) return;  // in place: the token's rows stay as they came
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], s[M];
  if (rotary && valid) {
    const float* cs = p.cos_sin + I(pos) * I(p.cs_sp) + (NEOX ? e : e / 2);
    load_float<float, M>(cs, c);
    load_float<float, M>(cs + half_r, s);
  }

  // 3. rotate and store
  T_* q_out = static_cast<T_*>(p.q_out) + I(token) * I(p.qo_st);
  T_* k_out = static_cast<T_*>(p.k_out) + I(token) * I(p.ko_st);
#pragma unroll
  for (int u = 0; u < kRowsMax; ++u) {
    const int h = first + u * slots;
    if (u >= U || h >= H) continue;
    T_* row = h < p.Hq ? q_out + I(h) * I(p.qo_sh) : k_out + I(h - p.Hq) * I(p.ko_sh);
    if (!rotary || !valid) {  // pass-through chunk, or a row copied unrotated (out of place)
      store<T_, N>(row + e, va[u]);
      if (pair) store<T_, N>(row + e + half_r, vb[u]);
      continue;
    }
    float a[N], b[N];
    to_floats<T_, N>(va[u], a);
    if (pair) to_floats<T_, N>(vb[u], b);
    rotate_chunk<NEOX, N, M>(a, b, c, s);
    store_float<T_, N>(row + e, a);
    if (pair) store_float<T_, N>(row + e + half_r, b);
  }
}

// The lean form of qk_rope: one chunk of one head row per thread, for decode (and, by the host's
// choice, any token count). Block (items, S, Tb): threadIdx.x is the chunk j, threadIdx.y the row
// of blockIdx.y's group of S rows, threadIdx.z the token of blockIdx.x's group of Tb tokens; no
// division anywhere. The position load is issued first and the row loads right behind it, so
// their latencies overlap; only the cos/sin loads wait for the position. Same rules as qk_rope:
// a position outside [0, P) reads no table row; in place the token is left as it came, out of
// place its rows are copied unrotated; pass-through chunks (j >= rot, out of place only) copied.
template <typename T_, bool NEOX, int N, typename I>
__global__ void __launch_bounds__(kMaxThreads) qk_rope_lean(const QKRopeParams p) {
  pdl_launch_dependents();
  const int token = blockIdx.x * blockDim.z + threadIdx.z;
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  if (token >= p.T || h >= p.Hq + p.Hk) return;
  pdl_wait();
  // 1. the position, then this lane's chunk of its row: all loads in flight together
  const i64 pos = p.pos64 ? __ldg(static_cast<const i64*>(p.positions) + token)
                          : i64(__ldg(static_cast<const int*>(p.positions) + token));
  const int j = threadIdx.x;
  const int half_r = p.R >> 1;
  const int rot = NEOX ? half_r / N : p.R / N;
  const bool rotary = j < rot;
  const bool pair = NEOX && rotary;  // two vectors per chunk: x[e] and its partner x[e + R/2]
  const int e = rotary ? j * N : p.R + (j - rot) * N;
  const bool is_q = h < p.Hq;
  const int hh = is_q ? h : h - p.Hq;
  const T_* row = static_cast<const T_*>(is_q ? p.q : p.k) +
                  (I(token) * I(is_q ? p.q_st : p.k_st) + I(hh) * I(is_q ? p.q_sh : p.k_sh) + I(e));
  const Vec<T_, N> va = load<T_, N>(row);
  Vec<T_, N> vb;
  if (pair) vb = load<T_, N>(row + half_r);
  T_* out = static_cast<T_*>(is_q ? p.q_out : p.k_out) +
            (I(token) * I(is_q ? p.qo_st : p.ko_st) + I(hh) * I(is_q ? p.qo_sh : p.ko_sh) + I(e));

  // 2. its cos/sin values (one table row, read only when in range)
  const bool valid = pos >= 0 && pos < p.P;
  if (!valid && !p.copy) return;  // in place: the token's rows stay as they came
  if (!rotary || !valid) {        // pass-through chunk, or a row copied unrotated (out of place)
    store<T_, N>(out, va);
    if (pair) store<T_, N>(out + half_r, vb);
    return;
  }
  constexpr int M = NEOX ? N : (N / 2 > 0 ? N / 2 : 1);
  float c[M], s[M];
  const float* cs = p.cos_sin + (I(pos) * I(p.cs_sp) + I(NEOX ? e : e / 2));
  load_float<float, M>(cs, c);
  load_float<float, M>(cs + half_r, s);

  // 3. rotate and store
  float a[N], b[N];
  to_floats<T_, N>(va, a);
  if (pair) to_floats<T_, N>(vb, b);
  rotate_chunk<NEOX, N, M>(a, b, c, s);
  store_float<T_, N>(out, a);
  if (pair) store_float<T_, N>(out + half_r, b);
}
