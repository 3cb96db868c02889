/* libFuzzer harness for the guest agent's request path (its sources built with -DCAPSULE_AGENT_FUZZ):
 * the input is what the host writes on the channel — any bytes, any number of lines. It goes through
 * feed() (line splitting, the line limit), handle_line() (the JSON parser, the request checks,
 * dispatch: only the handlers that change nothing run, see fuzz_dispatch) and the JSON writer.
 *
 * Beyond the sanitizers (address, undefined), one property is checked: every reply the agent writes
 * is one line of valid JSON, an object with "id" and "ok" — the agent's own parser reads it back.
 *
 * Build and run: make -C guest-balloon fuzz (a bounded run; see the Makefile). */

#include "../agent.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/mman.h>

static int g_fuzz_fd = -1;

static void check_replies(void)
{
    off_t n = lseek(g_fuzz_fd, 0, SEEK_CUR);
    if (n <= 0)
        return;
    char *out = malloc((size_t)n);
    if (!out || pread(g_fuzz_fd, out, (size_t)n, 0) != n)
        abort();
    if (out[n - 1] != '\n') {
        fprintf(stderr, "reply output does not end with a newline\n");
        abort();
    }
    const char *p = out, *end = out + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *err = NULL;
        jval *v = json_parse(p, (size_t)(nl - p), &err);
        if (!v || v->t != J_OBJ || !jget(v, "id") || !jget(v, "ok")) {
            fprintf(stderr, "invalid reply line (%s): %.*s\n", err ? err : "not an object with id and ok",
                    (int)(nl - p > 300 ? 300 : nl - p), p);
            abort();
        }
        jfree(v);
        p = nl + 1;
    }
    free(out);
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size)
{
    if (g_fuzz_fd < 0) {
        g_fuzz_fd = memfd_create("replies", 0);
        if (g_fuzz_fd < 0)
            abort();
        g_start = now_mono();
    }
    if (ftruncate(g_fuzz_fd, 0) < 0 || lseek(g_fuzz_fd, 0, SEEK_SET) < 0)
        abort();
    g_out = g_fuzz_fd;
    g_need_newline = 0;
    reset_line();
    feed((const char *)data, size);
    feed("\n", 1); /* the last line, unterminated in the input */
    check_replies();
    return 0;
}
