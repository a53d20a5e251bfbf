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
