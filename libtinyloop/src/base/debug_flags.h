/* debug_flags.h — the environment switches of the library, all read here
 * (debug_flags.c holds their one table; docs/api.md, "Environment switches", lists them).
 * No other file of the core reads the environment, and the CUDA library asks the core
 * (tl_backend_host in backend.h). The enum is shared with the CUDA library. */
#ifndef TL_DEBUG_FLAGS_H
#define TL_DEBUG_FLAGS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tl_debug_flag {
    TL_FLAG_CPU = 0,          /* TINYLOOP_CPU: cap on the CPU kernel level     */
    TL_FLAG_CUDA_GRAPHS = 1,  /* the switches: "0" turns a feature off         */
    TL_FLAG_CUDA_PDL = 2,
    TL_FLAG_CUDA_TC = 3,
    TL_FLAG_CUDA_DP4A = 4,
    TL_FLAG_CUDA_CHAIN = 5,
    TL_FLAG_CUDA_SPLIT_K = 6,
    TL_FLAG_COUNT
} tl_debug_flag;

/* The variable's name ("TINYLOOP_CPU", ...), NULL for a value out of range. */
const char *tl_debug_flag_name(tl_debug_flag flag);
/* A switch: 0 when its variable is "0", else 1 (unset included). Read at every call:
 * the CUDA backend asks when a context is created, so a program may change a switch
 * between contexts. */
int tl_debug_switch(tl_debug_flag flag);
/* The variable's value, NULL when unset or empty (TINYLOOP_CPU: cpu/dispatch.c reads it
 * once and parses the level name), and what it accepts, for messages. */
const char *tl_debug_value(tl_debug_flag flag);
const char *tl_debug_flag_values(tl_debug_flag flag);

#ifdef __cplusplus
}
#endif

#endif
