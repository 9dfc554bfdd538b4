/* api_metadata.c — the metadata calls of tinyloop.h: enumeration of the file's entries
 * (format.c keeps them sorted by key) and one getter per value type. */
#include "abi/api_structs.h"
#include "model/format.h"
#include "model/model.h"

/* The public type codes are the file's (docs/format.md). */
_Static_assert((int)TL_METADATA_INT == (int)TL_META_INT && (int)TL_METADATA_FLOAT == (int)TL_META_FLOAT &&
                   (int)TL_METADATA_STRING == (int)TL_META_STRING,
               "tl_metadata_type must keep the file's type codes");

static const char *type_name(tl_meta_type type) {
    switch (type) {
    case TL_META_INT: return "an int";
    case TL_META_FLOAT: return "a float";
    default: return "a string";
    }
}

/* The entry `key` of the model's file, which must be of `type` (value: the caller's
 * output, checked here); NULL with the reason recorded (TL_ERR_INVALID_ARGUMENT). */
static const tl_meta_entry *typed_entry(const tl_model *model, const char *key, tl_meta_type type,
                                        const void *value) {
    if (!model || !key || !value) {
        tl_fail(TL_ERR_INVALID_ARGUMENT, "%s must not be NULL", !model ? "model" : !key ? "key" : "value");
        return NULL;
    }
    const tl_meta_entry *e = tl_file_meta(model->file, key);
    if (!e)
        tl_fail(TL_ERR_INVALID_ARGUMENT, "the model has no metadata key \"%s\"", key);
    else if (e->type != type)
        tl_fail(TL_ERR_INVALID_ARGUMENT, "metadata key \"%s\" is %s, not %s", key, type_name(e->type),
                type_name(type));
    return e && e->type == type ? e : NULL;
}

tl_status tl_model_metadata_count(const tl_model *model, size_t *count) {
    NEED(model, "model");
    NEED(count, "count");
    *count = model->file->n_meta;
    return TL_OK;
}

tl_status tl_model_metadata_key(const tl_model *model, size_t index, const char **key,
                                tl_metadata_type *type) {
    NEED(model, "model");
    NEED(key, "key");
    if (index >= model->file->n_meta)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "metadata index %zu out of range: the model has %u entries",
                       index, model->file->n_meta);
    const tl_meta_entry *e = &model->file->meta[index];
    *key = e->key;
    if (type) *type = (tl_metadata_type)e->type;
    return TL_OK;
}

tl_status tl_model_get_metadata_int(const tl_model *model, const char *key, int64_t *value) {
    const tl_meta_entry *e = typed_entry(model, key, TL_META_INT, value);
    if (e) *value = e->i;
    return e ? TL_OK : TL_ERR_INVALID_ARGUMENT;
}

tl_status tl_model_get_metadata_float(const tl_model *model, const char *key, double *value) {
    const tl_meta_entry *e = typed_entry(model, key, TL_META_FLOAT, value);
    if (e) *value = e->f;
    return e ? TL_OK : TL_ERR_INVALID_ARGUMENT;
}

tl_status tl_model_get_metadata_string(const tl_model *model, const char *key,
                                       const char **value, size_t *len) {
    NEED(len, "len");
    const tl_meta_entry *e = typed_entry(model, key, TL_META_STRING, value);
    if (!e) return TL_ERR_INVALID_ARGUMENT;
    *value = e->s;
    *len = (size_t)e->s_len;
    return TL_OK;
}
