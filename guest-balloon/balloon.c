/* capsule-agent: the §4.1 balloon — balloon.inflate, balloon.deflate, balloon.status and the
 * memory-pressure check that gives memory back while it is held. */
#include "agent.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    void *p;
    size_t len;
} chunk;

static chunk *g_chunks;
static size_t g_nchunks, g_chunks_cap;
unsigned long long g_held;
char g_oom_orig[32] = "0\n"; /* read at start-up */
int g_oom_state;             /* 0 = original, 1 = +1000 (victim), -1 = -1000 (protected) */
static char g_last_stop[32] = "";
static unsigned long long g_floor = 32 * MiB;
static unsigned long long g_pressure_released;
static double g_auto_deflate_at;    /* 0 = never */
static double g_next_balloon_check; /* monotonic seconds */

/* While the balloon holds memory, be the OOM killer's first victim: the
 * guest survives and the memory comes back.  But while file systems are
 * frozen, never be killed: nobody else would thaw them. */
void oom_update(int inflating)
{
    int want = g_nfrozen > 0 ? -1 : (g_held > 0 || inflating) ? 1 : 0;
    if (want == g_oom_state)
        return;
    const char *v = want < 0 ? "-1000\n" : want > 0 ? "1000\n" : g_oom_orig;
    if (write_file("/proc/self/oom_score_adj", v) == 0)
        g_oom_state = want;
}

/* Release chunks, newest first, until at least `bytes` are freed. */
unsigned long long balloon_release(unsigned long long bytes)
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

int cmd_balloon_inflate(const jval *args, jw *w, errbuf *e)
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

int cmd_balloon_deflate(const jval *args, jw *w, errbuf *e)
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

int cmd_balloon_status(const jval *args, jw *w, errbuf *e)
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
void balloon_tick(void)
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

/* When balloon_tick has work next (monotonic seconds), or 0: nothing while no memory is held. */
double balloon_due(void)
{
    if (g_held == 0)
        return 0;
    double b = g_next_balloon_check;
    if (g_auto_deflate_at > 0 && g_auto_deflate_at < b)
        b = g_auto_deflate_at;
    return b;
}
