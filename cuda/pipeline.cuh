// pipeline.cuh: the shared-memory tile ring of the pass-1 and pass-2 mainloops (scheduling only:
// docs/numerics.md §6.2 — no arithmetic depends on it).
//
// Why not one __syncthreads per tile: it keeps the warps of a CTA in lockstep, so all of them
// are in the MMA phase (tensor cores busy, ALU idle) or in the softmax/quantization phase (the
// reverse) at the same time. With a ring of NS stages and per-stage mbarriers a warp may run up to
// NS - 1 tiles ahead of the slowest one, and the scheduler overlaps one warp's MMAs with another's
// ALU work.
//
// Protocol, per stage s = i mod NS of the CTA's i-th tile:
//   full[s]  mbarrier; consumers wait on its phase parity. One arrival, the loader's expect_tx of
//            the stage's bytes, which its copies count: in pass 1 two bulk copies of tile images
//            (prep.cuh), in pass 2 tensor copies of K and V from the inputs. Paged K and V: 32
//            arrivals, each lane of the loading warp's once its cp.async copies of rows have landed.
//   done[s]  release counter: every warp of the ring adds 1 (release) after its last read of the stage;
//            the warp that brings it to MEMBERS (i / NS + 1) is the last reader, and loads tile i + NS there
//            (pass 1 tests its increment's result a step later, when the round trip has passed).
// Counters only grow (no reset to race with), and every warp of the ring waits on every tile of the
// sequence, computing or not, so each phase completes exactly once per use.
//
// A CTA may split into SLICES rings, each of NS stages, its own barriers and counters, and the
// MEMBERS = WARPS / SLICES consecutive warps of its slice (pass 2: warps whose hot sets differ then
// wait on fewer tiles that are not theirs).
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
// One box of a 3-D tensor map (apa_gpu/device.py tensor_map: 64 channels x 1 head x 64 keys, the
// 128-byte swizzle, rows past the tensor zero) at coordinates (c0, c1, c2) into shared memory,
// counted on bar when it lands. The map lives in global memory, written before the launch.
__device__ __forceinline__ void tma_load_3d(void* smem, const void* map, int c0, int c1, int c2, uint64_t* bar) {
#ifdef APA_SIM
    apa_sim::tma_load_3d(smem, map, c0, c1, c2, bar);
#else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"((uint32_t)__cvta_generic_to_shared(smem)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"((uint32_t)__cvta_generic_to_shared(bar))
        : "memory");
#endif
}
// Makes a tensor map that the host wrote to global memory before the launch visible to this
// thread's tensor copies (the tensormap proxy).
__device__ __forceinline__ void tensormap_acquire(const void* map) {
#ifndef APA_SIM
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
#endif
}
// Orders this thread's generic-proxy accesses before its later async-proxy ones (bulk copies,
// wgmma operand reads) of shared memory.
__device__ __forceinline__ void fence_proxy_async() {
#ifndef APA_SIM
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// One arrival on bar once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
#ifdef APA_SIM
    apa_sim::mbar_arrive(bar);
#else
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
#endif
}
// Wait until the phase of bar with the given parity has completed (acquire, CTA scope). The thread
// sleeps in try_wait until then (up to the hint) instead of spinning: waiting warps leave the issue
// slots to the CTA's slowest warp, which the ring's other warps wait for.
constexpr uint32_t MBAR_SUSPEND_NS = 10000000u;
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef APA_SIM
    apa_sim::mbar_wait(bar, parity);
#else
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n\t"
        "@!done bra WAIT;\n}\n" ::"r"((uint32_t)__cvta_generic_to_shared(bar)),
        "r"(parity), "r"(MBAR_SUSPEND_NS)
        : "memory");
#endif
}
// Shared-memory counter increment that orders the warp's earlier reads before it (release); the
// warp that reads the last value acquires with fence_acq_rel before it loads the stage again. The
// result is read a step later (TileRing::released): an acquire here, or ptxas's warp aggregation of
// an add (which an inc with no wrap and a lane-dependent address avoid), would wait for it at once.
__device__ __forceinline__ uint32_t atom_inc_release(uint32_t* p) {
#ifdef APA_SIM
    return __atomic_fetch_add(p, 1u, __ATOMIC_ACQ_REL);
#else
    uint32_t old;
    asm volatile("atom.release.cta.shared::cta.inc.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(0xFFFFFFFFu)
                 : "memory");
    return old;
#endif
}
__device__ __forceinline__ void fence_acq_rel() {
#ifndef APA_SIM
    asm volatile("fence.acq_rel.cta;\n" ::: "memory");
#endif
}

// Dynamic shared memory of a kernel: the ring's barriers and counters (at offset 0, where both
// passes of the fused launch find them), its stages, then the pass's own data. Pass 1 runs
// NS = 5 stages (its Q̂ images take the rest of the 227 KB), pass 2 three slices of 2 (pass2.cuh).
// A stage holds two tile images of TILE * D halves (K̂ then V̂ᵀ in pass 1, K then V in pass 2: prep
// writes them, mma.cuh sw128_half), 1024-byte aligned (the period of the 128-byte swizzle).
constexpr int RING_MAX_STAGES = 6;
constexpr int TENSOR_MAP_BYTES = 128;  // a CUtensorMap (apa_gpu/device.py)
constexpr int RING_SYNC_BYTES = 80;
constexpr int RING_ALIGN = 1024;
constexpr int STAGE_HALVES = 2 * TILE * D;
static_assert(RING_SYNC_BYTES >= RING_MAX_STAGES * (8 + 4) && RING_SYNC_BYTES % 16 == 0, "ring barriers");
template <int NS>
constexpr int ring_smem_bytes() { return RING_SYNC_BYTES + (RING_ALIGN - 16) + NS * STAGE_HALVES * 2; }

template <int NS, int SLICES = 1>
struct TileRing {
    static constexpr int MEMBERS = WARPS / SLICES;
    static_assert(WARPS % SLICES == 0 && NS * SLICES <= RING_MAX_STAGES, "the ring's barriers");
    static_assert(NS <= MEMBERS, "the prologue gives step s to the slice's warp s");
    uint64_t* full;
    uint32_t* done;
    uint16_t* base;  // the slice's first stage
    uint16_t* end;   // past every slice's stages

    // smem is 16-byte aligned; the stages start at the next multiple of RING_ALIGN after the
    // barriers (shared-window addresses: the swizzle acts on address bits).
    __device__ __forceinline__ explicit TileRing(uint16_t* smem, int slice = 0)
        : full(reinterpret_cast<uint64_t*>(smem) + slice * NS),
          done(reinterpret_cast<uint32_t*>(reinterpret_cast<uint64_t*>(smem) + RING_MAX_STAGES) + slice * NS) {
        const uint32_t at = smem_addr(smem) + RING_SYNC_BYTES;
        uint16_t* const first = smem + (RING_SYNC_BYTES + ((RING_ALIGN - at % RING_ALIGN) % RING_ALIGN)) / 2;
        base = first + slice * NS * STAGE_HALVES;
        end = first + SLICES * NS * STAGE_HALVES;
    }

    // Thread 0 arms the ring for a work item (fresh: first use of this shared memory by the CTA;
    // otherwise the previous item's barriers are invalidated first) with the loads' arrivals per
    // stage (load_images 1, load_rows 32); the caller's __syncthreads publishes it.
    __device__ __forceinline__ void reset(bool fresh, uint32_t arrivals) {
        if (threadIdx.x == 0) {
            for (int s = 0; s < RING_MAX_STAGES; ++s) {
                if (!fresh) mbar_inval(full + s);
                mbar_init(full + s, arrivals);
                done[s] = 0;
            }
        }
    }
    __device__ __forceinline__ uint16_t* stage(int i) const { return base + (i % NS) * STAGE_HALVES; }
    // The pass's own data after the stages of every slice.
    __device__ __forceinline__ uint16_t* tail() const { return end; }

    // Every lane of the warp that loads step i (the prologue gives step s < NS to warp s): the two
    // tile images (TILE * D halves each) by lane 0. The fence orders the readers' earlier accesses,
    // published to this warp by the release counter, before the async-proxy writes.
    __device__ __forceinline__ void load_images(int i, const uint16_t* kimg, const uint16_t* vimg) {
        if ((threadIdx.x & 31) == 0) {
            uint64_t* bar = full + i % NS;
            uint16_t* st = stage(i);
            fence_proxy_async();
            mbar_arrive_expect_tx(bar, 2u * TILE * D * 2);
            bulk_copy(st, kimg, TILE * D * 2, bar);
            bulk_copy(st + TILE * D, vimg, TILE * D * 2, bar);
        }
    }
    // Every lane of the warp that loads step i: K and V of keys row0 .. row0+63 of KV head hk, as
    // D/64 boxes each of the tensor maps maps[0] (K) and maps[1] (V), by lane 0.
    __device__ __forceinline__ void load_tensors(int i, const void* maps, int hk, int row0) {
        if ((threadIdx.x & 31) == 0) {
            uint64_t* bar = full + i % NS;
            uint16_t* st = stage(i);
            const char* m = static_cast<const char*>(maps);
            fence_proxy_async();
            mbar_arrive_expect_tx(bar, 2u * TILE * D * 2);
#pragma unroll
            for (int cb = 0; cb < D / 64; ++cb) {
                tma_load_3d(st + cb * TILE * 64, m, 64 * cb, hk, row0, bar);
                tma_load_3d(st + TILE * D + cb * TILE * 64, m + TENSOR_MAP_BYTES, 64 * cb, hk, row0, bar);
            }
        }
    }
    // Every lane of the warp that loads step i: K and V of the tile's 64 keys into the stage's two
    // images (sw128_half, key order), row(j) giving key j's element offset in k and v, or -1 for
    // zeros (past S, a hole). 16-byte cp.async copies, consecutive lanes along a row.
    template <class Row>
    __device__ __forceinline__ void load_rows(int i, const uint16_t* k, const uint16_t* v, Row row) {
        constexpr int CH = D / 8;  // 16-byte chunks per row
        uint16_t* st = stage(i);
        for (int e = threadIdx.x & 31; e < TILE * CH; e += 32) {
            const int key = e / CH, c = e % CH;
            const long long src = row(key);
            const long long at = src < 0 ? 0 : src + 8 * c;
            const uint32_t n = src < 0 ? 0u : 16u;
            cp_async16(st + sw128_half(key, 8 * c, TILE), k + at, n);
            cp_async16(st + TILE * D + sw128_half(key, 8 * c, TILE), v + at, n);
        }
        cp_async_arrive(full + i % NS);
    }
    __device__ __forceinline__ void wait(int i) { mbar_wait(full + i % NS, (uint32_t)(i / NS) & 1u); }

    // Every lane of every warp of the ring, after the warp's last read of step i's stage. True for
    // the last of them: that warp loads step i + NS into stage(i), if there is one.
    __device__ __forceinline__ bool release(int i) { return released(i, release_begin(i)); }
    // The same in two halves, so that the counter's round trip can pass under other work: the
    // increment (lane 0's counter value before it, 0 on the other lanes), and later the test, which
    // acquires the other warps' releases for the last of them.
    __device__ __forceinline__ uint32_t release_begin(int i) {
        __syncwarp();
        uint32_t lane;  // from %laneid: ptxas does not know it below 32, and keeps the atomic lane 0's
#ifdef APA_SIM
        lane = threadIdx.x & 31;
#else
        asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
#endif
        return lane == 0 ? atom_inc_release(done + i % NS + (lane >> 5)) : 0u;
    }
    __device__ __forceinline__ bool released(int i, uint32_t old) {
        const bool last = __shfl_sync(0xFFFFFFFFu, old, 0) == (uint32_t)(MEMBERS * (i / NS + 1) - 1);
        if (last) fence_acq_rel();
        return last;
    }
};

}  // namespace apa
