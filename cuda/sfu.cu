// sfu.cu: the approximate special-function instructions that numerics.md §13 models, each evaluated on
// chosen inputs, for apa_gpu/sfu.py (it checks the models of apa_emu/sfu.py against the hardware and
// measures their tables). Only the GPU runs it: the CPU simulator has no special-function unit.
#include <cstdint>
#include "params.cuh"

// op: which instruction (apa_gpu/sfu.py OPS). a: the inputs' bits, or null for the consecutive bit
// patterns start, start + 1, ... (an exhaustive sweep, wrapping at 2³²); b: the divisors of div.full;
// out: the results' bits. A binary16 operand is the low half of its word.
#define APA_FIELDS_SfuParams(X) X(const uint32_t*, a) X(const uint32_t*, b) X(uint32_t*, out) \
    X(long long, start) X(long long, count) X(int, op)
struct SfuParams {
    APA_FIELDS_SfuParams(APA_MEMBER)
};

namespace {

// Each instruction as PTX names it, so that ptxas expands it exactly as it does in a user's kernel
// (ex2.approx.f32 and rcp.approx.f32 around the unit's op, div.full.f32 with its operand scaling).
__device__ __forceinline__ uint32_t sfu_eval(int op, uint32_t a, uint32_t b) {
    float r = 0.0f;
    const float x = __uint_as_float(a);
    switch (op) {
        case 0: asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); break;
        case 1: asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); break;
        case 2: {
            uint16_t h = (uint16_t)a, y;
            asm("ex2.approx.f16 %0, %1;" : "=h"(y) : "h"(h));
            return y;
        }
        case 3: {
            uint32_t y;
            asm("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(a));
            return y;
        }
        case 4: asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); break;
        case 5: asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); break;
        case 6: asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(__uint_as_float(b))); break;
        case 7: asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); break;
        default: return 0xFFFFFFFFu;
    }
    return __float_as_uint(r);
}

}  // namespace

extern "C" __global__ void apa_sfu(const __grid_constant__ SfuParams p) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.count;
         i += (long long)gridDim.x * blockDim.x) {
        const uint32_t a = p.a ? p.a[i] : (uint32_t)(p.start + i);
        p.out[i] = sfu_eval(p.op, a, p.b ? p.b[i] : 0u);
    }
}

APA_PARAMS_EXPORT(SfuParams)
