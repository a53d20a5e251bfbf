// merge.cuh: the log-sum-exp merge of pass 1's and pass 2's results of one row (docs/numerics.md §9).
#pragma once

#include "fpmath.cuh"

namespace apa {

struct MergeWeights {
    float w1, w2, inv;
};

// §9.1–9.3: the weights of pass 1's (m1, l1) and pass 2's (m2, l2) and the inverse of the sum.
__device__ __forceinline__ MergeWeights merge_weights(float m1, float l1, float m2, float l2) {
    const float M = fmaxf(m1, m2);                                   // §9.1
    const float w1 = (l1 > 0.0f) ? exp2x(fsub(m1, M)) : 0.0f;         // §9.2
    const float w2 = (l2 > 0.0f) ? exp2x(fsub(m2, M)) : 0.0f;
    const float inv = fdiv(1.0f, fadd(fmul(w1, l1), fmul(w2, l2)));  // §9.3
    return {w1, w2, inv};
}

// §9.4: two adjacent output channels from pass 1's part and pass 2's o2, as an f16x2 pair.
__device__ __forceinline__ uint32_t merge_out2(const MergeWeights& mw, float2 part, float o2a, float o2b) {
    const float ya = fmul(fadd(fmul(mw.w1, part.x), fmul(mw.w2, o2a)), mw.inv);
    const float yb = fmul(fadd(fmul(mw.w1, part.y), fmul(mw.w2, o2b)), mw.inv);
    return f16x2(ya, yb);
}

}  // namespace apa
