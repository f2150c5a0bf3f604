/*
** Tests of ms_safetensors_save / ms_safetensors_load through the public ABI: round trips of every dtype,
** the file layout, hand-made corrupt files (each error names its problem), truncation at every length,
** random header mutations, and atomic writing (a failed save leaves the old file and no temporary file).
*/
#define _XOPEN_SOURCE 700   /* mkdtemp */

#include "check.h"
#include "json.h"
#include "moonstep.h"

#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static ms_ctx *ctx;
static char dir[64], path[128];

/* --- helpers -------------------------------------------------------------------------------------- */

static ms_tensor *make(ms_dtype dt, int ndim, const int64_t *shape, const void *data)
{
    ms_tensor *t = NULL;
    if (ms_tensor_new(ctx, dt, ndim, shape, &t) != MS_OK) return NULL;
    size_t n = (size_t)ms_tensor_numel(t) * ms_dtype_size(dt);
    if (n && ms_tensor_write(ctx, t, data, n) != MS_OK) { ms_tensor_free(t); return NULL; }
    return t;
}

/* The tensor's bytes in row-major order (malloc'd; *n gets the size). */
static void *bytes_of(const ms_tensor *t, size_t *n)
{
    *n = (size_t)ms_tensor_numel(t) * ms_dtype_size(ms_tensor_dtype(t));
    void *buf = malloc(*n ? *n : 1);
    if (buf && *n && ms_tensor_read(ctx, t, buf, *n) != MS_OK) { free(buf); return NULL; }
    return buf;
}

static void write_bytes(const char *p, const void *data, size_t n)
{
    FILE *f = fopen(p, "wb");
    if (!f) { perror(p); exit(2); }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

static unsigned char *read_bytes(const char *p, size_t *n)
{
    FILE *f = fopen(p, "rb");
    if (!f) { *n = 0; return NULL; }
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(*n + 1);
    if (buf && fread(buf, 1, *n, f) != *n) { free(buf); buf = NULL; }
    fclose(f);
    return buf;
}

/* A file with this header (length written as is) followed by `data_len` bytes of a pattern. */
static void write_st(const char *p, const char *header, size_t data_len)
{
    size_t h = strlen(header);
    unsigned char *buf = malloc(8 + h + data_len + 1);
    uint64_t len = h;
    memcpy(buf, &len, 8);
    memcpy(buf + 8, header, h);
    for (size_t i = 0; i < data_len; i++) buf[8 + h + i] = (unsigned char)(i * 37 + 11);
    write_bytes(p, buf, 8 + h + data_len);
    free(buf);
}

static int count_temp_files(void)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

/* Loading `path` must fail with `want` and a message containing `needle`. */
#define EXPECT_LOAD_FAIL(label, want, needle)                                                           \
    do {                                                                                                \
        ms_tensor_set *set_ = (ms_tensor_set *)&set_;                                                   \
        ms_status st_ = ms_safetensors_load(ctx, path, &set_);                                          \
        CHECK(st_ == (want) && set_ == NULL, "%s: got %s, expected %s: %s", label, ms_status_name(st_), \
              ms_status_name(want), ms_ctx_last_error(ctx));                                            \
        CHECK(strstr(ms_ctx_last_error(ctx), needle) && strstr(ms_ctx_last_error(ctx), "ms_safetensors_load"), \
              "%s: message \"%s\" lacks \"%s\"", label, ms_ctx_last_error(ctx), needle);                \
        if (st_ == MS_OK) ms_tensor_set_free(set_);                                                     \
    } while (0)

static int64_t file_esize(const char *dtype)
{
    static const struct { const char *name; int64_t size; } t[] = {
        { "F32", 4 }, { "F64", 8 }, { "BF16", 2 }, { "F16", 2 }, { "I32", 4 }, { "U8", 1 },
    };
    for (size_t k = 0; k < sizeof t / sizeof *t; k++)
        if (strcmp(dtype, t[k].name) == 0) return t[k].size;
    return 0;
}

/* --- round trips ---------------------------------------------------------------------------------- */

static void test_roundtrip(void)
{
    float f32[6] = { 1, -2.5f, 3e-20f, 1e30f, -0.0f, 7 };
    double f64[4] = { 0.1, -1e300, 5e-324, 3.141592653589793 };
    uint16_t bf16[3] = { 0x3f80, 0xc049, 0x7fc0 };        /* 1, -3.140625, NaN */
    uint16_t f16[5] = { 0x3c00, 0xc000, 0x7bff, 0x0001, 0xfc00 };   /* 1, -2, 65504, tiny, -inf */
    int32_t i32[4] = { INT32_MIN, -1, 0, INT32_MAX };
    uint8_t u8[7] = { 0, 1, 2, 127, 128, 254, 255 };
    float scalar = 42.5f;
    int64_t s23[2] = { 2, 3 }, s4[1] = { 4 }, s3[1] = { 3 }, s5[3] = { 1, 5, 1 }, s22[2] = { 2, 2 };
    int64_t s7[1] = { 7 }, s03[2] = { 0, 3 };
    const char *names[] = { "w.f32", "f64", "bf16 \xc3\xa9", "f16", "i32", "u8", "scalar", "empty", "u8.T" };
    ms_tensor *u8m = make(MS_DTYPE_U8, 2, (int64_t[]){ 2, 3 }, u8), *u8t = NULL;
    if (u8m) ms_tensor_transpose(ctx, u8m, 0, 1, &u8t);        /* [3,2], not contiguous */
    const ms_tensor *ts[9] = {
        make(MS_DTYPE_F32, 2, s23, f32), make(MS_DTYPE_F64, 1, s4, f64), make(MS_DTYPE_BF16, 1, s3, bf16),
        make(MS_DTYPE_F16, 3, s5, f16), make(MS_DTYPE_I32, 2, s22, i32), make(MS_DTYPE_U8, 1, s7, u8),
        make(MS_DTYPE_F32, 0, NULL, &scalar), make(MS_DTYPE_F16, 2, s03, NULL), u8t,
    };
    for (int i = 0; i < 9; i++) CHECK(ts[i] != NULL, "tensor %d made: %s", i, ms_last_error());
    if (!u8t || !ts[0]) return;
    CHECK(!ms_tensor_is_contiguous(u8t), "transposed source is strided");

    const char *meta = "{\"format\":\"pt\", \"note\":\"caf\\u00e9 \\\"x\\\"\\n\", \"\":\"\"}";
    ms_status st = ms_safetensors_save(ctx, path, 9, names, ts, meta);
    CHECK(st == MS_OK, "save: %s", ms_ctx_last_error(ctx));
    CHECK(count_temp_files() == 0, "no temporary file left");

    /* layout: header padded to 8, data 8-aligned, every tensor aligned to its element size */
    size_t fn;
    unsigned char *file = read_bytes(path, &fn);
    uint64_t hlen = 0;
    if (file) memcpy(&hlen, file, 8);
    CHECK(file && hlen % 8 == 0 && hlen + 8 <= fn, "header length %llu is a multiple of 8", (unsigned long long)hlen);
    CHECK(file && fn - 8 - hlen == 24 + 32 + 6 + 10 + 16 + 7 + 4 + 0 + 6, "data size %zu", fn - 8 - (size_t)hlen);
    ms_json *hdr = NULL;
    if (file && hlen + 8 <= fn && ms_json_parse((char *)file + 8, hlen, &hdr, NULL, 0) == MS_OK) {
        CHECK(hdr->len == 10 && strcmp(hdr->items[0].key, "__metadata__") == 0, "metadata first, then 9 tensors");
        for (size_t k = 1; k < hdr->len; k++) {
            const ms_json *dt = ms_json_get(&hdr->items[k], "dtype"), *off = ms_json_get(&hdr->items[k], "data_offsets");
            int64_t esize = dt ? file_esize(dt->s) : 0;
            CHECK(off && off->len == 2 && esize && off->items[0].i % esize == 0, "%s: offset %lld aligned to %lld",
                  hdr->items[k].key, off ? (long long)off->items[0].i : -1LL, (long long)esize);
            CHECK(strcmp(hdr->items[k].key, names[k - 1]) == 0, "header keeps the caller's order");
        }
    } else CHECK(0, "the header parses");
    ms_json_free(hdr);
    free(file);

    ms_tensor_set *set = NULL;
    st = ms_safetensors_load(ctx, path, &set);
    CHECK(st == MS_OK, "load: %s", ms_ctx_last_error(ctx));
    if (st != MS_OK) goto out;
    CHECK(ms_tensor_set_count(set) == 9, "count %d", ms_tensor_set_count(set));
    CHECK(strcmp(ms_tensor_set_metadata(set), "{\"format\":\"pt\",\"note\":\"caf\xc3\xa9 \\\"x\\\"\\n\",\"\":\"\"}") == 0,
          "metadata: %s", ms_tensor_set_metadata(set));
    CHECK(ms_tensor_set_name(set, 9) == NULL && ms_tensor_set_name(set, -1) == NULL, "name out of range");
    for (int i = 0; i < 9 && i < ms_tensor_set_count(set); i++) {
        ms_tensor *t = NULL;
        CHECK(strcmp(ms_tensor_set_name(set, i), names[i]) == 0, "name %d: %s", i, ms_tensor_set_name(set, i));
        if (ms_tensor_set_get(set, i, &t) != MS_OK) { CHECK(0, "get %d: %s", i, ms_last_error()); continue; }
        CHECK(ms_tensor_dtype(t) == ms_tensor_dtype(ts[i]) && ms_tensor_ndim(t) == ms_tensor_ndim(ts[i]),
              "%s: dtype and ndim", names[i]);
        for (int d = 0; d < ms_tensor_ndim(t); d++)
            CHECK(ms_tensor_size(t, d) == ms_tensor_size(ts[i], d), "%s: dim %d", names[i], d);
        size_t na, nb;
        void *a = bytes_of(t, &na), *b = bytes_of(ts[i], &nb);
        CHECK(a && b && na == nb && memcmp(a, b, na) == 0, "%s: data bit-exact", names[i]);
        free(a);
        free(b);
        ms_tensor_free(t);
    }
    ms_tensor *keep = NULL;
    CHECK(ms_tensor_set_get(set, 9, &keep) == MS_E_ARG && keep == NULL, "get out of range");
    CHECK(ms_tensor_set_get(set, 0, &keep) == MS_OK, "get 0");
    ms_tensor_set_free(set);
    float back[6] = { 0 };
    CHECK(keep && ms_tensor_read(ctx, keep, back, sizeof back) == MS_OK && memcmp(back, f32, sizeof back) == 0,
          "a handle outlives its set");
    ms_tensor_free(keep);

    /* no metadata: "{}"; zero tensors: a valid, empty file */
    CHECK(ms_safetensors_save(ctx, path, 1, names, ts, "") == MS_OK, "save without metadata");
    CHECK(ms_safetensors_load(ctx, path, &set) == MS_OK && strcmp(ms_tensor_set_metadata(set), "{}") == 0,
          "metadata {} when absent");
    ms_tensor_set_free(set);
    CHECK(ms_safetensors_save(ctx, path, 0, NULL, NULL, NULL) == MS_OK, "save of nothing");
    CHECK(ms_safetensors_load(ctx, path, &set) == MS_OK && ms_tensor_set_count(set) == 0, "load of nothing");
    ms_tensor_set_free(set);
    /* a relative path (no folder part) */
    char cwd[512];
    if (getcwd(cwd, sizeof cwd) && chdir(dir) == 0) {
        CHECK(ms_safetensors_save(ctx, "rel.safetensors", 1, names, ts, NULL) == MS_OK, "relative path: %s",
              ms_ctx_last_error(ctx));
        CHECK(access("rel.safetensors", F_OK) == 0 && count_temp_files() == 0, "relative file written");
        unlink("rel.safetensors");
        CHECK(chdir(cwd) == 0, "chdir back");
    }
out:
    for (int i = 0; i < 9; i++) ms_tensor_free((ms_tensor *)ts[i]);
    ms_tensor_free(u8m);
}

/* --- save errors and atomicity -------------------------------------------------------------------- */

static void test_save_errors(void)
{
    float v[4] = { 1, 2, 3, 4 };
    ms_tensor *a = make(MS_DTYPE_F32, 1, (int64_t[]){ 4 }, v);
    const ms_tensor *two[2] = { a, a };
    /* malformed metadata JSON is MS_E_FORMAT (as for any JSON), the rest invalid arguments */
    static const struct { const char *n0, *n1, *meta, *needle; ms_status st; } cases[] = {
        { "a", "a", NULL, "name \"a\" is given twice (names[0] and names[1])", MS_E_ARG },
        { "a", "", NULL, "names[1] is empty", MS_E_ARG },
        { "__metadata__", "b", NULL, "names[0] is \"__metadata__\"", MS_E_ARG },
        { "a", "b\xff", NULL, "names[1] is not valid UTF-8", MS_E_ARG },
        { "a", "b", "{\"k\":", "metadata_json is not valid JSON: byte 5: unexpected end of input", MS_E_FORMAT },
        { "a", "b", "[\"k\"]", "metadata_json is not a JSON object", MS_E_FORMAT },
        { "a", "b", "{\"k\":\"v\",\"step\":3}", "the value of \"step\" is not a string", MS_E_ARG },
        { "a", "b", "{\"k\":\"v\",\"k\":\"w\"}", "metadata_json has the key \"k\" twice", MS_E_FORMAT },
    };
    size_t before_n;
    CHECK(ms_safetensors_save(ctx, path, 1, (const char *[]){ "old" }, two, "{\"v\":\"1\"}") == MS_OK, "old file");
    unsigned char *before = read_bytes(path, &before_n);
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const char *names[2] = { cases[k].n0, cases[k].n1 };
        ms_status st = ms_safetensors_save(ctx, path, 2, names, two, cases[k].meta);
        CHECK(st == cases[k].st, "save case %zu: %s", k, ms_status_name(st));
        CHECK(strstr(ms_ctx_last_error(ctx), cases[k].needle) != NULL, "save case %zu: \"%s\"", k,
              ms_ctx_last_error(ctx));
    }
    CHECK(ms_safetensors_save(NULL, path, 0, NULL, NULL, NULL) == MS_E_ARG, "NULL ctx");
    CHECK(ms_safetensors_save(ctx, "", 0, NULL, NULL, NULL) == MS_E_ARG, "empty path");
    CHECK(ms_safetensors_save(ctx, path, -1, NULL, NULL, NULL) == MS_E_ARG, "n < 0");
    CHECK(ms_safetensors_save(ctx, path, 1, (const char *[]){ "x" }, (const ms_tensor *[]){ NULL }, NULL) == MS_E_ARG
          && strstr(ms_ctx_last_error(ctx), "tensors[0] (\"x\") is NULL"), "NULL tensor: %s", ms_ctx_last_error(ctx));

    char p[256];
    snprintf(p, sizeof p, "%s/no/such/dir/x.safetensors", dir);
    CHECK(ms_safetensors_save(ctx, p, 1, (const char *[]){ "x" }, two, NULL) == MS_E_IO
          && strstr(ms_ctx_last_error(ctx), "No such file or directory"), "missing folder: %s", ms_ctx_last_error(ctx));
    snprintf(p, sizeof p, "%s/", dir);
    CHECK(ms_safetensors_save(ctx, p, 1, (const char *[]){ "x" }, two, NULL) == MS_E_ARG
          && strstr(ms_ctx_last_error(ctx), "names a folder"), "folder path: %s", ms_ctx_last_error(ctx));
    /* an existing folder names a folder too (moonstep.h: MS_E_ARG), refused before anything is written; it is
    ** left as it was */
    snprintf(p, sizeof p, "%s/adir", dir);
    mkdir(p, 0755);
    char q[300];
    snprintf(q, sizeof q, "%s/inside", p);
    write_bytes(q, "x", 1);
    CHECK(ms_safetensors_save(ctx, p, 1, (const char *[]){ "x" }, two, NULL) == MS_E_ARG
          && strstr(ms_ctx_last_error(ctx), "names a folder"), "existing folder: %s", ms_ctx_last_error(ctx));
    CHECK(count_temp_files() == 0, "no temporary file left for an existing folder");
    struct stat sq;
    CHECK(stat(q, &sq) == 0 && sq.st_size == 1, "the folder's contents are untouched");
    unlink(q);
    rmdir(p);

    /* a failure in the middle of the data (the tensor cannot be staged: its context is out of memory) */
    ms_ctx *small = NULL;
    ms_ctx_options o = { .mem_limit = 64 };
    CHECK(ms_ctx_new("cpu", &o, &small) == MS_OK, "small context");
    ms_tensor *m = NULL, *mt = NULL;
    float sixteen[16] = { 0 };
    if (small && ms_tensor_new(small, MS_DTYPE_F32, 2, (int64_t[]){ 4, 4 }, &m) == MS_OK
        && ms_tensor_write(small, m, sixteen, sizeof sixteen) == MS_OK && ms_tensor_transpose(small, m, 0, 1, &mt) == MS_OK) {
        const ms_tensor *ok_then_bad[2] = { a, mt };
        ms_status st = ms_safetensors_save(ctx, path, 2, (const char *[]){ "a", "b" }, ok_then_bad, NULL);
        CHECK(st == MS_E_OOM && strstr(ms_ctx_last_error(ctx), "reading tensor \"b\""), "mid-write failure: %s %s",
              ms_status_name(st), ms_ctx_last_error(ctx));
    } else CHECK(0, "strided tensor in a small context: %s", ms_last_error());
    ms_tensor_free(mt);
    ms_tensor_free(m);
    ms_ctx_free(small);

    /* an expanded view of 2^62 f32 elements (2^64 bytes, which wrapped to 0) was written as data_offsets [0, 0]:
    ** a file that its own loader refuses */
    ms_tensor *e = NULL;
    CHECK(ms_tensor_expand(ctx, a, 2, (int64_t[]){ (int64_t)1 << 60, 4 }, &e) == MS_OK, "expand to 2^62 elements");
    {
        ms_status st = ms_safetensors_save(ctx, path, 1, (const char *[]){ "huge" }, (const ms_tensor *[]){ e }, NULL);
        CHECK(st == MS_E_OOM && strstr(ms_ctx_last_error(ctx), "tensor \"huge\""), "2^62 elements: %s %s",
              ms_status_name(st), ms_ctx_last_error(ctx));
    }
    ms_tensor_free(e);

    size_t after_n;
    unsigned char *after = read_bytes(path, &after_n);
    CHECK(before && after && before_n == after_n && memcmp(before, after, before_n) == 0,
          "failed saves left the old file untouched");
    CHECK(count_temp_files() == 0, "no temporary file left");
    free(before);
    free(after);
    ms_tensor_free(a);
}

/* --- load errors ---------------------------------------------------------------------------------- */

static void test_load_errors(void)
{
    static const struct { const char *header; size_t data; ms_status st; const char *needle; } cases[] = {
        { "{", 0, MS_E_FORMAT, "header is not valid JSON: header byte 1: unexpected end of input" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}x", 4, MS_E_FORMAT, "not valid JSON" },
        { "[]", 0, MS_E_FORMAT, "header is not a JSON object" },
        { "\"x\"", 0, MS_E_FORMAT, "header is not a JSON object" },
        { "{\"a\":1}", 0, MS_E_FORMAT, "tensor \"a\": entry is not an object" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, MS_E_FORMAT, "tensor \"a\": missing key \"data_offsets\"" },
        { "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "tensor \"a\": missing key \"dtype\"" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, MS_E_FORMAT,
          "tensor \"a\": unexpected key \"x\"" },
        { "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT,
          "tensor \"a\": key \"dtype\" given twice" },
        { "{\"a\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "tensor \"a\": dtype is not a string" },
        { "{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, MS_E_UNSUPPORTED,
          "tensor \"w\": dtype \"F8_E4M3\" is not supported" },
        { "{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MS_E_UNSUPPORTED, "dtype \"f32\" is not supported" },
        { "{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, MS_E_UNSUPPORTED, "dtype \"I64\"" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", 16, MS_E_FORMAT, "tensor \"a\": shape is not an array" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT,
          "tensor \"a\": shape[0] is not a non-negative integer" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1.5],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "shape[1] is not a non-negative" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "shape[0] is not" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "shape[0] is not" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, MS_E_UNSUPPORTED,
          "tensor \"a\": 9 dims, more than MS_MAX_DIMS (8)" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, MS_E_FORMAT,
          "tensor \"a\": data_offsets is not [begin, end] of non-negative integers" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, MS_E_FORMAT, "data_offsets is not [begin, end]" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, MS_E_FORMAT, "data_offsets is not [begin, end]" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}}", 4, MS_E_FORMAT, "data_offsets is not [begin, end]" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, MS_E_FORMAT,
          "tensor \"a\": data_offsets [4, 0] end before they begin" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT,
          "tensor \"a\": shape [2] of F32 needs 8 bytes but data_offsets [0, 4] hold 4" },
        /* more bytes than the shape needs is as wrong as fewer */
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, MS_E_FORMAT,
          "tensor \"a\": shape [1] of F32 needs 4 bytes but data_offsets [0, 8] hold 8" },
        { "{\"a\":{\"dtype\":\"BF16\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,0]}}", 0, MS_E_FORMAT,
          "tensor \"a\": shape [4611686018427387904,4] is too large" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775807,2],\"data_offsets\":[0,0]}}", 0, MS_E_FORMAT, "is too large" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,0]}}", 0, MS_E_FORMAT, "shape[0] is not" },
        /* no bytes, but the sizes other than 0 are its strides: they must multiply within int64 too (a hand-made
        ** input to fuzz_safetensors, under UBSan: the tensor was made, its first stride a signed overflow) */
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[0,4611686018427387904,4611686018427387904],\"data_offsets\":[0,0]}}", 0,
          MS_E_FORMAT, "tensor \"a\": shape [0,4611686018427387904,4611686018427387904] is too large" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775807,9223372036854775807,0],\"data_offsets\":[0,0]}}", 0,
          MS_E_FORMAT, "is too large" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 8, MS_E_FORMAT,
          "tensor \"a\": data_offsets [0, 12] run past the end of the data (8 bytes; truncated file?)" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],"
          "\"data_offsets\":[4,12]}}", 12, MS_E_FORMAT, "tensors \"a\" and \"b\" overlap (data_offsets [0, 8] and [4, 12])" },
        { "{\"b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]},\"a\":{\"dtype\":\"U8\",\"shape\":[4],"
          "\"data_offsets\":[0,4]}}", 4, MS_E_FORMAT, "tensors \"a\" and \"b\" overlap" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],"
          "\"data_offsets\":[8,12]}}", 12, MS_E_FORMAT, "data bytes [4, 8) belong to no tensor (a hole before \"b\")" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, MS_E_FORMAT, "data bytes [0, 4) belong to no tensor" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 16, MS_E_FORMAT,
          "data bytes [4, 16) at the end belong to no tensor" },
        { "{}", 1, MS_E_FORMAT, "data bytes [0, 1) at the end belong to no tensor" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
          "\"data_offsets\":[4,8]}}", 8, MS_E_FORMAT, "duplicate tensor name \"a\"" },
        { "{\"__metadata__\":[],\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, MS_E_FORMAT,
          "__metadata__ is not an object" },
        { "{\"__metadata__\":{\"step\":3},\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, MS_E_FORMAT,
          "__metadata__ value of \"step\" is not a string" },
        { "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, MS_E_FORMAT, "__metadata__ has the key \"k\" twice" },
        { "{\"__metadata__\":{},\"__metadata__\":{}}", 0, MS_E_FORMAT, "duplicate tensor name \"__metadata__\"" },
        { "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, MS_E_FORMAT, "contains a NUL byte" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        char label[32];
        snprintf(label, sizeof label, "load case %zu", k);
        write_st(path, cases[k].header, cases[k].data);
        EXPECT_LOAD_FAIL(label, cases[k].st, cases[k].needle);
    }

    /* valid corner cases: zero-size tensors share offsets, 0-dim, padding, entries out of data order */
    ms_tensor_set *set = NULL;
    write_st(path, "{\"z\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[4,4]},\"s\":{\"dtype\":\"I32\",\"shape\":[],"
                   "\"data_offsets\":[4,8]},\"z2\":{\"dtype\":\"U8\",\"shape\":[3,0],\"data_offsets\":[4,4]},"
                   "\"a\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[0,4]}}       ", 8);
    CHECK(ms_safetensors_load(ctx, path, &set) == MS_OK && ms_tensor_set_count(set) == 4
          && strcmp(ms_tensor_set_name(set, 1), "s") == 0, "valid corner cases: %s", ms_ctx_last_error(ctx));
    ms_tensor *s = NULL;
    int32_t sv = 0;
    if (set && ms_tensor_set_get(set, 1, &s) == MS_OK) {
        unsigned char pat[4] = { 4 * 37 + 11, 5 * 37 + 11, (unsigned char)(6 * 37 + 11), (unsigned char)(7 * 37 + 11) };
        CHECK(ms_tensor_ndim(s) == 0 && ms_tensor_read(ctx, s, &sv, 4) == MS_OK && memcmp(&sv, pat, 4) == 0,
              "0-dim tensor read from its offset");
    }
    ms_tensor_free(s);
    ms_tensor_set_free(set);

    /* file-level problems */
    write_bytes(path, "", 0);
    EXPECT_LOAD_FAIL("empty file", MS_E_FORMAT, "file of 0 bytes is too short for the 8-byte header length");
    write_bytes(path, "\x02\0\0\0\0\0\0", 7);
    EXPECT_LOAD_FAIL("7 bytes", MS_E_FORMAT, "file of 7 bytes is too short");
    write_bytes(path, "\0\0\0\0\0\0\0\0", 8);
    EXPECT_LOAD_FAIL("empty header", MS_E_FORMAT, "header byte 0: unexpected end of input");
    write_bytes(path, "\0\0\0\0\0\1\0\0{}", 10);
    EXPECT_LOAD_FAIL("huge header length", MS_E_FORMAT, "header length 1099511627776 is over the limit of 100000000 bytes");
    write_bytes(path, "\x40\0\0\0\0\0\0\0{}", 10);
    EXPECT_LOAD_FAIL("header past EOF", MS_E_FORMAT, "header length 64 runs past the end of the file (10 bytes)");
    /* past the end by fewer bytes than the 8-byte length itself: the length counts from byte 8 */
    write_bytes(path, "\x04\0\0\0\0\0\0\0{}", 10);
    EXPECT_LOAD_FAIL("header just past EOF", MS_E_FORMAT, "header length 4 runs past the end of the file (10 bytes)");
    write_bytes(path, "\x04\0\0\0\0\0\0\0{}\xff ", 12);
    EXPECT_LOAD_FAIL("binary in header", MS_E_FORMAT, "byte 2: unexpected data after the value");
    char p[256];
    snprintf(p, sizeof p, "%s/missing.safetensors", dir);
    ms_tensor_set *none = (ms_tensor_set *)&none;
    CHECK(ms_safetensors_load(ctx, p, &none) == MS_E_IO && none == NULL && strstr(ms_ctx_last_error(ctx), p)
          && strstr(ms_ctx_last_error(ctx), "No such file or directory"), "missing file: %s", ms_ctx_last_error(ctx));
    CHECK(ms_safetensors_load(ctx, dir, &none) == MS_E_IO && strstr(ms_ctx_last_error(ctx), "not a regular file"),
          "folder: %s", ms_ctx_last_error(ctx));
    CHECK(ms_safetensors_load(NULL, path, &none) == MS_E_ARG && ms_safetensors_load(ctx, NULL, &none) == MS_E_ARG,
          "NULL arguments");
    /* *out is NULL after every failure (moonstep.h), a NULL ctx or path included */
    none = (ms_tensor_set *)&none;
    CHECK(ms_safetensors_load(NULL, path, &none) == MS_E_ARG && none == NULL, "NULL ctx clears *out");
    none = (ms_tensor_set *)&none;
    CHECK(ms_safetensors_load(ctx, NULL, &none) == MS_E_ARG && none == NULL, "NULL path clears *out");

    /* tensors that do not fit the context: the error names the tensor, nothing leaks */
    ms_ctx *small = NULL;
    ms_ctx_options o = { .mem_limit = 6 };
    write_st(path, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},\"b\":{\"dtype\":\"U8\",\"shape\":[4],"
                   "\"data_offsets\":[4,8]}}", 8);
    if (ms_ctx_new("cpu", &o, &small) == MS_OK) {
        CHECK(ms_safetensors_load(small, path, &none) == MS_E_OOM && strstr(ms_ctx_last_error(small), "tensor \"b\""),
              "out of memory: %s", ms_ctx_last_error(small));
        ms_mem_stats ms;
        CHECK(ms_ctx_mem_stats(small, &ms) == MS_OK && ms.bytes_in_use == 0, "nothing left allocated");
        ms_ctx_free(small);
    }
}

/* A valid file cut at every length, and with random header bytes changed, never loads wrongly or crashes. */
static void test_truncation_and_mutation(void)
{
    float v[6] = { 1, 2, 3, 4, 5, 6 };
    uint16_t h[3] = { 1, 2, 3 };
    const ms_tensor *ts[2] = { make(MS_DTYPE_F32, 2, (int64_t[]){ 3, 2 }, v), make(MS_DTYPE_BF16, 1, (int64_t[]){ 3 }, h) };
    CHECK(ms_safetensors_save(ctx, path, 2, (const char *[]){ "x", "y" }, ts, "{\"k\":\"v\"}") == MS_OK, "save");
    size_t n;
    unsigned char *file = read_bytes(path, &n);
    if (!file) return;
    int bad = 0;
    for (size_t len = 0; len < n; len++) {
        ms_tensor_set *set = NULL;
        write_bytes(path, file, len);
        ms_status st = ms_safetensors_load(ctx, path, &set);
        if (st != MS_E_FORMAT || set) {
            bad++;
            printf("  cut at %zu: %s %s\n", len, ms_status_name(st), ms_ctx_last_error(ctx));
        }
        ms_tensor_set_free(set);
    }
    CHECK(bad == 0, "%d of %zu truncated files did not fail with MS_E_FORMAT", bad, n);

    uint64_t hlen;
    memcpy(&hlen, file, 8);
    uint64_t x = 12345;
    int loaded = 0, failed = 0, unexpected = 0;
    unsigned char *m = malloc(n);
    for (int it = 0; it < 3000; it++) {
        memcpy(m, file, n);
        for (int k = 0; k < 1 + it % 3; k++) {
            x = x * 6364136223846793005u + 1442695040888963407u;
            size_t at = (size_t)(x >> 33) % (8 + hlen);
            m[at] = it % 2 ? (unsigned char)(x >> 20) : (unsigned char)"{}[]\",:0123456789eE.-tfn \\"[(x >> 20) % 27];
        }
        write_bytes(path, m, n);
        ms_tensor_set *set = NULL;
        ms_status st = ms_safetensors_load(ctx, path, &set);
        if (st == MS_OK) loaded++;
        else failed++;
        if (st != MS_OK && st != MS_E_FORMAT && st != MS_E_UNSUPPORTED) {
            unexpected++;
            printf("  mutation %d: %s %s\n", it, ms_status_name(st), ms_ctx_last_error(ctx));
        }
        ms_tensor_set_free(set);
    }
    CHECK(unexpected == 0, "%d mutations gave a status other than OK, FORMAT or UNSUPPORTED", unexpected);
    CHECK(failed > 2000, "most mutations refused (%d loaded, %d refused)", loaded, failed);
    free(m);
    free(file);
    ms_tensor_free((ms_tensor *)ts[0]);
    ms_tensor_free((ms_tensor *)ts[1]);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/ms_test_st.XXXXXX");
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 2; }
    snprintf(path, sizeof path, "%s/t.safetensors", dir);
    if (ms_ctx_new("cpu", NULL, &ctx) != MS_OK) { printf("ms_ctx_new: %s\n", ms_last_error()); return 2; }
    test_roundtrip();
    test_save_errors();
    test_load_errors();
    test_truncation_and_mutation();
    ms_ctx_free(ctx);
    unlink(path);
    CHECK(rmdir(dir) == 0, "the test folder is empty at the end (no stray files)");
    return CHECK_REPORT();
}
