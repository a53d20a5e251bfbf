// probe.cu: single-instruction and single-primitive kernels for the GPU tests
// (tests/test_gpu_mma.py, tests/test_gpu_formats.py): the m16n8k16 MMAs of the sm90 model
// (numerics.md §3.1; research/mma_models.md §8) and the arithmetic primitives of fpmath.cuh and
// formats.cuh, so that each can be compared bitwise with the emulator in isolation.
#include "fpmath.cuh"
#include "formats.cuh"
#include "mma.cuh"

using namespace apa;

// One warp per tile: A [16][16] row-major (binary16 bits), B [8][16] (B[n][k]), C [16][8], D [16][8].
__device__ __forceinline__ void probe_frags(const uint16_t* A, const uint16_t* B, uint32_t (&a)[4], uint32_t& b0,
                                            uint32_t& b1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    auto pk = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); };
    a[0] = pk(A[g * 16 + 2 * t0], A[g * 16 + 2 * t0 + 1]);
    a[1] = pk(A[(g + 8) * 16 + 2 * t0], A[(g + 8) * 16 + 2 * t0 + 1]);
    a[2] = pk(A[g * 16 + 2 * t0 + 8], A[g * 16 + 2 * t0 + 9]);
    a[3] = pk(A[(g + 8) * 16 + 2 * t0 + 8], A[(g + 8) * 16 + 2 * t0 + 9]);
    b0 = pk(B[g * 16 + 2 * t0], B[g * 16 + 2 * t0 + 1]);
    b1 = pk(B[g * 16 + 2 * t0 + 8], B[g * 16 + 2 * t0 + 9]);
}

extern "C" __global__ void apa_probe_mma_f32(const uint16_t* A, const uint16_t* B, const float* C, float* Dout,
                                             int ntiles) {
    const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (tile >= ntiles) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    uint32_t a[4], b0, b1;
    probe_frags(A + (size_t)tile * 256, B + (size_t)tile * 128, a, b0, b1);
    const float* c = C + (size_t)tile * 128;
    float acc[4] = {c[g * 8 + 2 * t0], c[g * 8 + 2 * t0 + 1], c[(g + 8) * 8 + 2 * t0], c[(g + 8) * 8 + 2 * t0 + 1]};
    mma_f32_acc(acc, a, b0, b1);
    float* d = Dout + (size_t)tile * 128;
    d[g * 8 + 2 * t0] = acc[0];
    d[g * 8 + 2 * t0 + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t0] = acc[2];
    d[(g + 8) * 8 + 2 * t0 + 1] = acc[3];
}

extern "C" __global__ void apa_probe_mma_f16(const uint16_t* A, const uint16_t* B, const uint16_t* C,
                                             uint16_t* Dout, int ntiles) {
    const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (tile >= ntiles) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    uint32_t a[4], b0, b1;
    probe_frags(A + (size_t)tile * 256, B + (size_t)tile * 128, a, b0, b1);
    const uint16_t* c = C + (size_t)tile * 128;
    uint32_t acc[2] = {(uint32_t)c[g * 8 + 2 * t0] | ((uint32_t)c[g * 8 + 2 * t0 + 1] << 16),
                       (uint32_t)c[(g + 8) * 8 + 2 * t0] | ((uint32_t)c[(g + 8) * 8 + 2 * t0 + 1] << 16)};
    mma_f16_acc(acc, a, b0, b1);
    uint16_t* d = Dout + (size_t)tile * 128;
    d[g * 8 + 2 * t0] = (uint16_t)(acc[0] & 0xFFFFu);
    d[g * 8 + 2 * t0 + 1] = (uint16_t)(acc[0] >> 16);
    d[(g + 8) * 8 + 2 * t0] = (uint16_t)(acc[1] & 0xFFFFu);
    d[(g + 8) * 8 + 2 * t0 + 1] = (uint16_t)(acc[1] >> 16);
}

// exp2s (mode 0), ex2.approx.ftz (mode 1), exp2s_core (mode 2, x in [0, 1)) or exp2s_nonpos (mode 3,
// x ≤ 0) of every element.
extern "C" __global__ void apa_probe_exp2(const float* x, float* y, long long count, int mode) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count)
        y[i] = mode == 3 ? exp2s_nonpos(x[i]) : mode == 2 ? exp2s_core(x[i]) : mode ? exp2_hw(x[i]) : exp2s(x[i]);
}

// E2M1 code and E4M3 code of every binary32 element.
extern "C" __global__ void apa_probe_codes(const float* x, uint8_t* e2m1, uint8_t* e4m3, long long count) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        e2m1[i] = (uint8_t)e2m1_code(x[i]);
        e4m3[i] = (uint8_t)e4m3_code(x[i]);
    }
}

// quant16 of each block of 16 binary32 values: codes [nblocks][16], sb [nblocks].
extern "C" __global__ void apa_probe_quant16(const float* x, uint8_t* codes, uint8_t* sb, long long nblocks,
                                             int lsq) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks) return;
    float v[16];
    uint32_t c[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = x[i * 16 + j];
    sb[i] = (uint8_t)quant16(v, c, lsq != 0);
#pragma unroll
    for (int j = 0; j < 16; ++j) codes[i * 16 + j] = (uint8_t)c[j];
}

// The LG2 table (9 entries) and UE4M3 dec of codes 0..0x7E.
extern "C" __global__ void apa_probe_tables(float* lg2, float* dec) {
    const int i = threadIdx.x;
    if (i < 9) lg2[i] = lg2_table(i);
    if (i < 0x7F) dec[i] = ue4m3_dec((uint32_t)i);
}
