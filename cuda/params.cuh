// params.cuh: the int tables a module exports to the host, its parameter-struct layouts among them.
//
// Every entry point takes one struct by value (apa.cu, probe.cu), which the host builds from a
// NumPy structured dtype (apa_gpu/params.py). A positional argument list would rebind silently
// when a field moved; so each module exports, per struct S, the table apa_params_S of sizeof(S)
// and, per field in declaration order, its offset, size and name hash, and apa_gpu/device.py
// compares it with the dtype before the first launch and refuses to launch on any difference.
#pragma once

#include <stddef.h>

template <typename... T>
__host__ __device__ constexpr int apa_count(T...) {
    return (int)sizeof...(T);
}

// 32-bit FNV-1a of a field's name: with it the host tells two swapped fields of one size apart.
__host__ __device__ constexpr unsigned apa_name_hash(const char* s, unsigned h = 2166136261u) {
    return *s ? apa_name_hash(s + 1, (h ^ (unsigned char)*s) * 16777619u) : h;
}

// An int table the host reads back (apa_gpu/device.py): {count of the values, values...}.
#define APA_EXPORT_INTS(name, ...) extern "C" __device__ const int name[] = {apa_count(__VA_ARGS__), __VA_ARGS__}

// APA_PARAMS_LAYOUT(S, APA_FIELD(S, a), APA_FIELD(S, b), ...): every field of S, in order.
#define APA_FIELD(S, f) (int)offsetof(S, f), (int)sizeof(S::f), (int)apa_name_hash(#f)
#define APA_PARAMS_LAYOUT(S, ...) APA_EXPORT_INTS(apa_params_##S, (int)sizeof(S), __VA_ARGS__)
