"""Settings shared by every test module.

On CUDA the KV cache defaults to fp16 (docs/api.md, "KV dtype"). The suites that hold a
device to the float64 oracle at the float tolerance run on the f32 cache, which is exact
to fp32 rounding; tests/test_cuda_backend.py loads f16 explicitly and holds it to the
f32 path within KV_F16_TOLERANCE."""

import os

os.environ.setdefault("TINYLOOP_CUDA_KV_F16", "0")
