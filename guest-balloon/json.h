/*
 * JSON for the guest agent: a growable string buffer, a parser into jval trees and a writer.
 * Knows nothing of requests or commands (protocol.c does).
 */
#ifndef CAPSULE_AGENT_JSON_H
#define CAPSULE_AGENT_JSON_H

#include <stddef.h>

#define MAX_DEPTH 32 /* JSON nesting limit */

/* growable string buffer; allocation failure sets a flag, never aborts (json_write.c) */

typedef struct {
    char *p;
    size_t len, cap;
    int failed;
} sbuf;

int sb_reserve(sbuf *b, size_t extra);
void sb_put(sbuf *b, const char *s, size_t n);
void sb_puts(sbuf *b, const char *s);
void sb_putc(sbuf *b, char c);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sb_free(sbuf *b);
void put_utf8(sbuf *b, unsigned cp);

/* JSON values and parser (json_parse.c) */

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

void jfree(jval *v);
jval *json_parse(const char *s, size_t len, const char **err);
jval *jget(const jval *obj, const char *key);

/* JSON writer (json_write.c) */

typedef struct {
    sbuf *b;
    int depth;
    unsigned char first[MAX_DEPTH + 2];
    int after_key;
} jw;

void jw_sep(jw *w);
void jw_open(jw *w, char c);
void jw_close(jw *w, char c);
void jw_key(jw *w, const char *k);
void jw_str(jw *w, const char *s, size_t n);
void jw_cstr(jw *w, const char *s);
void jw_i64(jw *w, long long v);
void jw_u64(jw *w, unsigned long long v);
void jw_dbl(jw *w, double v);
void jw_bool(jw *w, int v);
void jw_null(jw *w);
void jw_raw(jw *w, const char *s, size_t n);
void kv_str(jw *w, const char *k, const char *v);
void kv_i64(jw *w, const char *k, long long v);
void kv_u64(jw *w, const char *k, unsigned long long v);
void kv_dbl(jw *w, const char *k, double v);
void kv_bool(jw *w, const char *k, int v);

#endif
