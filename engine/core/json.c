/*
** Strict JSON: a recursive-descent reader into ms_json trees and a writer into ms_json_buf.
** Numbers are converted in the "C" locale whatever locale the host has set, so "1.5" means 1.5 everywhere.
*/
#define _POSIX_C_SOURCE 200809L   /* newlocale, uselocale */

#include "json.h"

#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- UTF-8 -------------------------------------------------------------------------------------- */

/* Length of the well-formed UTF-8 sequence at s (n bytes available), 0 when there is none. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0], lo = 0x80, hi = 0xbf;
    size_t k;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) k = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        k = 3;
        if (c == 0xe0) lo = 0xa0;          /* overlong */
        else if (c == 0xed) hi = 0x9f;     /* UTF-16 surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        k = 4;
        if (c == 0xf0) lo = 0x90;          /* overlong */
        else if (c == 0xf4) hi = 0x8f;     /* past U+10FFFF */
    } else return 0;
    if (n < k || s[1] < lo || s[1] > hi) return 0;
    for (size_t j = 2; j < k; j++)
        if ((s[j] & 0xc0) != 0x80) return 0;
    return k;
}

bool ms_json_utf8_valid(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(u + i, n - i);
        if (k == 0) return false;
        i += k;
    }
    return true;
}

static size_t utf8_put(char *out, unsigned cp)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* --- reader ------------------------------------------------------------------------------------- */

typedef struct parser {
    const char *start, *p, *end;
    int         depth;
    locale_t    c_locale;     /* made on the first number strtod must convert */
    char       *err;
    size_t      errlen;
} parser;

__attribute__((format(printf, 3, 4)))
static ms_status fail(parser *ps, const char *at, const char *fmt, ...)
{
    if (ps->err && ps->errlen) {
        int k = snprintf(ps->err, ps->errlen, "byte %zu: ", (size_t)(at - ps->start));
        if (k >= 0 && (size_t)k < ps->errlen) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(ps->err + k, ps->errlen - (size_t)k, fmt, ap);
            va_end(ap);
        }
    }
    return MS_E_FORMAT;
}

static ms_status oom(parser *ps)
{
    if (ps->err && ps->errlen) snprintf(ps->err, ps->errlen, "out of memory");
    return MS_E_OOM;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static bool hex4(const char *s, const char *end, unsigned *out)
{
    unsigned v = 0;
    if (end - s < 4) return false;
    for (int j = 0; j < 4; j++) {
        char c = s[j];
        unsigned d = is_digit(c) ? (unsigned)(c - '0') : (c >= 'a' && c <= 'f') ? (unsigned)(c - 'a' + 10)
                   : (c >= 'A' && c <= 'F') ? (unsigned)(c - 'A' + 10) : 16u;
        if (d == 16) return false;
        v = v << 4 | d;
    }
    *out = v;
    return true;
}

/* The string whose opening quote is at ps->p.  Decoding never grows the text, so one buffer of the raw
** length is enough: the first pass only finds the closing quote, the second decodes and validates. */
static ms_status parse_string(parser *ps, char **out, size_t *outlen)
{
    const char *q = ps->p + 1, *e = q, *s = q;
    while (e < ps->end && *e != '"') e += (*e == '\\' && ps->end - e > 1) ? 2 : 1;
    char *buf = malloc((size_t)(e - q) + 1);
    if (!buf) return oom(ps);
    size_t n = 0;
    ms_status st = MS_OK;
    while (s < e && st == MS_OK) {
        unsigned char c = (unsigned char)*s;
        if (c == '\\') {
            static const char names[] = "\"\\/bfnrt", bytes[] = "\"\\/\b\f\n\r\t";
            unsigned u, lo;
            char x = e - s > 1 ? s[1] : 0;
            const char *simple = x ? strchr(names, x) : NULL;
            if (simple) { buf[n++] = bytes[simple - names]; s += 2; continue; }
            if (x != 'u') { st = e - s > 1 ? fail(ps, s, "invalid escape in string") : fail(ps, e, "unexpected end of input in string"); break; }
            if (!hex4(s + 2, e, &u)) { st = fail(ps, s, "expected 4 hex digits after \\u"); break; }
            if (u >= 0xdc00 && u <= 0xdfff) { st = fail(ps, s, "lone low surrogate \\u%04x", u); break; }
            if (u >= 0xd800 && u <= 0xdbff) {
                if (e - s < 12 || s[6] != '\\' || s[7] != 'u' || !hex4(s + 8, e, &lo) || lo < 0xdc00 || lo > 0xdfff) {
                    st = fail(ps, s, "high surrogate \\u%04x not followed by a low surrogate", u);
                    break;
                }
                u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
                s += 6;
            }
            n += utf8_put(buf + n, u);
            s += 6;
        } else if (c < 0x20) {
            st = fail(ps, s, "control character 0x%02x in string (must be escaped)", c);
        } else {
            size_t k = utf8_seq((const unsigned char *)s, (size_t)(e - s));
            if (k == 0) { st = fail(ps, s, "invalid UTF-8 in string"); break; }
            memcpy(buf + n, s, k);
            n += k;
            s += k;
        }
    }
    if (st == MS_OK && e == ps->end) st = fail(ps, e, "unexpected end of input in string");
    if (st != MS_OK) { free(buf); return st; }
    buf[n] = '\0';
    *out = buf;
    *outlen = n;
    ps->p = e + 1;
    return MS_OK;
}

/* strtod in the "C" locale on [s, e), which the caller has checked against the JSON grammar. */
static ms_status convert_double(parser *ps, const char *s, const char *e, double *out)
{
    char small[64], *tmp = small;
    size_t n = (size_t)(e - s);
    if (n >= sizeof small && !(tmp = malloc(n + 1))) return oom(ps);
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    if (!ps->c_locale && !(ps->c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0))) {
        if (tmp != small) free(tmp);
        return oom(ps);
    }
    locale_t old = uselocale(ps->c_locale);
    *out = strtod(tmp, NULL);
    uselocale(old);
    if (tmp != small) free(tmp);
    if (!isfinite(*out)) return fail(ps, s, "number out of the range of a double");
    return MS_OK;   /* underflow to 0 or a subnormal is a loss of precision, not an error */
}

static ms_status parse_number(parser *ps, ms_json *v)
{
    const char *s = ps->p, *p = s, *e = ps->end;
    bool neg = false, integral = true, fits = true;
    uint64_t mag = 0;
    if (*p == '-') { neg = true; p++; }
    if (p == e || !is_digit(*p)) return fail(ps, p, p == e ? "unexpected end of input in number" : "expected a digit");
    if (*p == '0') {
        if (++p < e && is_digit(*p)) return fail(ps, p, "leading zero in number");
    } else {
        for (; p < e && is_digit(*p); p++) {
            unsigned d = (unsigned)(*p - '0');
            if (mag > (UINT64_MAX - d) / 10) fits = false;
            else mag = mag * 10 + d;
        }
    }
    if (p < e && *p == '.') {
        integral = false;
        if (++p == e || !is_digit(*p)) return fail(ps, p, "expected a digit after '.'");
        while (p < e && is_digit(*p)) p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        integral = false;
        if (++p < e && (*p == '+' || *p == '-')) p++;
        if (p == e || !is_digit(*p)) return fail(ps, p, "expected a digit in the exponent");
        while (p < e && is_digit(*p)) p++;
    }
    v->type = MS_JSON_NUMBER;
    if (integral && fits && mag <= (uint64_t)INT64_MAX + (neg ? 1u : 0u)) {
        v->is_int = true;
        v->i = !neg ? (int64_t)mag : mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
        v->d = neg ? -(double)mag : (double)mag;   /* correctly rounded, and "-0" gives -0.0 */
    } else {
        ms_status st = convert_double(ps, s, p, &v->d);
        if (st != MS_OK) return st;
    }
    ps->p = p;
    return MS_OK;
}

static ms_status parse_value(parser *ps, ms_json *v);

static ms_status parse_container(parser *ps, ms_json *v, bool obj)
{
    const char close = obj ? '}' : ']';
    size_t cap = 0;
    if (++ps->depth > MS_JSON_MAX_DEPTH) return fail(ps, ps->p, "nesting deeper than %d", MS_JSON_MAX_DEPTH);
    v->type = obj ? MS_JSON_OBJECT : MS_JSON_ARRAY;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; ps->depth--; return MS_OK; }
    for (;;) {
        if (v->len == cap) {
            size_t ncap = cap ? cap * 2 : 4;
            ms_json *items = ncap <= SIZE_MAX / sizeof *items ? realloc(v->items, ncap * sizeof *items) : NULL;
            if (!items) return oom(ps);
            v->items = items;
            cap = ncap;
        }
        ms_json *c = &v->items[v->len++];   /* counted now, so that ms_json_free sees a half-built child */
        memset(c, 0, sizeof *c);
        ms_status st;
        if (obj) {
            skip_ws(ps);
            if (ps->p == ps->end) return fail(ps, ps->p, "unexpected end of input, expected a string key");
            if (*ps->p != '"') return fail(ps, ps->p, "expected a string key");
            if ((st = parse_string(ps, &c->key, &c->key_len)) != MS_OK) return st;
            skip_ws(ps);
            if (ps->p == ps->end) return fail(ps, ps->p, "unexpected end of input, expected ':'");
            if (*ps->p != ':') return fail(ps, ps->p, "expected ':' after an object key");
            ps->p++;
        }
        if ((st = parse_value(ps, c)) != MS_OK) return st;
        skip_ws(ps);
        if (ps->p == ps->end) return fail(ps, ps->p, "unexpected end of input, expected ',' or '%c'", close);
        if (*ps->p == close) break;
        if (*ps->p != ',') return fail(ps, ps->p, "expected ',' or '%c'", close);
        ps->p++;
    }
    ps->p++;
    ps->depth--;
    return MS_OK;
}

static ms_status parse_literal(parser *ps, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return fail(ps, ps->p, "expected '%s'", word);
    ps->p += n;
    return MS_OK;
}

static ms_status parse_value(parser *ps, ms_json *v)
{
    skip_ws(ps);
    if (ps->p == ps->end) return fail(ps, ps->p, "unexpected end of input, expected a value");
    char c = *ps->p;
    switch (c) {
    case '{': return parse_container(ps, v, true);
    case '[': return parse_container(ps, v, false);
    case '"': v->type = MS_JSON_STRING; return parse_string(ps, &v->s, &v->len);
    case 't': v->type = MS_JSON_BOOL; v->b = true; return parse_literal(ps, "true");
    case 'f': v->type = MS_JSON_BOOL; return parse_literal(ps, "false");
    case 'n': return parse_literal(ps, "null");
    default:
        if (c == '-' || is_digit(c)) return parse_number(ps, v);
        if (c > 0x20 && c < 0x7f) return fail(ps, ps->p, "expected a value, found '%c'", c);
        return fail(ps, ps->p, "expected a value, found byte 0x%02x", (unsigned char)c);
    }
}

static void free_value(ms_json *v)
{
    free(v->key);
    free(v->s);
    if (v->type == MS_JSON_ARRAY || v->type == MS_JSON_OBJECT)
        for (size_t i = 0; i < v->len; i++) free_value(&v->items[i]);
    free(v->items);
}

void ms_json_free(ms_json *v)
{
    if (!v) return;
    free_value(v);
    free(v);
}

ms_status ms_json_parse(const char *buf, size_t len, ms_json **out, char *err, size_t errlen)
{
    static const char empty[1] = "";
    parser ps = { .err = err, .errlen = errlen };
    *out = NULL;
    if (err && errlen) err[0] = '\0';
    if (!buf) {
        if (len) {
            if (err && errlen) snprintf(err, errlen, "NULL input of %zu bytes", len);
            return MS_E_ARG;
        }
        buf = empty;
    }
    ps.start = ps.p = buf;
    ps.end = buf + len;
    ms_json *root = calloc(1, sizeof *root);
    if (!root) return oom(&ps);
    ms_status st = parse_value(&ps, root);
    if (st == MS_OK) {
        skip_ws(&ps);
        if (ps.p != ps.end) st = fail(&ps, ps.p, "unexpected data after the value");
    }
    if (ps.c_locale) freelocale(ps.c_locale);
    if (st != MS_OK) { ms_json_free(root); return st; }
    *out = root;
    return MS_OK;
}

const ms_json *ms_json_get(const ms_json *obj, const char *key)
{
    size_t n = strlen(key);
    if (!obj || obj->type != MS_JSON_OBJECT) return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (obj->items[i].key_len == n && memcmp(obj->items[i].key, key, n) == 0) return &obj->items[i];
    return NULL;
}

/* Orders children by key, then by position, so equal keys sit together with the earliest first. */
static int cmp_key(const void *a, const void *b)
{
    const ms_json *x = *(const ms_json *const *)a, *y = *(const ms_json *const *)b;
    int c = memcmp(x->key, y->key, x->key_len < y->key_len ? x->key_len : y->key_len);
    if (c) return c;
    if (x->key_len != y->key_len) return x->key_len < y->key_len ? -1 : 1;
    return (x > y) - (x < y);
}

ms_status ms_json_dup_key(const ms_json *obj, const ms_json **dup)
{
    *dup = NULL;
    if (!obj || obj->type != MS_JSON_OBJECT || obj->len < 2) return MS_OK;
    const ms_json **ix = malloc(obj->len * sizeof *ix);
    if (!ix) return MS_E_OOM;
    for (size_t i = 0; i < obj->len; i++) ix[i] = &obj->items[i];
    qsort(ix, obj->len, sizeof *ix, cmp_key);
    for (size_t i = 1; i < obj->len; i++)   /* report the repeat that comes first in the document */
        if (ix[i]->key_len == ix[i - 1]->key_len && memcmp(ix[i]->key, ix[i - 1]->key, ix[i]->key_len) == 0
            && (!*dup || ix[i] < *dup))
            *dup = ix[i];
    free(ix);
    return MS_OK;
}

/* --- writer ------------------------------------------------------------------------------------- */

void ms_json_buf_init(ms_json_buf *b)
{
    b->data = NULL;
    b->len = b->cap = 0;
    b->st = MS_OK;
}

void ms_json_buf_free(ms_json_buf *b)
{
    free(b->data);
    ms_json_buf_init(b);
}

static bool reserve(ms_json_buf *b, size_t extra)
{
    if (b->st != MS_OK) return false;
    if (extra > SIZE_MAX / 2 - b->len) { b->st = MS_E_OOM; return false; }
    size_t need = b->len + extra + 1, cap = b->cap ? b->cap : 64;
    if (need <= b->cap) return true;
    while (cap < need) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) { b->st = MS_E_OOM; return false; }
    b->data = d;
    b->cap = cap;
    return true;
}

void ms_json_buf_raw(ms_json_buf *b, const char *s, size_t n)
{
    if (!reserve(b, n)) return;
    if (n) memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void ms_json_buf_str(ms_json_buf *b, const char *s, size_t n)
{
    if (b->st != MS_OK) return;
    if (!ms_json_utf8_valid(s, n)) { b->st = MS_E_ARG; return; }
    ms_json_buf_raw(b, "\"", 1);
    size_t run = 0;   /* start of the bytes not yet copied */
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)s[k];
        char esc[8];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        switch (c) {
        case '"':  strcpy(esc, "\\\""); break;
        case '\\': strcpy(esc, "\\\\"); break;
        case '\n': strcpy(esc, "\\n"); break;
        case '\r': strcpy(esc, "\\r"); break;
        case '\t': strcpy(esc, "\\t"); break;
        case '\b': strcpy(esc, "\\b"); break;
        case '\f': strcpy(esc, "\\f"); break;
        default:   snprintf(esc, sizeof esc, "\\u%04x", c); break;
        }
        ms_json_buf_raw(b, s + run, k - run);
        ms_json_buf_raw(b, esc, strlen(esc));
        run = k + 1;
    }
    ms_json_buf_raw(b, s + run, n - run);
    ms_json_buf_raw(b, "\"", 1);
}

void ms_json_buf_int(ms_json_buf *b, int64_t v)
{
    char tmp[24];
    int k = snprintf(tmp, sizeof tmp, "%" PRId64, v);
    ms_json_buf_raw(b, tmp, (size_t)k);
}

void ms_json_buf_num(ms_json_buf *b, double v)
{
    char tmp[40];
    if (b->st != MS_OK) return;
    if (!isfinite(v)) { b->st = MS_E_ARG; return; }
    locale_t loc = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    if (!loc) { b->st = MS_E_OOM; return; }
    locale_t old = uselocale(loc);
    for (int prec = 15; prec <= 17; prec++) {   /* 17 significant digits always read back exactly */
        snprintf(tmp, sizeof tmp, "%.*g", prec, v);
        if (strtod(tmp, NULL) == v) break;
    }
    uselocale(old);
    freelocale(loc);
    ms_json_buf_raw(b, tmp, strlen(tmp));
}

void ms_json_buf_value(ms_json_buf *b, const ms_json *v)
{
    switch (v->type) {
    case MS_JSON_NULL: ms_json_buf_raw(b, "null", 4); break;
    case MS_JSON_BOOL: ms_json_buf_raw(b, v->b ? "true" : "false", v->b ? 4 : 5); break;
    case MS_JSON_NUMBER:
        if (v->is_int && !(v->i == 0 && signbit(v->d))) ms_json_buf_int(b, v->i);
        else ms_json_buf_num(b, v->d);
        break;
    case MS_JSON_STRING: ms_json_buf_str(b, v->s, v->len); break;
    case MS_JSON_ARRAY:
    case MS_JSON_OBJECT: {
        bool obj = v->type == MS_JSON_OBJECT;
        ms_json_buf_raw(b, obj ? "{" : "[", 1);
        for (size_t i = 0; i < v->len; i++) {
            if (i) ms_json_buf_raw(b, ",", 1);
            if (obj) {
                ms_json_buf_str(b, v->items[i].key, v->items[i].key_len);
                ms_json_buf_raw(b, ":", 1);
            }
            ms_json_buf_value(b, &v->items[i]);
        }
        ms_json_buf_raw(b, obj ? "}" : "]", 1);
        break;
    }
    }
}
