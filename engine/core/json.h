/*
** A small strict JSON (RFC 8259) reader into a DOM, and a writer into a growable buffer.  Internal to the
** engine (safetensors headers, metadata); never exported.  Input is (buf, len) and is never read past len.
*/
#ifndef MS_JSON_H
#define MS_JSON_H

#include "moonstep.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MS_JSON_MAX_DEPTH 64     /* arrays and objects nested deeper than this are refused */

typedef enum ms_json_type {
    MS_JSON_NULL = 0, MS_JSON_BOOL, MS_JSON_NUMBER, MS_JSON_STRING, MS_JSON_ARRAY, MS_JSON_OBJECT
} ms_json_type;

/* One value.  Children of arrays and objects are stored inline in `items`, in document order; children
** of an object also carry their key.  Strings and keys are NUL-terminated but may contain "\u0000":
** use the lengths when that matters. */
typedef struct ms_json {
    ms_json_type    type;
    bool            b;          /* BOOL */
    bool            is_int;     /* NUMBER: an integer literal (no fraction or exponent) that fits int64 */
    int64_t         i;          /* NUMBER: the exact value when is_int */
    double          d;          /* NUMBER: the nearest double (always set) */
    char           *s;          /* STRING: UTF-8 */
    size_t          len;        /* STRING: bytes; ARRAY, OBJECT: number of children */
    struct ms_json *items;      /* ARRAY, OBJECT */
    char           *key;        /* set on the children of an OBJECT */
    size_t          key_len;
} ms_json;

/* Parses exactly one JSON value filling buf[0, len) (surrounding whitespace allowed).  On success *out is
** a new tree (free with ms_json_free).  Errors: MS_E_FORMAT with "byte N: <what was expected>" in err,
** MS_E_OOM, MS_E_ARG (buf NULL with len > 0).  Duplicate object keys are kept (see ms_json_dup_key).
** err may be NULL. */
ms_status ms_json_parse(const char *buf, size_t len, ms_json **out, char *err, size_t errlen);
void ms_json_free(ms_json *v);

/* The first child of object `obj` with this key, or NULL (also when obj is not an object). */
const ms_json *ms_json_get(const ms_json *obj, const char *key);
/* Sets *dup to a child of object `obj` whose key an earlier child already has, or NULL when the keys are
** unique (O(n log n)).  Errors: MS_E_OOM. */
ms_status ms_json_dup_key(const ms_json *obj, const ms_json **dup);

/* Nonzero when s[0, n) is well-formed UTF-8 (no overlong forms, surrogates or values past U+10FFFF). */
bool ms_json_utf8_valid(const char *s, size_t n);

/* A growable output buffer, always NUL-terminated once anything was appended.  Errors are sticky: the
** first failure is kept in `st` and later appends do nothing, so a writer checks once at the end. */
typedef struct ms_json_buf {
    char     *data;
    size_t    len, cap;
    ms_status st;
} ms_json_buf;

void ms_json_buf_init(ms_json_buf *b);
void ms_json_buf_free(ms_json_buf *b);
void ms_json_buf_raw(ms_json_buf *b, const char *s, size_t n);    /* bytes as they are */
void ms_json_buf_str(ms_json_buf *b, const char *s, size_t n);    /* a quoted string; MS_E_ARG on bad UTF-8 */
void ms_json_buf_int(ms_json_buf *b, int64_t v);
/* The shortest of %.15g, %.16g, %.17g that reads back as v (always exact); MS_E_ARG for NaN and inf. */
void ms_json_buf_num(ms_json_buf *b, double v);
/* The compact text of a parsed value (integers keep their exact int64). */
void ms_json_buf_value(ms_json_buf *b, const ms_json *v);

#endif /* MS_JSON_H */
