/*
** libFuzzer harness for the engine's JSON reader and writer (engine/core/json.c): parse the input; when it
** parses, write it, parse that again and check the second writing is byte-identical to the first.
*/
#include "json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Exercises the lookups a safetensors header uses on every object of the tree. */
static void walk(const ms_json *v, int depth)
{
    if (v->type == MS_JSON_OBJECT) {
        const ms_json *dup = NULL;
        /* a reported repeat has an earlier child of the same key, compared as bytes: keys may hold "\u0000",
        ** which ms_json_get (a C string) cannot look up */
        if (ms_json_dup_key(v, &dup) == MS_OK && dup) {
            size_t i = 0;
            while (&v->items[i] != dup
                   && !(v->items[i].key_len == dup->key_len && memcmp(v->items[i].key, dup->key, dup->key_len) == 0))
                i++;
            if (&v->items[i] == dup) abort();
        }
        /* every key finds some child; ms_json_get takes a C string, so keys holding "\u0000" are out of reach
        ** by design (json.h) and skipped here */
        for (size_t i = 0; i < v->len; i++)
            if (strlen(v->items[i].key) == v->items[i].key_len && ms_json_get(v, v->items[i].key) == NULL) abort();
    }
    if (v->type == MS_JSON_STRING && !ms_json_utf8_valid(v->s, v->len)) abort();  /* the reader checks UTF-8 */
    if (v->type == MS_JSON_ARRAY || v->type == MS_JSON_OBJECT)
        for (size_t i = 0; i < v->len; i++) walk(&v->items[i], depth + 1);
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    char err[256];
    ms_json *v = NULL;
    if (ms_json_parse((const char *)data, size, &v, err, sizeof err) != MS_OK) return 0;
    walk(v, 0);

    ms_json_buf a, b;
    ms_json_buf_init(&a);
    ms_json_buf_value(&a, v);
    ms_json_free(v);
    if (a.st != MS_OK) { ms_json_buf_free(&a); return 0; }     /* e.g. a string that is not valid UTF-8 */

    ms_json *w = NULL;
    if (ms_json_parse(a.data, a.len, &w, err, sizeof err) != MS_OK) {
        fprintf(stderr, "fuzz_json: the writer produced text the reader refuses: %s\n%.*s\n", err, (int)a.len, a.data);
        abort();
    }
    ms_json_buf_init(&b);
    ms_json_buf_value(&b, w);
    ms_json_free(w);
    if (b.st != MS_OK || b.len != a.len || memcmp(a.data, b.data, a.len) != 0) {
        fprintf(stderr, "fuzz_json: writing is not stable:\n%.*s\n%.*s\n", (int)a.len, a.data, (int)b.len, b.data);
        abort();
    }
    ms_json_buf_free(&a);
    ms_json_buf_free(&b);
    return 0;
}
