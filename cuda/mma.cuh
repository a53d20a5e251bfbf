// mma.cuh: the tensor-core instruction of the sm90 model and fragment helpers
// (docs/numerics.md §3.1; ../shared/research/mma_models.md §3-4).
//
// mma.sync.aligned.m16n8k16.row.col with FP16 operands: one fused step over 16 products and C.
// Fragment layout (lane = 4*g + t0, g = lane>>2, t0 = lane&3):
//   A (16x16, row-major) regs a0..a3, each an f16x2 pair:
//     a0: row g,   k = 2t0, 2t0+1      a1: row g+8, k = 2t0, 2t0+1
//     a2: row g,   k = 2t0+8, 2t0+9    a3: row g+8, k = 2t0+8, 2t0+9
//   B (16x8, "col": B[k][n] with n fixed per lane) regs b0, b1:
//     b0: k = 2t0, 2t0+1, n = g        b1: k = 2t0+8, 2t0+9, n = g
//   C/D f32: c0, c1: row g, n = 2t0, 2t0+1;  c2, c3: row g+8, n = 2t0, 2t0+1
//   C/D f16: c0 (f16x2): row g, n = 2t0, 2t0+1; c1: row g+8.
// So a score accumulator of n-tile nt holds key j = 8nt + 2t0 + e (numerics.md §6.5), and the
// accumulators of n-tiles 2kk and 2kk+1 are exactly the A fragment of k-step kk (keys 16kk..+15).
#pragma once

#include <stdint.h>
#include <string.h>

namespace apa {

// acc = acc + A.B, FP32 accumulation (RZ to binary32, F = 25; numerics.md §3.1).
__device__ __forceinline__ void mma_f32_acc(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef APA_SIM
    apa_sim::mma_f32(acc, a, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// D = C + A.B, FP16 accumulation (one RNE to binary16 per step; numerics.md §3.1).
__device__ __forceinline__ void mma_f16_acc(uint32_t (&acc)[2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef APA_SIM
    apa_sim::mma_f16(acc, a, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 "
        "{%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
        : "+r"(acc[0]), "+r"(acc[1])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ldmatrix: four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem_row) {
#ifdef APA_SIM
    apa_sim::ldmatrix_x4(r, smem_row, false);
#else
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* smem_row) {
#ifdef APA_SIM
    apa_sim::ldmatrix_x4(r, smem_row, true);
#else
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// cp.async 16 bytes global -> shared (L2 only), with zero fill when src_bytes == 0.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, uint32_t src_bytes) {
#ifdef APA_SIM
    if (src_bytes) memcpy(smem, gmem, 16);
    else memset(smem, 0, 16);
#else
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef APA_SIM
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef APA_SIM
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---------------------------------------------------------------------------------------------
// wgmma (sm_90a), for pass 1. mma_models.md §3: a wgmma k16 step is the same fused step (F = 25,
// RZ-FP32) as mma.sync m16n8k16, and the per-warp fragments are mma.sync's: warp j of the
// warpgroup holds rows 16j..16j+15 of A (registers or image) and of D, n-tile nt of D in acc[nt].
// Shared-memory operands are K-major images with the 128-byte swizzle: rows of 64 halves
// (128 bytes), 8-row groups 1024 bytes apart, 16-byte chunk c of row r stored at chunk c ^ (r & 7),
// every further 64 channels in a block of its own after all rows. A k16 step starts 32 bytes
// further into the row. The accumulators are plain f32 chains from the caller's C (scale-d = 1). On the
// H200 scale-d = 0 equals C = +0 (mma_models.md §3; tests/kernel/test_gpu_mma.py test_wgmma_scale_d_zero),
// but the kernels do not use it: without the moves that zero C, ptxas serializes pass 1's wgmma
// (C7515; docs/results/performance-log.md, "Pass 1 in the FlashAttention-3 shape").
// ---------------------------------------------------------------------------------------------

// Half offset of element (r, c) in an image of R rows (K-major, channels or keys c).
__host__ __device__ constexpr int sw128_half(int r, int c, int R) {
    return (c >> 6) * R * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// Shared-window address (the simulator's is the host address; its low bits match the layout).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
#ifdef APA_SIM
    return (uint32_t)reinterpret_cast<uintptr_t>(p);
#else
    return (uint32_t)__cvta_generic_to_shared(p);
#endif
}

// A shared-memory operand of wgmma: its descriptor (the start address in 16-byte units, SBO = 1024
// bytes, 128-byte swizzle), built once per image; a k16 step or block offset is an addition to the
// address field (images stay below 256 KB, so it never carries out). The simulator keeps the pointer.
struct WgOperand {
#ifdef APA_SIM
    const uint16_t* p;
    WgOperand plus(int halves) const { return {p + halves}; }
#else
    uint64_t d;
    __device__ __forceinline__ WgOperand plus(int halves) const { return {d + (uint64_t)(halves >> 3)}; }
#endif
};
__device__ __forceinline__ WgOperand wg_operand(const uint16_t* start) {
#ifdef APA_SIM
    return {start};
#else
    return {(uint64_t)((smem_addr(start) & 0x3FFFFu) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) |
            (1ull << 62)};
#endif
}

#ifdef APA_SIM
// Halves k, k+1 (k even) of row n of the operand whose k16 step starts at start: the hardware's
// address arithmetic (descriptor offsets, then the swizzle on address bits 4-6 by bits 7-9).
inline uint32_t wg_pair(WgOperand op, int n, int k) {
    uintptr_t p = reinterpret_cast<uintptr_t>(op.p) + (uintptr_t)((n >> 3) * 1024 + (n & 7) * 128 + 2 * k);
    p ^= ((p >> 7) & 7) << 4;
    return *reinterpret_cast<const uint32_t*>(p);
}
// The B fragments of n-tile nt, then acc[nt] += A.B, for every n-tile (each warp on its own rows).
template <int NT>
inline void wg_sim_steps(float (&acc)[NT][4], const uint32_t (&a)[4], WgOperand b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    for (int nt = 0; nt < NT; ++nt)
        apa_sim::mma_f32(acc[nt], a, wg_pair(b, 8 * nt + g, 2 * t0), wg_pair(b, 8 * nt + g, 2 * t0 + 8));
}
#endif

// Before the first wgmma of a chain: orders the warp's register writes of accumulators and A.
__device__ __forceinline__ void wg_fence() {
#ifndef APA_SIM
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// After the last wgmma of a chain: commit it as one group.
__device__ __forceinline__ void wg_commit() {
#ifndef APA_SIM
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Named barrier id of n threads: bar.sync waits for the n, bar.arrive counts itself and goes on.
// Pass 1's warpgroups take turns at the tensor cores with them (pass1_cta.cuh); scheduling only, so the
// simulator, which runs an MMA when it is issued, skips them.
__device__ __forceinline__ void named_bar_sync(int id, int n) {
#ifndef APA_SIM
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
#endif
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
#ifndef APA_SIM
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
#endif
}

// Wait until at most N committed groups are pending: the results of the others are in the
// registers and their shared-memory reads are done.
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifndef APA_SIM
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// acc = (accumulate ? acc : +0) + A.B over one k16 step, A and B (64 keys) from images: the scores of
// pass 1. accumulate false is the instruction's scale-d = 0.
__device__ __forceinline__ void wgmma_ss_n64(float (&acc)[8][4], WgOperand a, WgOperand b, bool accumulate = true) {
#ifdef APA_SIM
    if (!accumulate)
        for (auto& nt : acc) nt[0] = nt[1] = nt[2] = nt[3] = 0.0f;
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3, m = 16 * ((threadIdx.x >> 5) & 3) + g;
    const uint32_t af[4] = {wg_pair(a, m, 2 * t0), wg_pair(a, m + 8, 2 * t0), wg_pair(a, m, 2 * t0 + 8),
                            wg_pair(a, m + 8, 2 * t0 + 8)};
    wg_sim_steps(acc, af, b);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
        " %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]),
          "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]),
          "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]),
          "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3]),
          "+f"(acc[4][0]), "+f"(acc[4][1]), "+f"(acc[4][2]), "+f"(acc[4][3]),
          "+f"(acc[5][0]), "+f"(acc[5][1]), "+f"(acc[5][2]), "+f"(acc[5][3]),
          "+f"(acc[6][0]), "+f"(acc[6][1]), "+f"(acc[6][2]), "+f"(acc[6][3]),
          "+f"(acc[7][0]), "+f"(acc[7][1]), "+f"(acc[7][2]), "+f"(acc[7][3])
        : "l"(a.d), "l"(b.d), "r"(accumulate ? 1 : 0));
#endif
}

// acc += A.B over one k16 step, A from registers (mma.sync's A fragment), B (N = NT * 8 channels)
// from an image: the cold P·V of pass 1.
template <int NT>
__device__ __forceinline__ void wgmma_rs(float (&acc)[NT][4], const uint32_t (&a)[4], WgOperand b) {
    static_assert(NT == 8 || NT == 16 || NT == 32, "N = 64, 128 or 256");
#ifdef APA_SIM
    wg_sim_steps(acc, a, b);
#else
    if constexpr (NT == 32) {  // N = 256 (no such wgmma): the image's channels 0..127, then 128.. (16 KB on)
        wgmma_rs(reinterpret_cast<float(&)[16][4]>(acc[0]), a, b);
        wgmma_rs(reinterpret_cast<float(&)[16][4]>(acc[16]), a, b.plus(128 * TILE));
    } else if constexpr (NT == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
        " {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]),
          "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]),
          "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]),
          "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3]),
          "+f"(acc[4][0]), "+f"(acc[4][1]), "+f"(acc[4][2]), "+f"(acc[4][3]),
          "+f"(acc[5][0]), "+f"(acc[5][1]), "+f"(acc[5][2]), "+f"(acc[5][3]),
          "+f"(acc[6][0]), "+f"(acc[6][1]), "+f"(acc[6][2]), "+f"(acc[6][3]),
          "+f"(acc[7][0]), "+f"(acc[7][1]), "+f"(acc[7][2]), "+f"(acc[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b.d), "r"(1));
    } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"
        " {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]),
          "+f"(acc[1][0]), "+f"(acc[1][1]), "+f"(acc[1][2]), "+f"(acc[1][3]),
          "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]),
          "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3]),
          "+f"(acc[4][0]), "+f"(acc[4][1]), "+f"(acc[4][2]), "+f"(acc[4][3]),
          "+f"(acc[5][0]), "+f"(acc[5][1]), "+f"(acc[5][2]), "+f"(acc[5][3]),
          "+f"(acc[6][0]), "+f"(acc[6][1]), "+f"(acc[6][2]), "+f"(acc[6][3]),
          "+f"(acc[7][0]), "+f"(acc[7][1]), "+f"(acc[7][2]), "+f"(acc[7][3]),
          "+f"(acc[8][0]), "+f"(acc[8][1]), "+f"(acc[8][2]), "+f"(acc[8][3]),
          "+f"(acc[9][0]), "+f"(acc[9][1]), "+f"(acc[9][2]), "+f"(acc[9][3]),
          "+f"(acc[10][0]), "+f"(acc[10][1]), "+f"(acc[10][2]), "+f"(acc[10][3]),
          "+f"(acc[11][0]), "+f"(acc[11][1]), "+f"(acc[11][2]), "+f"(acc[11][3]),
          "+f"(acc[12][0]), "+f"(acc[12][1]), "+f"(acc[12][2]), "+f"(acc[12][3]),
          "+f"(acc[13][0]), "+f"(acc[13][1]), "+f"(acc[13][2]), "+f"(acc[13][3]),
          "+f"(acc[14][0]), "+f"(acc[14][1]), "+f"(acc[14][2]), "+f"(acc[14][3]),
          "+f"(acc[15][0]), "+f"(acc[15][1]), "+f"(acc[15][2]), "+f"(acc[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b.d), "r"(1));
    }
#endif
}

// acc += A.B over one k16 step with FP16 accumulation (one RNE to binary16 per step, as mma_f16_acc),
// A from registers (mma.sync's A fragment), B (64 keys) from an image; acc[nt] is mma_f16_acc's C
// fragment of n-tile nt (rows g and g + 8 of the warp, as packed pairs). The probe of pass 2's FP16
// chains on wgmma (tests/kernel/test_gpu_mma.py test_wgmma_f16_accumulation_is_the_mma_step: the same step as
// mma.sync's on the H200). Pass 2 does not use it: its scores on it, every warp of a slice joining each
// tile of the slice's union, measured 7-17 % slower (docs/results/performance-log.md).
__device__ __forceinline__ void wgmma_rs_f16_n64(uint32_t (&acc)[8][2], const uint32_t (&a)[4], WgOperand b) {
#ifdef APA_SIM
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    for (int nt = 0; nt < 8; ++nt)
        apa_sim::mma_f16(acc[nt], a, wg_pair(b, 8 * nt + g, 2 * t0), wg_pair(b, 8 * nt + g, 2 * t0 + 8));
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f16.f16.f16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
        " {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+r"(acc[0][0]), "+r"(acc[0][1]), "+r"(acc[1][0]), "+r"(acc[1][1]), "+r"(acc[2][0]), "+r"(acc[2][1]),
          "+r"(acc[3][0]), "+r"(acc[3][1]), "+r"(acc[4][0]), "+r"(acc[4][1]), "+r"(acc[5][0]), "+r"(acc[5][1]),
          "+r"(acc[6][0]), "+r"(acc[6][1]), "+r"(acc[7][0]), "+r"(acc[7][1])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b.d), "r"(1));
#endif
}

// Ready flags of the fused launch: a release store and an acquire load at gpu scope.
__device__ __forceinline__ void flag_release(unsigned int* p) {
#ifdef APA_SIM
    apa_sim::flag_release(p);
#else
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(1u) : "memory");
#endif
}
__device__ __forceinline__ unsigned int flag_acquire(const unsigned int* p) {
#ifdef APA_SIM
    return apa_sim::flag_acquire(p);
#else
    unsigned int f;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(p) : "memory");
    return f;
#endif
}

}  // namespace apa
