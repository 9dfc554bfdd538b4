/* c_generate.c — generate greedily from token ids with libtinyloop, no Python involved.
 *
 *   cc c_generate.c -I<prefix>/include -L<libdir> -ltinyloop -o c_generate
 *   ./c_generate MODEL.tinyloop MAX_TOKENS TOKEN [TOKEN ...]
 *
 * Prints the generated token ids on one line and the stop reason on stderr.
 * Exits with 1 on any library error, 2 on bad usage. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include <tinyloop/tinyloop.h>

static int parse_int(const char *s, long lo, long hi, long *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int fail(const char *what, tl_status st) {
    fprintf(stderr, "c_generate: %s failed: %s: %s\n", what, tl_status_name(st), tl_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.tinyloop MAX_TOKENS TOKEN [TOKEN ...]\n", argv[0]);
        return 2;
    }
    if (tl_abi_version() != TL_ABI_VERSION) {
        fprintf(stderr, "c_generate: library ABI %u, header ABI %d\n", tl_abi_version(),
                TL_ABI_VERSION);
        return 1;
    }
    long max_tokens;
    if (parse_int(argv[2], 0, 1 << 20, &max_tokens) != 0) {
        fprintf(stderr, "c_generate: MAX_TOKENS \"%s\" is not a number in [0, %d]\n", argv[2], 1 << 20);
        return 2;
    }
    size_t n_prompt = (size_t)(argc - 3);
    int32_t *prompt = malloc(n_prompt * sizeof *prompt);
    int32_t *out = malloc(((size_t)max_tokens + 1) * sizeof *out);
    if (!prompt || !out) {
        fprintf(stderr, "c_generate: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n_prompt; i++) {
        long v;
        if (parse_int(argv[3 + i], 0, INT32_MAX, &v) != 0) {
            fprintf(stderr, "c_generate: token \"%s\" is not a non-negative integer\n", argv[3 + i]);
            return 2;
        }
        prompt[i] = (int32_t)v;
    }

    int rc = 0;
    tl_model *model = NULL;
    tl_load_options lo;
    tl_load_options_default(&lo);
    tl_status st = tl_load_model(argv[1], &lo, &model);
    if (st != TL_OK) {
        rc = fail("tl_load_model", st);
    } else {
        tl_generate_options go;
        tl_generate_options_default(&go);
        go.temperature = 0.0f; /* greedy */
        go.max_tokens = (int32_t)max_tokens;
        tl_generate_result res;
        tl_generate_result_default(&res);
        st = tl_generate(model, prompt, n_prompt, &go, out, (size_t)max_tokens, &res);
        if (st != TL_OK) {
            rc = fail("tl_generate", st);
        } else {
            for (uint32_t i = 0; i < res.n_tokens; i++) printf(i ? " %d" : "%d", out[i]);
            printf("\n");
            fprintf(stderr, "stop reason %d, %u prompt tokens, prefill %.3f s, decode %.3f s\n",
                    (int)res.stop_reason, res.n_prompt_tokens, res.prefill_seconds,
                    res.decode_seconds);
        }
        tl_free_model(model);
    }
    free(prompt);
    free(out);
    return rc;
}
