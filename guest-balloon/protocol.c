/* capsule-agent: the protocol (PROTOCOL.md) — request lines in, with the line limit; each line's
 * JSON request checked and dispatched; one JSON reply line out for each. */
#include "agent.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int g_need_newline; /* a reply was cut short: terminate it first */
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
    for (size_t h = 0; h < g_nhandlers; h++)
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

void feed(const char *data, size_t n)
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

void reset_line(void)
{
    g_linelen = 0;
    g_discard = 0;
}
