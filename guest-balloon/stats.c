/* capsule-agent: /proc/meminfo and the commands that only report: ping and stats. */
#include "agent.h"

#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

int read_meminfo(meminfo *m)
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

static double system_uptime(void)
{
    char buf[64];
    if (read_file("/proc/uptime", buf, sizeof buf) <= 0)
        return -1;
    return strtod(buf, NULL);
}

int cmd_ping(const jval *args, jw *w, errbuf *e)
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
    for (size_t h = 0; h < g_nhandlers; h++) /* the dispatch table: what this agent answers */
        jw_cstr(w, g_handlers[h].name);
    jw_close(w, ']');
    return 0;
}

int cmd_stats(const jval *args, jw *w, errbuf *e)
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
