/* capsule-agent: the growable string buffer and the JSON writer (see json.h). */
#include "agent.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int sb_reserve(sbuf *b, size_t extra)
{
    if (b->failed)
        return -1;
    if (b->len + extra + 1 <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return -1;
    }
    if (b->len == 0)
        p[0] = 0; /* NUL-terminated from the start: an empty JSON string "" has no put to end it */
    b->p = p;
    b->cap = cap;
    return 0;
}

void sb_put(sbuf *b, const char *s, size_t n)
{
    if (sb_reserve(b, n) < 0)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
void sb_putc(sbuf *b, char c) { sb_put(b, &c, 1); }

void sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof tmp) {
        sb_put(b, tmp, (size_t)n);
        return;
    }
    if (sb_reserve(b, (size_t)n) < 0)
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void sb_free(sbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0;
        if (c == 0xED)
            hi = 0x9F; /* no UTF-16 surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0)
            lo = 0x90;
        if (c == 0xF4)
            hi = 0x8F; /* <= U+10FFFF */
    } else
        return 0;
    if (n < need)
        return 0;
    if (s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < need; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return need;
}

/* Append data as a JSON string literal.  Control characters are escaped,
 * valid UTF-8 passes through, every invalid byte becomes U+FFFD. */
static void sb_json_str(sbuf *b, const char *data, size_t len)
{
    const unsigned char *s = (const unsigned char *)data;
    sb_putc(b, '"');
    size_t i = 0, run = 0; /* run: start of the pending verbatim span */
    while (i < len) {
        unsigned char c = s[i];
        const char *esc = NULL;
        char ubuf[8];
        size_t adv = 1;
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c < 0x20) {
            switch (c) {
            case '\n': esc = "\\n"; break;
            case '\r': esc = "\\r"; break;
            case '\t': esc = "\\t"; break;
            case '\b': esc = "\\b"; break;
            case '\f': esc = "\\f"; break;
            default:
                snprintf(ubuf, sizeof ubuf, "\\u%04x", c);
                esc = ubuf;
            }
        } else if (c >= 0x80) {
            adv = utf8_seq(s + i, len - i);
            if (!adv) {
                esc = "\\ufffd";
                adv = 1;
            }
        }
        if (esc) {
            sb_put(b, data + run, i - run);
            sb_puts(b, esc);
            i += adv;
            run = i;
        } else
            i += adv;
    }
    sb_put(b, data + run, len - run);
    sb_putc(b, '"');
}

void put_utf8(sbuf *b, unsigned cp)
{
    char u[4];
    if (cp < 0x80) {
        u[0] = (char)cp;
        sb_put(b, u, 1);
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3F));
        sb_put(b, u, 2);
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        sb_put(b, u, 3);
    } else {
        u[0] = (char)(0xF0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        sb_put(b, u, 4);
    }
}

void jw_sep(jw *w)
{
    if (w->after_key) {
        w->after_key = 0;
        return;
    }
    if (w->depth > 0) {
        if (!w->first[w->depth])
            sb_putc(w->b, ',');
        w->first[w->depth] = 0;
    }
}

void jw_open(jw *w, char c)
{
    jw_sep(w);
    sb_putc(w->b, c);
    if (w->depth < MAX_DEPTH)
        w->depth++;
    w->first[w->depth] = 1;
}

void jw_close(jw *w, char c)
{
    sb_putc(w->b, c);
    if (w->depth > 0)
        w->depth--;
}

void jw_key(jw *w, const char *k)
{
    jw_sep(w);
    sb_json_str(w->b, k, strlen(k));
    sb_putc(w->b, ':');
    w->after_key = 1;
}

void jw_str(jw *w, const char *s, size_t n)
{
    jw_sep(w);
    sb_json_str(w->b, s, n);
}
void jw_cstr(jw *w, const char *s) { jw_str(w, s, strlen(s)); }
void jw_i64(jw *w, long long v)
{
    jw_sep(w);
    sb_printf(w->b, "%lld", v);
}
void jw_u64(jw *w, unsigned long long v)
{
    jw_sep(w);
    sb_printf(w->b, "%llu", v);
}
void jw_dbl(jw *w, double v)
{
    jw_sep(w);
    sb_printf(w->b, "%.3f", v);
}
void jw_bool(jw *w, int v)
{
    jw_sep(w);
    sb_puts(w->b, v ? "true" : "false");
}
void jw_null(jw *w)
{
    jw_sep(w);
    sb_puts(w->b, "null");
}

/* An already-serialised JSON value. */
void jw_raw(jw *w, const char *s, size_t n)
{
    jw_sep(w);
    sb_put(w->b, s, n);
}

void kv_str(jw *w, const char *k, const char *v)
{
    jw_key(w, k);
    jw_cstr(w, v);
}
void kv_i64(jw *w, const char *k, long long v)
{
    jw_key(w, k);
    jw_i64(w, v);
}
void kv_u64(jw *w, const char *k, unsigned long long v)
{
    jw_key(w, k);
    jw_u64(w, v);
}
void kv_dbl(jw *w, const char *k, double v)
{
    jw_key(w, k);
    jw_dbl(w, v);
}
void kv_bool(jw *w, const char *k, int v)
{
    jw_key(w, k);
    jw_bool(w, v);
}
