/* backend_loader.c — turns a device string into a backend.
 *
 * "cpu" (or NULL) is the built-in CPU backend. "cuda" / "cuda:N" dlopen()s
 * libtinyloop_cuda.so from the directory of libtinyloop.so itself (found with
 * dladdr, so it works from a build tree, an install or a Python wheel alike) and
 * asks it for devices through tl_cuda_probe(). "auto" prefers CUDA and falls back
 * to the CPU when CUDA cannot serve. The CUDA ops table is not built yet, so a
 * CUDA request that finds a device still ends in TL_ERR_UNSUPPORTED. */
#define _GNU_SOURCE
#include "backend.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

#define TL_CUDA_LIBRARY "libtinyloop_cuda.so"

typedef int (*tl_cuda_probe_fn)(int *device_count, char *msg, size_t msg_len);

/* Parse "cuda" / "cuda:N": returns 1 and sets *index (-1 = any) on a CUDA string,
 * 0 when the string is not a CUDA one, -1 when it is malformed. */
static int parse_cuda(const char *device, int *index) {
    if (strncmp(device, "cuda", 4) != 0) return 0;
    if (device[4] == '\0') {
        *index = -1;
        return 1;
    }
    if (device[4] != ':' || device[5] < '0' || device[5] > '9') return -1;
    errno = 0;
    char *end = NULL;
    long v = strtol(device + 5, &end, 10);
    if (errno || *end != '\0' || v < 0 || v > INT_MAX) return -1;
    *index = (int)v;
    return 1;
}

/* Directory holding this library, with a trailing '/', or "" when unknown. */
static void library_dir(char *out, size_t cap) {
    Dl_info info;
    out[0] = '\0';
    if (!dladdr((void *)&tl_backend_open, &info) || !info.dli_fname) return;
    const char *slash = strrchr(info.dli_fname, '/');
    if (!slash) return;
    size_t len = (size_t)(slash - info.dli_fname) + 1;
    if (len >= cap) return;
    memcpy(out, info.dli_fname, len);
    out[len] = '\0';
}

/* dlopen the CUDA library next to this one, or in cuda/ beside it (the build tree). */
static void *open_cuda_library(char *tried, size_t tried_cap) {
    static const char *const subdirs[] = { "", "cuda/" };
    char dir[PATH_MAX], path[PATH_MAX + 64];
    library_dir(dir, sizeof dir);
    tried[0] = '\0';
    for (size_t i = 0; i < sizeof subdirs / sizeof subdirs[0]; i++) {
        snprintf(path, sizeof path, "%s%s" TL_CUDA_LIBRARY, dir, subdirs[i]);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
        size_t used = strlen(tried);
        snprintf(tried + used, tried_cap - used, "%s%s", used ? ", " : "", path);
    }
    return NULL;
}

/* Can CUDA serve `device` (index -1 = any)? TL_OK means a device exists; otherwise
 * the error names why not. */
static tl_status probe_cuda(const char *device, int index) {
    char tried[2 * PATH_MAX + 256];
    void *lib = open_cuda_library(tried, sizeof tried);
    if (!lib)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "device \"%s\" requested but the CUDA backend library was not found "
                       "(tried %s); build with -Dcuda=enabled on a machine with nvcc",
                       device, tried);
    tl_cuda_probe_fn probe = (tl_cuda_probe_fn)(uintptr_t)dlsym(lib, "tl_cuda_probe");
    if (!probe) {
        dlclose(lib);
        return tl_fail(TL_ERR_UNSUPPORTED, "device \"%s\": %s does not export tl_cuda_probe",
                       device, TL_CUDA_LIBRARY);
    }
    int count = 0;
    char msg[256] = "";
    int rc = probe(&count, msg, sizeof msg);
    dlclose(lib);
    msg[sizeof msg - 1] = '\0';
    if (rc != 0 || count <= 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "device \"%s\" requested but no CUDA device is usable%s%s",
                       device, msg[0] ? ": " : "", msg);
    if (index >= count)
        return tl_fail(TL_ERR_UNSUPPORTED, "device \"%s\" requested but only %d CUDA device%s found",
                       device, count, count == 1 ? " was" : "s were");
    return TL_OK;
}

tl_status tl_backend_open(const char *device, tl_backend **out) {
    if (!device || strcmp(device, "cpu") == 0) return tl_backend_cpu_create(out);
    if (strcmp(device, "auto") == 0) {
        /* No CUDA ops table exists yet, so even a found device falls back to the CPU. */
        return tl_backend_cpu_create(out);
    }
    int index = -1;
    int kind = parse_cuda(device, &index);
    if (kind == 0 || kind < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "unknown device \"%s\" (expected \"cpu\", \"auto\", \"cuda\" or \"cuda:N\")",
                       device);
    tl_status st = probe_cuda(device, index);
    if (st != TL_OK) return st;
    return tl_fail(TL_ERR_UNSUPPORTED,
                   "device \"%s\": a CUDA device was found, but the CUDA backend ops are not "
                   "built yet; use device \"cpu\"", device);
}

void tl_backend_close(tl_backend *be) {
    if (be) be->ops->destroy(be);
}
