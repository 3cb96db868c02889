/* capsule-agent: reading a command's arguments; each helper returns 0, or -1 with the error filled. */
#include "agent.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int fail(errbuf *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

int check_keys(const jval *args, const char *const *allowed, errbuf *e)
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

int arg_u64(const jval *args, const char *key, unsigned long long def, unsigned long long *out, errbuf *e)
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

int arg_seconds(const jval *args, const char *key, double def, double max, double *out, errbuf *e)
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
int arg_cstr(const jval *args, const char *key, const char **out, errbuf *e)
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
int arg_str_array(const jval *args, const char *key, const jval **out, int *present, errbuf *e)
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
