// pipeline.cuh: the shared-memory tile ring of the pass-1 and pass-2 mainloops (scheduling only:
// docs/numerics.md §6.2 — no arithmetic depends on it).
//
// Why not one __syncthreads per tile: it keeps the 12 warps of a CTA in lockstep, so all of them
// are in the MMA phase (tensor cores busy, ALU idle) or in the softmax/quantization phase (the
// reverse) at the same time. With a ring of NS stages and per-stage mbarriers a warp may run up to
// NS - 1 tiles ahead of the slowest one, and the scheduler overlaps one warp's MMAs with another's
// ALU work.
//
// Protocol, per stage s = i mod NS of the CTA's i-th tile:
//   full[s]  mbarrier, 32 arrivals: the loading warp's cp.async.mbarrier.arrive.noinc, one per lane,
//            each firing once the lane's copies have landed; consumers wait on its phase parity.
//   done[s]  release counter: every warp adds 1 (acq_rel) after its last read of the stage; the
//            warp that brings it to 12 (i / NS + 1) is the last reader, and loads tile i + NS there.
// Counters only grow (no reset to race with), and every warp waits on every tile of the sequence,
// computing or not, so each phase completes exactly once per use.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace apa {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#ifdef APA_SIM
    apa_sim::mbar_init(bar, count);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
                 "r"(count));
#endif
}
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
#ifndef APA_SIM
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)));
#endif
}
// One arrival on bar once all of this thread's earlier cp.async copies have completed.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
#ifdef APA_SIM
    apa_sim::mbar_arrive(bar);  // the simulator's copies are synchronous
#else
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
#endif
}
// Wait until the phase of bar with the given parity has completed (acquire, CTA scope).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef APA_SIM
    apa_sim::mbar_wait(bar, parity);
#else
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT;\n}\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
        "r"(parity)
        : "memory");
#endif
}
// Shared-memory counter increment that orders the warp's earlier reads before any later reader of
// the result (and the loader's later copies after everybody's reads).
__device__ __forceinline__ uint32_t atom_add_acq_rel(uint32_t* p, uint32_t v) {
#ifdef APA_SIM
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#else
    uint32_t old;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(v)
                 : "memory");
    return old;
#endif
}

// Dynamic shared memory of a kernel: the ring's barriers and counters (at offset 0, where both
// passes of the fused launch find them), its stages, then the pass's own data. Pass 1 runs
// NS = 5 (its Q̂ rows take the rest of the 227 KB), pass 2 NS = 6: its warps skip the tiles of the
// CTA's union that are not their own, so they run further ahead of the slowest one.
constexpr int STAGE_HALVES = 2 * TILE * LDS;  // K then V (K̂ then V̂ in pass 1) of one tile
constexpr int RING_MAX_STAGES = 6;
constexpr int RING_SYNC_BYTES = 80;
static_assert(RING_SYNC_BYTES >= RING_MAX_STAGES * (8 + 4) && RING_SYNC_BYTES % 16 == 0, "ring barriers");
template <int NS>
constexpr int ring_smem_bytes() { return RING_SYNC_BYTES + NS * STAGE_HALVES * 2; }

template <int NS>
struct TileRing {
    static_assert(NS <= RING_MAX_STAGES && NS <= WARPS, "the prologue gives step s to warp s");
    uint64_t* full;
    uint32_t* done;
    uint16_t* base;

    __device__ __forceinline__ explicit TileRing(uint16_t* smem)
        : full(reinterpret_cast<uint64_t*>(smem)),
          done(reinterpret_cast<uint32_t*>(reinterpret_cast<uint64_t*>(smem) + RING_MAX_STAGES)),
          base(smem + RING_SYNC_BYTES / 2) {}

    // Thread 0 arms the ring for a work item (fresh: first use of this shared memory by the CTA;
    // otherwise the previous item's barriers, whatever its NS, are invalidated first); the caller's
    // __syncthreads publishes it.
    __device__ __forceinline__ void reset(bool fresh) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < RING_MAX_STAGES; ++s) {
                if (!fresh) mbar_inval(full + s);
                mbar_init(full + s, 32);
                done[s] = 0;
            }
        }
    }
    __device__ __forceinline__ uint16_t* stage(int i) const { return base + (i % NS) * STAGE_HALVES; }
    // The pass's own data after the stages.
    __device__ __forceinline__ uint16_t* tail() const { return base + NS * STAGE_HALVES; }

    // Every lane of the warp that loads step i (the prologue gives step s < NS to warp s): rows
    // r < nrows of K and V from krow(r) and vrow(r) (D halves each, 16-byte chunks), rows
    // nrows..63 zero-filled.
    template <class KRow, class VRow>
    __device__ __forceinline__ void load(int i, int nrows, KRow&& krow, VRow&& vrow) {
        constexpr int CH = D / 8;
        uint16_t* st = stage(i);
#pragma unroll 4
        for (int c = threadIdx.x & 31; c < TILE * CH; c += 32) {
            const int r = c / CH, col = (c % CH) * 8;
            const bool in = r < nrows;
            const uint32_t bytes = in ? 16u : 0u;
            cp_async16(st + r * LDS + col, krow(in ? r : 0) + col, bytes);
            cp_async16(st + (TILE + r) * LDS + col, vrow(in ? r : 0) + col, bytes);
        }
        cp_async_arrive(full + i % NS);
    }
    __device__ __forceinline__ void wait(int i) { mbar_wait(full + i % NS, (uint32_t)(i / NS) & 1u); }

    // Every lane of every warp, after the warp's last read of step i's stage. True for the last of
    // the CTA's warps: that warp loads step i + NS into stage(i), if there is one.
    __device__ __forceinline__ bool release(int i) {
        __syncwarp();
        uint32_t old = 0;
        if ((threadIdx.x & 31) == 0) old = atom_add_acq_rel(done + i % NS, 1u);
        old = __shfl_sync(0xFFFFFFFFu, old, 0);
        return old == (uint32_t)(WARPS * (i / NS + 1) - 1);
    }
};

}  // namespace apa
