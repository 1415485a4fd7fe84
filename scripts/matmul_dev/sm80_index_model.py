#!/usr/bin/env python3
# CPU model of csrc/cuda/matmul/sm80.cuh index math: cp.async staging + swizzle,
# ldmatrix(.trans) lane addresses (bank-conflict check), mma.sync fragment
# layouts (PTX ISA), epilogue and raster; compares with numpy. No GPU needed.
#   python3 scripts/matmul_dev/sm80_index_model.py [M N K]
# Python model of sm80.cuh's index math (smem staging, swizzle, ldmatrix, mma fragments, epilogue).
import numpy as np, itertools, sys
def swz_xor(CPR, r):
    if CPR >= 8: return r & 7
    if CPR == 4: return (r >> 1) & 3
    if CPR == 2: return (r >> 2) & 1
    return 0
def swz(CPR, r, c): return r * CPR + (c ^ swz_xor(CPR, r))

def load_tile(smem, ROWS, CPR, THREADS, G, outer_rem, inner_rem):
    # G(r, e) -> element at stored row r, inner element e (only called in range)
    EPC = 8; RPI = THREADS // CPR
    assert THREADS % CPR == 0 and (ROWS*CPR) % THREADS == 0 and RPI % 8 == 0
    written = set()
    for tid in range(THREADS):
        r0, c = tid // CPR, tid % CPR
        inner = c * EPC; n_in = inner_rem - inner
        nbytes = 0 if n_in <= 0 else min(n_in, EPC) * 2
        dst0 = swz(CPR, r0, c)
        for i in range(ROWS // RPI):
            r = r0 + i * RPI
            ok = nbytes > 0 and r < outer_rem
            dst = dst0 + i * RPI * CPR
            assert dst == swz(CPR, r, c)
            assert dst not in written; written.add(dst)
            vals = [G(r, inner + e) if (ok and e < nbytes // 2) else 0 for e in range(8)]
            smem[dst] = vals
    assert len(written) == ROWS * CPR

def ldsm_x4(smem, addrs, trans):
    # addrs: 32 chunk indices; returns regs[lane][j] = (lo, hi)
    regs = [[None]*4 for _ in range(32)]
    for j in range(4):
        M = [smem[addrs[8*j + row]] for row in range(8)]
        for i in range(32):
            if not trans: regs[i][j] = (M[i//4][2*(i%4)], M[i//4][2*(i%4)+1])
            else: regs[i][j] = (M[2*(i%4)][i//4], M[2*(i%4)+1][i//4])
    return regs

def bank_check(addrs):
    for j in range(4):
        slots = [(addrs[8*j+r] % 8) for r in range(8)]
        assert len(set(slots)) == 8, ("bank conflict", slots)

def ldsm_addrs(CPR, base, kk, k_inner, odd_rows):
    # Chunk addresses of one ldmatrix.x4 (a 16x16 block at M or N index `base`,
    # k-step kk); lane l addresses a row of matrix j = l >> 3.  k_inner: the
    # tile stores K innermost.  odd_rows: matrix j reads rows +8 for odd j and
    # chunk j >> 1 (else rows +8 for j >= 2 and chunk j & 1); the A tile wants
    # that when K is innermost, the B tile when it is not.
    addrs = []
    for lane in range(32):
        j, r8 = lane >> 3, lane & 7
        lr = r8 + ((j & 1) if odd_rows else (j >> 1)) * 8
        lc = (j >> 1) if odd_rows else (j & 1)
        lx = lc ^ swz_xor(CPR, lr)
        row = base if k_inner else kk*16; ch = kk*2 if k_inner else base // 8
        ad = (row + lr) * CPR + (ch ^ lx)
        assert ad == swz(CPR, row + lr, ch + lc)
        addrs.append(ad)
    bank_check(addrs)
    return addrs

def run_block(A, B, M, N, K, m0, n0, BM, BN, BK, WARPS_M, WARPS_N, A_K, B_K):
    THREADS = 32 * WARPS_M * WARPS_N
    WM, WN = BM // WARPS_M, BN // WARPS_N; MI, NI = WM // 16, WN // 8; KK = BK // 16
    TA_ROWS, TA_CPR = (BM, BK//8) if A_K else (BK, BM//8)
    TB_ROWS, TB_CPR = (BN, BK//8) if B_K else (BK, BN//8)
    acc = np.zeros((THREADS, MI, NI, 4))
    KT = (K + BK - 1) // BK
    for kt in range(KT):
        k0 = kt * BK
        sa, sb = {}, {}
        if A_K: load_tile(sa, TA_ROWS, TA_CPR, THREADS, lambda r, e: A[m0+r, k0+e], M-m0, K-k0)
        else:   load_tile(sa, TA_ROWS, TA_CPR, THREADS, lambda r, e: A[m0+e, k0+r], K-k0, M-m0)
        if B_K: load_tile(sb, TB_ROWS, TB_CPR, THREADS, lambda r, e: B[k0+e, n0+r], N-n0, K-k0)
        else:   load_tile(sb, TB_ROWS, TB_CPR, THREADS, lambda r, e: B[k0+r, n0+e], K-k0, N-n0)
        for warp in range(THREADS // 32):
            wm0 = (warp // WARPS_N) * WM; wn0 = (warp % WARPS_N) * WN
            for kk in range(KK):
                af = {}; bf = {}
                for mi in range(MI):
                    addrs = ldsm_addrs(TA_CPR, wm0 + mi*16, kk, A_K, A_K)
                    af[mi] = ldsm_x4(sa, addrs, not A_K)
                for nj in range(NI // 2):
                    addrs = ldsm_addrs(TB_CPR, wn0 + nj*16, kk, B_K, not B_K)
                    r = ldsm_x4(sb, addrs, not B_K)
                    bf[2*nj] = [(r[l][0], r[l][1]) for l in range(32)]
                    bf[2*nj+1] = [(r[l][2], r[l][3]) for l in range(32)]
                # mma semantics (PTX ISA fragment layouts)
                for mi in range(MI):
                    Af = np.zeros((16, 16))
                    for l in range(32):
                        g, t = l >> 2, l & 3
                        regs = af[mi][l]
                        for (ri, (rr, cc)) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
                            Af[rr, cc], Af[rr, cc+1] = regs[ri]
                    for ni in range(NI):
                        Bf = np.zeros((16, 8))
                        for l in range(32):
                            g, t = l >> 2, l & 3
                            (b00, b01), (b10, b11) = bf[ni][l]
                            Bf[2*t, g], Bf[2*t+1, g] = b00, b01
                            Bf[2*t+8, g], Bf[2*t+9, g] = b10, b11
                        D = Af @ Bf
                        for l in range(32):
                            g, t = l >> 2, l & 3
                            tid = warp*32 + l
                            acc[tid, mi, ni] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]
    C = np.full((M, N), np.nan)
    for tid in range(THREADS):
        warp, lane = tid >> 5, tid & 31
        wm0 = (warp // WARPS_N) * WM; wn0 = (warp % WARPS_N) * WN
        g, t4 = lane >> 2, lane & 3
        for mi in range(MI):
            for h in range(2):
                row = m0 + wm0 + mi*16 + g + h*8
                if row >= M: continue
                for ni in range(NI):
                    col = n0 + wn0 + ni*8 + t4*2
                    x, y = acc[tid, mi, ni, 2*h], acc[tid, mi, ni, 2*h+1]
                    if col < N: C[row, col] = x
                    if col + 1 < N: C[row, col+1] = y
    return C

def raster(tiles_m, tiles_n):
    out = []
    GROUP = 8
    for t in range(tiles_m * tiles_n):
        width = GROUP * tiles_n
        first_m = (t // width) * GROUP
        gsz = min(tiles_m - first_m, GROUP)
        out.append((first_m + (t % width) % gsz, (t % width) // gsz))
    assert sorted(out) == [(a, b) for a in range(tiles_m) for b in range(tiles_n)]
    return out

def gemm(A, B, cfg, A_K, B_K):
    BM, BN, BK, WARPS_M, WARPS_N = cfg
    M, K = A.shape; N = B.shape[1]
    tm, tn = -(-M // BM), -(-N // BN)
    C = np.full((M, N), np.nan)
    for (pm, pn) in raster(tm, tn):
        Cb = run_block(A, B, M, N, K, pm*BM, pn*BN, BM, BN, BK, WARPS_M, WARPS_N, A_K, B_K)
        mask = ~np.isnan(Cb); assert not np.any(mask & ~np.isnan(C)); C[mask] = Cb[mask]
    return C

rng = np.random.default_rng(0)
cfgs = [(64, 64, 32, 2, 2), (128, 128, 32, 2, 4), (128, 256, 32, 2, 4)]
shapes = [(1, 1, 1), (17, 9, 33), (64, 64, 64), (70, 130, 41)] if len(sys.argv) < 2 else [tuple(map(int, sys.argv[1:4]))]
for cfg in cfgs:
    for (M, N, K) in shapes:
        if cfg[0] == 128 and M*N*K > 200000: continue
        for A_K, B_K in itertools.product([True, False], repeat=2):
            A = rng.integers(-3, 4, (M, K)).astype(float); B = rng.integers(-3, 4, (K, N)).astype(float)
            C = gemm(A, B, cfg, A_K, B_K)
            ok = np.array_equal(C, A @ B)
            print(cfg, (M, N, K), A_K, B_K, "OK" if ok else "MISMATCH", flush=True)
            if not ok: sys.exit(1)
