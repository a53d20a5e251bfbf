// probe.cu: single-instruction and single-primitive kernels for the GPU tests
// (tests/kernel/test_gpu_mma.py, tests/kernel/test_gpu_formats.py): the m16n8k16 MMAs of the sm90 model and wgmma's
// scale-d = 0
// (numerics.md §3.1; research/mma_models.md §8) and the arithmetic primitives of fpmath.cuh and
// formats.cuh, so that each can be compared bitwise with the emulator in isolation; and two of the
// seed's FMA sites (§1.8) on chosen operands: §7.4's P scale and §9.3–9.4's merge; and §7.7's budget
// test, its vote and βr, whose last bits no traced field shows.
#define APA_D 64  // pass1.cuh needs a head dim; the P scale of §7.4 does not depend on it
#include "fpmath.cuh"
#include "formats.cuh"
#include "merge.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "pass1.cuh"
#include "pipeline.cuh"

using namespace apa;

// Each probe's struct is declared once, as its field list (params.cuh APA_FIELDS_S), which
// apa_gpu/probes.py reads for the host.

// One tile per warp: A [16][16] row-major (binary16 bits), B [8][16] (B[n][k]), C and D [16][8] of
// C_T (float or binary16 bits). The two instantiations export their layouts under their own names, from
// the one list.
#define APA_FIELDS_ProbeMmaParams(X) X(const uint16_t*, A) X(const uint16_t*, B) X(const C_T*, C) X(C_T*, D) X(int, ntiles)
template <typename C_T>
struct ProbeMmaParams {
    APA_FIELDS_ProbeMmaParams(APA_MEMBER)
};
using ProbeMmaF32Params = ProbeMmaParams<float>;
using ProbeMmaF16Params = ProbeMmaParams<uint16_t>;
#define APA_FIELDS_ProbeMmaF32Params APA_FIELDS_ProbeMmaParams
#define APA_FIELDS_ProbeMmaF16Params APA_FIELDS_ProbeMmaParams

// One wgmma m64n64k16 per tile (a CTA of one warpgroup): A [64][16] and B [64][16] (B[n][k]) as
// binary16 bits; D0 [64][64] from scale-d = 0 over a NaN accumulator, D1 from an explicit C = +0.
#define APA_FIELDS_ProbeWgmmaParams(X) X(const uint16_t*, A) X(const uint16_t*, B) X(float*, D0) X(float*, D1)
struct ProbeWgmmaParams {
    APA_FIELDS_ProbeWgmmaParams(APA_MEMBER)
};

// One wgmma m64n64k16 with FP16 accumulation per tile (pass 2's scores, §8.1): A [64][16] from
// registers, B [64][16] (B[n][k]) from an image, C and D [64][64], all binary16 bits.
#define APA_FIELDS_ProbeWgmmaF16Params(X) \
    X(const uint16_t*, A) X(const uint16_t*, B) X(const uint16_t*, C) X(uint16_t*, D)
struct ProbeWgmmaF16Params {
    APA_FIELDS_ProbeWgmmaF16Params(APA_MEMBER)
};

#define APA_FIELDS_ProbeExp2Params(X) X(const float*, x) X(float*, y) X(long long, count) X(int, mode)
struct ProbeExp2Params {
    APA_FIELDS_ProbeExp2Params(APA_MEMBER)
};

#define APA_FIELDS_ProbeCodesParams(X) X(const float*, x) X(float*, e2m1) X(uint8_t*, e4m3) X(long long, count)
struct ProbeCodesParams {
    APA_FIELDS_ProbeCodesParams(APA_MEMBER)
};

#define APA_FIELDS_ProbeQuant16Params(X) \
    X(const float*, x) X(float*, q) X(uint8_t*, sb) X(long long, nblocks) X(int, lsq)
struct ProbeQuant16Params {
    APA_FIELDS_ProbeQuant16Params(APA_MEMBER)
};

#define APA_FIELDS_ProbeTablesParams(X) X(float*, lg2) X(float*, dec)
struct ProbeTablesParams {
    APA_FIELDS_ProbeTablesParams(APA_MEMBER)
};

// §7.4 of (gm, c_q, c) triples: dec(kb), bias and a_g of each (pass1.cuh p1_pscale).
#define APA_FIELDS_ProbePscaleParams(X)                                                               \
    X(const float*, gm) X(const float*, cq) X(const float*, c) X(float*, scale) X(float*, bias)     \
    X(float*, mass) X(long long, count) X(float, A) X(float, L) X(int, pow2) X(int, fma)
struct ProbePscaleParams {
    APA_FIELDS_ProbePscaleParams(APA_MEMBER)
};

// §9.1–9.4 of rows of two channels: (m1, l1, part[2]) and (m2, l2, o2[2]) to an f16x2 output.
#define APA_FIELDS_ProbeMergeParams(X)                                                                \
    X(const float*, m1) X(const float*, l1) X(const float*, part) X(const float*, m2) X(const float*, l2) \
    X(const float*, o2) X(uint32_t*, out) X(long long, count) X(int, fma)
struct ProbeMergeParams {
    APA_FIELDS_ProbeMergeParams(APA_MEMBER)
};

// §7.7's budget vote of single rows, one row a warp (the vote is warp-wide): state (m, la, ws), visit
// (c, tl, t2) and βr; hot is 1 where the row votes hot.
#define APA_FIELDS_ProbeBudgetVoteParams(X)                                                           \
    X(const float*, m) X(const float*, la) X(const float*, ws) X(const float*, c) X(const float*, tl) \
    X(const float*, t2) X(const float*, beta) X(uint8_t*, hot) X(long long, count)
struct ProbeBudgetVoteParams {
    APA_FIELDS_ProbeBudgetVoteParams(APA_MEMBER)
};

// §7.7's βr of rows (c_q, qstat [count][3]) against one head's kvstat [KV_STATS] (float bits).
#define APA_FIELDS_ProbeBudgetBetaParams(X)                                                                 \
    X(const float*, cq) X(const float*, qstat) X(const unsigned int*, kvstat) X(float*, beta) X(long long, count) \
    X(float, eps) X(float, rho)
struct ProbeBudgetBetaParams {
    APA_FIELDS_ProbeBudgetBetaParams(APA_MEMBER)
};

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

extern "C" __global__ void apa_probe_mma_f32(const __grid_constant__ ProbeMmaF32Params p) {
    const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (tile >= p.ntiles) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    uint32_t a[4], b0, b1;
    probe_frags(p.A + (size_t)tile * 256, p.B + (size_t)tile * 128, a, b0, b1);
    const float* c = p.C + (size_t)tile * 128;
    float acc[4] = {c[g * 8 + 2 * t0], c[g * 8 + 2 * t0 + 1], c[(g + 8) * 8 + 2 * t0], c[(g + 8) * 8 + 2 * t0 + 1]};
    mma_f32_acc(acc, a, b0, b1);
    float* d = p.D + (size_t)tile * 128;
    d[g * 8 + 2 * t0] = acc[0];
    d[g * 8 + 2 * t0 + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t0] = acc[2];
    d[(g + 8) * 8 + 2 * t0 + 1] = acc[3];
}

extern "C" __global__ void apa_probe_mma_f16(const __grid_constant__ ProbeMmaF16Params p) {
    const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (tile >= p.ntiles) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3;
    uint32_t a[4], b0, b1;
    probe_frags(p.A + (size_t)tile * 256, p.B + (size_t)tile * 128, a, b0, b1);
    const uint16_t* c = p.C + (size_t)tile * 128;
    uint32_t acc[2] = {(uint32_t)c[g * 8 + 2 * t0] | ((uint32_t)c[g * 8 + 2 * t0 + 1] << 16),
                       (uint32_t)c[(g + 8) * 8 + 2 * t0] | ((uint32_t)c[(g + 8) * 8 + 2 * t0 + 1] << 16)};
    mma_f16_acc(acc, a, b0, b1);
    uint16_t* d = p.D + (size_t)tile * 128;
    d[g * 8 + 2 * t0] = (uint16_t)(acc[0] & 0xFFFFu);
    d[g * 8 + 2 * t0 + 1] = (uint16_t)(acc[0] >> 16);
    d[(g + 8) * 8 + 2 * t0] = (uint16_t)(acc[1] & 0xFFFFu);
    d[(g + 8) * 8 + 2 * t0 + 1] = (uint16_t)(acc[1] >> 16);
}

// Whether scale-d = 0 starts a chain as C = +0 does (mma_models.md §3): what a score chain that does not
// zero its accumulators first would rely on (pass 1 still zeroes them; docs/results/performance-log.md says why).
extern "C" __global__ void __launch_bounds__(128) apa_probe_wgmma(const __grid_constant__ ProbeWgmmaParams p) {
    struct __align__(1024) Images {  // the 128-byte swizzle's period
        uint16_t h[2][64 * 64];
    };
    __shared__ Images sm;
    auto& img = sm.h;
    const size_t tile = blockIdx.x;
    for (int i = threadIdx.x; i < 64 * 64; i += 128) {
        const int r = i / 64, c = i % 64;
        img[0][sw128_half(r, c, 64)] = c < 16 ? p.A[(tile * 64 + r) * 16 + c] : 0;
        img[1][sw128_half(r, c, 64)] = c < 16 ? p.B[(tile * 64 + r) * 16 + c] : 0;
    }
    fence_proxy_async();
    __syncthreads();
    float d0[8][4], d1[8][4];
    for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e) d0[nt][e] = __uint_as_float(0x7FC00001u), d1[nt][e] = 0.0f;
    wg_fence();
    wgmma_ss_n64(d0, wg_operand(img[0]), wg_operand(img[1]), false);
    wgmma_ss_n64(d1, wg_operand(img[0]), wg_operand(img[1]), true);
    wg_commit();
    wg_wait<0>();
    const int lane = threadIdx.x & 31, row = 16 * (threadIdx.x >> 5) + (lane >> 2), t0 = lane & 3;
    for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e) {
            const size_t at = (tile * 64 + row + 8 * (e >> 1)) * 64 + 8 * nt + 2 * t0 + (e & 1);
            p.D0[at] = d0[nt][e];
            p.D1[at] = d1[nt][e];
        }
}

extern "C" __global__ void __launch_bounds__(128) apa_probe_wgmma_f16(const __grid_constant__ ProbeWgmmaF16Params p) {
    struct __align__(1024) Image {  // the 128-byte swizzle's period
        uint16_t h[64 * 64];
    };
    __shared__ Image sm;
    const size_t tile = blockIdx.x;
    for (int i = threadIdx.x; i < 64 * 64; i += 128) {
        const int r = i / 64, c = i % 64;
        sm.h[sw128_half(r, c, 64)] = c < 16 ? p.B[(tile * 64 + r) * 16 + c] : 0;
    }
    fence_proxy_async();
    __syncthreads();
    const int lane = threadIdx.x & 31, g = lane >> 2, t0 = lane & 3, w = threadIdx.x >> 5;
    uint32_t a[4], unused0, unused1;
    probe_frags(p.A + (tile * 64 + 16 * w) * 16, p.B, a, unused0, unused1);  // the warp's 16 rows of A
    const uint16_t* c = p.C + (tile * 64 + 16 * w) * 64;
    auto pk = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); };
    uint32_t acc[8][2];
    for (int nt = 0; nt < 8; ++nt) {
        acc[nt][0] = pk(c[g * 64 + 8 * nt + 2 * t0], c[g * 64 + 8 * nt + 2 * t0 + 1]);
        acc[nt][1] = pk(c[(g + 8) * 64 + 8 * nt + 2 * t0], c[(g + 8) * 64 + 8 * nt + 2 * t0 + 1]);
    }
    wg_fence();
    wgmma_rs_f16_n64(acc, a, wg_operand(sm.h));
    wg_commit();
    wg_wait<0>();
    uint16_t* d = p.D + (tile * 64 + 16 * w) * 64;
    for (int nt = 0; nt < 8; ++nt)
        for (int e = 0; e < 4; ++e)
            d[(g + 8 * (e >> 1)) * 64 + 8 * nt + 2 * t0 + (e & 1)] = (uint16_t)(acc[nt][e >> 1] >> (16 * (e & 1)));
}

// exp2s (mode 0), ex2.approx.ftz (mode 1), exp2s_core (mode 2, x in [0, 1)) or exp2s_nonpos (mode 3,
// x ≤ 0) of every element.
extern "C" __global__ void apa_probe_exp2(const __grid_constant__ ProbeExp2Params p) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.count) {
        const float x = p.x[i];
        p.y[i] = p.mode == 3 ? exp2s_nonpos(x) : p.mode == 2 ? exp2s_core(x) : p.mode ? exp2_hw(x) : exp2s(x);
    }
}

// E2M1 value and E4M3 code of every binary32 element.
extern "C" __global__ void apa_probe_codes(const __grid_constant__ ProbeCodesParams p) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.count) {
        p.e2m1[i] = e2m1_round(p.x[i]);
        p.e4m3[i] = (uint8_t)e4m3_code(p.x[i]);
    }
}

// quant16 of each block of 16 binary32 values: values q [nblocks][16], sb [nblocks].
extern "C" __global__ void apa_probe_quant16(const __grid_constant__ ProbeQuant16Params p) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.nblocks) return;
    float v[16], q[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = p.x[i * 16 + j];
    p.sb[i] = (uint8_t)quant16(v, q, p.lsq != 0);
#pragma unroll
    for (int j = 0; j < 16; ++j) p.q[i * 16 + j] = q[j];
}

// The LG2 table (9 entries) and UE4M3 dec of codes 0..0x7E.
extern "C" __global__ void apa_probe_tables(const __grid_constant__ ProbeTablesParams p) {
    const int i = threadIdx.x;
    if (i < 9) p.lg2[i] = lg2_table(i);
    if (i < 0x7F) p.dec[i] = ue4m3_dec((uint32_t)i);
}

// Every lane reaches p1_pscale, whose LG2 lookup is a shuffle across the warp. Thread t takes items
// 2t (row lo) and 2t + 1 (row hi).
extern "C" __global__ void apa_probe_pscale(const __grid_constant__ ProbePscaleParams p) {
    const long long i0 = 2 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    Pass1Args a{};
    a.A = p.A, a.L = p.L, a.pow2 = p.pow2, a.fma = p.fma;
    const int lane = threadIdx.x & 31;
    float gm[2], cq[2], c[2], bias[2], scale[2], mass[2];
    for (int h = 0; h < 2; ++h) {
        const bool in = i0 + h < p.count;
        gm[h] = in ? p.gm[i0 + h] : 0.0f, cq[h] = in ? p.cq[i0 + h] : 1.0f, c[h] = in ? p.c[i0 + h] : 0.0f;
    }
    p1_pscale(gm, cq, c, a, lg2_table(lane < 9 ? lane : 0), bias, scale, mass);
    for (int h = 0; h < 2; ++h)
        if (i0 + h < p.count) p.scale[i0 + h] = scale[h], p.bias[i0 + h] = bias[h], p.mass[i0 + h] = mass[h];
}

extern "C" __global__ void apa_probe_merge(const __grid_constant__ ProbeMergeParams p) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.count) return;
    const MergeWeights mw = merge_weights(p.m1[i], p.l1[i], p.m2[i], p.l2[i], p.fma != 0);
    const float2 y =
        merge_y2(mw, make_float2(p.part[2 * i], p.part[2 * i + 1]), p.o2[2 * i], p.o2[2 * i + 1], p.fma != 0);
    p.out[i] = f16x2(y.x, y.y);
}

// Lane 0's row lo carries the item; every other row runs no vote. moved: a = exp2(m ⊖ c) unless c == m.
extern "C" __global__ void apa_probe_budget_vote(const __grid_constant__ ProbeBudgetVoteParams p) {
    const long long i = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (i >= p.count) return;  // uniform across the warp
    const bool mine = (threadIdx.x & 31) == 0;
    WarpRows wr{};
    wr.run_lo = mine;
    P1Warp w{};
    w.beta[0] = mine ? p.beta[i] : 0.0f;
    P1State<1> st;
    p1_init(st);
    st.m[0] = mine ? p.m[i] : 0.0f, st.m[1] = 0.0f;
    st.r[0].la = mine ? p.la[i] : 0.0f, st.r[0].ws = mine ? p.ws[i] : 0.0f;
    P1Visit v{};
    v.moved = true;
    v.c[0] = mine ? p.c[i] : 0.0f, v.tl[0] = mine ? p.tl[i] : 0.0f, v.t2[0] = mine ? p.t2[i] : 0.0f;
    const bool hot = p1_budget_vote(wr, w, st, v);
    if (mine) p.hot[i] = hot;
}

// Thread t forms βr of items 2t (row lo) and 2t + 1 (row hi), as pass 1 does for its lane's rows.
extern "C" __global__ void apa_probe_budget_beta(const __grid_constant__ ProbeBudgetBetaParams p) {
    const long long i0 = 2 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i0 >= p.count) return;
    Pass1Args a{};
    a.qstat = p.qstat, a.kvstat = p.kvstat, a.eps = p.eps, a.rho = p.rho;
    GeomSizes sizes{};  // n = 0: no buffer stride, so row r reads qstat[r]
    sizes.H = sizes.Hkv = 1;
    const Geom geo(sizes, 0);
    WarpRows wr{};
    wr.r_lo = (int)i0, wr.r_hi = (int)min(i0 + 1, p.count - 1);
    const float cq[2] = {p.cq[wr.r_lo], p.cq[wr.r_hi]};
    float beta[2];
    p1_budget_beta(a, geo, wr, 0, cq, beta);
    p.beta[i0] = beta[0];
    if (i0 + 1 < p.count) p.beta[i0 + 1] = beta[1];
}

APA_PARAMS_EXPORT(ProbeMmaF32Params)
APA_PARAMS_EXPORT(ProbeMmaF16Params)
APA_PARAMS_EXPORT(ProbeWgmmaParams)
APA_PARAMS_EXPORT(ProbeWgmmaF16Params)
APA_PARAMS_EXPORT(ProbeExp2Params)
APA_PARAMS_EXPORT(ProbeCodesParams)
APA_PARAMS_EXPORT(ProbeQuant16Params)
APA_PARAMS_EXPORT(ProbeTablesParams)
APA_PARAMS_EXPORT(ProbePscaleParams)
APA_PARAMS_EXPORT(ProbeMergeParams)
APA_PARAMS_EXPORT(ProbeBudgetVoteParams)
APA_PARAMS_EXPORT(ProbeBudgetBetaParams)
