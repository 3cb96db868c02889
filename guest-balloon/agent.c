/*
 * capsule-agent: the Capsule guest agent.
 *
 * A small static program that runs inside a Linux guest and answers JSON-lines
 * requests from the host over a virtio-serial port (org.capsule.agent.0):
 * liveness (ping), memory statistics, the §4.1 "balloon" (allocate and zero
 * pages so the guest's free memory becomes zero pages / holes in the saved
 * memory image), file-system freeze/thaw and command execution.
 *
 * No libraries besides libc; no NSS (getpwnam & co.), so a static glibc build
 * runs in a bare busybox initramfs.  See PROTOCOL.md for the wire protocol.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/fs.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "0.1.0"
#define PROTOCOL_VERSION 1
#define DEFAULT_PORT "org.capsule.agent.0"
#define MAX_LINE (64 * 1024)           /* request line limit, newline excluded */
#define MAX_DEPTH 32                   /* JSON nesting limit */
#define MiB (1024ULL * 1024ULL)
#define HUP_SLEEP_MS 250               /* pause while the host is not connected */
#define REOPEN_MAX_MS 2000             /* cap of the reopen back-off */
#define EOF_REOPEN_ROUNDS 40           /* reopen a silent port every 40 * HUP_SLEEP_MS */
#define WRITE_TIMEOUT_MS 10000         /* give up a reply the host does not read */
#define BALLOON_CHECK_MS 250           /* memory-pressure check while holding */
#define EXEC_DEFAULT_CAP (1024 * 1024) /* stdout / stderr capture cap */
#define EXEC_MAX_CAP (8 * 1024 * 1024)
#define MAX_FROZEN 256

/* ------------------------------------------------------------------------ */
/* small utilities                                                          */

static int g_verbose;
static volatile sig_atomic_t g_term;
static double g_start;

static double now_mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(long ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL); /* EINTR (signal) just shortens the pause */
}

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int g_nfrozen;
static void logmsg(const char *fmt, ...)
{
    char buf[1024];
    /* stderr might be a file on a frozen file system: writing would block us,
     * and with us the auto-thaw.  Stay quiet while anything is frozen. */
    if (g_nfrozen > 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    dprintf(2, "capsule-agent: %s\n", buf);
}

static int read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = 0;
    while (len + 1 < cap) {
        ssize_t n = read(fd, buf + len, cap - 1 - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = 0;
    return (int)len;
}

static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = strlen(text);
    ssize_t n;
    do
        n = write(fd, text, len);
    while (n < 0 && errno == EINTR);
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)len ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* growable string buffer; allocation failure sets a flag, never aborts     */

typedef struct {
    char *p;
    size_t len, cap;
    int failed;
} sbuf;

static int sb_reserve(sbuf *b, size_t extra)
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

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (sb_reserve(b, n) < 0)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_putc(sbuf *b, char c) { sb_put(b, &c, 1); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
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

static void sb_free(sbuf *b)
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

/* ------------------------------------------------------------------------ */
/* JSON values and parser                                                   */

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct jval {
    enum jtype t;
    int b;
    double num;
    int is_int;
    long long i;
    char *s; /* J_STR: decoded bytes, NUL-terminated (may contain NULs) */
    size_t slen;
    size_t n;            /* J_ARR / J_OBJ: element count */
    struct jval **items; /* values */
    char **keys;         /* J_OBJ keys (decoded, NUL-terminated) */
    size_t *keylens;
} jval;

static void jfree(jval *v)
{
    if (!v)
        return;
    for (size_t k = 0; k < v->n; k++) {
        jfree(v->items[k]);
        if (v->keys)
            free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    free(v->keylens);
    free(v->s);
    free(v);
}

typedef struct {
    const char *p, *end;
    const char *err;
    int depth;
} jparser;

static void jp_ws(jparser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static jval *jnew(enum jtype t)
{
    jval *v = calloc(1, sizeof *v);
    if (v)
        v->t = t;
    return v;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int jp_hex4(jparser *ps, unsigned *out)
{
    if (ps->end - ps->p < 4)
        return -1;
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(ps->p[k]);
        if (h < 0)
            return -1;
        v = v * 16 + (unsigned)h;
    }
    ps->p += 4;
    *out = v;
    return 0;
}

static void put_utf8(sbuf *b, unsigned cp)
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

/* Parse a string literal (ps->p at the opening quote) into a malloc'd buffer. */
static int jp_string(jparser *ps, char **out, size_t *outlen)
{
    sbuf b = {0};
    ps->p++; /* opening quote */
    sb_reserve(&b, 16);
    for (;;) {
        if (ps->p >= ps->end) {
            ps->err = "unterminated string";
            goto fail;
        }
        unsigned char c = (unsigned char)*ps->p;
        if (c == '"') {
            ps->p++;
            break;
        }
        if (c < 0x20) {
            ps->err = "control character in string";
            goto fail;
        }
        if (c != '\\') {
            /* copy a run of ordinary bytes at once */
            const char *q = ps->p;
            while (q < ps->end && *q != '"' && *q != '\\' && (unsigned char)*q >= 0x20)
                q++;
            sb_put(&b, ps->p, (size_t)(q - ps->p));
            ps->p = q;
            continue;
        }
        ps->p++;
        if (ps->p >= ps->end) {
            ps->err = "unterminated string";
            goto fail;
        }
        char e = *ps->p++;
        switch (e) {
        case '"': sb_putc(&b, '"'); break;
        case '\\': sb_putc(&b, '\\'); break;
        case '/': sb_putc(&b, '/'); break;
        case 'b': sb_putc(&b, '\b'); break;
        case 'f': sb_putc(&b, '\f'); break;
        case 'n': sb_putc(&b, '\n'); break;
        case 'r': sb_putc(&b, '\r'); break;
        case 't': sb_putc(&b, '\t'); break;
        case 'u': {
            unsigned cp;
            if (jp_hex4(ps, &cp) < 0) {
                ps->err = "bad \\u escape";
                goto fail;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u') {
                    ps->p += 2;
                    if (jp_hex4(ps, &lo) < 0) {
                        ps->err = "bad \\u escape";
                        goto fail;
                    }
                    if (lo >= 0xDC00 && lo <= 0xDFFF)
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    else {
                        put_utf8(&b, 0xFFFD); /* lone high surrogate */
                        cp = lo >= 0xD800 && lo <= 0xDFFF ? 0xFFFD : lo;
                    }
                } else
                    cp = 0xFFFD;
            } else if (cp >= 0xDC00 && cp <= 0xDFFF)
                cp = 0xFFFD; /* lone low surrogate */
            put_utf8(&b, cp);
            break;
        }
        default:
            ps->err = "bad escape in string";
            goto fail;
        }
    }
    if (b.failed) {
        ps->err = "out of memory";
        goto fail;
    }
    *out = b.p;
    *outlen = b.len;
    return 0;
fail:
    sb_free(&b);
    return -1;
}

static jval *jp_value(jparser *ps);

static jval *jp_number(jparser *ps)
{
    const char *s = ps->p, *q = s;
    int is_int = 1;
    if (q < ps->end && *q == '-')
        q++;
    if (q >= ps->end || !isdigit((unsigned char)*q))
        goto bad;
    if (*q == '0')
        q++;
    else
        while (q < ps->end && isdigit((unsigned char)*q))
            q++;
    if (q < ps->end && *q == '.') {
        is_int = 0;
        q++;
        if (q >= ps->end || !isdigit((unsigned char)*q))
            goto bad;
        while (q < ps->end && isdigit((unsigned char)*q))
            q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        is_int = 0;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= ps->end || !isdigit((unsigned char)*q))
            goto bad;
        while (q < ps->end && isdigit((unsigned char)*q))
            q++;
    }
    char tmp[64];
    size_t len = (size_t)(q - s);
    if (len >= sizeof tmp) {
        /* very long literal: still valid JSON, parse via a heap copy */
        char *h = strndup(s, len);
        if (!h) {
            ps->err = "out of memory";
            return NULL;
        }
        jval *v = jnew(J_NUM);
        if (v)
            v->num = strtod(h, NULL);
        free(h);
        if (!v) {
            ps->err = "out of memory";
            return NULL;
        }
        if (v->num != v->num || v->num > 1.7e308 || v->num < -1.7e308) {
            free(v);
            ps->err = "number out of range";
            return NULL;
        }
        ps->p = q;
        return v;
    }
    memcpy(tmp, s, len);
    tmp[len] = 0;
    jval *v = jnew(J_NUM);
    if (!v) {
        ps->err = "out of memory";
        return NULL;
    }
    v->num = strtod(tmp, NULL);
    if (v->num != v->num || v->num > 1.7e308 || v->num < -1.7e308) {
        free(v);
        ps->err = "number out of range";
        return NULL;
    }
    if (is_int) {
        errno = 0;
        long long i = strtoll(tmp, NULL, 10);
        if (errno == 0) {
            v->is_int = 1;
            v->i = i;
        }
    }
    ps->p = q;
    return v;
bad:
    ps->err = "bad number";
    return NULL;
}

static int jp_append(jval *c, jval *item, char *key, size_t keylen)
{
    jval **items = realloc(c->items, (c->n + 1) * sizeof *items);
    if (!items)
        return -1;
    c->items = items;
    if (c->t == J_OBJ) {
        char **keys = realloc(c->keys, (c->n + 1) * sizeof *keys);
        if (!keys)
            return -1;
        c->keys = keys;
        size_t *kl = realloc(c->keylens, (c->n + 1) * sizeof *kl);
        if (!kl)
            return -1;
        c->keylens = kl;
        c->keys[c->n] = key;
        c->keylens[c->n] = keylen;
    }
    c->items[c->n++] = item;
    return 0;
}

static jval *jp_container(jparser *ps, int obj)
{
    if (++ps->depth > MAX_DEPTH) {
        ps->err = "nesting too deep";
        return NULL;
    }
    jval *c = jnew(obj ? J_OBJ : J_ARR);
    if (!c) {
        ps->err = "out of memory";
        return NULL;
    }
    ps->p++; /* [ or { */
    jp_ws(ps);
    char close = obj ? '}' : ']';
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        ps->depth--;
        return c;
    }
    for (;;) {
        char *key = NULL;
        size_t keylen = 0;
        jp_ws(ps);
        if (obj) {
            if (ps->p >= ps->end || *ps->p != '"') {
                ps->err = "expected a string key";
                goto fail;
            }
            if (jp_string(ps, &key, &keylen) < 0)
                goto fail;
            jp_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') {
                free(key);
                ps->err = "expected ':'";
                goto fail;
            }
            ps->p++;
        }
        jval *item = jp_value(ps);
        if (!item) {
            free(key);
            goto fail;
        }
        if (jp_append(c, item, key, keylen) < 0) {
            jfree(item);
            free(key);
            ps->err = "out of memory";
            goto fail;
        }
        jp_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            break;
        }
        ps->err = obj ? "expected ',' or '}'" : "expected ',' or ']'";
        goto fail;
    }
    ps->depth--;
    return c;
fail:
    jfree(c);
    return NULL;
}

static jval *jp_value(jparser *ps)
{
    jp_ws(ps);
    if (ps->p >= ps->end) {
        ps->err = "unexpected end of input";
        return NULL;
    }
    char c = *ps->p;
    if (c == '{' || c == '[')
        return jp_container(ps, c == '{');
    if (c == '"') {
        jval *v = jnew(J_STR);
        if (!v) {
            ps->err = "out of memory";
            return NULL;
        }
        if (jp_string(ps, &v->s, &v->slen) < 0) {
            free(v);
            return NULL;
        }
        return v;
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return jp_number(ps);
    static const struct {
        const char *lit;
        enum jtype t;
        int b;
    } lits[] = {{"true", J_BOOL, 1}, {"false", J_BOOL, 0}, {"null", J_NULL, 0}};
    for (size_t k = 0; k < sizeof lits / sizeof lits[0]; k++) {
        size_t l = strlen(lits[k].lit);
        if ((size_t)(ps->end - ps->p) >= l && memcmp(ps->p, lits[k].lit, l) == 0) {
            ps->p += l;
            jval *v = jnew(lits[k].t);
            if (!v)
                ps->err = "out of memory";
            else
                v->b = lits[k].b;
            return v;
        }
    }
    ps->err = "unexpected character";
    return NULL;
}

static jval *json_parse(const char *s, size_t len, const char **err)
{
    jparser ps = {s, s + len, NULL, 0};
    jval *v = jp_value(&ps);
    if (v) {
        jp_ws(&ps);
        if (ps.p != ps.end) {
            jfree(v);
            v = NULL;
            ps.err = "trailing characters after JSON value";
        }
    }
    *err = ps.err;
    return v;
}

static jval *jget(const jval *obj, const char *key)
{
    if (!obj || obj->t != J_OBJ)
        return NULL;
    size_t kl = strlen(key);
    for (size_t k = 0; k < obj->n; k++)
        if (obj->keylens[k] == kl && memcmp(obj->keys[k], key, kl) == 0)
            return obj->items[k];
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* JSON writer                                                              */

typedef struct {
    sbuf *b;
    int depth;
    unsigned char first[MAX_DEPTH + 2];
    int after_key;
} jw;

static void jw_sep(jw *w)
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

static void jw_open(jw *w, char c)
{
    jw_sep(w);
    sb_putc(w->b, c);
    if (w->depth < MAX_DEPTH)
        w->depth++;
    w->first[w->depth] = 1;
}

static void jw_close(jw *w, char c)
{
    sb_putc(w->b, c);
    if (w->depth > 0)
        w->depth--;
}

static void jw_key(jw *w, const char *k)
{
    jw_sep(w);
    sb_json_str(w->b, k, strlen(k));
    sb_putc(w->b, ':');
    w->after_key = 1;
}

static void jw_str(jw *w, const char *s, size_t n)
{
    jw_sep(w);
    sb_json_str(w->b, s, n);
}
static void jw_cstr(jw *w, const char *s) { jw_str(w, s, strlen(s)); }
static void jw_i64(jw *w, long long v)
{
    jw_sep(w);
    sb_printf(w->b, "%lld", v);
}
static void jw_u64(jw *w, unsigned long long v)
{
    jw_sep(w);
    sb_printf(w->b, "%llu", v);
}
static void jw_dbl(jw *w, double v)
{
    jw_sep(w);
    sb_printf(w->b, "%.3f", v);
}
static void jw_bool(jw *w, int v)
{
    jw_sep(w);
    sb_puts(w->b, v ? "true" : "false");
}
static void jw_null(jw *w)
{
    jw_sep(w);
    sb_puts(w->b, "null");
}

/* An already-serialised JSON value. */
static void jw_raw(jw *w, const char *s, size_t n)
{
    jw_sep(w);
    sb_put(w->b, s, n);
}

static void kv_str(jw *w, const char *k, const char *v)
{
    jw_key(w, k);
    jw_cstr(w, v);
}
static void kv_i64(jw *w, const char *k, long long v)
{
    jw_key(w, k);
    jw_i64(w, v);
}
static void kv_u64(jw *w, const char *k, unsigned long long v)
{
    jw_key(w, k);
    jw_u64(w, v);
}
static void kv_dbl(jw *w, const char *k, double v)
{
    jw_key(w, k);
    jw_dbl(w, v);
}
static void kv_bool(jw *w, const char *k, int v)
{
    jw_key(w, k);
    jw_bool(w, v);
}

/* ------------------------------------------------------------------------ */
/* argument helpers: each returns 0, or -1 with err filled                  */

typedef struct {
    char msg[512];
} errbuf;

static int fail(errbuf *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(errbuf *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static int check_keys(const jval *args, const char *const *allowed, errbuf *e)
{
    if (!args)
        return 0;
    for (size_t k = 0; k < args->n; k++) {
        int ok = 0;
        for (const char *const *a = allowed; *a; a++)
            if (strlen(*a) == args->keylens[k] && memcmp(*a, args->keys[k], args->keylens[k]) == 0)
                ok = 1;
        if (!ok)
            return fail(e, "unknown argument '%.100s'", args->keys[k]);
    }
    return 0;
}

static int arg_u64(const jval *args, const char *key, unsigned long long def, unsigned long long *out, errbuf *e)
{
    const jval *v = jget(args, key);
    if (!v || v->t == J_NULL) {
        *out = def;
        return 0;
    }
    if (v->t != J_NUM)
        return fail(e, "argument '%s' must be a number", key);
    if (v->is_int) {
        if (v->i < 0)
            return fail(e, "argument '%s' must not be negative", key);
        *out = (unsigned long long)v->i;
        return 0;
    }
    if (v->num < 0 || v->num >= 9.2e18 || (double)(long long)v->num != v->num)
        return fail(e, "argument '%s' must be a non-negative integer", key);
    *out = (unsigned long long)v->num;
    return 0;
}

static int arg_seconds(const jval *args, const char *key, double def, double max, double *out, errbuf *e)
{
    const jval *v = jget(args, key);
    if (!v || v->t == J_NULL) {
        *out = def;
        return 0;
    }
    if (v->t != J_NUM || v->num < 0 || v->num > max)
        return fail(e, "argument '%s' must be a number of seconds in [0, %g]", key, max);
    *out = v->num;
    return 0;
}

/* A string without NUL bytes (or NULL if absent). */
static int arg_cstr(const jval *args, const char *key, const char **out, errbuf *e)
{
    const jval *v = jget(args, key);
    *out = NULL;
    if (!v || v->t == J_NULL)
        return 0;
    if (v->t != J_STR)
        return fail(e, "argument '%s' must be a string", key);
    if (memchr(v->s, 0, v->slen))
        return fail(e, "argument '%s' must not contain NUL", key);
    *out = v->s;
    return 0;
}

/* Array of NUL-free strings; *present tells whether the key was given. */
static int arg_str_array(const jval *args, const char *key, const jval **out, int *present, errbuf *e)
{
    const jval *v = jget(args, key);
    *out = NULL;
    *present = 0;
    if (!v || v->t == J_NULL)
        return 0;
    if (v->t != J_ARR)
        return fail(e, "argument '%s' must be an array of strings", key);
    for (size_t k = 0; k < v->n; k++) {
        if (v->items[k]->t != J_STR)
            return fail(e, "argument '%s' must be an array of strings", key);
        if (memchr(v->items[k]->s, 0, v->items[k]->slen))
            return fail(e, "argument '%s' contains a string with NUL", key);
    }
    *out = v;
    *present = 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* /proc/meminfo                                                            */

typedef struct {
    long long total, free, avail, cached, buffers, swap_total, swap_free;
} meminfo;

static int read_meminfo(meminfo *m)
{
    char buf[8192];
    m->total = m->free = m->avail = m->cached = m->buffers = m->swap_total = m->swap_free = -1;
    if (read_file("/proc/meminfo", buf, sizeof buf) <= 0)
        return -1;
    static const struct {
        const char *name;
        size_t off;
    } fields[] = {
        {"MemTotal:", offsetof(meminfo, total)},     {"MemFree:", offsetof(meminfo, free)},
        {"MemAvailable:", offsetof(meminfo, avail)}, {"Cached:", offsetof(meminfo, cached)},
        {"Buffers:", offsetof(meminfo, buffers)},    {"SwapTotal:", offsetof(meminfo, swap_total)},
        {"SwapFree:", offsetof(meminfo, swap_free)},
    };
    for (char *line = buf; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = 0;
        for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++) {
            size_t l = strlen(fields[k].name);
            if (strncmp(line, fields[k].name, l) == 0) {
                long long v = strtoll(line + l, NULL, 10);
                if (strstr(line + l, "kB"))
                    v *= 1024;
                *(long long *)((char *)m + fields[k].off) = v;
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    if (m->avail < 0 && m->free >= 0) /* kernels before 3.14 */
        m->avail = m->free + (m->cached > 0 ? m->cached : 0) + (m->buffers > 0 ? m->buffers : 0);
    if (m->swap_free < 0)
        m->swap_free = 0;
    if (m->swap_total < 0)
        m->swap_total = 0;
    return m->total >= 0 && m->avail >= 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* balloon                                                                  */

typedef struct {
    void *p;
    size_t len;
} chunk;

static chunk *g_chunks;
static size_t g_nchunks, g_chunks_cap;
static unsigned long long g_held;
static char g_oom_orig[32] = "0\n"; /* read at start-up */
static int g_oom_state;              /* 0 = original, 1 = +1000 (victim), -1 = -1000 (protected) */
static char g_last_stop[32] = "";
static unsigned long long g_floor = 32 * MiB;
static unsigned long long g_pressure_released;
static double g_auto_deflate_at;    /* 0 = never */
static double g_next_balloon_check; /* monotonic seconds */

/* While the balloon holds memory, be the OOM killer's first victim: the
 * guest survives and the memory comes back.  But while file systems are
 * frozen, never be killed: nobody else would thaw them. */
static void oom_update(int inflating)
{
    int want = g_nfrozen > 0 ? -1 : (g_held > 0 || inflating) ? 1 : 0;
    if (want == g_oom_state)
        return;
    const char *v = want < 0 ? "-1000\n" : want > 0 ? "1000\n" : g_oom_orig;
    if (write_file("/proc/self/oom_score_adj", v) == 0)
        g_oom_state = want;
}

/* Release chunks, newest first, until at least `bytes` are freed. */
static unsigned long long balloon_release(unsigned long long bytes)
{
    unsigned long long released = 0;
    while (g_nchunks > 0 && released < bytes) {
        chunk *c = &g_chunks[--g_nchunks];
        munmap(c->p, c->len);
        released += c->len;
        g_held -= c->len;
    }
    if (g_nchunks == 0) {
        g_held = 0;
        g_auto_deflate_at = 0;
    }
    oom_update(0);
    return released;
}

static const char *drop_caches(const char *policy, char *detail, size_t detail_len)
{
    if (strcmp(policy, "none") == 0)
        return "skipped";
    sync();
    const char *what = strcmp(policy, "cache") == 0 ? "1\n" : "3\n";
    if (write_file("/proc/sys/vm/drop_caches", what) < 0) {
        snprintf(detail, detail_len, "drop_caches: %s", strerror(errno));
        return "failed";
    }
    if (strcmp(policy, "aggressive") == 0 && access("/proc/sys/vm/compact_memory", F_OK) == 0 &&
        write_file("/proc/sys/vm/compact_memory", "1\n") < 0) {
        snprintf(detail, detail_len, "compact_memory: %s", strerror(errno));
        return "partial";
    }
    return "ok";
}

static int cmd_balloon_inflate(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"policy",     "floor_bytes", "max_bytes", "swap_drop_bytes",
                                          "step_bytes", "timeout_s",   "hold_s",    NULL};
    if (check_keys(args, allowed, e) < 0)
        return -1;
    const char *policy;
    unsigned long long floor_b, max_b, swap_drop, step;
    double timeout_s, hold_s;
    if (arg_cstr(args, "policy", &policy, e) < 0 || arg_u64(args, "floor_bytes", ULLONG_MAX, &floor_b, e) < 0 ||
        arg_u64(args, "max_bytes", ULLONG_MAX, &max_b, e) < 0 ||
        arg_u64(args, "swap_drop_bytes", 1 * MiB, &swap_drop, e) < 0 ||
        arg_u64(args, "step_bytes", 4 * MiB, &step, e) < 0 || arg_seconds(args, "timeout_s", 30, 3600, &timeout_s, e) < 0 ||
        arg_seconds(args, "hold_s", 0, 30 * 86400, &hold_s, e) < 0)
        return -1;
    if (!policy)
        policy = "none";
    if (floor_b > (1ULL << 50) && floor_b != ULLONG_MAX)
        floor_b = 1ULL << 50;
    if (swap_drop > (1ULL << 50))
        swap_drop = 1ULL << 50;
    if (strcmp(policy, "none") && strcmp(policy, "cache") && strcmp(policy, "aggressive"))
        return fail(e, "policy must be \"none\", \"cache\" or \"aggressive\"");
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (step < page)
        step = page;
    if (step > 256 * MiB)
        step = 256 * MiB;
    step = (step + page - 1) / page * page;

    double t0 = now_mono();
    char drop_detail[160] = "";
    const char *drop = drop_caches(policy, drop_detail, sizeof drop_detail);

    meminfo m0, m;
    if (read_meminfo(&m0) < 0)
        return fail(e, "cannot read /proc/meminfo");
    unsigned long long added = 0;
    const char *stop = NULL;
    if (floor_b == ULLONG_MAX) /* default: 32 MiB, or 1/32 of RAM on big guests */
        floor_b = (unsigned long long)m0.total / 32 > 32 * MiB ? (unsigned long long)m0.total / 32 : 32 * MiB;
    g_floor = floor_b;
    oom_update(1);
    for (;;) {
        if (g_term) {
            stop = "terminated";
            break;
        }
        if (g_held >= max_b) {
            stop = "max_bytes";
            break;
        }
        if (now_mono() - t0 > timeout_s) {
            stop = "timeout";
            break;
        }
        if (read_meminfo(&m) < 0) {
            stop = "meminfo_failed";
            break;
        }
        /* §4.1: stop as soon as free swap has fallen by more than swap_drop. */
        if (m0.swap_free - m.swap_free > (long long)swap_drop) {
            stop = "swap";
            break;
        }
        unsigned long long this_step = step;
        if (max_b - g_held < this_step)
            this_step = (max_b - g_held + page - 1) / page * page;
        if ((unsigned long long)m.avail < floor_b + this_step) {
            stop = "floor";
            break;
        }
        void *p = mmap(NULL, this_step, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            stop = "mmap_failed";
            break;
        }
        if (g_nchunks == g_chunks_cap) {
            size_t cap = g_chunks_cap ? g_chunks_cap * 2 : 64;
            chunk *c = realloc(g_chunks, cap * sizeof *c);
            if (!c) {
                munmap(p, this_step);
                stop = "out_of_memory";
                break;
            }
            g_chunks = c;
            g_chunks_cap = cap;
        }
        /* Small pages: a huge page would make the kernel compact memory (slow). */
        madvise(p, this_step, MADV_NOHUGEPAGE);
        /* A write fault gives each page its own zero-filled frame (a read would
         * map the shared zero page); the explicit zero write is the paper's
         * "write some zeros to each allocated page". */
        for (size_t off = 0; off < this_step; off += page)
            ((volatile unsigned char *)p)[off] = 0;
        g_chunks[g_nchunks].p = p;
        g_chunks[g_nchunks].len = this_step;
        g_nchunks++;
        g_held += this_step;
        added += this_step;
    }
    oom_update(0);
    snprintf(g_last_stop, sizeof g_last_stop, "%s", stop);
    g_auto_deflate_at = hold_s > 0 && g_held > 0 ? now_mono() + hold_s : 0;
    g_next_balloon_check = now_mono() + BALLOON_CHECK_MS / 1000.0;
    if (read_meminfo(&m) < 0)
        m = m0;
    kv_u64(w, "held_bytes", g_held);
    kv_u64(w, "added_bytes", added);
    kv_str(w, "stop_reason", stop);
    kv_u64(w, "floor_bytes", floor_b);
    kv_dbl(w, "seconds", now_mono() - t0);
    kv_str(w, "policy", policy);
    kv_str(w, "drop_caches", drop);
    if (drop_detail[0])
        kv_str(w, "drop_caches_error", drop_detail);
    kv_i64(w, "MemAvailable", m.avail);
    kv_i64(w, "swap_dropped_bytes", m0.swap_free - m.swap_free);
    return 0;
}

static int cmd_balloon_deflate(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"bytes", NULL};
    unsigned long long bytes;
    if (check_keys(args, allowed, e) < 0 || arg_u64(args, "bytes", ULLONG_MAX, &bytes, e) < 0)
        return -1;
    unsigned long long released = balloon_release(bytes);
    kv_u64(w, "released_bytes", released);
    kv_u64(w, "held_bytes", g_held);
    return 0;
}

static int cmd_balloon_status(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {NULL};
    if (check_keys(args, allowed, e) < 0)
        return -1;
    char oom[32] = "";
    read_file("/proc/self/oom_score_adj", oom, sizeof oom);
    meminfo m;
    read_meminfo(&m);
    kv_u64(w, "held_bytes", g_held);
    kv_u64(w, "chunks", g_nchunks);
    jw_key(w, "last_stop_reason");
    if (g_last_stop[0])
        jw_cstr(w, g_last_stop);
    else
        jw_null(w);
    kv_u64(w, "floor_bytes", g_floor);
    kv_u64(w, "pressure_released_bytes", g_pressure_released);
    jw_key(w, "auto_deflate_in_s");
    if (g_auto_deflate_at > 0)
        jw_dbl(w, g_auto_deflate_at - now_mono());
    else
        jw_null(w);
    kv_i64(w, "oom_score_adj", strtol(oom, NULL, 10));
    kv_i64(w, "MemAvailable", m.avail);
    return 0;
}

/* Called from the main loop (and during exec) every BALLOON_CHECK_MS while memory is held. */
static void balloon_tick(void)
{
    if (g_held == 0)
        return;
    double t = now_mono();
    if (g_auto_deflate_at > 0 && t >= g_auto_deflate_at) {
        unsigned long long r = balloon_release(ULLONG_MAX);
        logmsg("hold time over: deflated %llu bytes", r);
        return;
    }
    if (t < g_next_balloon_check)
        return;
    g_next_balloon_check = t + BALLOON_CHECK_MS / 1000.0;
    meminfo m;
    if (read_meminfo(&m) < 0)
        return;
    /* Someone in the guest needs memory: give back enough to reach the floor. */
    if ((unsigned long long)m.avail < g_floor / 4 * 3) {
        unsigned long long r = balloon_release(g_floor - (unsigned long long)m.avail);
        g_pressure_released += r;
        logmsg("memory pressure (MemAvailable %lld): released %llu bytes", m.avail, r);
    }
}

/* ------------------------------------------------------------------------ */
/* file-system freeze                                                       */

typedef struct {
    char *path;
    dev_t dev;
} frozen_fs;

static frozen_fs g_frozen[MAX_FROZEN];
static double g_thaw_at; /* 0 = no timer */

static void unescape_mount(char *s)
{
    char *o = s;
    for (char *p = s; *p;) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] >= '0' && p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 4;
        } else
            *o++ = *p++;
    }
    *o = 0;
}

static int has_option(const char *opts, const char *opt)
{
    size_t l = strlen(opt);
    for (const char *p = opts; p && *p;) {
        const char *c = strchr(p, ',');
        size_t n = c ? (size_t)(c - p) : strlen(p);
        if (n == l && memcmp(p, opt, l) == 0)
            return 1;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

static int is_virtual_fs(const char *type, const char *nodev_list)
{
    static const char *const virt[] = {"proc",     "sysfs",      "devtmpfs",  "devpts",     "tmpfs",   "ramfs",
                                       "rootfs",   "cgroup",     "cgroup2",   "debugfs",    "tracefs", "securityfs",
                                       "pstore",   "bpf",        "mqueue",    "hugetlbfs",  "configfs", "fusectl",
                                       "autofs",   "binfmt_misc", "efivarfs", "nsfs",       "overlay", "squashfs",
                                       "iso9660",  "nfs",        "nfs4",      "cifs",       "9p",      "virtiofs",
                                       "selinuxfs", NULL};
    for (const char *const *v = virt; *v; v++)
        if (strcmp(type, *v) == 0)
            return 1;
    if (strncmp(type, "fuse", 4) == 0)
        return 1;
    /* /proc/filesystems marks file systems without a block device "nodev" */
    size_t l = strlen(type);
    for (const char *p = nodev_list; (p = strstr(p, type)) != NULL; p += l)
        if ((p == nodev_list || p[-1] == '\n') && (p[l] == '\n' || p[l] == 0))
            return 1;
    return 0;
}

/* Default freeze set: writable block-device file systems, in /proc/mounts order. */
static int default_mounts(char ***out, int *count)
{
    static char buf[256 * 1024];
    static char fsbuf[8192];
    char nodev[4096] = "";
    size_t nl = 0;
    if (read_file("/proc/filesystems", fsbuf, sizeof fsbuf) > 0) {
        for (char *line = strtok(fsbuf, "\n"); line; line = strtok(NULL, "\n"))
            if (strncmp(line, "nodev", 5) == 0) {
                const char *name = line + 5;
                while (*name == '\t' || *name == ' ')
                    name++;
                size_t l = strlen(name);
                if (nl + l + 2 < sizeof nodev) {
                    memcpy(nodev + nl, name, l);
                    nl += l;
                    nodev[nl++] = '\n';
                    nodev[nl] = 0;
                }
            }
    }
    if (read_file("/proc/mounts", buf, sizeof buf) <= 0)
        return -1;
    char **list = NULL;
    int n = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *fields[4];
        int nf = 0;
        char *s2 = NULL;
        for (char *f = strtok_r(line, " ", &s2); f && nf < 4; f = strtok_r(NULL, " ", &s2))
            fields[nf++] = f;
        if (nf < 4)
            continue;
        char *mnt = fields[1], *type = fields[2], *opts = fields[3];
        unescape_mount(mnt);
        if (has_option(opts, "ro") || is_virtual_fs(type, nodev))
            continue;
        int dup = 0;
        for (int k = 0; k < n; k++)
            if (strcmp(list[k], mnt) == 0)
                dup = 1;
        if (dup)
            continue;
        char **nlist = realloc(list, (size_t)(n + 1) * sizeof *nlist);
        if (!nlist)
            break;
        list = nlist;
        list[n] = strdup(mnt);
        if (list[n])
            n++;
    }
    *out = list;
    *count = n;
    return 0;
}

static int frozen_index(dev_t dev)
{
    for (int k = 0; k < g_nfrozen; k++)
        if (g_frozen[k].dev == dev)
            return k;
    return -1;
}

static void frozen_remove(int k)
{
    free(g_frozen[k].path);
    memmove(&g_frozen[k], &g_frozen[k + 1], (size_t)(g_nfrozen - k - 1) * sizeof g_frozen[0]);
    g_nfrozen--;
    if (g_nfrozen == 0)
        g_thaw_at = 0;
    oom_update(0);
}

static int fs_ioctl(const char *path, unsigned long req, dev_t *dev)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int s = errno;
        close(fd);
        errno = s;
        return -1;
    }
    *dev = st.st_dev;
    int r = req ? ioctl(fd, req, 0) : 0;
    int s = errno;
    close(fd);
    errno = s;
    return r;
}

/* Thaw everything we froze, newest first.  Returns the number of failures. */
static int thaw_all(jw *w)
{
    int failures = 0;
    for (int k = g_nfrozen - 1; k >= 0; k--) {
        dev_t dev;
        int r = fs_ioctl(g_frozen[k].path, FITHAW, &dev);
        if (r < 0 && errno != EINVAL) {
            failures++;
            logmsg("thaw %s: %s", g_frozen[k].path, strerror(errno));
            continue;
        }
        if (w)
            jw_cstr(w, g_frozen[k].path);
        frozen_remove(k);
    }
    return failures;
}

static void list_frozen(jw *w, const char *key)
{
    jw_key(w, key);
    jw_open(w, '[');
    for (int k = 0; k < g_nfrozen; k++)
        jw_cstr(w, g_frozen[k].path);
    jw_close(w, ']');
}

static int cmd_fs_freeze(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"mounts", "timeout_s", NULL};
    const jval *mounts;
    int explicit_list;
    double timeout_s;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "mounts", &mounts, &explicit_list, e) < 0 ||
        arg_seconds(args, "timeout_s", 30, 86400, &timeout_s, e) < 0)
        return -1;
    char **paths = NULL;
    int n = 0;
    if (explicit_list) {
        n = (int)mounts->n;
        paths = calloc((size_t)n + 1, sizeof *paths);
        if (!paths)
            return fail(e, "out of memory");
        for (int k = 0; k < n; k++)
            paths[k] = strdup(mounts->items[k]->s);
    } else if (default_mounts(&paths, &n) < 0)
        return fail(e, "cannot read /proc/mounts");

    int rc = 0;
    int first_new = g_nfrozen;
    sbuf skipped = {0};
    jw sw = {.b = &skipped};
    jw_open(&sw, '[');
    /* Freeze in reverse mount order: file systems mounted on top first. */
    for (int k = n - 1; k >= 0; k--) {
        if (!paths[k]) {
            rc = fail(e, "out of memory");
            break;
        }
        dev_t dev;
        if (fs_ioctl(paths[k], 0, &dev) < 0) {
            if (!explicit_list) {
                jw_open(&sw, '{');
                kv_str(&sw, "mount", paths[k]);
                kv_str(&sw, "error", strerror(errno));
                jw_close(&sw, '}');
                continue;
            }
            rc = fail(e, "%.200s: %s", paths[k], strerror(errno));
            break;
        }
        if (frozen_index(dev) >= 0)
            continue; /* already frozen by us (or the same fs twice) */
        if (g_nfrozen >= MAX_FROZEN) {
            rc = fail(e, "too many file systems");
            break;
        }
        if (fs_ioctl(paths[k], FIFREEZE, &dev) < 0) {
            int err = errno;
            if (!explicit_list && (err == EOPNOTSUPP || err == ENOTTY || err == EBUSY || err == EINVAL)) {
                jw_open(&sw, '{');
                kv_str(&sw, "mount", paths[k]);
                kv_str(&sw, "error", strerror(err));
                jw_close(&sw, '}');
                continue;
            }
            rc = fail(e, "freeze %.200s: %s", paths[k], strerror(err));
            break;
        }
        g_frozen[g_nfrozen].path = paths[k];
        g_frozen[g_nfrozen].dev = dev;
        paths[k] = NULL;
        g_nfrozen++;
    }
    jw_close(&sw, ']');
    for (int k = 0; k < n; k++)
        free(paths[k]);
    free(paths);
    if (rc < 0) {
        /* all or nothing: thaw what this request froze */
        for (int k = g_nfrozen - 1; k >= first_new; k--) {
            dev_t dev;
            fs_ioctl(g_frozen[k].path, FITHAW, &dev);
            frozen_remove(k);
        }
        sb_free(&skipped);
        return -1;
    }
    if (g_nfrozen > 0)
        g_thaw_at = now_mono() + timeout_s;
    oom_update(0);
    list_frozen(w, "frozen");
    jw_key(w, "skipped");
    jw_raw(w, skipped.p, skipped.len);
    sb_free(&skipped);
    kv_dbl(w, "timeout_s", timeout_s);
    return 0;
}

static int cmd_fs_thaw(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"mounts", NULL};
    const jval *mounts;
    int explicit_list;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "mounts", &mounts, &explicit_list, e) < 0)
        return -1;
    int failures = 0;
    char firsterr[256] = "";
    if (!explicit_list) {
        jw_key(w, "thawed");
        jw_open(w, '[');
        failures = thaw_all(w);
        /* Also sweep the default set: recovers file systems left frozen by an
         * earlier agent that was killed.  FITHAW on a thawed fs is a no-op
         * (EINVAL), so this is harmless. */
        char **paths = NULL;
        int n = 0;
        if (default_mounts(&paths, &n) == 0) {
            for (int k = 0; k < n; k++) {
                dev_t dev;
                if (paths[k] && fs_ioctl(paths[k], FITHAW, &dev) == 0) {
                    jw_cstr(w, paths[k]);
                    int i = frozen_index(dev);
                    if (i >= 0) {
                        frozen_remove(i);
                        failures--;
                    }
                }
                free(paths[k]);
            }
            free(paths);
        }
        jw_close(w, ']');
        if (failures)
            snprintf(firsterr, sizeof firsterr, "%d file system(s) failed to thaw", failures);
    } else {
        jw_key(w, "thawed");
        jw_open(w, '[');
        sbuf nf = {0};
        jw nw = {.b = &nf};
        jw_open(&nw, '[');
        for (size_t k = 0; k < mounts->n; k++) {
            const char *p = mounts->items[k]->s;
            dev_t dev = 0;
            int r = fs_ioctl(p, FITHAW, &dev);
            if (r < 0 && errno == EINVAL) {
                jw_cstr(&nw, p); /* was not frozen */
            } else if (r < 0) {
                failures++;
                if (!firsterr[0])
                    snprintf(firsterr, sizeof firsterr, "thaw %.200s: %s", p, strerror(errno));
                continue;
            } else
                jw_cstr(w, p);
            int i = frozen_index(dev);
            if (i >= 0)
                frozen_remove(i);
        }
        jw_close(&nw, ']');
        jw_close(w, ']');
        jw_key(w, "not_frozen");
        jw_raw(w, nf.p, nf.len);
        sb_free(&nf);
    }
    if (failures)
        return fail(e, "%s", firsterr);
    list_frozen(w, "still_frozen");
    return 0;
}

static int cmd_fs_status(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {NULL};
    if (check_keys(args, allowed, e) < 0)
        return -1;
    list_frozen(w, "frozen");
    jw_key(w, "thaw_in_s");
    if (g_thaw_at > 0)
        jw_dbl(w, g_thaw_at - now_mono());
    else
        jw_null(w);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* timers shared by the main loop and long-running commands                 */

static void service_timers(void)
{
    if (g_nfrozen > 0 && g_thaw_at > 0 && now_mono() >= g_thaw_at) {
        int n = g_nfrozen;
        if (thaw_all(NULL) > 0)
            g_thaw_at = now_mono() + 1; /* retry in a second */
        else
            logmsg("freeze timeout: thawed %d file system(s)", n);
    }
    balloon_tick();
}

/* Milliseconds until the next timer is due (capped at cap_ms). */
static int next_timer_ms(int cap_ms)
{
    double t = now_mono(), due = t + cap_ms / 1000.0;
    if (g_nfrozen > 0 && g_thaw_at > 0 && g_thaw_at < due)
        due = g_thaw_at;
    if (g_held > 0) {
        double b = g_next_balloon_check;
        if (g_auto_deflate_at > 0 && g_auto_deflate_at < b)
            b = g_auto_deflate_at;
        if (b < due)
            due = b;
    }
    double ms = (due - t) * 1000.0;
    if (ms < 0)
        return 0;
    return (int)ms + 1;
}

/* ------------------------------------------------------------------------ */
/* exec                                                                     */

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

typedef struct {
    sbuf buf;
    size_t cap;
    int truncated;
} capture;

static void capture_read(int *fd, capture *c)
{
    char tmp[65536];
    /* bounded: a fast writer must not keep us from checking the deadline */
    for (int rounds = 0; rounds < 16; rounds++) {
        ssize_t n = read(*fd, tmp, sizeof tmp);
        if (n > 0) {
            size_t room = c->buf.len < c->cap ? c->cap - c->buf.len : 0;
            size_t take = (size_t)n < room ? (size_t)n : room;
            sb_put(&c->buf, tmp, take);
            if (take < (size_t)n)
                c->truncated = 1;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        close(*fd); /* EOF or error */
        *fd = -1;
        return;
    }
}

static int cmd_exec(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"argv", "timeout_s", "stdin", "env", "cwd", "max_output_bytes", NULL};
    const jval *argv_v, *env_v, *stdin_v;
    int have_argv, have_env;
    const char *cwd;
    double timeout_s;
    unsigned long long cap;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "argv", &argv_v, &have_argv, e) < 0 ||
        arg_str_array(args, "env", &env_v, &have_env, e) < 0 || arg_cstr(args, "cwd", &cwd, e) < 0 ||
        arg_seconds(args, "timeout_s", 30, 86400, &timeout_s, e) < 0 ||
        arg_u64(args, "max_output_bytes", EXEC_DEFAULT_CAP, &cap, e) < 0)
        return -1;
    if (!have_argv || argv_v->n == 0)
        return fail(e, "argument 'argv' must be a non-empty array of strings");
    if (cap > EXEC_MAX_CAP)
        cap = EXEC_MAX_CAP;
    stdin_v = jget(args, "stdin");
    if (stdin_v && stdin_v->t == J_NULL)
        stdin_v = NULL;
    if (stdin_v && stdin_v->t != J_STR)
        return fail(e, "argument 'stdin' must be a string");
    if (timeout_s <= 0)
        timeout_s = 30;

    char **argv = calloc(argv_v->n + 1, sizeof *argv);
    if (!argv)
        return fail(e, "out of memory");
    for (size_t k = 0; k < argv_v->n; k++)
        argv[k] = argv_v->items[k]->s;

    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, pst[2] = {-1, -1};
    if (pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0 ||
        pipe2(pst, O_CLOEXEC) < 0) {
        int s = errno;
        int fds[] = {pin[0], pin[1], pout[0], pout[1], perr[0], perr[1], pst[0], pst[1]};
        for (size_t k = 0; k < 8; k++)
            if (fds[k] >= 0)
                close(fds[k]);
        free(argv);
        return fail(e, "pipe: %s", strerror(s));
    }
    double t0 = now_mono();
    pid_t pid = fork();
    if (pid < 0) {
        int s = errno;
        int fds[] = {pin[0], pin[1], pout[0], pout[1], perr[0], perr[1], pst[0], pst[1]};
        for (size_t k = 0; k < 8; k++)
            close(fds[k]);
        free(argv);
        return fail(e, "fork: %s", strerror(s));
    }
    if (pid == 0) {
        /* child: own process group (so a timeout kills the whole tree) */
        setpgid(0, 0);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGHUP, SIG_DFL);
        if (g_oom_state != 0)
            write_file("/proc/self/oom_score_adj", g_oom_orig);
        dup2(pin[0], 0);
        dup2(pout[1], 1);
        dup2(perr[1], 2);
        int err = 0;
        unsigned char in_chdir = 0;
        if (cwd && chdir(cwd) < 0) {
            err = errno;
            in_chdir = 1;
        }
        if (!err && have_env)
            for (size_t k = 0; k < env_v->n; k++)
                putenv(env_v->items[k]->s);
        if (!err) {
            execvp(argv[0], argv);
            err = errno;
        }
        unsigned char msg[5] = {in_chdir};
        memcpy(msg + 1, &err, 4);
        ssize_t wr = write(pst[1], msg, 5);
        (void)wr;
        _exit(127);
    }
    setpgid(pid, pid); /* also from the parent: no race with an early kill */
    free(argv);
    close(pin[0]);
    close(pout[1]);
    close(perr[1]);
    close(pst[1]);
    int fin = pin[1], fout = pout[0], ferr = perr[0], fst = pst[0];
    set_nonblock(fin);
    set_nonblock(fout);
    set_nonblock(ferr);
    set_nonblock(fst);
    const char *in_data = stdin_v ? stdin_v->s : "";
    size_t in_len = stdin_v ? stdin_v->slen : 0, in_off = 0;
    if (in_len == 0) {
        close(fin);
        fin = -1;
    }

    capture out = {.cap = cap}, err = {.cap = cap};
    int status = 0, reaped = 0, timed_out = 0, exec_errno = 0, exec_in_chdir = 0;
    double deadline = t0 + timeout_s, grace = 0;
    int idle_ms = 1;
    for (;;) {
        service_timers();
        if (!reaped) {
            pid_t r = waitpid(pid, &status, WNOHANG);
            if (r == pid) {
                reaped = 1;
                grace = now_mono() + 1.0; /* let background children's output drain briefly */
            }
        }
        if (reaped && fout < 0 && ferr < 0 && fst < 0)
            break;
        double t = now_mono();
        if (reaped && t >= grace)
            break; /* a background grandchild holds the pipes: stop waiting for it */
        if (!reaped && (t >= deadline || g_term)) {
            timed_out = !g_term || t >= deadline;
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            /* Not a blocking waitpid: a child stuck writing to a file system we
             * froze dies only once the auto-thaw (a timer of ours) has run. */
            for (int k = 0; k < 1000 && waitpid(pid, &status, WNOHANG) == 0; k++) {
                service_timers();
                sleep_ms(10);
            }
            if (fout >= 0)
                capture_read(&fout, &out);
            if (ferr >= 0)
                capture_read(&ferr, &err);
            break;
        }
        struct pollfd pf[4];
        int np = 0, iout = -1, ierr = -1, iin = -1, ist = -1;
        if (fout >= 0) {
            pf[np] = (struct pollfd){fout, POLLIN, 0};
            iout = np++;
        }
        if (ferr >= 0) {
            pf[np] = (struct pollfd){ferr, POLLIN, 0};
            ierr = np++;
        }
        if (fin >= 0) {
            pf[np] = (struct pollfd){fin, POLLOUT, 0};
            iin = np++;
        }
        if (fst >= 0) {
            pf[np] = (struct pollfd){fst, POLLIN, 0};
            ist = np++;
        }
        double until = reaped ? grace : deadline;
        int ms = (int)((until - t) * 1000) + 1;
        /* wake at least every 100 ms: child exit, timers, termination */
        if (ms > 100)
            ms = 100;
        int tm = next_timer_ms(100);
        if (tm < ms)
            ms = tm;
        if (np == 0) {
            /* only the exit is left to wait for: back off 1, 2, 4 .. 64 ms */
            if (ms > idle_ms)
                ms = idle_ms;
            if (idle_ms < 64)
                idle_ms *= 2;
        }
        int pr = poll(pf, (nfds_t)np, ms);
        if (pr <= 0)
            continue;
        if (iout >= 0 && pf[iout].revents)
            capture_read(&fout, &out);
        if (ierr >= 0 && pf[ierr].revents)
            capture_read(&ferr, &err);
        if (iin >= 0 && pf[iin].revents) {
            ssize_t n = write(fin, in_data + in_off, in_len - in_off);
            if (n > 0)
                in_off += (size_t)n;
            if ((n < 0 && errno != EAGAIN && errno != EINTR) || in_off >= in_len) {
                close(fin);
                fin = -1;
            }
        }
        if (ist >= 0 && pf[ist].revents) {
            unsigned char msg[5];
            ssize_t n = read(fst, msg, sizeof msg);
            if (n == 5) {
                exec_in_chdir = msg[0];
                memcpy(&exec_errno, msg + 1, 4);
            }
            if (n >= 0 || errno != EAGAIN) {
                close(fst);
                fst = -1;
            }
        }
    }
    if (fin >= 0)
        close(fin);
    if (fout >= 0)
        close(fout);
    if (ferr >= 0)
        close(ferr);
    if (fst >= 0) {
        unsigned char msg[5];
        if (read(fst, msg, sizeof msg) == 5) {
            exec_in_chdir = msg[0];
            memcpy(&exec_errno, msg + 1, 4);
        }
        close(fst);
    }
    int rc = 0;
    if (exec_errno) {
        rc = fail(e, "%s %.200s: %s", exec_in_chdir ? "chdir" : "exec", exec_in_chdir ? cwd : argv_v->items[0]->s,
                  strerror(exec_errno));
    } else {
        jw_key(w, "exit_code");
        if (WIFEXITED(status))
            jw_i64(w, WEXITSTATUS(status));
        else
            jw_null(w);
        jw_key(w, "signal");
        if (WIFSIGNALED(status))
            jw_i64(w, WTERMSIG(status));
        else
            jw_null(w);
        kv_bool(w, "timed_out", timed_out);
        jw_key(w, "stdout");
        jw_str(w, out.buf.p ? out.buf.p : "", out.buf.len);
        jw_key(w, "stderr");
        jw_str(w, err.buf.p ? err.buf.p : "", err.buf.len);
        kv_bool(w, "stdout_truncated", out.truncated);
        kv_bool(w, "stderr_truncated", err.truncated);
        kv_dbl(w, "seconds", now_mono() - t0);
    }
    sb_free(&out.buf);
    sb_free(&err.buf);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* ping / stats                                                             */

static const char *const g_commands[] = {"ping",    "stats",     "balloon.inflate", "balloon.deflate", "balloon.status",
                                         "fs.freeze", "fs.thaw", "fs.status",       "exec",            NULL};

static double system_uptime(void)
{
    char buf[64];
    if (read_file("/proc/uptime", buf, sizeof buf) <= 0)
        return -1;
    return strtod(buf, NULL);
}

static int cmd_ping(const jval *args, jw *w, errbuf *e)
{
    (void)args;
    (void)e;
    struct utsname u;
    kv_str(w, "version", AGENT_VERSION);
    kv_i64(w, "protocol", PROTOCOL_VERSION);
    kv_i64(w, "pid", getpid());
    kv_dbl(w, "uptime", now_mono() - g_start);
    kv_dbl(w, "system_uptime", system_uptime());
    if (uname(&u) == 0) {
        kv_str(w, "kernel", u.release);
        kv_str(w, "hostname", u.nodename);
    }
    jw_key(w, "commands");
    jw_open(w, '[');
    for (const char *const *c = g_commands; *c; c++)
        jw_cstr(w, *c);
    jw_close(w, ']');
    return 0;
}

static int cmd_stats(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {NULL};
    if (check_keys(args, allowed, e) < 0)
        return -1;
    meminfo m;
    if (read_meminfo(&m) < 0)
        return fail(e, "cannot read /proc/meminfo");
    kv_i64(w, "MemTotal", m.total);
    kv_i64(w, "MemFree", m.free);
    kv_i64(w, "MemAvailable", m.avail);
    kv_i64(w, "Cached", m.cached);
    kv_i64(w, "Buffers", m.buffers);
    kv_i64(w, "SwapTotal", m.swap_total);
    kv_i64(w, "SwapFree", m.swap_free);
    kv_u64(w, "balloon_held_bytes", g_held);
    kv_i64(w, "frozen_mounts", g_nfrozen);
    kv_dbl(w, "system_uptime", system_uptime());
    return 0;
}

/* ------------------------------------------------------------------------ */
/* transport                                                                */

enum { KIND_STDIO, KIND_CHR, KIND_SOCK };

static int g_in = -1, g_out = -1; /* current connection; -1 = none */
static int g_kind;
static int g_is_tty;
static int g_stdio;
static const char *g_device;       /* --device */
static const char *g_port = DEFAULT_PORT;
static int g_need_newline;         /* a reply was cut short: terminate it first */
static char g_line[MAX_LINE + 1];
static size_t g_linelen;
static int g_discard;

/* Write a whole buffer; gives up after WRITE_TIMEOUT_MS without progress or
 * when the peer hangs up.  Returns 0 on success. */
static int write_all(int fd, const char *p, size_t len)
{
    size_t off = 0;
    double stall = now_mono() + WRITE_TIMEOUT_MS / 1000.0;
    while (off < len) {
        ssize_t n = write(fd, p + off, len - off);
        if (n > 0) {
            off += (size_t)n;
            stall = now_mono() + WRITE_TIMEOUT_MS / 1000.0;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN)
            break;
        int ms = (int)((stall - now_mono()) * 1000);
        if (ms <= 0)
            break;
        struct pollfd pf = {fd, POLLOUT, 0};
        int r = poll(&pf, 1, ms > 250 ? 250 : ms);
        if (r > 0 && !(pf.revents & POLLOUT) && (pf.revents & (POLLHUP | POLLERR | POLLNVAL)))
            break; /* host went away */
        if (g_term)
            break;
    }
    if (off < len) {
        if (off > 0)
            g_need_newline = 1;
        return -1;
    }
    return 0;
}

static void send_reply(sbuf *b)
{
    if (g_out < 0)
        return;
    if (g_need_newline) {
        if (write_all(g_out, "\n", 1) < 0)
            return;
        g_need_newline = 0;
    }
    if (write_all(g_out, b->p, b->len) < 0 && g_verbose)
        logmsg("reply of %zu bytes dropped (host not reading)", b->len);
}

static void jw_id(jw *w, const jval *id)
{
    jw_key(w, "id");
    if (!id || id->t == J_NULL)
        jw_null(w);
    else if (id->t == J_STR)
        jw_str(w, id->s, id->slen);
    else if (id->is_int)
        jw_i64(w, id->i);
    else {
        jw_sep(w);
        sb_printf(w->b, "%.17g", id->num);
    }
}

static void send_error(const jval *id, const char *msg)
{
    sbuf b = {0};
    jw w = {.b = &b};
    jw_open(&w, '{');
    jw_id(&w, id);
    kv_bool(&w, "ok", 0);
    kv_str(&w, "error", msg);
    jw_close(&w, '}');
    sb_putc(&b, '\n');
    if (b.failed) {
        sbuf s = {0};
        sb_puts(&s, "{\"id\":null,\"ok\":false,\"error\":\"out of memory\"}\n");
        send_reply(&s);
        sb_free(&s);
    } else
        send_reply(&b);
    sb_free(&b);
}

typedef int (*handler)(const jval *args, jw *w, errbuf *e);
static const struct {
    const char *name;
    handler fn;
} g_handlers[] = {
    {"ping", cmd_ping},
    {"stats", cmd_stats},
    {"balloon.inflate", cmd_balloon_inflate},
    {"balloon.deflate", cmd_balloon_deflate},
    {"balloon.status", cmd_balloon_status},
    {"fs.freeze", cmd_fs_freeze},
    {"fs.thaw", cmd_fs_thaw},
    {"fs.status", cmd_fs_status},
    {"exec", cmd_exec},
};

#ifdef CAPSULE_AGENT_FUZZ
/* Fuzz builds only (guest-balloon/fuzz/): the request parser runs as in the agent, but only the
 * handlers that change nothing run; for the others every argument is put through the argument
 * readers and echoed, which covers what they parse without freezing, ballooning or executing. */
static int fuzz_dispatch(handler fn, const jval *args, jw *w, errbuf *e)
{
    if (fn == cmd_ping || fn == cmd_balloon_status || fn == cmd_fs_status)
        return fn(args, w, e);
    static const char *const allowed[] = {"argv", "stdin", "timeout_s", "target_mib", "policy", NULL};
    errbuf unknown = {""};
    (void)check_keys(args, allowed, &unknown); /* its message is not the point here */
    (void)e;
    for (size_t k = 0; args && k < args->n; k++) {
        const char *key = args->keys[k], *s;
        unsigned long long u;
        double d;
        const jval *arr;
        int present;
        errbuf scratch = {""};
        if (arg_u64(args, key, 0, &u, &scratch) == 0)
            kv_u64(w, key, u);
        if (arg_seconds(args, key, 0, 3600, &d, &scratch) == 0)
            kv_dbl(w, key, d);
        if (arg_cstr(args, key, &s, &scratch) == 0 && s)
            kv_str(w, key, s);
        if (arg_str_array(args, key, &arr, &present, &scratch) == 0 && present) {
            jw_key(w, key);
            jw_open(w, '[');
            for (size_t i = 0; i < arr->n; i++)
                jw_str(w, arr->items[i]->s, arr->items[i]->slen);
            jw_close(w, ']');
        }
    }
    return 0;
}
#endif

static void handle_line(const char *line, size_t len)
{
    while (len > 0 && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t'))
        len--;
    size_t k = 0;
    while (k < len && (line[k] == ' ' || line[k] == '\t'))
        k++;
    if (k == len)
        return; /* blank line: ignored (hosts send one to resynchronise) */
    const char *perr = NULL;
    jval *req = json_parse(line, len, &perr);
    if (!req) {
        char msg[128];
        snprintf(msg, sizeof msg, "malformed JSON: %s", perr ? perr : "?");
        send_error(NULL, msg);
        return;
    }
    if (req->t != J_OBJ) {
        send_error(NULL, "request must be a JSON object");
        jfree(req);
        return;
    }
    const jval *id = jget(req, "id");
    if (id && id->t != J_NUM && id->t != J_STR && id->t != J_NULL) {
        send_error(NULL, "'id' must be a number, a string or null");
        jfree(req);
        return;
    }
    const jval *cmd = jget(req, "cmd");
    if (!cmd || cmd->t != J_STR) {
        send_error(id, "request needs a string 'cmd'");
        jfree(req);
        return;
    }
    const jval *args = jget(req, "args");
    if (args && args->t == J_NULL)
        args = NULL;
    if (args && args->t != J_OBJ) {
        send_error(id, "'args' must be an object");
        jfree(req);
        return;
    }
    handler fn = NULL;
    for (size_t h = 0; h < sizeof g_handlers / sizeof g_handlers[0]; h++)
        if (strlen(g_handlers[h].name) == cmd->slen && memcmp(g_handlers[h].name, cmd->s, cmd->slen) == 0)
            fn = g_handlers[h].fn;
    if (!fn) {
        char msg[200];
        snprintf(msg, sizeof msg, "unknown command '%.100s'", cmd->s);
        send_error(id, msg);
        jfree(req);
        return;
    }
    if (g_verbose)
        logmsg("request: %s", cmd->s);
    sbuf b = {0};
    jw w = {.b = &b};
    errbuf e = {""};
    jw_open(&w, '{');
    jw_id(&w, id);
    kv_bool(&w, "ok", 1);
    jw_key(&w, "result");
    jw_open(&w, '{');
#ifdef CAPSULE_AGENT_FUZZ
    int rc = fuzz_dispatch(fn, args, &w, &e);
#else
    int rc = fn(args, &w, &e);
#endif
    jw_close(&w, '}');
    jw_close(&w, '}');
    sb_putc(&b, '\n');
    if (rc < 0)
        send_error(id, e.msg[0] ? e.msg : "failed");
    else if (b.failed)
        send_error(id, "out of memory building the reply");
    else
        send_reply(&b);
    sb_free(&b);
    jfree(req);
}

static void feed(const char *data, size_t n)
{
    while (n > 0) {
        const char *nl = memchr(data, '\n', n);
        size_t take = nl ? (size_t)(nl - data) : n;
        if (!g_discard) {
            if (g_linelen + take > MAX_LINE) {
                g_discard = 1;
                g_linelen = 0;
                send_error(NULL, "request line too long (max 65536 bytes)");
            } else {
                memcpy(g_line + g_linelen, data, take);
                g_linelen += take;
            }
        }
        if (!nl)
            break;
        data += take + 1;
        n -= take + 1;
        if (g_discard)
            g_discard = 0;
        else {
            size_t l = g_linelen;
            g_linelen = 0;
            handle_line(g_line, l);
        }
    }
}

static void reset_line(void)
{
    g_linelen = 0;
    g_discard = 0;
}

/* Find the virtio-serial port called `name`: the udev link, or the
 * /sys/class/virtio-ports scan (busybox guests have no udev). */
static int resolve_port(const char *name, char *out, size_t outlen)
{
    snprintf(out, outlen, "/dev/virtio-ports/%s", name);
    if (access(out, F_OK) == 0)
        return 0;
    DIR *d = opendir("/sys/class/virtio-ports");
    if (!d)
        return -1;
    struct dirent *de;
    int found = -1;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char p[512], buf[256];
        snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
        int n = read_file(p, buf, sizeof buf);
        if (n <= 0)
            continue;
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
            buf[--n] = 0;
        if (strcmp(buf, name) != 0)
            continue;
        snprintf(out, outlen, "/dev/%s", de->d_name);
        if (access(out, F_OK) != 0) {
            /* no devtmpfs/mdev node: make one from the sysfs major:minor */
            snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/dev", de->d_name);
            unsigned maj, min;
            if (read_file(p, buf, sizeof buf) > 0 && sscanf(buf, "%u:%u", &maj, &min) == 2)
                mknod(out, S_IFCHR | 0600, makedev(maj, min));
        }
        found = 0;
        break;
    }
    closedir(d);
    return found;
}

static char g_last_open_err[600];
static int g_reopened_quietly; /* periodic reopen of a silent port: do not log it */

static void open_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void open_err(const char *fmt, ...)
{
    char buf[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (strcmp(buf, g_last_open_err) != 0) {
        logmsg("%s (retrying)", buf);
        snprintf(g_last_open_err, sizeof g_last_open_err, "%s", buf);
    }
}

static int open_transport(void)
{
    char path[600];
    if (g_device)
        snprintf(path, sizeof path, "%s", g_device);
    else if (resolve_port(g_port, path, sizeof path) < 0) {
        open_err("virtio-serial port %s not found (is the virtio_console module loaded?)", g_port);
        return -1;
    }
    struct stat st;
    if (stat(path, &st) < 0) {
        open_err("%s: %s", path, strerror(errno));
        return -1;
    }
    int fd;
    if (S_ISSOCK(st.st_mode)) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (strlen(path) >= sizeof sa.sun_path) {
            open_err("%s: socket path too long", path);
            return -1;
        }
        strcpy(sa.sun_path, path);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
            open_err("connect %s: %s", path, strerror(errno));
            if (fd >= 0)
                close(fd);
            return -1;
        }
        set_nonblock(fd);
        g_kind = KIND_SOCK;
    } else {
        fd = open(path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) {
            open_err("open %s: %s", path, strerror(errno));
            return -1;
        }
        struct termios t;
        if (tcgetattr(fd, &t) == 0) { /* a tty (pty in tests, serial line): raw bytes, no echo */
            cfmakeraw(&t);
            tcsetattr(fd, TCSANOW, &t);
            g_is_tty = 1;
        } else
            g_is_tty = 0;
        g_kind = KIND_CHR;
    }
    g_last_open_err[0] = 0;
    if (g_verbose || !g_reopened_quietly)
        logmsg("opened %s", path);
    g_reopened_quietly = 0;
    g_in = g_out = fd;
    return 0;
}

static void close_transport(void)
{
    if (g_in >= 0 && !g_stdio)
        close(g_in);
    g_in = g_out = -1;
    reset_line();
    g_need_newline = 0;
}

static void on_signal(int sig)
{
    (void)sig;
    g_term = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: capsule-agent [--device PATH | --stdio] [--port NAME] [--verbose]\n"
            "\n"
            "Capsule guest agent: answers JSON-lines requests (see PROTOCOL.md).\n"
            "\n"
            "  --device PATH  talk over PATH: a character device (virtio-serial port,\n"
            "                 serial line, pty), a FIFO or a unix stream socket\n"
            "  --port NAME    virtio-serial port name to look for (default %s):\n"
            "                 /dev/virtio-ports/NAME or /sys/class/virtio-ports/*/name\n"
            "  --stdio        read requests on stdin, reply on stdout; exit at EOF\n"
            "  --verbose      log every request on stderr\n"
            "  --version      print the version and exit\n"
            "  --help         this text\n",
            DEFAULT_PORT);
}

#ifndef CAPSULE_AGENT_FUZZ /* a fuzz harness includes this file and has its own entry point */
int main(int argc, char **argv)
{
    for (int k = 1; k < argc; k++) {
        const char *a = argv[k];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version") || !strcmp(a, "-V")) {
            printf("capsule-agent %s (protocol %d)\n", AGENT_VERSION, PROTOCOL_VERSION);
            return 0;
        } else if (!strcmp(a, "--stdio"))
            g_stdio = 1;
        else if (!strcmp(a, "--verbose") || !strcmp(a, "-v"))
            g_verbose = 1;
        else if ((!strcmp(a, "--device") || !strcmp(a, "--port")) && k + 1 < argc) {
            if (!strcmp(a, "--device"))
                g_device = argv[++k];
            else
                g_port = argv[++k];
        } else if (!strncmp(a, "--device=", 9))
            g_device = a + 9;
        else if (!strncmp(a, "--port=", 7))
            g_port = a + 7;
        else {
            fprintf(stderr, "capsule-agent: bad argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (g_stdio && g_device) {
        fprintf(stderr, "capsule-agent: --stdio and --device are exclusive\n");
        return 2;
    }
    g_start = now_mono();
    if (read_file("/proc/self/oom_score_adj", g_oom_orig, sizeof g_oom_orig) <= 0)
        strcpy(g_oom_orig, "0\n");
    if (!getenv("PATH"))
        setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal; /* no SA_RESTART: poll() returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (g_stdio)
        sigaction(SIGHUP, &sa, NULL);
    else
        signal(SIGHUP, SIG_IGN); /* a daemon: a console hangup must not stop it */

    static char rbuf[65536];
    long backoff = HUP_SLEEP_MS;
    int host_gone = 0;
    if (g_stdio) {
        g_kind = KIND_STDIO;
        g_in = 0;
        g_out = 1;
    }
    while (!g_term) {
        service_timers();
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ; /* children abandoned by a timed-out exec */
        if (g_in < 0) {
            if (open_transport() < 0) {
                int t = next_timer_ms((int)backoff);
                sleep_ms(t < backoff ? t : backoff);
                backoff = backoff * 2 > REOPEN_MAX_MS ? REOPEN_MAX_MS : backoff * 2;
                continue;
            }
        }
        struct pollfd pf = {g_in, POLLIN, 0};
        int r = poll(&pf, 1, next_timer_ms(60000));
        if (r < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            sleep_ms(HUP_SLEEP_MS);
            continue;
        }
        if (r <= 0)
            continue;
        if (pf.revents & POLLNVAL) {
            g_in = g_out = -1;
            reset_line();
            if (g_stdio)
                break;
            continue;
        }
        ssize_t n = read(g_in, rbuf, sizeof rbuf);
        if (n > 0) {
            if (host_gone)
                logmsg("host connected");
            host_gone = 0;
            backoff = HUP_SLEEP_MS;
            feed(rbuf, (size_t)n);
            continue;
        }
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        /* EOF or error */
        if (g_stdio) {
            if (n < 0)
                logmsg("stdin: %s", strerror(errno));
            break;
        }
        reset_line(); /* a half-received request belongs to the old host session */
        g_need_newline = 0;
        if (n == 0 && g_kind == KIND_CHR && !g_is_tty) {
            /* virtio-serial: EOF (and POLLHUP) while no host has the port open.
             * Keep the port, look again shortly; data arriving ends this. */
            if (!host_gone)
                logmsg("host not connected; waiting");
            host_gone++;
            int t = next_timer_ms(HUP_SLEEP_MS);
            sleep_ms(t < HUP_SLEEP_MS ? t : HUP_SLEEP_MS);
            /* Every ~10 s of silence, reopen: if the port was hot-unplugged
             * and plugged again, the old descriptor would never wake up.
             * A host may have connected and written during the sleep, and a
             * close discards what the port holds unread (virtio_console drops
             * it at release): the host's request would be lost and it would
             * wait for a reply that never comes. So read once more first;
             * only a port that is still silent is reopened. */
            if (host_gone % EOF_REOPEN_ROUNDS == 0) {
                ssize_t m = read(g_in, rbuf, sizeof rbuf);
                if (m > 0) {
                    logmsg("host connected");
                    host_gone = 0;
                    feed(rbuf, (size_t)m);
                    continue;
                }
                close_transport();
                g_reopened_quietly = 1;
                host_gone = 1;
            }
            continue;
        }
        /* socket closed, tty hung up, device error: reopen with back-off */
        logmsg("connection lost (%s); reopening", n == 0 ? "EOF" : strerror(errno));
        close_transport();
        sleep_ms(backoff);
        backoff = backoff * 2 > REOPEN_MAX_MS ? REOPEN_MAX_MS : backoff * 2;
    }
    /* leaving (stdin EOF or SIGTERM): never leave the guest frozen or squeezed */
    if (g_nfrozen)
        thaw_all(NULL);
    balloon_release(ULLONG_MAX);
    if (g_term)
        logmsg("terminated");
    return 0;
}
#endif /* CAPSULE_AGENT_FUZZ */
