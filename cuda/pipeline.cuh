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
//   full[s]  mbarrier; consumers wait on its phase parity. Row loads (pass 2): 32 arrivals, the
//            loading warp's cp.async.mbarrier.arrive.noinc, one per lane, each firing once the
//            lane's copies have landed. Image loads (pass 1): one arrival, the loader's expect_tx of
//            the stage's bytes, which its two bulk copies (K̂ and V̂ᵀ tile images, prep.cuh) count.
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
// One arrival on bar that also expects tx more bytes of bulk copies before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t tx) {
#ifdef APA_SIM
    apa_sim::mbar_arrive_expect_tx(bar, tx);
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(bar)),
                 "r"(tx)
                 : "memory");
#endif
}
// Bulk (TMA) copy of bytes (a multiple of 16, both addresses 16-byte aligned) into shared memory,
// counted on bar when it lands.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
#ifdef APA_SIM
    memcpy(smem, gmem, bytes);
    apa_sim::mbar_complete_tx(bar, bytes);
#else
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            (uint32_t)__cvta_generic_to_shared(smem)),
        "l"(gmem), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar))
        : "memory");
#endif
}
// Orders this thread's generic-proxy accesses before its later async-proxy ones (bulk copies,
// wgmma operand reads) of shared memory.
__device__ __forceinline__ void fence_proxy_async() {
#ifndef APA_SIM
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
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
// NS = 5 stages of tile images (its Q̂ images take the rest of the 227 KB), pass 2 NS = 6 of padded
// rows: its warps skip the tiles of the CTA's union that are not their own, so they run further
// ahead of the slowest one.
constexpr int RING_MAX_STAGES = 6;
constexpr int RING_SYNC_BYTES = 80;
static_assert(RING_SYNC_BYTES >= RING_MAX_STAGES * (8 + 4) && RING_SYNC_BYTES % 16 == 0, "ring barriers");

// IMAGES: stages hold K̂ then V̂ᵀ as wgmma operand images (mma.cuh sw128_*), 1024-byte aligned (the
// period of the 128-byte swizzle), loaded by two bulk copies. Otherwise: K then V as TILE padded
// rows of LDS halves, loaded row by row with zero fill.
template <bool IMAGES>
__host__ __device__ constexpr int stage_halves() { return IMAGES ? 2 * TILE * D : 2 * TILE * LDS; }
template <bool IMAGES>
__host__ __device__ constexpr int ring_align() { return IMAGES ? 1024 : 16; }
template <int NS, bool IMAGES>
constexpr int ring_smem_bytes() {
    return RING_SYNC_BYTES + (ring_align<IMAGES>() - 16) + NS * stage_halves<IMAGES>() * 2;
}

template <int NS, bool IMAGES>
struct TileRing {
    static_assert(NS <= RING_MAX_STAGES && NS <= WARPS, "the prologue gives step s to warp s");
    static constexpr int STAGE = stage_halves<IMAGES>();
    uint64_t* full;
    uint32_t* done;
    uint16_t* base;

    // smem is 16-byte aligned; the stages start at the next multiple of ring_align() after the
    // barriers (shared-window addresses: the swizzle acts on address bits).
    __device__ __forceinline__ explicit TileRing(uint16_t* smem)
        : full(reinterpret_cast<uint64_t*>(smem)),
          done(reinterpret_cast<uint32_t*>(reinterpret_cast<uint64_t*>(smem) + RING_MAX_STAGES)) {
        constexpr uint32_t A = ring_align<IMAGES>();
        const uint32_t at = smem_addr(smem) + RING_SYNC_BYTES;
        base = smem + (RING_SYNC_BYTES + ((A - at % A) % A)) / 2;
    }

    // Thread 0 arms the ring for a work item (fresh: first use of this shared memory by the CTA;
    // otherwise the previous item's barriers, whatever its kind, are invalidated first); the
    // caller's __syncthreads publishes it.
    __device__ __forceinline__ void reset(bool fresh) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < RING_MAX_STAGES; ++s) {
                if (!fresh) mbar_inval(full + s);
                mbar_init(full + s, IMAGES ? 1 : 32);
                done[s] = 0;
            }
        }
    }
    __device__ __forceinline__ uint16_t* stage(int i) const { return base + (i % NS) * STAGE; }
    // The pass's own data after the stages.
    __device__ __forceinline__ uint16_t* tail() const { return base + NS * STAGE; }

    // Every lane of the warp that loads step i (the prologue gives step s < NS to warp s): rows
    // r < nrows of K and V from krow(r) and vrow(r) (D halves each, 16-byte chunks), rows
    // nrows..63 zero-filled.
    template <class KRow, class VRow>
    __device__ __forceinline__ void load(int i, int nrows, KRow&& krow, VRow&& vrow) {
        static_assert(!IMAGES, "row loads fill padded rows");
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
    // Every lane of the warp that loads step i: the two tile images (TILE * D halves each, as prep
    // wrote them) by lane 0. The fence orders the readers' earlier accesses, published to this warp
    // by the release counter, before the async-proxy writes.
    __device__ __forceinline__ void load_images(int i, const uint16_t* kimg, const uint16_t* vimg) {
        static_assert(IMAGES, "image loads fill image stages");
        if ((threadIdx.x & 31) == 0) {
            uint64_t* bar = full + i % NS;
            uint16_t* st = stage(i);
            fence_proxy_async();
            mbar_arrive_expect_tx(bar, 2u * TILE * D * 2);
            bulk_copy(st, kimg, TILE * D * 2, bar);
            bulk_copy(st + TILE * D, vimg, TILE * D * 2, bar);
        }
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
