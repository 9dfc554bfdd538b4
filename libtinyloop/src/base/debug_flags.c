/* debug_flags.c — the one reader of the library's environment variables (debug_flags.h).
 * The table is what docs/api.md ("Environment switches") shows; tests/test_binding.py
 * checks the two list the same names and that nothing else in libtinyloop calls getenv. */
#include "base/debug_flags.h"

#include <stdlib.h>
#include <string.h>

#include "base/log.h"

typedef struct flag_info {
    const char *name;
    const char *values;    /* what it accepts */
    const char *meaning;   /* and when it is read */
} flag_info;

static const flag_info flags[TL_FLAG_COUNT] = {
    [TL_FLAG_CPU] = {"TINYLOOP_CPU", "generic, avx2, avx512vnni",
                     "caps the CPU kernel level (docs/cpu-backend.md); read once per process"},
    [TL_FLAG_CUDA_GRAPHS] = {"TINYLOOP_CUDA_GRAPHS", "0 = off",
                             "decode steps recorded and replayed as CUDA graphs; read per context"},
    [TL_FLAG_CUDA_PDL] = {"TINYLOOP_CUDA_PDL", "0 = off",
                          "programmatic dependent launch (sm_90+); read per context"},
    [TL_FLAG_CUDA_TC] = {"TINYLOOP_CUDA_TC", "0 = off",
                         "the prefill GEMM on tensor cores (sm_80+); read per context"},
    [TL_FLAG_CUDA_DP4A] = {"TINYLOOP_CUDA_DP4A", "0 = off",
                           "integer dot products in the quantized GEMV; read per context"},
    [TL_FLAG_CUDA_CHAIN] = {"TINYLOOP_CUDA_CHAIN", "0 = off",
                            "greedy decode steps chained on the device; read per context"},
    [TL_FLAG_CUDA_SPLIT_K] = {"TINYLOOP_CUDA_SPLIT_K", "0 = off",
                              "the tensor-core GEMM split over k when its tiles cannot fill the "
                              "device (batched decode); read per context"},
};

const char *tl_debug_flag_name(tl_debug_flag flag) {
    return (unsigned)flag < TL_FLAG_COUNT ? flags[flag].name : NULL;
}

int tl_debug_switch(tl_debug_flag flag) {
    const char *name = tl_debug_flag_name(flag);
    const char *value = name && flag != TL_FLAG_CPU ? getenv(name) : NULL;
    return !(value && strcmp(value, "0") == 0);
}

const char *tl_debug_value(tl_debug_flag flag) {
    const char *name = tl_debug_flag_name(flag);
    const char *value = name ? getenv(name) : NULL;
    return value && *value ? value : NULL;
}

const char *tl_debug_flag_values(tl_debug_flag flag) {
    return (unsigned)flag < TL_FLAG_COUNT ? flags[flag].values : NULL;
}
