/* tensor.h — a read-only view of one weight tensor in the canonical on-disk layout
 * (docs/format.md). Views point into the mmapped file; backends may attach a
 * repacked copy through `backend_data`. */
#ifndef TL_TENSOR_H
#define TL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

typedef enum tl_dtype {
    TL_DTYPE_F32 = 0,
    TL_DTYPE_F16 = 1,
    TL_DTYPE_BF16 = 2,
    TL_DTYPE_Q8 = 3,
    TL_DTYPE_Q4 = 4,
    TL_DTYPE_Q2 = 5,
    TL_DTYPE_COUNT = 6
} tl_dtype;

typedef struct tl_tensor {
    const char *name;          /* points into the file's directory copy; NUL-terminated */
    tl_dtype dtype;
    int32_t ndim;
    int64_t shape[4];
    int64_t rows, cols;        /* 2-D view: 1-D tensors have rows = 1, cols = shape[0] */
    int32_t group;             /* quantized: 32/64/128; else 0 */
    const void *data;          /* f32/f16/bf16 values, or the packed qs plane */
    const uint16_t *scales;    /* quantized: f16 [rows * cols / group] */
    const uint16_t *mins;      /* q4/q2: f16 [rows * cols / group]; NULL for q8 */
    uint64_t nbytes;           /* bytes of the whole tensor in the file */
    uint32_t crc32;            /* as recorded in the directory */
    void *backend_data;        /* backend-owned repacked copy, or NULL */
} tl_tensor;

const char *tl_dtype_name(tl_dtype dtype);
int tl_dtype_is_quantized(tl_dtype dtype);
/* Bytes of n elements' values (f32/f16/bf16) or codes (q8/q4/q2): a tensor's first plane,
 * before the quantized dtypes' f16 scales and mins. */
uint64_t tl_dtype_values_bytes(tl_dtype dtype, uint64_t n);
/* Bytes a tensor of this dtype and 2-D shape takes in the file; 0 if the shape is
 * invalid for the dtype (e.g. cols not a multiple of group). */
uint64_t tl_dtype_nbytes(tl_dtype dtype, int64_t rows, int64_t cols, int32_t group);

/* half/bfloat16 conversion helpers shared by loader, kernels and tests */
float tl_f16_to_f32(uint16_t h);
uint16_t tl_f32_to_f16(float f);
float tl_bf16_to_f32(uint16_t h);

#endif
