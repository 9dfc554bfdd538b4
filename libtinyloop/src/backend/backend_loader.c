/* backend_loader.c — turns a device string into a backend.
 *
 * "cpu" (or NULL) is the built-in CPU backend, whose constructor the caller passes
 * (the CPU backend is built on this interface, not below it). "cuda" / "cuda:N" dlopen()s
 * libtinyloop_cuda.so from the directory of libtinyloop.so itself (found with
 * dladdr, so it works from a build tree, an install or a Python wheel alike) and
 * asks it for a backend through tl_cuda_backend_open(). "auto" prefers CUDA and
 * falls back to the CPU when CUDA cannot serve.
 *
 * The two libraries are built apart, so they check each other first: the core reads
 * the version and size of the library's ops table (tl_cuda_backend_ops()), the library
 * those of the tl_backend_host it is given; a library from another build is refused
 * with a message saying so, before any of its ops runs.
 *
 * The CUDA library cannot reach the core's tl_fail(): its ops that return a status
 * leave their message in a thread-local buffer of the library. The loader therefore
 * hands out a copy of the library's ops table whose status-returning entries relay
 * that message to tl_fail(), so orchestration sees ordinary TinyLoop errors. */
#define _GNU_SOURCE
#include "backend/backend.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/debug_flags.h"
#include "base/error.h"
#include "base/log.h"

#define TL_CUDA_LIBRARY "libtinyloop_cuda.so"
#define TL_CORE_LIBRARY "libtinyloop.so"

typedef const tl_backend_ops *(*tl_cuda_ops_fn)(void);
/* 0: *out is the backend; TL_CUDA_NO_DEVICE, TL_CUDA_MISMATCH (the host's handshake
 * failed): the reason is in msg. */
typedef int (*tl_cuda_open_fn)(const tl_backend_host *host, int device_index, tl_backend **out,
                               char *msg, size_t msg_len);
#define TL_CUDA_NO_DEVICE 1
#define TL_CUDA_MISMATCH 2
typedef const char *(*tl_cuda_error_fn)(void);

static const tl_backend_host host = {
    .version = TL_BACKEND_INTERFACE_VERSION,
    .struct_size = sizeof(tl_backend_host),
    .ops_size = sizeof(tl_backend_ops),
    .model_size = sizeof(struct tl_model),
    .log = tl_log,
    .debug_switch = tl_debug_switch,
};

tl_status tl_backend_check_ops(const tl_backend_ops *ops, const char *library) {
    char msg[PATH_MAX + 512];   /* the library path and the rest of the sentence */
    if (!ops)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s gave no ops table", library);
    if (tl_backend_interface_mismatch(library, TL_CORE_LIBRARY, "tl_backend_ops", ops->version,
                                      ops->struct_size, sizeof(tl_backend_ops), msg, sizeof msg))
        return tl_fail(TL_ERR_UNSUPPORTED, "%s", msg);
    return TL_OK;
}

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

/* dlopen the CUDA library next to this one, or in cuda/ beside it (the build tree);
 * *path gets the one opened. */
static void *open_cuda_library(char *tried, size_t tried_cap, char *path, size_t path_cap) {
    static const char *const subdirs[] = { "", "cuda/" };
    char dir[PATH_MAX];
    library_dir(dir, sizeof dir);
    tried[0] = '\0';
    for (size_t i = 0; i < sizeof subdirs / sizeof subdirs[0]; i++) {
        snprintf(path, path_cap, "%s%s" TL_CUDA_LIBRARY, dir, subdirs[i]);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
        size_t used = strlen(tried);
        snprintf(tried + used, tried_cap - used, "%s%s", used ? ", " : "", path);
    }
    return NULL;
}

/* The library's ops table and message function, and the relaying copy handed out.
 * The library stays loaded for the life of the process once a backend came from it. */
static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static const tl_backend_ops *cuda_lib_ops;
static tl_cuda_error_fn cuda_lib_error;
static tl_backend_ops cuda_relay_ops;

static tl_status relay(tl_status st) {
    if (st == TL_OK) return st;
    const char *msg = cuda_lib_error ? cuda_lib_error() : NULL;
    return tl_fail(st, "%s", msg && msg[0] ? msg : "CUDA backend error");
}

static tl_status relay_prepare_model(tl_backend *be, const struct tl_model *model) {
    return relay(cuda_lib_ops->prepare_model(be, model));
}
static tl_status relay_exec_create(tl_backend *be, int n_threads, int max_rows, int max_seq,
                                   tl_exec **out) {
    return relay(cuda_lib_ops->exec_create(be, n_threads, max_rows, max_seq, out));
}
static tl_status relay_status(tl_exec *ex) { return relay(cuda_lib_ops->status(ex)); }
static tl_status relay_buf_alloc(tl_backend *be, size_t n_floats, tl_buf **out) {
    return relay(cuda_lib_ops->buf_alloc(be, n_floats, out));
}
static tl_status relay_buf_alloc_f16(tl_backend *be, size_t n, tl_buf **out) {
    return relay(cuda_lib_ops->buf_alloc_f16(be, n, out));
}

/* The library's entry points once its ops table passed the handshake; TL_OK, or the
 * reason (a library of another build, or none of ours). */
static tl_status cuda_entry_points(void *lib, const char *path, tl_cuda_open_fn *open_fn,
                                   tl_cuda_error_fn *error_fn) {
    tl_cuda_ops_fn ops = (tl_cuda_ops_fn)(uintptr_t)dlsym(lib, "tl_cuda_backend_ops");
    *open_fn = (tl_cuda_open_fn)(uintptr_t)dlsym(lib, "tl_cuda_backend_open");
    *error_fn = (tl_cuda_error_fn)(uintptr_t)dlsym(lib, "tl_cuda_last_error");
    if (!ops && dlsym(lib, "tl_cuda_backend_create"))
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "%s was built by an older TinyLoop, before its backend interface was versioned "
                       "(no tl_cuda_backend_ops): rebuild it with this " TL_CORE_LIBRARY,
                       path);
    if (!ops || !*open_fn || !*error_fn)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "%s does not export tl_cuda_backend_ops / tl_cuda_backend_open / tl_cuda_last_error",
                       path);
    return tl_backend_check_ops(ops(), path);
}

/* Open the CUDA library and create a backend on device `index` (-1 = the first).
 * *mismatch: 1 when the library is one of another build. */
static tl_status open_cuda(const char *device, int index, tl_backend **out, int *mismatch) {
    char tried[2 * PATH_MAX + 256], path[PATH_MAX + 64];
    void *lib = open_cuda_library(tried, sizeof tried, path, sizeof path);
    if (!lib)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "device \"%s\" requested but the CUDA backend library was not found "
                       "(tried %s); build with -Dcuda=enabled on a machine with nvcc",
                       device, tried);
    tl_cuda_open_fn open_fn = NULL;
    tl_cuda_error_fn error = NULL;
    tl_status st = cuda_entry_points(lib, path, &open_fn, &error);
    if (st != TL_OK) {
        dlclose(lib);
        *mismatch = 1;
        return tl_fail(st, "device \"%s\": %s", device, tl_error_message());
    }
    char msg[512] = "";
    tl_backend *be = NULL;
    int rc = open_fn(&host, index, &be, msg, sizeof msg);
    msg[sizeof msg - 1] = '\0';
    if (rc == TL_CUDA_MISMATCH) {
        dlclose(lib);
        *mismatch = 1;
        return tl_fail(TL_ERR_UNSUPPORTED, "device \"%s\": %s", device, msg);
    }
    if (rc != 0 || !be) {
        dlclose(lib);
        return tl_fail(TL_ERR_UNSUPPORTED, "device \"%s\" requested but no CUDA device is usable%s%s",
                       device, msg[0] ? ": " : "", msg);
    }
    pthread_mutex_lock(&cuda_lock);
    if (!cuda_lib_ops) {
        cuda_lib_ops = be->ops;
        cuda_lib_error = error;
        cuda_relay_ops = *be->ops;
        cuda_relay_ops.prepare_model = relay_prepare_model;
        cuda_relay_ops.exec_create = relay_exec_create;
        cuda_relay_ops.status = relay_status;
        cuda_relay_ops.buf_alloc = relay_buf_alloc;
        if (cuda_relay_ops.buf_alloc_f16) cuda_relay_ops.buf_alloc_f16 = relay_buf_alloc_f16;
    } else {
        dlclose(lib);   /* already loaded: drop the extra reference */
    }
    pthread_mutex_unlock(&cuda_lock);
    be->ops = &cuda_relay_ops;
    *out = be;
    return TL_OK;
}

tl_status tl_backend_open(const char *device, tl_backend_create_fn cpu_create, tl_backend **out) {
    if (!device || strcmp(device, "cpu") == 0) return cpu_create(out);
    int mismatch = 0;
    if (strcmp(device, "auto") == 0) {
        if (open_cuda(device, -1, out, &mismatch) == TL_OK) return TL_OK;
        /* no usable CUDA device is the normal case for auto: a note, not an error; a
         * CUDA library of another build is a mistake to point out */
        tl_log(mismatch ? TL_LOG_WARN : TL_LOG_INFO, "%s; running on the CPU", tl_error_message());
        tl_clear_error();
        return cpu_create(out);
    }
    int index = -1;
    int kind = parse_cuda(device, &index);
    if (kind <= 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "unknown device \"%s\" (expected \"cpu\", \"auto\", \"cuda\" or \"cuda:N\")",
                       device);
    return open_cuda(device, index, out, &mismatch);
}

void tl_backend_close(tl_backend *be) {
    if (be) be->ops->destroy(be);
}
