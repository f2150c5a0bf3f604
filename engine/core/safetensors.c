/*
** safetensors files.  The loader trusts nothing: every size, offset, dtype, shape and key is checked before
** a byte of data is read.  The saver writes a temporary file beside the target, syncs it and renames it over.
*/
#define _XOPEN_SOURCE 700   /* pread, fsync, O_CLOEXEC, O_DIRECTORY */

#include "internal.h"
#include "json.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, and is copied as is");
_Static_assert(sizeof(off_t) == 8, "files past 2 GB need a 64-bit off_t");

#define MAX_HEADER 100000000u        /* the reference implementation's limit */
#define NAME_FMT "\"%.200s\""        /* names in messages, cut so that the message keeps its end */
#define U64(x) ((unsigned long long)(x))

static const struct { const char *name; ms_dtype dt; } file_dtypes[] = {
    { "F32", MS_DTYPE_F32 }, { "F64", MS_DTYPE_F64 }, { "BF16", MS_DTYPE_BF16 },
    { "F16", MS_DTYPE_F16 }, { "I32", MS_DTYPE_I32 }, { "U8", MS_DTYPE_U8 },
};

static const char *file_dtype_name(ms_dtype dt)
{
    for (size_t k = 0; k < sizeof file_dtypes / sizeof *file_dtypes; k++)
        if (file_dtypes[k].dt == dt) return file_dtypes[k].name;
    return NULL;
}

struct ms_tensor_set {
    ms_ctx     *ctx;          /* retained; errors of the set's calls are recorded on it */
    int         n;
    char      **names;
    ms_tensor **tensors;
    char       *metadata;     /* compact JSON object */
};

/* --- file helpers --------------------------------------------------------------------------------- */

/* Reads n bytes at off: 0 when done, 1 at a premature end of file, -1 with errno on an error. */
static int read_full(int fd, void *buf, size_t n, uint64_t off)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = pread(fd, p, n < (1u << 30) ? n : (1u << 30), (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        if (k == 0) return 1;
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n < (1u << 30) ? n : (1u << 30));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        if (k == 0) { errno = ENOSPC; return -1; }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* --- load ----------------------------------------------------------------------------------------- */

typedef struct entry {
    const char *name;         /* points into the parsed header */
    ms_dtype    dt;
    int         ndim;
    int64_t     shape[MS_MAX_DIMS];
    uint64_t    begin, end;   /* relative to the start of the data */
    int         index;        /* position in the header, and in the set */
} entry;

typedef struct loader {
    ms_ctx     *ctx;
    const char *path;
    uint64_t    data_size;
} loader;

/* Records "ms_safetensors_load: <path>: <detail>" with the caller's line. */
__attribute__((format(printf, 4, 5)))
static ms_status load_fail(const loader *L, ms_status st, int line, const char *fmt, ...)
{
    char detail[MS_ERRMSG_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return ms_error_at(L->ctx, st, __FILE__, line, "ms_safetensors_load: %s: %s", L->path, detail);
}
#define LFAIL(L, st, ...) load_fail((L), (st), __LINE__, __VA_ARGS__)

static bool nonneg_int(const ms_json *v) { return v->type == MS_JSON_NUMBER && v->is_int && v->i >= 0; }

static ms_status parse_entry(loader *L, const ms_json *v, entry *e)
{
    const ms_json *dup, *dtype = ms_json_get(v, "dtype"), *shape = ms_json_get(v, "shape");
    const ms_json *offs = ms_json_get(v, "data_offsets");
    e->name = v->key;
    if (strlen(v->key) != v->key_len) return LFAIL(L, MS_E_FORMAT, "a tensor name contains a NUL byte");
    if (v->type != MS_JSON_OBJECT) return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": entry is not an object", e->name);
    if (ms_json_dup_key(v, &dup) != MS_OK) return LFAIL(L, MS_E_OOM, "out of memory");
    if (dup) return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": key \"%.40s\" given twice", e->name, dup->key);
    for (size_t k = 0; k < v->len; k++) {
        const ms_json *c = &v->items[k];
        if (c != dtype && c != shape && c != offs)
            return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": unexpected key \"%.40s\"", e->name, c->key);
    }
    if (!dtype || !shape || !offs)
        return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": missing key \"%s\"", e->name,
                     !dtype ? "dtype" : !shape ? "shape" : "data_offsets");

    if (dtype->type != MS_JSON_STRING) return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": dtype is not a string", e->name);
    size_t k = 0;
    while (k < sizeof file_dtypes / sizeof *file_dtypes && strcmp(dtype->s, file_dtypes[k].name) != 0) k++;
    if (k == sizeof file_dtypes / sizeof *file_dtypes || strlen(dtype->s) != dtype->len)
        return LFAIL(L, MS_E_UNSUPPORTED, "tensor " NAME_FMT ": dtype \"%.40s\" is not supported (F32 F64 BF16 F16 "
                     "I32 U8)", e->name, dtype->s);
    e->dt = file_dtypes[k].dt;

    if (shape->type != MS_JSON_ARRAY) return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": shape is not an array", e->name);
    if (shape->len > MS_MAX_DIMS)
        return LFAIL(L, MS_E_UNSUPPORTED, "tensor " NAME_FMT ": %zu dims, more than MS_MAX_DIMS (%d)", e->name,
                     shape->len, MS_MAX_DIMS);
    e->ndim = (int)shape->len;
    bool empty = false;
    for (int d = 0; d < e->ndim; d++) {
        if (!nonneg_int(&shape->items[d]))
            return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": shape[%d] is not a non-negative integer", e->name, d);
        e->shape[d] = shape->items[d].i;
        empty |= e->shape[d] == 0;
    }

    if (offs->type != MS_JSON_ARRAY || offs->len != 2 || !nonneg_int(&offs->items[0]) || !nonneg_int(&offs->items[1]))
        return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": data_offsets is not [begin, end] of non-negative integers",
                     e->name);
    e->begin = (uint64_t)offs->items[0].i;
    e->end = (uint64_t)offs->items[1].i;
    if (e->begin > e->end)
        return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": data_offsets [%llu, %llu] end before they begin", e->name,
                     U64(e->begin), U64(e->end));

    /* bytes = numel * size, refusing any product that overflows int64 (a tensor could not hold it).  The sizes
    ** other than 0 must multiply within int64 even when one is 0: they are an empty tensor's strides too
    ** ([0, 2^62, 2^62] holds no byte, but its first stride would be 2^124) */
    char sbuf[16 * MS_MAX_DIMS + 4];
    uint64_t esize = ms_dtype_size(e->dt), extent = esize;
    for (int d = 0; d < e->ndim; d++) {
        if (e->shape[d] == 0) continue;
        if ((uint64_t)e->shape[d] > (uint64_t)INT64_MAX / extent)
            return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": shape %s is too large", e->name,
                         ms_shape_str(sbuf, sizeof sbuf, e->ndim, e->shape));
        extent *= (uint64_t)e->shape[d];
    }
    uint64_t bytes = empty ? 0 : extent;
    if (bytes != e->end - e->begin)
        return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": shape %s of %s needs %llu bytes but data_offsets [%llu, "
                     "%llu] hold %llu", e->name, ms_shape_str(sbuf, sizeof sbuf, e->ndim, e->shape),
                     file_dtypes[k].name, U64(bytes), U64(e->begin), U64(e->end), U64(e->end - e->begin));
    if (e->end > L->data_size)
        return LFAIL(L, MS_E_FORMAT, "tensor " NAME_FMT ": data_offsets [%llu, %llu] run past the end of the data "
                     "(%llu bytes; truncated file?)", e->name, U64(e->begin), U64(e->end), U64(L->data_size));
    return MS_OK;
}

static ms_status parse_metadata(loader *L, const ms_json *v, char **out)
{
    const ms_json *dup;
    if (v->type != MS_JSON_OBJECT) return LFAIL(L, MS_E_FORMAT, "__metadata__ is not an object");
    if (ms_json_dup_key(v, &dup) != MS_OK) return LFAIL(L, MS_E_OOM, "out of memory");
    if (dup) return LFAIL(L, MS_E_FORMAT, "__metadata__ has the key " NAME_FMT " twice", dup->key);
    for (size_t k = 0; k < v->len; k++)
        if (v->items[k].type != MS_JSON_STRING)
            return LFAIL(L, MS_E_FORMAT, "__metadata__ value of " NAME_FMT " is not a string", v->items[k].key);
    ms_json_buf b;
    ms_json_buf_init(&b);
    ms_json_buf_value(&b, v);
    if (b.st != MS_OK) { ms_json_buf_free(&b); return LFAIL(L, MS_E_OOM, "out of memory"); }
    *out = b.data;
    return MS_OK;
}

static int cmp_offsets(const void *a, const void *b)
{
    const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The entries, sorted by offsets, must tile the data exactly: no overlap, no hole, nothing after. */
static ms_status check_tiling(loader *L, entry **sorted, int n)
{
    uint64_t expect = 0;
    const entry *prev = NULL;
    for (int k = 0; k < n; k++) {
        const entry *e = sorted[k];
        if (e->begin < expect)
            return LFAIL(L, MS_E_FORMAT, "tensors " NAME_FMT " and " NAME_FMT " overlap (data_offsets [%llu, %llu] "
                         "and [%llu, %llu])", prev->name, e->name, U64(prev->begin), U64(prev->end),
                         U64(e->begin), U64(e->end));
        if (e->begin > expect)
            return LFAIL(L, MS_E_FORMAT, "data bytes [%llu, %llu) belong to no tensor (a hole before " NAME_FMT ")",
                         U64(expect), U64(e->begin), e->name);
        expect = e->end;
        prev = e;
    }
    if (expect != L->data_size)
        return LFAIL(L, MS_E_FORMAT, "data bytes [%llu, %llu) at the end belong to no tensor", U64(expect),
                     U64(L->data_size));
    return MS_OK;
}

MS_API void ms_tensor_set_free(ms_tensor_set *set)
{
    if (!set) return;
    for (int i = 0; i < set->n; i++) {
        if (set->tensors) ms_tensor_free(set->tensors[i]);
        if (set->names) free(set->names[i]);
    }
    free(set->tensors);
    free(set->names);
    free(set->metadata);
    if (set->ctx) ms_ctx_release(set->ctx);
    free(set);
}

/* Creates the set's tensors and reads their data, in file order. */
static ms_status read_tensors(loader *L, int fd, uint64_t data_start, entry **sorted, ms_tensor_set *set)
{
    size_t stage_size = 0;
    for (int k = 0; k < set->n; k++)
        if (sorted[k]->end - sorted[k]->begin > stage_size) stage_size = (size_t)(sorted[k]->end - sorted[k]->begin);
    void *stage = stage_size ? malloc(stage_size) : NULL;
    if (stage_size && !stage) return LFAIL(L, MS_E_OOM, "no memory for a %zu-byte read buffer", stage_size);
    ms_status st = MS_OK;
    for (int k = 0; k < set->n && st == MS_OK; k++) {
        const entry *e = sorted[k];
        size_t nbytes = (size_t)(e->end - e->begin);
        ms_tensor **t = &set->tensors[e->index];
        if ((set->names[e->index] = strdup(e->name)) == NULL) { st = LFAIL(L, MS_E_OOM, "out of memory"); break; }
        if ((st = ms_tensor_new(L->ctx, e->dt, e->ndim, e->shape, t)) != MS_OK) {
            char why[MS_ERRMSG_SIZE];
            snprintf(why, sizeof why, "%s", ms_ctx_last_error(L->ctx));
            st = LFAIL(L, st, "tensor " NAME_FMT ": %s", e->name, why);
            break;
        }
        if (nbytes == 0) continue;
        int r = read_full(fd, stage, nbytes, data_start + e->begin);
        if (r < 0) st = LFAIL(L, MS_E_IO, "reading tensor " NAME_FMT ": %s", e->name, strerror(errno));
        else if (r > 0) st = LFAIL(L, MS_E_FORMAT, "the file ended while reading tensor " NAME_FMT " (it shrank?)", e->name);
        else if ((st = ms_tensor_write(L->ctx, *t, stage, nbytes)) != MS_OK) {
            char why[MS_ERRMSG_SIZE];
            snprintf(why, sizeof why, "%s", ms_ctx_last_error(L->ctx));
            st = LFAIL(L, st, "tensor " NAME_FMT ": %s", e->name, why);
        }
    }
    free(stage);
    return st;
}

static ms_status load_fd(loader *L, int fd, ms_tensor_set **out)
{
    struct stat sb;
    unsigned char lenbytes[8];
    if (fstat(fd, &sb) != 0) return LFAIL(L, MS_E_IO, "%s", strerror(errno));
    if (!S_ISREG(sb.st_mode)) return LFAIL(L, MS_E_IO, "not a regular file");
    uint64_t fsize = (uint64_t)sb.st_size, hlen;
    if (fsize < 8) return LFAIL(L, MS_E_FORMAT, "file of %llu bytes is too short for the 8-byte header length", U64(fsize));
    int r = read_full(fd, lenbytes, 8, 0);
    if (r != 0) return r < 0 ? LFAIL(L, MS_E_IO, "%s", strerror(errno)) : LFAIL(L, MS_E_FORMAT, "file shrank");
    memcpy(&hlen, lenbytes, 8);
    if (hlen > MAX_HEADER)
        return LFAIL(L, MS_E_FORMAT, "header length %llu is over the limit of %u bytes", U64(hlen), MAX_HEADER);
    if (hlen > fsize - 8)
        return LFAIL(L, MS_E_FORMAT, "header length %llu runs past the end of the file (%llu bytes)", U64(hlen),
                     U64(fsize));
    L->data_size = fsize - 8 - hlen;

    char *text = malloc(hlen ? (size_t)hlen : 1), err[160];
    if (!text) return LFAIL(L, MS_E_OOM, "no memory for a header of %llu bytes", U64(hlen));
    ms_json *root = NULL;
    ms_status st = MS_OK;
    if ((r = read_full(fd, text, (size_t)hlen, 8)) != 0)
        st = r < 0 ? LFAIL(L, MS_E_IO, "%s", strerror(errno)) : LFAIL(L, MS_E_FORMAT, "file shrank");
    else if ((st = ms_json_parse(text, (size_t)hlen, &root, err, sizeof err)) != MS_OK)
        st = st == MS_E_OOM ? LFAIL(L, st, "no memory to parse the header of %llu bytes", U64(hlen))
                            : LFAIL(L, st, "header is not valid JSON: header %s", err);
    free(text);
    if (st != MS_OK) return st;

    const ms_json *dup, *meta = ms_json_get(root, "__metadata__");
    entry *entries = NULL, **sorted = NULL;
    ms_tensor_set *set = NULL;
    int n = 0;   /* a 100 MB header holds far fewer than INT_MAX entries */
    if (root->type != MS_JSON_OBJECT) { st = LFAIL(L, MS_E_FORMAT, "header is not a JSON object"); goto done; }
    if (ms_json_dup_key(root, &dup) != MS_OK) { st = LFAIL(L, MS_E_OOM, "out of memory"); goto done; }
    if (dup) { st = LFAIL(L, MS_E_FORMAT, "duplicate tensor name " NAME_FMT, dup->key); goto done; }
    n = (int)root->len - (meta ? 1 : 0);
    entries = calloc((size_t)n + 1, sizeof *entries);
    sorted = calloc((size_t)n + 1, sizeof *sorted);
    set = calloc(1, sizeof *set);
    if (!entries || !sorted || !set) { st = LFAIL(L, MS_E_OOM, "out of memory"); goto done; }
    ms_ctx_retain(L->ctx);
    set->ctx = L->ctx;
    for (size_t k = 0, i = 0; k < root->len && st == MS_OK; k++) {
        if (&root->items[k] == meta) { st = parse_metadata(L, meta, &set->metadata); continue; }
        entries[i].index = (int)i;
        sorted[i] = &entries[i];
        st = parse_entry(L, &root->items[k], &entries[i++]);
    }
    if (st != MS_OK) goto done;
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_offsets);
    if ((st = check_tiling(L, sorted, n)) != MS_OK) goto done;

    if (!set->metadata && !(set->metadata = strdup("{}"))) { st = LFAIL(L, MS_E_OOM, "out of memory"); goto done; }
    set->names = calloc((size_t)n + 1, sizeof *set->names);
    set->tensors = calloc((size_t)n + 1, sizeof *set->tensors);
    if (!set->names || !set->tensors) { st = LFAIL(L, MS_E_OOM, "out of memory"); goto done; }
    set->n = n;
    st = read_tensors(L, fd, 8 + hlen, sorted, set);
done:
    if (st != MS_OK) ms_tensor_set_free(set);
    else *out = set;
    free(sorted);
    free(entries);
    ms_json_free(root);
    return st;
}

MS_API ms_status ms_safetensors_load(ms_ctx *ctx, const char *path, ms_tensor_set **out)
{
    if (out) *out = NULL;   /* on every error, NULL ctx and path included */
    if (!ctx) return MS_FAIL(NULL, MS_E_ARG, "ms_safetensors_load: ctx is NULL");
    if (!path || !out) return MS_FAIL(ctx, MS_E_ARG, "ms_safetensors_load: %s is NULL", path ? "out" : "path");
    loader L = { .ctx = ctx, .path = path };
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return LFAIL(&L, MS_E_IO, "%s", strerror(errno));
    ms_status st = load_fd(&L, fd, out);
    close(fd);
    return st;
}

MS_API int ms_tensor_set_count(const ms_tensor_set *set) { return set ? set->n : 0; }

MS_API const char *ms_tensor_set_name(const ms_tensor_set *set, int i)
{
    return set && i >= 0 && i < set->n ? set->names[i] : NULL;
}

MS_API ms_status ms_tensor_set_get(const ms_tensor_set *set, int i, ms_tensor **out)
{
    if (out) *out = NULL;
    if (!set || !out) return MS_FAIL(NULL, MS_E_ARG, "ms_tensor_set_get: %s is NULL", set ? "out" : "set");
    if (i < 0 || i >= set->n)
        return MS_FAIL(set->ctx, MS_E_ARG, "ms_tensor_set_get: index %d out of range [0, %d)", i, set->n);
    return ms_tensor_contiguous(set->ctx, set->tensors[i], out);   /* a new view of a contiguous tensor */
}

MS_API const char *ms_tensor_set_metadata(const ms_tensor_set *set) { return set ? set->metadata : "{}"; }

/* --- save ----------------------------------------------------------------------------------------- */

__attribute__((format(printf, 5, 6)))
static ms_status save_fail(ms_ctx *ctx, ms_status st, const char *path, int line, const char *fmt, ...)
{
    char detail[MS_ERRMSG_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return ms_error_at(ctx, st, __FILE__, line, "ms_safetensors_save: %s: %s", path, detail);
}
#define SFAIL(ctx, st, path, ...) save_fail((ctx), (st), (path), __LINE__, __VA_ARGS__)

typedef struct slot {
    const char *name;
    int         index;    /* in the caller's arrays */
    size_t      esize;
} slot;

static int cmp_slot_name(const void *a, const void *b)
{
    const slot *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->index > y->index) - (x->index < y->index);
}

/* Larger elements first, then the caller's order: every tensor's offset is then a multiple of its element
** size (as in the reference writer), so that readers who map the file get aligned data. */
static int cmp_slot_layout(const void *a, const void *b)
{
    const slot *x = a, *y = b;
    if (x->esize != y->esize) return x->esize > y->esize ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static ms_status parse_user_metadata(ms_ctx *ctx, const char *path, const char *text, ms_json **out)
{
    char err[160];
    const ms_json *dup;
    ms_status st = ms_json_parse(text, strlen(text), out, err, sizeof err);
    /* malformed JSON is MS_E_FORMAT (moonstep.h's status classes, as ms_optimizer_new's JSON arguments); a value
    ** of the wrong type, below, is an invalid argument */
    if (st == MS_E_OOM) return SFAIL(ctx, MS_E_OOM, path, "out of memory");
    if (st != MS_OK) return SFAIL(ctx, MS_E_FORMAT, path, "metadata_json is not valid JSON: %s", err);
    const ms_json *m = *out;
    if (m->type != MS_JSON_OBJECT) st = SFAIL(ctx, MS_E_FORMAT, path, "metadata_json is not a JSON object");
    else if (ms_json_dup_key(m, &dup) != MS_OK) st = SFAIL(ctx, MS_E_OOM, path, "out of memory");
    else if (dup) st = SFAIL(ctx, MS_E_FORMAT, path, "metadata_json has the key " NAME_FMT " twice", dup->key);
    for (size_t k = 0; k < m->len && st == MS_OK; k++)
        if (m->items[k].type != MS_JSON_STRING)
            st = SFAIL(ctx, MS_E_ARG, path, "metadata_json: the value of " NAME_FMT " is not a string", m->items[k].key);
    if (st != MS_OK) { ms_json_free(*out); *out = NULL; }
    return st;
}

static void header_entry(ms_json_buf *b, const char *name, const ms_tensor *t, uint64_t begin, uint64_t nbytes)
{
    const char *dt = file_dtype_name(t->dtype);
    ms_json_buf_str(b, name, strlen(name));
    ms_json_buf_raw(b, ":{\"dtype\":\"", 11);
    ms_json_buf_raw(b, dt, strlen(dt));
    ms_json_buf_raw(b, "\",\"shape\":[", 11);
    for (int d = 0; d < t->ndim; d++) {
        if (d) ms_json_buf_raw(b, ",", 1);
        ms_json_buf_int(b, t->shape[d]);
    }
    ms_json_buf_raw(b, "],\"data_offsets\":[", 18);
    ms_json_buf_int(b, (int64_t)begin);
    ms_json_buf_raw(b, ",", 1);
    ms_json_buf_int(b, (int64_t)(begin + nbytes));
    ms_json_buf_raw(b, "]}", 2);
}

/* Writes length, header and data to a temporary file beside `path`, syncs it and renames it over `path`.
** Until the rename, `path` is untouched; on failure the temporary file is removed. */
static ms_status write_file(ms_ctx *ctx, const char *path, const ms_json_buf *hdr, const ms_tensor *const *tensors,
                            const char *const *names, const slot *layout, int n)
{
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    size_t dlen = (size_t)(base - path), tlen = strlen(path) + 48, stage_size = 0;
    struct stat sb;
    /* an existing folder too (moonstep.h: MS_E_ARG), before a byte is written rather than at the rename */
    if (!*base || (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)))
        return SFAIL(ctx, MS_E_ARG, path, "the path names a folder, not a file");
    for (int k = 0; k < n; k++) {
        const ms_tensor *t = tensors[layout[k].index];
        size_t nbytes = (size_t)ms_tensor_numel(t) * layout[k].esize;
        if (nbytes > stage_size) stage_size = nbytes;
    }
    char *tmp = malloc(tlen), *dir = malloc(dlen + 2);
    void *stage = stage_size ? malloc(stage_size) : NULL;
    if (!tmp || !dir || (stage_size && !stage)) {
        free(tmp); free(dir); free(stage);
        return SFAIL(ctx, MS_E_OOM, path, "out of memory (a %zu-byte write buffer)", stage_size);
    }
    snprintf(tmp, tlen, "%.*s.%s.tmp.%ld", (int)dlen, path, base, (long)getpid());
    if (dlen) snprintf(dir, dlen + 2, "%.*s", (int)dlen, path);
    else strcpy(dir, ".");

    ms_status st = MS_OK;
    uint64_t hlen = hdr->len;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
        st = SFAIL(ctx, MS_E_IO, path, "creating %s: %s", tmp, strerror(errno));
        tmp[0] = '\0';   /* not ours to remove (EEXIST: another writer's, or a stale one) */
        goto done;
    }
    if (write_full(fd, &hlen, 8) != 0 || write_full(fd, hdr->data, hdr->len) != 0) {
        st = SFAIL(ctx, MS_E_IO, path, "writing %s: %s", tmp, strerror(errno));
        goto done;
    }
    for (int k = 0; k < n; k++) {
        const ms_tensor *t = tensors[layout[k].index];
        size_t nbytes = (size_t)ms_tensor_numel(t) * layout[k].esize;
        if (nbytes == 0) continue;
        if ((st = ms_tensor_read(ctx, t, stage, nbytes)) != MS_OK) {
            char why[MS_ERRMSG_SIZE];
            snprintf(why, sizeof why, "%s", ms_ctx_last_error(ctx));
            st = SFAIL(ctx, st, path, "reading tensor " NAME_FMT ": %s", names[layout[k].index], why);
            goto done;
        }
        if (write_full(fd, stage, nbytes) != 0) {
            st = SFAIL(ctx, MS_E_IO, path, "writing %s: %s", tmp, strerror(errno));
            goto done;
        }
    }
    if (fsync(fd) != 0) { st = SFAIL(ctx, MS_E_IO, path, "syncing %s: %s", tmp, strerror(errno)); goto done; }
    int rc = close(fd);
    fd = -1;
    if (rc != 0) { st = SFAIL(ctx, MS_E_IO, path, "closing %s: %s", tmp, strerror(errno)); goto done; }
    if (rename(tmp, path) != 0) { st = SFAIL(ctx, MS_E_IO, path, "renaming %s over it: %s", tmp, strerror(errno)); goto done; }
    tmp[0] = '\0';   /* renamed: nothing left to remove */
    /* make the rename itself durable; filesystems that cannot sync a folder say EINVAL */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || (fsync(dfd) != 0 && errno != EINVAL))
        st = SFAIL(ctx, MS_E_IO, path, "written, but syncing the folder %s failed: %s", dir, strerror(errno));
    if (dfd >= 0) close(dfd);
done:
    if (fd >= 0) close(fd);
    if (tmp[0]) unlink(tmp);
    free(stage);
    free(tmp);
    free(dir);
    return st;
}

MS_API ms_status ms_safetensors_save(ms_ctx *ctx, const char *path, int n, const char *const *names,
                                     const ms_tensor *const *tensors, const char *metadata_json)
{
    if (!ctx) return MS_FAIL(NULL, MS_E_ARG, "ms_safetensors_save: ctx is NULL");
    if (!path || !*path) return MS_FAIL(ctx, MS_E_ARG, "ms_safetensors_save: path is %s", path ? "empty" : "NULL");
    if (n < 0 || (n > 0 && (!names || !tensors)))
        return SFAIL(ctx, MS_E_ARG, path, "n = %d with names %s and tensors %s", n, names ? "given" : "NULL",
                     tensors ? "given" : "NULL");
    for (int i = 0; i < n; i++) {
        const char *nm = names[i];
        if (!nm) return SFAIL(ctx, MS_E_ARG, path, "names[%d] is NULL", i);
        if (!*nm) return SFAIL(ctx, MS_E_ARG, path, "names[%d] is empty", i);
        if (strcmp(nm, "__metadata__") == 0)
            return SFAIL(ctx, MS_E_ARG, path, "names[%d] is \"__metadata__\", which the format reserves", i);
        if (!ms_json_utf8_valid(nm, strlen(nm))) return SFAIL(ctx, MS_E_ARG, path, "names[%d] is not valid UTF-8", i);
        if (!tensors[i]) return SFAIL(ctx, MS_E_ARG, path, "tensors[%d] (" NAME_FMT ") is NULL", i, nm);
        if (!file_dtype_name(tensors[i]->dtype))
            return SFAIL(ctx, MS_E_DTYPE, path, "tensor " NAME_FMT " has invalid dtype %d", nm, (int)tensors[i]->dtype);
        /* an expanded view may have more bytes than memory (or size_t: 2^62 f32 elements wrapped to 0 bytes) */
        if ((uint64_t)ms_tensor_numel(tensors[i]) > (SIZE_MAX / 2) / ms_dtype_size(tensors[i]->dtype))
            return SFAIL(ctx, MS_E_OOM, path, "tensor " NAME_FMT ": %lld elements of %s do not fit in memory", nm,
                         (long long)ms_tensor_numel(tensors[i]), ms_dtype_name(tensors[i]->dtype));
    }

    ms_json *meta = NULL;
    ms_json_buf hdr;
    ms_json_buf_init(&hdr);
    slot *slots = malloc(((size_t)n + 1) * sizeof *slots);
    uint64_t *begin = malloc(((size_t)n + 1) * sizeof *begin), off = 0;
    ms_status st = MS_OK;
    if (!slots || !begin) { st = SFAIL(ctx, MS_E_OOM, path, "out of memory"); goto done; }
    if (metadata_json && *metadata_json && (st = parse_user_metadata(ctx, path, metadata_json, &meta)) != MS_OK)
        goto done;
    for (int i = 0; i < n; i++) slots[i] = (slot){ names[i], i, ms_dtype_size(tensors[i]->dtype) };
    qsort(slots, (size_t)n, sizeof *slots, cmp_slot_name);
    for (int k = 1; k < n; k++)
        if (strcmp(slots[k - 1].name, slots[k].name) == 0) {
            st = SFAIL(ctx, MS_E_ARG, path, "name " NAME_FMT " is given twice (names[%d] and names[%d])", slots[k].name,
                       slots[k - 1].index, slots[k].index);
            goto done;
        }
    qsort(slots, (size_t)n, sizeof *slots, cmp_slot_layout);
    for (int k = 0; k < n; k++) {
        begin[slots[k].index] = off;
        off += (uint64_t)ms_tensor_numel(tensors[slots[k].index]) * slots[k].esize;   /* each < 2^63 (checked) */
        if (off > (uint64_t)INT64_MAX) {
            st = SFAIL(ctx, MS_E_OOM, path, "the tensors hold more than 2^63 bytes together");
            goto done;
        }
    }

    ms_json_buf_raw(&hdr, "{", 1);
    if (meta) {
        ms_json_buf_raw(&hdr, "\"__metadata__\":", 15);
        ms_json_buf_value(&hdr, meta);
    }
    for (int i = 0; i < n; i++) {
        if (i || meta) ms_json_buf_raw(&hdr, ",", 1);
        header_entry(&hdr, names[i], tensors[i], begin[i], (uint64_t)ms_tensor_numel(tensors[i])
                     * ms_dtype_size(tensors[i]->dtype));
    }
    ms_json_buf_raw(&hdr, "}", 1);
    while (hdr.st == MS_OK && hdr.len % 8 != 0) ms_json_buf_raw(&hdr, " ", 1);   /* data starts 8-aligned */
    if (hdr.st != MS_OK) { st = SFAIL(ctx, MS_E_OOM, path, "out of memory building the header"); goto done; }
    st = write_file(ctx, path, &hdr, tensors, names, slots, n);
done:
    ms_json_buf_free(&hdr);
    ms_json_free(meta);
    free(slots);
    free(begin);
    return st;
}
