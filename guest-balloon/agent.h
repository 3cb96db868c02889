/*
 * capsule-agent: what its files share — the limits, the state that more than one concern reads,
 * and each file's functions that the others call.  Every .c file includes this first.
 */
#ifndef CAPSULE_AGENT_H
#define CAPSULE_AGENT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <signal.h>
#include <stddef.h>
#include <sys/types.h>

#include "json.h"

#define AGENT_VERSION "0.1.0"
#define PROTOCOL_VERSION 1
#define DEFAULT_PORT "org.capsule.agent.0"
#define MAX_LINE (64 * 1024)           /* request line limit, newline excluded */
#define MiB (1024ULL * 1024ULL)
#define HUP_SLEEP_MS 250               /* pause while the host is not connected */
#define REOPEN_MAX_MS 2000             /* cap of the reopen back-off */
#define EOF_REOPEN_ROUNDS 40           /* reopen a silent port every 40 * HUP_SLEEP_MS */
#define WRITE_TIMEOUT_MS 10000         /* give up a reply the host does not read */
#define BALLOON_CHECK_MS 250           /* memory-pressure check while holding */
#define EXEC_DEFAULT_CAP (1024 * 1024) /* stdout / stderr capture cap */
#define EXEC_MAX_CAP (8 * 1024 * 1024)
#define MAX_FROZEN 256

/* small utilities (util.c) */

extern int g_verbose;
extern volatile sig_atomic_t g_term;
extern double g_start;

double now_mono(void);
void sleep_ms(long ms);
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int read_file(const char *path, char *buf, size_t cap);
int write_file(const char *path, const char *text);
void set_nonblock(int fd);

/* argument helpers: each returns 0, or -1 with err filled (args.c) */

typedef struct {
    char msg[512];
} errbuf;

int fail(errbuf *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int check_keys(const jval *args, const char *const *allowed, errbuf *e);
int arg_u64(const jval *args, const char *key, unsigned long long def, unsigned long long *out, errbuf *e);
int arg_seconds(const jval *args, const char *key, double def, double max, double *out, errbuf *e);
int arg_cstr(const jval *args, const char *key, const char **out, errbuf *e);
int arg_str_array(const jval *args, const char *key, const jval **out, int *present, errbuf *e);

/* commands: each writes its result's members into w, or returns -1 with e filled */

typedef int (*handler)(const jval *args, jw *w, errbuf *e);
typedef struct {
    const char *name;
    handler fn;
} command;

extern const command g_handlers[]; /* the dispatch table (main.c) */
extern const size_t g_nhandlers;

int cmd_ping(const jval *args, jw *w, errbuf *e);  /* stats.c */
int cmd_stats(const jval *args, jw *w, errbuf *e); /* stats.c */
int cmd_balloon_inflate(const jval *args, jw *w, errbuf *e);
int cmd_balloon_deflate(const jval *args, jw *w, errbuf *e);
int cmd_balloon_status(const jval *args, jw *w, errbuf *e);
int cmd_fs_freeze(const jval *args, jw *w, errbuf *e);
int cmd_fs_thaw(const jval *args, jw *w, errbuf *e);
int cmd_fs_status(const jval *args, jw *w, errbuf *e);
int cmd_exec(const jval *args, jw *w, errbuf *e);

/* /proc/meminfo (stats.c) */

typedef struct {
    long long total, free, avail, cached, buffers, swap_total, swap_free;
} meminfo;

int read_meminfo(meminfo *m);

/* balloon (balloon.c) */

extern unsigned long long g_held;
extern char g_oom_orig[32];
extern int g_oom_state;

void oom_update(int inflating);
unsigned long long balloon_release(unsigned long long bytes);
void balloon_tick(void);
double balloon_due(void);

/* file-system freeze (freeze.c, mounts.c) */

extern int g_nfrozen;

int thaw_all(jw *w);
void freeze_tick(void);
double freeze_due(void);
int default_mounts(char ***out, int *count);

/* timers shared by the main loop and long-running commands (timers.c) */

void service_timers(void);
int next_timer_ms(int cap_ms);

/* the channel to the host (channel.c) */

enum { KIND_STDIO, KIND_CHR, KIND_SOCK };

extern int g_in, g_out;
extern int g_kind;
extern int g_is_tty;
extern int g_stdio;
extern const char *g_device;
extern const char *g_port;
extern int g_reopened_quietly;

int open_transport(void);
void close_transport(void);

/* request lines in, replies out (protocol.c) */

extern int g_need_newline;

void feed(const char *data, size_t n);
void reset_line(void);

#endif
