// cuda_backend.cu — entry points of libtinyloop_cuda.so, the CUDA backend that the
// core dlopen()s only when a CUDA device is requested (src/backend_loader.c).
// Every entry point is extern "C", catches nothing (no exceptions are thrown in
// here) and reports CUDA errors as text, never by aborting.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>

#define TL_CUDA_API extern "C" __attribute__((visibility("default")))

// Fills *device_count and a human-readable description of device 0 (or the error).
// Returns 0 when at least one device is usable, non-zero otherwise.
TL_CUDA_API int tl_cuda_probe(int *device_count, char *msg, size_t msg_len) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (device_count) *device_count = (err == cudaSuccess) ? count : 0;
    if (err != cudaSuccess) {
        if (msg && msg_len) snprintf(msg, msg_len, "CUDA unavailable: %s", cudaGetErrorString(err));
        return 1;
    }
    if (count == 0) {
        if (msg && msg_len) snprintf(msg, msg_len, "no CUDA device found");
        return 1;
    }
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, 0);
    if (err != cudaSuccess) {
        if (msg && msg_len) snprintf(msg, msg_len, "cudaGetDeviceProperties: %s", cudaGetErrorString(err));
        return 1;
    }
    if (msg && msg_len)
        snprintf(msg, msg_len, "%d device(s); device 0: %s (sm_%d%d, %.1f GiB)", count, prop.name,
                 prop.major, prop.minor, prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return 0;
}
