/* backend_cpu.h — the CPU backend: backend.h's ops on the host, over cpu/kernels.h. */
#ifndef TL_BACKEND_CPU_H
#define TL_BACKEND_CPU_H

#include "backend/backend.h"

tl_status tl_backend_cpu_create(tl_backend **out);

#endif
