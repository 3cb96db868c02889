/* capsule-agent: the JSON parser, strict RFC 8259 with a nesting limit (see json.h). */
#include "agent.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

void jfree(jval *v)
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

jval *json_parse(const char *s, size_t len, const char **err)
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

jval *jget(const jval *obj, const char *key)
{
    if (!obj || obj->t != J_OBJ)
        return NULL;
    size_t kl = strlen(key);
    for (size_t k = 0; k < obj->n; k++)
        if (obj->keylens[k] == kl && memcmp(obj->keys[k], key, kl) == 0)
            return obj->items[k];
    return NULL;
}
