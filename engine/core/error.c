/*
** Errors: status names, and the per-context and per-thread last-error messages.
** The engine never prints; a failing call records its message here and returns its status.
*/
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char thread_last_error[MS_ERRMSG_SIZE];

MS_API const char *ms_status_name(ms_status s)
{
    switch (s) {
    case MS_OK:            return "MS_OK";
    case MS_E_ARG:         return "MS_E_ARG";
    case MS_E_SHAPE:       return "MS_E_SHAPE";
    case MS_E_DTYPE:       return "MS_E_DTYPE";
    case MS_E_DEVICE:      return "MS_E_DEVICE";
    case MS_E_OOM:         return "MS_E_OOM";
    case MS_E_NUMERIC:     return "MS_E_NUMERIC";
    case MS_E_IO:          return "MS_E_IO";
    case MS_E_FORMAT:      return "MS_E_FORMAT";
    case MS_E_UNSUPPORTED: return "MS_E_UNSUPPORTED";
    case MS_E_LAYOUT:      return "MS_E_LAYOUT";
    case MS_E_BACKEND:     return "MS_E_BACKEND";
    }
    return "MS_E_UNKNOWN";
}

MS_API const char *ms_last_error(void) { return thread_last_error; }

MS_API const char *ms_ctx_last_error(const ms_ctx *ctx) { return ctx ? ctx->last_error : ""; }

ms_status ms_error_at(ms_ctx *ctx, ms_status st, const char *file, int line, const char *fmt, ...)
{
    char msg[MS_ERRMSG_SIZE];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    /* keep the path from the repository root: "engine/core/ops.c" */
    const char *rel = strstr(file, "engine/");
    if (rel == NULL) rel = strstr(file, "kernels/");
    if (rel == NULL) rel = file;
    if ((size_t)n < sizeof msg) snprintf(msg + n, sizeof msg - (size_t)n, " (%s:%d)", rel, line);
    memcpy(thread_last_error, msg, sizeof msg);
    if (ctx) memcpy(ctx->last_error, msg, sizeof msg);
    return st;
}

ms_status ms_error_name(ms_ctx *ctx, ms_status st, const char *fn)
{
    if (st == MS_OK || fn == NULL) return st;
    const size_t fl = strlen(fn);
    const char *msg = thread_last_error;
    if (strncmp(msg, fn, fl) == 0 && msg[fl] == ':') return st;
    /* "eigh: ..." raised for ms_eigh: the short name gives way to the public one */
    const char *rest = msg;
    if (fl > 3 && strncmp(fn, "ms_", 3) == 0 && strncmp(msg, fn + 3, fl - 3) == 0 && msg[fl - 3] == ':' &&
        msg[fl - 2] == ' ')
        rest = msg + fl - 1;
    char out[MS_ERRMSG_SIZE];
    size_t k = fl < sizeof out - 3 ? fl : sizeof out - 3, r = strlen(rest);
    memcpy(out, fn, k);
    out[k++] = ':';
    out[k++] = ' ';
    if (r > sizeof out - 1 - k) r = sizeof out - 1 - k;   /* cut at the buffer's end */
    memcpy(out + k, rest, r);
    out[k + r] = '\0';
    memcpy(thread_last_error, out, sizeof out);
    if (ctx) memcpy(ctx->last_error, out, sizeof out);
    return st;
}

const char *ms_shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

const char *ms_tshape(const ms_tensor *t)
{
    static _Thread_local char ring[4][16 * MS_MAX_DIMS + 4];
    static _Thread_local int next;
    char *buf = ring[next++ & 3];
    if (t == NULL) return strcpy(buf, "(null)");
    return ms_shape_str(buf, sizeof ring[0], t->ndim, t->shape);
}
