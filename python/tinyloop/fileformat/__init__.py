"""The .tinyloop file in Python, for tools and tests (docs/format.md); no library needed.

tinyloop_file: the writer, validating reader and copier (TinyLoopWriter, read_file,
copy_file); quantize: the q8 / q4 / q2 group layouts; random_model: model files of
random weights (`python -m tinyloop.fileformat.random_model`).
"""
