"""Model import and re-quantization: GGUF and Hugging Face safetensors to .tinyloop, the
`pull` of known models into the cache, and the entry points of the matching CLI commands."""

from .pull import cache_dir, pull, resolve_model_name

__all__ = ["cache_dir", "pull", "resolve_model_name"]
