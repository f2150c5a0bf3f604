/*
** Unit tests of the engine's internal JSON reader and writer (engine/core/json.c).  Every input is
** copied into a heap block of exactly its length, so that AddressSanitizer catches any read past len.
*/
#include "check.h"
#include "json.h"

#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char err[256];

/* Parses s[0, n) from an exact-size copy. */
static ms_status parse_n(const char *s, size_t n, ms_json **out)
{
    char *copy = malloc(n ? n : 1);
    if (!copy) return MS_E_OOM;
    memcpy(copy, s, n);
    ms_status st = ms_json_parse(copy, n, out, err, sizeof err);
    free(copy);   /* the tree must not point into the input */
    return st;
}

static ms_status parse(const char *s, ms_json **out) { return parse_n(s, strlen(s), out); }

/* The compact text of s re-serialized ("<error>" when it does not parse); returns a static buffer. */
static const char *roundtrip(const char *s)
{
    static char text[4096];
    ms_json *v;
    if (parse(s, &v) != MS_OK) return "<error>";
    ms_json_buf b;
    ms_json_buf_init(&b);
    ms_json_buf_value(&b, v);
    snprintf(text, sizeof text, "%s", b.st == MS_OK ? b.data : "<write error>");
    ms_json_buf_free(&b);
    ms_json_free(v);
    return text;
}

static void test_document(void)
{
    ms_json *v;
    const char *doc = " {\"a\": [1, 2.5, \"x\", true, false, null, {}], \"b\":{\"c\":\"d\"},\r\n\t\"e\":[]} ";
    CHECK(parse(doc, &v) == MS_OK, "document: %s", err);
    if (!v) return;
    CHECK(v->type == MS_JSON_OBJECT && v->len == 3, "root object of 3");
    CHECK(strcmp(v->items[0].key, "a") == 0 && strcmp(v->items[1].key, "b") == 0
          && strcmp(v->items[2].key, "e") == 0, "key order kept");
    const ms_json *a = ms_json_get(v, "a");
    CHECK(a && a->type == MS_JSON_ARRAY && a->len == 7, "a is an array of 7");
    if (a && a->len == 7) {
        CHECK(a->items[0].type == MS_JSON_NUMBER && a->items[0].is_int && a->items[0].i == 1, "a[0] = 1");
        CHECK(a->items[1].d == 2.5 && !a->items[1].is_int, "a[1] = 2.5");
        CHECK(a->items[2].type == MS_JSON_STRING && a->items[2].len == 1 && strcmp(a->items[2].s, "x") == 0,
              "a[2] = x");
        CHECK(a->items[3].type == MS_JSON_BOOL && a->items[3].b, "a[3] true");
        CHECK(a->items[4].type == MS_JSON_BOOL && !a->items[4].b, "a[4] false");
        CHECK(a->items[5].type == MS_JSON_NULL, "a[5] null");
        CHECK(a->items[6].type == MS_JSON_OBJECT && a->items[6].len == 0, "a[6] {}");
    }
    const ms_json *c = ms_json_get(ms_json_get(v, "b"), "c");
    CHECK(c && c->type == MS_JSON_STRING && strcmp(c->s, "d") == 0, "b.c = d");
    CHECK(ms_json_get(v, "z") == NULL && ms_json_get(a, "a") == NULL, "missing key / non-object");
    ms_json_free(v);

    const char *scalars[] = { "0", "\"\"", "true", "null", " \n-1.5e-3\t" };
    for (size_t i = 0; i < sizeof scalars / sizeof *scalars; i++) {
        CHECK(parse(scalars[i], &v) == MS_OK, "top-level scalar %s: %s", scalars[i], err);
        ms_json_free(v);
    }
    /* len bounds the input: bytes past it are never looked at */
    CHECK(ms_json_parse("[1]xyz", 3, &v, err, sizeof err) == MS_OK, "len excludes trailing bytes");
    ms_json_free(v);
    CHECK(ms_json_parse("123", 2, &v, err, sizeof err) == MS_OK && v->i == 12, "number cut by len");
    ms_json_free(v);
    CHECK(ms_json_parse(NULL, 0, &v, err, sizeof err) == MS_E_FORMAT, "NULL, 0 is empty input");
    CHECK(ms_json_parse(NULL, 3, &v, err, sizeof err) == MS_E_ARG && v == NULL, "NULL with a length");
    CHECK(ms_json_parse("x", 1, &v, NULL, 0) == MS_E_FORMAT, "err may be NULL");
}

static void test_errors(void)
{
    static const struct { const char *in; size_t len; const char *msg; } cases[] = {
        { "", 0, "byte 0: unexpected end of input, expected a value" },
        { "   ", 0, "byte 3: unexpected end of input, expected a value" },
        { "[1,]", 0, "byte 3: expected a value, found ']'" },
        { "[1 2]", 0, "byte 3: expected ',' or ']'" },
        { "[1", 0, "byte 2: unexpected end of input, expected ',' or ']'" },
        { "{\"a\":1,}", 0, "byte 7: expected a string key" },
        { "{a:1}", 0, "byte 1: expected a string key" },
        { "{\"a\" 1}", 0, "byte 5: expected ':' after an object key" },
        { "{\"a\":1 \"b\":2}", 0, "byte 7: expected ',' or '}'" },
        { "{\"a\"", 0, "byte 4: unexpected end of input, expected ':'" },
        { "{", 0, "byte 1: unexpected end of input, expected a string key" },
        { "01", 0, "byte 1: leading zero in number" },
        { "-", 0, "byte 1: unexpected end of input in number" },
        { "-a", 0, "byte 1: expected a digit" },
        { "1.", 0, "byte 2: expected a digit after '.'" },
        { "1.e5", 0, "byte 2: expected a digit after '.'" },
        { "1e", 0, "byte 2: expected a digit in the exponent" },
        { "1e+", 0, "byte 3: expected a digit in the exponent" },
        { ".5", 0, "byte 0: expected a value, found '.'" },
        { "+1", 0, "byte 0: expected a value, found '+'" },
        { "NaN", 0, "byte 0: expected a value, found 'N'" },
        { "-Infinity", 0, "byte 1: expected a digit" },
        { "tru", 0, "byte 0: expected 'true'" },
        { "nul", 0, "byte 0: expected 'null'" },
        { "falsy", 0, "byte 0: expected 'false'" },
        { "True", 0, "byte 0: expected a value, found 'T'" },
        { "1e400", 0, "byte 0: number out of the range of a double" },
        { "[-1e400]", 0, "byte 1: number out of the range of a double" },
        { "'a'", 0, "byte 0: expected a value, found '''" },
        { "[1] x", 0, "byte 4: unexpected data after the value" },
        { "{}{}", 0, "byte 2: unexpected data after the value" },
        { "[1,\0]", 5, "byte 3: expected a value, found byte 0x00" },
        { "\"abc", 0, "byte 4: unexpected end of input in string" },
        { "\"abc\\", 0, "byte 5: unexpected end of input in string" },
        { "\"\\x\"", 0, "byte 1: invalid escape in string" },
        { "\"\\U0041\"", 0, "byte 1: invalid escape in string" },
        { "\"\\u12\"", 0, "byte 1: expected 4 hex digits after \\u" },
        { "\"\\u12g4\"", 0, "byte 1: expected 4 hex digits after \\u" },
        { "\"ab\\udc00\"", 0, "byte 3: lone low surrogate \\udc00" },
        { "\"\\ud800\"", 0, "byte 1: high surrogate \\ud800 not followed by a low surrogate" },
        { "\"\\ud800\\u0041\"", 0, "byte 1: high surrogate \\ud800 not followed by a low surrogate" },
        { "\"\\ud800\\ud800\"", 0, "byte 1: high surrogate \\ud800 not followed by a low surrogate" },
        { "\"a\nb\"", 0, "byte 2: control character 0x0a in string (must be escaped)" },
        { "\"\x1f\"", 0, "byte 1: control character 0x1f in string (must be escaped)" },
        { "\"\xff\"", 0, "byte 1: invalid UTF-8 in string" },
        { "\"x\xc0\xaf\"", 0, "byte 2: invalid UTF-8 in string" },          /* overlong '/' */
        { "\"\xe0\x80\xaf\"", 0, "byte 1: invalid UTF-8 in string" },       /* overlong, 3 bytes */
        { "\"\xed\xa0\x80\"", 0, "byte 1: invalid UTF-8 in string" },       /* encoded surrogate */
        { "\"\xf4\x90\x80\x80\"", 0, "byte 1: invalid UTF-8 in string" },   /* past U+10FFFF */
        { "\"\xf5\x80\x80\x80\"", 0, "byte 1: invalid UTF-8 in string" },
        { "\"\xe2\x82\"", 0, "byte 1: invalid UTF-8 in string" },           /* cut sequence */
        { "\"\x80\"", 0, "byte 1: invalid UTF-8 in string" },               /* lone continuation */
        { "{\"\xff\":1}", 0, "byte 2: invalid UTF-8 in string" },           /* in a key */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ms_json *v = (ms_json *)&v;
        size_t n = cases[i].len ? cases[i].len : strlen(cases[i].in);
        ms_status st = parse_n(cases[i].in, n, &v);
        CHECK(st == MS_E_FORMAT && v == NULL, "case %zu should fail: st %d", i, (int)st);
        CHECK(strcmp(err, cases[i].msg) == 0, "case %zu: message \"%s\", expected \"%s\"", i, err, cases[i].msg);
        if (st == MS_OK) ms_json_free(v);
    }
}

static void test_depth(void)
{
    char buf[2 * 100000 + 1];
    ms_json *v;
    for (int d = 63; d <= 65; d++) {
        memset(buf, '[', (size_t)d);
        memset(buf + d, ']', (size_t)d);
        ms_status st = parse_n(buf, 2 * (size_t)d, &v);
        if (d <= MS_JSON_MAX_DEPTH) CHECK(st == MS_OK, "depth %d accepted: %s", d, err);
        else CHECK(st == MS_E_FORMAT && strcmp(err, "byte 64: nesting deeper than 64") == 0,
                   "depth %d refused: %s", d, err);
        ms_json_free(st == MS_OK ? v : NULL);
    }
    /* objects count too */
    size_t n = 0;
    for (int d = 0; d < 65; d++) n += (size_t)sprintf(buf + n, "{\"k\":");
    n += (size_t)sprintf(buf + n, "1");
    for (int d = 0; d < 65; d++) buf[n++] = '}';
    CHECK(parse_n(buf, n, &v) == MS_E_FORMAT && strstr(err, "nesting deeper than 64"), "object depth: %s", err);
    /* a huge run of '[' fails fast at the limit instead of exhausting the stack */
    memset(buf, '[', 200000);
    CHECK(parse_n(buf, 200000, &v) == MS_E_FORMAT && strstr(err, "nesting deeper"), "deep run: %s", err);
    /* a wide array is fine */
    n = 0;
    buf[n++] = '[';
    for (int i = 0; i < 49999; i++) { buf[n++] = '7'; buf[n++] = ','; }
    buf[n++] = '7';
    buf[n++] = ']';
    CHECK(parse_n(buf, n, &v) == MS_OK && v->len == 50000 && v->items[49999].i == 7, "wide array");
    ms_json_free(v);
}

/* Every proper prefix of these documents is invalid and must fail cleanly (no crash, leak or over-read). */
static void test_truncation(void)
{
    const char *docs[] = {
        "{\"a\":[1,-2.5e3,\"\\u00e9\\ud83d\\ude00\xe2\x82\xac\",true,false,null],\"b\":{\"c\":{}},\"d\":\"\\\"\"}",
        "{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],"
        "\"data_offsets\":[0,24]}}",
        "[[[[\"\\n\\t\\\\\"]]],-0.0e-0,12345678901234567890,{\"\":\"\"}]",
    };
    for (size_t d = 0; d < sizeof docs / sizeof *docs; d++) {
        size_t len = strlen(docs[d]);
        ms_json *v;
        CHECK(parse_n(docs[d], len, &v) == MS_OK, "doc %zu parses: %s", d, err);
        ms_json_free(v);
        int bad = 0;
        for (size_t n = 0; n < len; n++) {
            ms_status st = parse_n(docs[d], n, &v);
            if (st != MS_E_FORMAT || v != NULL || strncmp(err, "byte ", 5) != 0) {
                bad++;
                printf("  doc %zu prefix %zu: st %d, %s\n", d, n, (int)st, err);
                if (st == MS_OK) ms_json_free(v);
            }
        }
        CHECK(bad == 0, "doc %zu: %d of %zu prefixes did not fail cleanly", d, bad, len);
    }
}

static void test_numbers(void)
{
    static const struct { const char *in; bool is_int; int64_t i; double d; } cases[] = {
        { "0", true, 0, 0.0 },
        { "-7", true, -7, -7.0 },
        { "9223372036854775807", true, INT64_MAX, 9223372036854775807.0 },
        { "-9223372036854775808", true, INT64_MIN, -9223372036854775808.0 },
        { "9223372036854775808", false, 0, 9223372036854775808.0 },
        { "-9223372036854775809", false, 0, -9223372036854775808.0 },
        { "18446744073709551615", false, 0, 18446744073709551615.0 },
        { "18446744073709551616", false, 0, 18446744073709551616.0 },
        { "123456789012345678901234567890", false, 0, 123456789012345678901234567890.0 },
        { "9007199254740993", true, 9007199254740993, 9007199254740992.0 },   /* exact as int64 only */
        { "1.0", false, 0, 1.0 },
        { "1E2", false, 0, 100.0 },
        { "1e+2", false, 0, 100.0 },
        { "2.5e-3", false, 0, 2.5e-3 },
        { "0.1", false, 0, 0.1 },
        { "1e-400", false, 0, 0.0 },
        { "4.9406564584124654e-324", false, 0, 4.9406564584124654e-324 },
        { "1.7976931348623157e308", false, 0, 1.7976931348623157e308 },
        { "0.30000000000000000000000000000000000000000000000000000000000000000000000001", false, 0, 0.3 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        ms_json *v;
        if (parse(cases[k].in, &v) != MS_OK) { CHECK(0, "%s: %s", cases[k].in, err); continue; }
        CHECK(v->type == MS_JSON_NUMBER && v->is_int == cases[k].is_int, "%s: is_int %d", cases[k].in, v->is_int);
        if (cases[k].is_int) CHECK(v->i == cases[k].i, "%s: i = %lld", cases[k].in, (long long)v->i);
        CHECK(v->d == cases[k].d, "%s: d = %.17g", cases[k].in, v->d);
        ms_json_free(v);
    }
    ms_json *v;
    CHECK(parse("-0", &v) == MS_OK && v->is_int && v->i == 0 && v->d == 0 && signbit(v->d), "-0 keeps its sign");
    ms_json_free(v);
    CHECK(parse("-0.0", &v) == MS_OK && !v->is_int && signbit(v->d), "-0.0 keeps its sign");
    ms_json_free(v);
    CHECK(strcmp(roundtrip("[-0,-0.0,0]"), "[-0,-0,0]") == 0, "-0 written back: %s", roundtrip("[-0,-0.0,0]"));
}

static void test_strings(void)
{
    static const struct { const char *in; const char *out; size_t len; } cases[] = {
        { "\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\/\b\f\n\r\t", 8 },
        { "\"\\u0041\\u00e9\\u00E9\\u20ac\"", "A\xc3\xa9\xc3\xa9\xe2\x82\xac", 8 },
        { "\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80", 4 },
        { "\"\\uDBFF\\uDFFF\"", "\xf4\x8f\xbf\xbf", 4 },
        { "\"a\\u0000b\"", "a\0b", 3 },
        { "\"\\u007f\\u0080\\u07ff\\u0800\\uffff\"", "\x7f\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf", 11 },
        { "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f\"", "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f", 10 },
        { "\"\"", "", 0 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        ms_json *v;
        if (parse(cases[k].in, &v) != MS_OK) { CHECK(0, "string %zu: %s", k, err); continue; }
        CHECK(v->type == MS_JSON_STRING && v->len == cases[k].len && memcmp(v->s, cases[k].out, v->len) == 0
              && v->s[v->len] == '\0', "string %zu decoded (len %zu)", k, v->len);
        ms_json_free(v);
    }
    CHECK(ms_json_utf8_valid("", 0) && ms_json_utf8_valid("\xf0\x9f\x98\x80", 4), "valid UTF-8");
    CHECK(!ms_json_utf8_valid("\xf0\x9f\x98", 3) && !ms_json_utf8_valid("\xc1\xbf", 2)
          && !ms_json_utf8_valid("\xed\xbf\xbf", 3), "invalid UTF-8");
}

static void test_dup_keys(void)
{
    ms_json *v;
    const ms_json *dup;
    CHECK(parse("{\"a\":1,\"b\":2,\"ab\":0,\"a\":3,\"b\":4}", &v) == MS_OK, "dup doc parses");
    CHECK(ms_json_dup_key(v, &dup) == MS_OK && dup == &v->items[3], "first repeat found");
    CHECK(ms_json_get(v, "a")->i == 1, "get returns the first");
    ms_json_free(v);
    CHECK(parse("{\"a\\u0000b\":1,\"a\\u0000c\":2,\"a\":3,\"\":4}", &v) == MS_OK, "NUL keys parse");
    CHECK(ms_json_dup_key(v, &dup) == MS_OK && dup == NULL, "keys differing after a NUL are distinct");
    ms_json_free(v);
    CHECK(parse("[1,1]", &v) == MS_OK && ms_json_dup_key(v, &dup) == MS_OK && dup == NULL, "not an object");
    ms_json_free(v);

    ms_json_buf b;
    ms_json_buf_init(&b);
    ms_json_buf_raw(&b, "{", 1);
    for (int i = 0; i < 3000; i++) {
        char key[32];
        snprintf(key, sizeof key, "layer.%d.weight", (i * 7919) % 3000);
        if (i) ms_json_buf_raw(&b, ",", 1);
        ms_json_buf_str(&b, key, strlen(key));
        ms_json_buf_raw(&b, ":0", 2);
    }
    ms_json_buf_raw(&b, ",\"layer.1234.weight\":1}", 23);
    CHECK(b.st == MS_OK && parse_n(b.data, b.len, &v) == MS_OK && v->len == 3001, "big object parses");
    CHECK(ms_json_dup_key(v, &dup) == MS_OK && dup == &v->items[3000], "dup in a big object");
    v->items[3000].key[6] = '9';   /* "layer.9234.weight" is new */
    CHECK(ms_json_dup_key(v, &dup) == MS_OK && dup == NULL, "big object without dups");
    ms_json_free(v);
    ms_json_buf_free(&b);
}

static void test_writer(void)
{
    ms_json_buf b;
    ms_json_buf_init(&b);
    ms_json_buf_str(&b, "a\"b\\c\n\x01\x1f\xc3\xa9/\x7f", 12);
    CHECK(b.st == MS_OK && strcmp(b.data, "\"a\\\"b\\\\c\\n\\u0001\\u001f\xc3\xa9/\x7f\"") == 0, "escaped: %s", b.data);
    ms_json_buf_free(&b);

    ms_json_buf_str(&b, "a\0b", 3);
    CHECK(b.len == 10 && memcmp(b.data, "\"a\\u0000b\"", 10) == 0, "NUL escaped");
    ms_json_buf_free(&b);

    ms_json_buf_raw(&b, "[", 1);
    ms_json_buf_str(&b, "\xff", 1);
    CHECK(b.st == MS_E_ARG, "bad UTF-8 refused");
    ms_json_buf_raw(&b, "]", 1);
    CHECK(b.st == MS_E_ARG && b.len == 1, "errors are sticky");
    ms_json_buf_free(&b);

    ms_json_buf_int(&b, INT64_MIN);
    ms_json_buf_raw(&b, " ", 1);
    ms_json_buf_int(&b, INT64_MAX);
    CHECK(strcmp(b.data, "-9223372036854775808 9223372036854775807") == 0, "int64 extremes: %s", b.data);
    ms_json_buf_free(&b);

    static const struct { double v; const char *text; } nums[] = {
        { 0.1, "0.1" }, { 1.0 / 3.0, "0.3333333333333333" }, { 1e300, "1e+300" }, { 1.0000000000000002, "1.0000000000000002" },
        { 5e-324, "4.94065645841247e-324" }, { -0.0, "-0" }, { 100, "100" },
        { 0.30000000000000004, "0.30000000000000004" },
        { 1e21, "1e+21" }, { -2.5, "-2.5" },
    };
    for (size_t k = 0; k < sizeof nums / sizeof *nums; k++) {
        ms_json_buf_num(&b, nums[k].v);
        CHECK(b.st == MS_OK && strcmp(b.data, nums[k].text) == 0, "num %.17g -> %s", nums[k].v, b.data);
        ms_json_buf_free(&b);
    }
    ms_json_buf_num(&b, NAN);
    CHECK(b.st == MS_E_ARG && b.len == 0, "NaN refused");
    ms_json_buf_free(&b);
    ms_json_buf_num(&b, -INFINITY);
    CHECK(b.st == MS_E_ARG, "inf refused");
    ms_json_buf_free(&b);

    /* written numbers read back bit for bit */
    uint64_t x = 0x9e3779b97f4a7c15u;
    int bad = 0;
    for (int k = 0; k < 20000; k++) {
        x = x * 6364136223846793005u + 1442695040888963407u;
        union { uint64_t u; double d; } r = { .u = x };
        if (!isfinite(r.d)) continue;
        ms_json *v;
        ms_json_buf_num(&b, r.d);
        if (b.st != MS_OK || parse_n(b.data, b.len, &v) != MS_OK) { bad++; ms_json_buf_free(&b); continue; }
        union { double d; uint64_t u; } back = { .d = v->d };
        if (back.u != r.u) bad++;
        ms_json_free(v);
        ms_json_buf_free(&b);
    }
    CHECK(bad == 0, "%d random doubles did not round-trip", bad);

    const char *doc = "{ \"b\" : [ 1 , 2.5 , -3e2 , true , null , \"\\u00e9\\n\" ] , \"a\" : { } , \"\" : [ ] }";
    CHECK(strcmp(roundtrip(doc), "{\"b\":[1,2.5,-300,true,null,\"\xc3\xa9\\n\"],\"a\":{},\"\":[]}") == 0,
          "compact: %s", roundtrip(doc));
    char first[4096];
    snprintf(first, sizeof first, "%s", roundtrip(doc));
    CHECK(strcmp(roundtrip(first), first) == 0, "writing is idempotent");
}

/* Numbers use '.' whatever LC_NUMERIC the host set (only testable where such a locale exists). */
static void test_locale(void)
{
    const char *names[] = { "de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8" };
    const char *got = NULL;
    for (size_t k = 0; k < sizeof names / sizeof *names && !got; k++) got = setlocale(LC_NUMERIC, names[k]);
    if (!got) { printf("note: no comma-decimal locale installed, locale test skipped\n"); return; }
    ms_json *v;
    ms_json_buf b;
    ms_json_buf_init(&b);
    CHECK(parse("1.5", &v) == MS_OK && v->d == 1.5, "1.5 under %s", got);
    ms_json_free(v);
    ms_json_buf_num(&b, 1.5);
    CHECK(strcmp(b.data, "1.5") == 0, "wrote %s under %s", b.data, got);
    ms_json_buf_free(&b);
    setlocale(LC_NUMERIC, "C");
}

int main(void)
{
    test_document();
    test_errors();
    test_depth();
    test_truncation();
    test_numbers();
    test_strings();
    test_dup_keys();
    test_writer();
    test_locale();
    return CHECK_REPORT();
}
