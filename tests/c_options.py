"""Contexts created through the C call with raw tl_context_options fields, for tests of
what the library itself accepts or refuses (beneath the Python binding's checks)."""


def create_context(model, **fields) -> tuple:
    """tl_context_create with the default options and `fields` set: (status name, the
    library's last error message); a context that was created is freed at once."""
    native = model._native
    ffi, lib = native.ffi, native.lib
    opts = ffi.new("tl_context_options *")
    lib.tl_context_options_default(opts)
    for key, value in fields.items():
        setattr(opts, key, value)
    out = ffi.new("tl_context **")
    status = lib.tl_context_create(model._require_open(), opts, out)
    if status == 0:
        lib.tl_context_free(out[0])
    return ffi.string(lib.tl_status_name(status)).decode(), native.last_error()
