/*
** libFuzzer harness for the safetensors reader (engine/core/safetensors.c).  The loader takes a path, so
** each input is written to a per-process temporary file; a file that loads is then read through the whole
** tensor-set API (names, tensors, their bytes, metadata).
*/
#include "moonstep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ms_ctx *ctx;
static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc; (void)argv;
    ms_ctx_options o = {0};
    o.mem_limit = 64 << 20;        /* a header may declare any size: the loader must refuse, not allocate it */
    o.num_threads = 1;
    if (ms_ctx_new("cpu", &o, &ctx) != MS_OK) abort();
    snprintf(path, sizeof path, "/tmp/moonstep-fuzz-st-%d.safetensors", (int)getpid());
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);

    ms_tensor_set *set = NULL;
    if (ms_safetensors_load(ctx, path, &set) != MS_OK) return 0;
    const char *meta = ms_tensor_set_metadata(set);
    if (meta) (void)strlen(meta);
    for (int i = 0; i < ms_tensor_set_count(set); i++) {
        (void)strlen(ms_tensor_set_name(set, i));
        ms_tensor *t = NULL;
        if (ms_tensor_set_get(set, i, &t) != MS_OK) continue;
        int64_t n = ms_tensor_numel(t);
        if (n > 0 && n <= (1 << 20)) {            /* read the bytes back: the loader must have filled them */
            double *buf = malloc((size_t)n * sizeof *buf);
            ms_tensor *d = NULL;
            int64_t shape[1] = { n };
            if (buf && ms_tensor_new(ctx, MS_DTYPE_F64, 1, shape, &d) == MS_OK) {
                ms_tensor *flat = NULL;
                int64_t fs[1] = { n };
                if (ms_tensor_reshape(ctx, t, 1, fs, &flat) == MS_OK) {
                    if (ms_copy(ctx, d, flat) == MS_OK) ms_tensor_read(ctx, d, buf, (size_t)n * sizeof *buf);
                    ms_tensor_free(flat);
                }
            }
            ms_tensor_free(d);
            free(buf);
        }
        ms_tensor_free(t);
    }
    ms_tensor_set_free(set);
    return 0;
}
