// sim_runtime.h: the host runtime behind cuda_sim.h (threads, barriers, warp collectives, the sm90
// MMA model) and the C entry points the Python side calls through ctypes. Included once by each
// simulator translation unit (sim_apa.cpp, sim_probe.cpp) after the kernel sources.
#pragma once

#include <barrier>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda_sim.h"

namespace apa_sim {

struct Warp {
    std::barrier<> bar{32};
    alignas(16) unsigned char buf[32][64];
};
struct Cta {
    explicit Cta(int nthreads) : bar(nthreads) {}
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> smem;
};

thread_local ThreadCtx t_ctx;
thread_local Cta* t_cta = nullptr;
thread_local Warp* t_warp = nullptr;
thread_local int t_lane = 0;

ThreadCtx& ctx() { return t_ctx; }
void syncthreads() { t_cta->bar.arrive_and_wait(); }
void* dynamic_smem() { return t_cta->smem.data(); }

void warp_exchange(const void* mine, void* all32, int bytes) {
    memcpy(t_warp->buf[t_lane], mine, bytes);
    t_warp->bar.arrive_and_wait();
    for (int i = 0; i < 32; ++i) memcpy(static_cast<unsigned char*>(all32) + i * bytes, t_warp->buf[i], bytes);
    t_warp->bar.arrive_and_wait();  // nobody overwrites the buffer before everyone has read it
}

void syncwarp() { t_warp->bar.arrive_and_wait(); }

constexpr uint64_t MB_FIELD = (1ull << 20) - 1, MB_TX = (1ull << 23) - 1;
void mbar_init(uint64_t* bar, uint32_t count) {
    __atomic_store_n(bar, ((uint64_t)count << 20) | count, __ATOMIC_RELEASE);
}
// One update: arrivals -= arrive, bytes += tx_add - tx_done; the phase completes (and re-arms)
// when both reach zero.
static void mbar_update(uint64_t* bar, uint32_t arrive, uint32_t tx_add, uint32_t tx_done) {
    uint64_t cur = __atomic_load_n(bar, __ATOMIC_ACQUIRE), next;
    do {
        const uint64_t phase = cur >> 63, expected = (cur >> 20) & MB_FIELD;
        const uint64_t pending = (cur & MB_FIELD) - arrive;
        const uint64_t tx = (((cur >> 40) & MB_TX) + tx_add - tx_done) & MB_TX;
        if (pending == 0 && tx == 0)
            next = ((phase ^ 1) << 63) | (expected << 20) | expected;
        else
            next = (phase << 63) | (tx << 40) | (expected << 20) | pending;
    } while (!__atomic_compare_exchange_n(bar, &cur, next, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
}
void mbar_arrive(uint64_t* bar) { mbar_update(bar, 1, 0, 0); }
void mbar_arrive_expect_tx(uint64_t* bar, uint32_t tx) { mbar_update(bar, 1, tx, 0); }
void mbar_complete_tx(uint64_t* bar, uint32_t tx) { mbar_update(bar, 0, 0, tx); }
void tma_load_3d(void* smem, const void* map, int c0, int c1, int c2, uint64_t* bar) {
    const TensorMap& m = *static_cast<const TensorMap*>(map);
    uint16_t* dst = static_cast<uint16_t*>(smem);
    const uint32_t w = m.box[0];  // elements per box row: 64 (128 bytes)
    for (uint32_t z = 0; z < m.box[2]; ++z)
        for (uint32_t y = 0; y < m.box[1]; ++y) {
            const uint32_t row = z * m.box[1] + y;
            for (uint32_t x = 0; x < w; ++x) {
                const uint64_t gx = (uint64_t)c0 + x, gy = (uint64_t)c1 + y, gz = (uint64_t)c2 + z;
                uint16_t val = 0;
                if (gx < m.dim[0] && gy < m.dim[1] && gz < m.dim[2])
                    memcpy(&val, reinterpret_cast<const char*>(m.base) + gz * m.stride[1] + gy * m.stride[0] + 2 * gx, 2);
                dst[row * w + ((((x >> 3) ^ row) & 7) << 3) + (x & 7)] = val;
            }
        }
    mbar_complete_tx(bar, 2u * w * m.box[1] * m.box[2]);
}
void mbar_wait(uint64_t* bar, uint32_t parity) {
    while ((__atomic_load_n(bar, __ATOMIC_ACQUIRE) >> 63) == parity) std::this_thread::yield();
}

void flag_release(unsigned* p) { __atomic_store_n(p, 1u, __ATOMIC_RELEASE); }
unsigned flag_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

// ---- sm90 MMA model: a port of apa_emu.mma (_fdpa, _rz_f32, _rne_f16) -----------------------
static int expo(double x, int emin) {
    int e;
    std::frexp(x, &e);
    return e - 1 > emin ? e - 1 : emin;
}
static double rz_f32(double x) {
    if (std::fabs(x) >= 0x1p128) return x > 0 ? INFINITY : -INFINITY;
    float f = (float)x;
    if (std::fabs((double)f) > std::fabs(x)) {
        uint32_t u = __float_as_uint(f) - 1u;
        f = __uint_as_float(u);
    }
    return (double)(f + 0.0f);
}
static double rne_f16(double x) {
    int e = expo(x, -14);
    const double y = std::nearbyint(x * std::ldexp(1.0, 10 - e)) * std::ldexp(1.0, e - 10);
    if (std::fabs(y) >= 65536.0) return y > 0 ? INFINITY : -INFINITY;
    return y + 0.0;
}
double mma_step(const double* a, const double* b, double c, bool f16_out) {
    const int F = 25, e_zero = f16_out ? -21 : -133, c_emin = f16_out ? -14 : -126;
    double val[17];
    bool zero[17];
    int ex[17];
    bool special = !std::isfinite(c);
    for (int i = 0; i < 16; ++i) {
        val[i] = a[i] * b[i];  // exact: FP16 x FP16
        special |= !std::isfinite(a[i]) || !std::isfinite(b[i]);
        zero[i] = val[i] == 0.0;
        ex[i] = zero[i] ? 0 : expo(a[i], -14) + expo(b[i], -14);
    }
    val[16] = c;
    zero[16] = c == 0.0;
    ex[16] = zero[16] ? 0 : expo(c, c_emin);
    if (special) {
        double naive = 0.0;
        for (int i = 0; i < 17; ++i) naive += val[i];
        if (!std::isfinite(naive)) return std::isnan(naive) ? NAN : naive;
    }
    int E = -(1 << 30);
    for (int i = 0; i < 17; ++i) {
        const int e = zero[i] ? e_zero : ex[i];
        if (e > E) E = e;
    }
    const double scale = std::ldexp(1.0, F - E);
    long long s = 0;
    for (int i = 0; i < 17; ++i) s += (long long)(val[i] * scale);  // truncation toward zero
    if (s == 0) return 0.0;
    const double x = (double)s * std::ldexp(1.0, E - F);
    return f16_out ? rne_f16(x) : rz_f32(x);
}

static void gather_ab(const uint32_t (&all)[32][6], int r, int n, double* a, double* b) {
    for (int k = 0; k < 16; ++k) {
        const uint32_t ra = all[(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)];
        const uint32_t rb = all[n * 4 + ((k & 7) >> 1)][4 + (k >> 3)];
        a[k] = f16_value((uint16_t)((k & 1) ? ra >> 16 : ra & 0xFFFFu));
        b[k] = f16_value((uint16_t)((k & 1) ? rb >> 16 : rb & 0xFFFFu));
    }
}
void mma_f32(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    uint32_t all[32][6];
    warp_exchange(mine, all, sizeof(mine));
    const int g = t_lane >> 2, t0 = t_lane & 3;
    double av[16], bv[16];
    for (int i = 0; i < 4; ++i) {
        gather_ab(all, g + 8 * (i >> 1), 2 * t0 + (i & 1), av, bv);
        const double d = mma_step(av, bv, (double)acc[i], false);
        acc[i] = std::isnan(d) ? __uint_as_float(0x7FFFFFFFu) : (float)d;
    }
}
void mma_f16(uint32_t (&acc)[2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    uint32_t all[32][6];
    warp_exchange(mine, all, sizeof(mine));
    const int g = t_lane >> 2, t0 = t_lane & 3;
    double av[16], bv[16];
    for (int h = 0; h < 2; ++h) {
        uint32_t out = 0;
        for (int e = 0; e < 2; ++e) {
            gather_ab(all, g + 8 * h, 2 * t0 + e, av, bv);
            const uint16_t cb = (uint16_t)(e ? acc[h] >> 16 : acc[h] & 0xFFFFu);
            const double d = mma_step(av, bv, f16_value(cb), true);
            out |= (uint32_t)f16_bits_rn(d) << (16 * e);  // exact: d is on the binary16 grid
        }
        acc[h] = out;
    }
}
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
    const void* all[32];
    warp_exchange(&row, all, sizeof(void*));
    const int g = t_lane >> 2, t0 = t_lane & 3;
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            const uint16_t* p = static_cast<const uint16_t*>(all[8 * i + g]);
            lo = p[2 * t0];
            hi = p[2 * t0 + 1];
        } else {
            lo = static_cast<const uint16_t*>(all[8 * i + 2 * t0])[g];
            hi = static_cast<const uint16_t*>(all[8 * i + 2 * t0 + 1])[g];
        }
        r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
}

// ---- launching ----------------------------------------------------------------------------
// Every kernel takes one parameter struct (cuda/params.cuh); the host passes its bytes and their
// count, which must be the struct's size.
using Invoker = void (*)(const void*);

template <typename P>
constexpr size_t param_size(void (*)(P)) {
    return sizeof(P);
}
template <auto F>
void invoker(const void* params) {
    []<typename P>(void (*f)(P), const void* p) { f(*static_cast<const P*>(p)); }(F, params);
}

struct Entry {
    const char* name;
    Invoker fn;
    size_t params_size;
};

// Run a grid, one CTA after another (the fused launch's tickets make that deadlock-free); each
// CTA's threads run concurrently so that barriers and warp collectives behave as on the GPU.
int launch(const Entry* table, int ntable, const char* name, int gx, int gy, int gz, int bx, int smem,
           const void* params, size_t params_size) {
    const Entry* e = nullptr;
    for (int i = 0; i < ntable; ++i)
        if (strcmp(table[i].name, name) == 0) e = &table[i];
    if (!e) {
        fprintf(stderr, "apa_sim: unknown kernel %s\n", name);
        return 1;
    }
    if (e->params_size != params_size) {
        fprintf(stderr, "apa_sim: %s takes %zu bytes of parameters, got %zu\n", name, e->params_size, params_size);
        return 2;
    }
    if (bx % 32) {
        fprintf(stderr, "apa_sim: block size %d is not a multiple of 32\n", bx);
        return 3;
    }
    for (int z = 0; z < gz; ++z)
        for (int y = 0; y < gy; ++y)
            for (int x = 0; x < gx; ++x) {
                Cta cta(bx);
                cta.smem.assign((size_t)smem + 16, 0xA5);  // poisoned: reads before writes show up
                for (int w = 0; w < bx / 32; ++w) cta.warps.emplace_back(new Warp);
                std::vector<std::thread> threads;
                threads.reserve(bx);
                for (int t = 0; t < bx; ++t) {
                    threads.emplace_back([&, t] {
                        t_ctx.tid = {(unsigned)t, 0, 0};
                        t_ctx.bid = {(unsigned)x, (unsigned)y, (unsigned)z};
                        t_ctx.bdim = {(unsigned)bx, 1, 1};
                        t_ctx.gdim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
                        t_cta = &cta;
                        t_warp = cta.warps[t / 32].get();
                        t_lane = t % 32;
                        e->fn(params);
                        t_warp->bar.arrive_and_drop();
                        t_cta->bar.arrive_and_drop();
                    });
                }
                for (auto& th : threads) th.join();
            }
    return 0;
}

}  // namespace apa_sim

void __nanosleep(unsigned) { std::this_thread::yield(); }

#define APA_SIM_ENTRY(k) {#k, &apa_sim::invoker<k>, apa_sim::param_size(k)}
#define APA_SIM_EXPORT(table)                                                                                  \
    extern "C" int apa_sim_launch(const char* name, int gx, int gy, int gz, int bx, int smem, const void* params, \
                                  size_t params_size) {                                                       \
        return apa_sim::launch(table, (int)(sizeof(table) / sizeof(table[0])), name, gx, gy, gz, bx, smem,      \
                               params, params_size);                                                          \
    }
