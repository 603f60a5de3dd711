"""NumPy emulation of qkv_mma_tiled<T, W_INT4, TN, S, STAGES, KG> (ropekv/kernels/qkv.cu) for one
CTA's main loop, index formulas copied from the kernel: the stages as load / scale_issue /
scale_store write them (in the kernel's order of iterations), the fragments as ldmatrix / lds128
read them, __byte_perm, int4_pair in T arithmetic, mma.m16n8k16's fragment layout, the partial
sums as stored to `part`; against the float64 product of the weights dequantized and rounded to
T. Also the bank groups of the shared loads. CPU only:
``python3 tools/experiments/qkv_tiled_int4_emu.py [case ...]`` (it mirrors the kernel by hand:
keep the two in step)."""

import sys

import ml_dtypes
import numpy as np

MMA_ROWS, TILED_WM, TILED_WN = 128, 64, 32


def int4_a_at(r, ch):
    return r * 64 + ((ch ^ ((r >> 1) & 3)) << 4)


def int4_b_at(r, ch):
    return r * 256 + ((ch ^ (((r & 1) << 2) | ((r >> 1) & 3))) << 4)


def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 0xF] << (8 * i) for i in range(4))


def bits_to(dt, u16):
    return np.array([u16], np.uint16).view(dt)[0]


def to_bits(dt, v):
    return int(np.array([v], dt).view(np.uint16)[0])


def pair_op(dt, a, b, op):  # T pair arithmetic, each half rounded to T
    r = 0
    for h in range(2):
        x = np.float32(bits_to(dt, (a >> (16 * h)) & 0xFFFF))
        y = np.float32(bits_to(dt, (b >> (16 * h)) & 0xFFFF))
        v = dt.type(op(np.float64(x), np.float64(y)))  # exact op then one rounding
        r |= to_bits(dt, v) << (16 * h)
    return r


def int4_pair(dt, w, i, sub, scale):
    magic = 0x64006400 if dt == np.float16 else 0x43004300
    m = ((w >> (4 * i)) & 0x000F000F) | magic
    return pair_op(dt, pair_op(dt, m, sub, lambda x, y: x - y), scale, lambda x, y: x * y)


def u32(buf, addr, n=1):
    return [
        int(np.frombuffer(buf[addr + 4 * i : addr + 4 * i + 4].tobytes(), np.uint32)[0])
        for i in range(n)
    ]


def run(dt, TN, S, STAGES, KG, K, N, nt, G, zp, kbeg, kc, seed, row0=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (N, K))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    scales = rng.uniform(0.5, 1.5, (N, K // G)).astype(dt)
    zps = rng.integers(0, 256, (N, K // G)).astype(np.uint8) if zp else None
    Ttot = nt + 3
    x = rng.standard_normal((Ttot, K)).astype(dt)
    t0 = 0
    BK, A_ROW, B_ROW = 128, 64, 256
    THREADS = TN * 2 * KG
    WARPS_N = TN // TILED_WN
    KSTEPS = A_ROW // 32 // KG
    MT, NT = 4, 4
    A_CHUNKS, B_CHUNKS = A_ROW // 16, B_ROW // 16
    A_BYTES = MMA_ROWS * A_ROW
    S_CHUNKS = BK // 32
    S_ENTRIES = MMA_ROWS * S_CHUNKS
    S_LOADS = S_ENTRIES // THREADS
    STAGE_BYTES = A_BYTES + TN * B_ROW + S_ENTRIES * 8
    A_STEP, B_STEP = THREADS // A_CHUNKS, THREADS // B_CHUNKS
    A_LOADS, B_LOADS = MMA_ROWS // A_STEP, TN // B_STEP
    klen = max(0, min(kc, K - kbeg))
    kend = kbeg + klen
    nk = (klen + BK - 1) // BK
    smem = np.full(STAGES * STAGE_BYTES, 0xAB, np.uint8)  # garbage
    wbytes = packed  # (N, K/2)
    xbytes = x.view(np.uint8).reshape(Ttot, K * 2)
    magic = 0x64006400 if dt == np.float16 else 0x43004300

    def load(stage, ks):
        base = stage * STAGE_BYTES
        dk = ks * BK
        for tid in range(THREADS):
            ra, ca = tid // A_CHUNKS, tid % A_CHUNKS
            rb, cb = tid // B_CHUNKS, tid % B_CHUNKS
            ka, kb = kbeg + ca * (BK // A_CHUNKS), kbeg + cb * 8
            for j in range(A_LOADS):
                on = ka + dk < kend and row0 + ra + j * A_STEP < N
                dst = base + int4_a_at(ra + j * A_STEP, ca)
                if on:
                    n = row0 + ra + j * A_STEP
                    src = (ka + dk) // 2
                    smem[dst : dst + 16] = wbytes[n, src : src + 16]
                else:
                    smem[dst : dst + 16] = 0
            for j in range(B_LOADS):
                on = kb + dk < kend and rb + j * B_STEP < nt
                dst = base + A_BYTES + int4_b_at(rb + j * B_STEP, cb)
                if on:
                    t = t0 + rb + j * B_STEP
                    src = (kb + dk) * 2
                    smem[dst : dst + 16] = xbytes[t, src : src + 16]
                else:
                    smem[dst : dst + 16] = 0

    pend = {}

    def scale_issue(ks):
        for tid in range(THREADS):
            k = kbeg + ks * BK + (tid & 3) * 32
            grp = k // G
            for j in range(S_LOADS):
                n = row0 + (tid >> 2) + j * (THREADS // 4)
                on = k < kend and n < N
                sb = to_bits(dt, scales[n, grp]) if on else 0
                z = int(zps[n, grp]) if on and zp else 8
                pend[tid, j] = (sb, z)

    def scale_store(stage):
        for tid in range(THREADS):
            base = (
                stage * STAGE_BYTES
                + A_BYTES
                + TN * B_ROW
                + (tid >> 2) * (S_CHUNKS * 8)
                + (tid & 3) * 8
            )
            for j in range(S_LOADS):
                sb, z = pend[tid, j]
                sub = (magic + (z & 0xF) * 0x10001) & 0xFFFFFFFF
                sc = (sb * 0x10001) & 0xFFFFFFFF
                a = base + j * (THREADS // 4) * (S_CHUNKS * 8)
                smem[a : a + 8] = np.array([sc, sub], np.uint32).view(np.uint8)

    for s in range(STAGES - 1):
        if s < nk:
            load(s, s)
    for s in range(STAGES - 2):
        if s < nk:
            scale_issue(s)
            scale_store(s)
    if STAGES - 2 < nk:
        scale_issue(STAGES - 2)

    nwarps = THREADS // 32
    acc = np.zeros((nwarps, 32, MT, NT, 4))
    for ks in range(nk):
        if ks + STAGES - 2 < nk:
            scale_store((ks + STAGES - 2) % STAGES)
        # barrier
        if ks + STAGES - 1 < nk:
            # the buffer being overwritten must not be the one read now
            assert (ks + STAGES - 1) % STAGES != ks % STAGES
            load((ks + STAGES - 1) % STAGES, ks + STAGES - 1)
            scale_issue(ks + STAGES - 1)
        a_base = (ks % STAGES) * STAGE_BYTES
        b_base = a_base + A_BYTES
        s_base = b_base + TN * B_ROW
        for warp in range(nwarps):
            kg = warp // (2 * WARPS_N)
            wk = warp - kg * 2 * WARPS_N
            wm, wn = wk // WARPS_N, wk - (wk // WARPS_N) * WARPS_N
            for kk in range(kg * KSTEPS, (kg + 1) * KSTEPS):
                # per lane fragments
                af = np.zeros((32, MT, 4), np.int64)
                bf = np.zeros((32, NT, 8), np.int64)
                sf = np.zeros((32, MT, 2, 4), np.int64)
                addr = {}
                for lane in range(32):
                    a_row, a_half = wm * TILED_WM + (lane & 15), lane >> 4
                    for m in range(MT):
                        addr[lane, m] = a_base + int4_a_at(a_row + m * 16, 2 * kk + a_half)
                for lane in range(32):
                    g, c = lane >> 2, lane & 3
                    for m in range(MT):
                        for i in range(4):  # ldmatrix x4: matrix i, row g from lane 8i + g
                            af[lane, m, i] = u32(smem, addr[8 * i + g, m] + 4 * c)[0]
                    for n in range(NT):
                        t = wn * TILED_WN + n * 8 + g
                        for h in range(2):
                            vx, vy, vz, vw = u32(smem, b_base + int4_b_at(t, 8 * kk + 4 * h + c), 4)
                            bf[lane, n, 4 * h] = byte_perm(vx, vz, 0x5410)
                            bf[lane, n, 4 * h + 1] = byte_perm(vx, vz, 0x7632)
                            bf[lane, n, 4 * h + 2] = byte_perm(vy, vw, 0x5410)
                            bf[lane, n, 4 * h + 3] = byte_perm(vy, vw, 0x7632)
                    for m in range(MT):
                        for h in range(2):
                            sf[lane, m, h] = u32(
                                smem,
                                s_base
                                + (wm * TILED_WM + m * 16 + h * 8 + g) * (S_CHUNKS * 8)
                                + kk * 16,
                                4,
                            )
                for m in range(MT):
                    for h in range(2):
                        wg = np.zeros((32, 4), np.int64)
                        w8 = np.zeros((32, 4), np.int64)
                        for lane in range(32):
                            sg, s8 = sf[lane, m, 0], sf[lane, m, 1]
                            scale_g, sub_g = (sg[2], sg[3]) if h else (sg[0], sg[1])
                            scale_8, sub_8 = (s8[2], s8[3]) if h else (s8[0], s8[1])
                            for i in range(4):
                                wg[lane, i] = int4_pair(
                                    dt, int(af[lane, m, 2 * h]), i, int(sub_g), int(scale_g)
                                )
                                w8[lane, i] = int4_pair(
                                    dt, int(af[lane, m, 2 * h + 1]), i, int(sub_8), int(scale_8)
                                )
                        for n in range(NT):
                            for s in range(2):
                                regsA = [
                                    (wg[l, 2 * s], w8[l, 2 * s], wg[l, 2 * s + 1], w8[l, 2 * s + 1])
                                    for l in range(32)
                                ]
                                regsB = [
                                    (bf[l, n, 4 * h + 2 * s], bf[l, n, 4 * h + 2 * s + 1])
                                    for l in range(32)
                                ]
                                mma(dt, acc[warp, :, m, n], regsA, regsB)
    # partial sums as the kernel stores them (sum over k groups)
    part = np.zeros((TN, MMA_ROWS))
    for warp in range(nwarps):
        kg = warp // (2 * WARPS_N)
        wk = warp - kg * 2 * WARPS_N
        wm, wn = wk // WARPS_N, wk - (wk // WARPS_N) * WARPS_N
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            for m in range(MT):
                for n in range(NT):
                    rl, tt = wm * TILED_WM + m * 16 + g, wn * TILED_WN + n * 8 + 2 * c
                    a = acc[warp, lane, m, n]
                    part[tt, rl] += a[0]
                    part[tt + 1, rl] += a[1]
                    part[tt, rl + 8] += a[2]
                    part[tt + 1, rl + 8] += a[3]
    # reference: weights dequantized and rounded to T, over the slice, valid rows / tokens
    z = (zps & 0xF).astype(np.float64) if zp else np.full(scales.shape, 8.0)
    zk = np.repeat(z, G, axis=1)
    sk = np.repeat(scales.astype(np.float64), G, axis=1)
    w = ((q - zk) * sk).astype(dt).astype(np.float64)
    ref = np.zeros((TN, MMA_ROWS))
    rows = min(MMA_ROWS, N - row0)
    ref[:nt, :rows] = (
        x[t0 : t0 + nt, kbeg:kend].astype(np.float64) @ w[row0 : row0 + rows, kbeg:kend].T
    )
    err = np.abs(part - ref).max() / max(1e-30, np.abs(ref).max())
    return err, int((np.abs(ref).sum(0) > 0).sum()), int((np.abs(ref).sum(1) > 0).sum())


def mma(dt, accs, regsA, regsB):
    """m16n8k16 row.col: lane (g, c): a0 (g, 2c..), a1 (g + 8, 2c..), a2 (g, 2c + 8..),
    a3 (g + 8, 2c + 8..); b0 (k 2c.., n g), b1 (k 2c + 8.., n g); d0, d1 (g, 2c, 2c + 1),
    d2, d3 (g + 8, ...)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))

    def halves(u):
        return [
            np.float64(np.float32(bits_to(dt, (int(u) >> (16 * h)) & 0xFFFF))) for h in range(2)
        ]

    for lane in range(32):
        g, c = lane >> 2, lane & 3
        a0, a1, a2, a3 = (halves(r) for r in regsA[lane])
        A[g, 2 * c : 2 * c + 2] = a0
        A[g + 8, 2 * c : 2 * c + 2] = a1
        A[g, 2 * c + 8 : 2 * c + 10] = a2
        A[g + 8, 2 * c + 8 : 2 * c + 10] = a3
        b0, b1 = (halves(r) for r in regsB[lane])
        B[2 * c : 2 * c + 2, g] = b0
        B[2 * c + 8 : 2 * c + 10, g] = b1
    D = A @ B
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        accs[lane, 0] += D[g, 2 * c]
        accs[lane, 1] += D[g, 2 * c + 1]
        accs[lane, 2] += D[g + 8, 2 * c]
        accs[lane, 3] += D[g + 8, 2 * c + 1]


def check_banks():
    # ldmatrix phases: 8 rows (r0 + i) at logical chunk ch -> 8 distinct 16-byte bank groups?
    ok = all(
        len({(int4_a_at(r0 + i, ch) // 16) % 8 for i in range(8)}) == 8
        for r0 in range(0, 128, 8)
        for ch in range(4)
    )
    print("A ldmatrix conflict-free:", ok)
    assert ok
    # B lds128: quarter q: lanes g in (2q, 2q+1), c 0..3: token base+g, chunk 8kk + 4h + c
    worst = 0
    for base in range(0, 128, 8):
        for kk in range(2):
            for h in range(2):
                for q in range(4):
                    groups = [
                        (int4_b_at(base + g, 8 * kk + 4 * h + c) // 16) % 8
                        for g in (2 * q, 2 * q + 1)
                        for c in range(4)
                    ]
                    worst = max(worst, max(groups.count(x) for x in groups))
    print("B lds128 max ways per quarter warp:", worst)
    assert worst == 1
    # the B rows are permutations of the 16 chunks
    print(
        "B swizzle bijective:",
        all(
            sorted(int4_b_at(r, ch) - r * 256 for ch in range(16)) == list(range(0, 256, 16))
            for r in range(64)
        ),
    )
    print(
        "A swizzle bijective:",
        all(
            sorted(int4_a_at(r, ch) - r * 64 for ch in range(4)) == list(range(0, 64, 16))
            for r in range(128)
        ),
    )
    # scales lds128: quarter q, rows g 2q, 2q+1 (4 lanes each same address): r*32 + kk*16
    worst = 0
    for q in range(4):
        addrs = {(2 * q + i) * 32 + 16 for i in range(2)}
        banks = [(a // 16) % 8 for a in addrs]
        worst = max(worst, max(banks.count(b) for b in banks))
    print("scale lds128 max ways:", worst)
    assert worst == 1


if __name__ == "__main__":
    check_banks()
    F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
    cases = [
        # dt, TN, S, STAGES, KG, K, N, nt, G, zp, kbeg, kc, row0
        (F16, 32, 1, 3, 1, 384, 128, 32, 32, True, 0, 384, 0),
        (BF16, 32, 1, 2, 2, 256, 100, 19, 128, False, 0, 256, 0),
        (F16, 64, 2, 4, 1, 512, 200, 64, 64, True, 256, 256, 128),  # rank 1, partial rows
        (BF16, 32, 4, 3, 1, 768, 96, 5, 96, True, 640, 256, 0),  # slice past K: 128 left
        (F16, 64, 1, 2, 2, 256, 64, 40, 256, True, 0, 256, 0),
        (F16, 32, 2, 3, 1, 256, 128, 32, 32, False, 256, 128, 0),  # empty slice
        (BF16, 128, 2, 2, 2, 512, 160, 77, 32, True, 256, 256, 0),  # 16 warps: 1 entry each
    ]
    which = [int(a) for a in sys.argv[1:]] or range(len(cases))
    for i in which:
        dt, TN, S, STG, KG, K, N, nt, G, zp, kbeg, kc, row0 = cases[i]
        err, rows, tokens = run(dt, TN, S, STG, KG, K, N, nt, G, zp, kbeg, kc, seed=i, row0=row0)
        print(
            f"case {i} {dt.name} {cases[i][1:]}: rows {rows} tokens {tokens} rel err {err}",
            flush=True,
        )
        assert err < 1e-12
