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

// A parameter struct S is declared once, as its field list APA_FIELDS_S(X): one X(type, name) per
// member, in order. `struct S { APA_FIELDS_S(APA_MEMBER) };` declares the members,
// APA_PARAMS_EXPORT(S) exports their layout, and apa_gpu/params.py reads the same X lines for the
// host's dtype. A type is a pointer, float, int, long long or another such struct. A field's comment
// is a block comment on its line (a line comment would swallow the line continuation). Structs of one
// layout under two names (probe.cu's MMA probes) share a list: `#define APA_FIELDS_T APA_FIELDS_S`.
#define APA_MEMBER(T, f) T f;
#define APA_LAYOUT_COUNT_(T, f) +3
#define APA_LAYOUT_FIELD_(T, f) , (int)offsetof(Self, f), (int)sizeof(Self::f), (int)apa_name_hash(#f)
#define APA_PARAMS_EXPORT(S)                                                                        \
    namespace apa_params_layout_##S {                                                               \
    using Self = S;                                                                                 \
    extern "C" __device__ const int apa_params_##S[] = {1 APA_FIELDS_##S(APA_LAYOUT_COUNT_),        \
                                                        (int)sizeof(S) APA_FIELDS_##S(APA_LAYOUT_FIELD_)}; \
    }
