/* capsule-agent: the exec command — run a program, feed its stdin, capture stdout and stderr. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* What to run, as the request's arguments say. */
typedef struct {
    const jval *argv;       /* a non-empty array of strings */
    const jval *env;        /* strings NAME=VALUE put into the environment, or NULL */
    const char *cwd;        /* or NULL: ours */
    double timeout_s;       /* > 0 */
    unsigned long long cap; /* stdout / stderr capture cap, each */
    const char *in_data;    /* stdin ("" when none) */
    size_t in_len;
} exec_req;

/* Read and check exec's arguments; the first that is wrong is the error. */
static int exec_args(const jval *args, exec_req *q, errbuf *e)
{
    static const char *const allowed[] = {"argv", "timeout_s", "stdin", "env", "cwd", "max_output_bytes", NULL};
    int have_argv, have_env;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "argv", &q->argv, &have_argv, e) < 0 ||
        arg_str_array(args, "env", &q->env, &have_env, e) < 0 || arg_cstr(args, "cwd", &q->cwd, e) < 0 ||
        arg_seconds(args, "timeout_s", 30, 86400, &q->timeout_s, e) < 0 ||
        arg_u64(args, "max_output_bytes", EXEC_DEFAULT_CAP, &q->cap, e) < 0)
        return -1;
    if (!have_argv || q->argv->n == 0)
        return fail(e, "argument 'argv' must be a non-empty array of strings");
    if (q->cap > EXEC_MAX_CAP)
        q->cap = EXEC_MAX_CAP;
    const jval *stdin_v = jget(args, "stdin");
    if (stdin_v && stdin_v->t == J_NULL)
        stdin_v = NULL;
    if (stdin_v && stdin_v->t != J_STR)
        return fail(e, "argument 'stdin' must be a string");
    q->in_data = stdin_v ? stdin_v->s : "";
    q->in_len = stdin_v ? stdin_v->slen : 0;
    if (q->timeout_s <= 0)
        q->timeout_s = 30;
    return 0;
}

/* One running (or finished) exec: the child and our ends of its pipes. */
typedef struct {
    pid_t pid;
    int fin, fout, ferr, fst; /* its stdin, stdout, stderr, exec status; -1 = closed */
    const char *in_data;      /* stdin still to write: in_data[in_off .. in_len) */
    size_t in_len, in_off;
    capture out, err;
    int status, reaped, timed_out;
    int exec_errno, exec_in_chdir; /* why the child never ran the program (from the status pipe) */
    double t0, deadline, grace;    /* grace: after the exit, how long its output may still drain */
    int idle_ms;                   /* back-off while only the exit is left to wait for */
} exec_run;

enum { P_IN, P_OUT, P_ERR, P_STATUS, NPIPES };

static void close_pipes(int p[NPIPES][2])
{
    for (int k = 0; k < NPIPES; k++)
        for (int end = 0; end < 2; end++)
            if (p[k][end] >= 0)
                close(p[k][end]);
}

/* In the child: become the program, or report on the status pipe why not (chdir or exec, errno). */
static void run_child(const exec_req *q, char **argv, int p[NPIPES][2]) __attribute__((noreturn));
static void run_child(const exec_req *q, char **argv, int p[NPIPES][2])
{
    /* own process group (so a timeout kills the whole tree) */
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
    dup2(p[P_IN][0], 0);
    dup2(p[P_OUT][1], 1);
    dup2(p[P_ERR][1], 2);
    int err = 0;
    unsigned char in_chdir = 0;
    if (q->cwd && chdir(q->cwd) < 0) {
        err = errno;
        in_chdir = 1;
    }
    if (!err && q->env)
        for (size_t k = 0; k < q->env->n; k++)
            putenv(q->env->items[k]->s);
    if (!err) {
        execvp(argv[0], argv);
        err = errno;
    }
    unsigned char msg[5] = {in_chdir};
    memcpy(msg + 1, &err, 4);
    ssize_t wr = write(p[P_STATUS][1], msg, 5);
    (void)wr;
    _exit(127);
}

/* Make the pipes and fork the child; r then holds our (non-blocking) ends. */
static int start_child(const exec_req *q, exec_run *r, errbuf *e)
{
    char **argv = calloc(q->argv->n + 1, sizeof *argv);
    if (!argv)
        return fail(e, "out of memory");
    for (size_t k = 0; k < q->argv->n; k++)
        argv[k] = q->argv->items[k]->s;

    int p[NPIPES][2] = {{-1, -1}, {-1, -1}, {-1, -1}, {-1, -1}};
    for (int k = 0; k < NPIPES; k++)
        if (pipe2(p[k], O_CLOEXEC) < 0) {
            int s = errno;
            close_pipes(p);
            free(argv);
            return fail(e, "pipe: %s", strerror(s));
        }
    r->t0 = now_mono();
    r->pid = fork();
    if (r->pid < 0) {
        int s = errno;
        close_pipes(p);
        free(argv);
        return fail(e, "fork: %s", strerror(s));
    }
    if (r->pid == 0)
        run_child(q, argv, p);
    setpgid(r->pid, r->pid); /* also from the parent: no race with an early kill */
    free(argv);
    close(p[P_IN][0]);
    close(p[P_OUT][1]);
    close(p[P_ERR][1]);
    close(p[P_STATUS][1]);
    r->fin = p[P_IN][1];
    r->fout = p[P_OUT][0];
    r->ferr = p[P_ERR][0];
    r->fst = p[P_STATUS][0];
    set_nonblock(r->fin);
    set_nonblock(r->fout);
    set_nonblock(r->ferr);
    set_nonblock(r->fst);
    r->in_data = q->in_data;
    r->in_len = q->in_len;
    if (r->in_len == 0) {
        close(r->fin);
        r->fin = -1;
    }
    r->out.cap = r->err.cap = q->cap;
    r->deadline = r->t0 + q->timeout_s;
    r->idle_ms = 1;
    return 0;
}

/* The child's message on the status pipe, if it sent one: it never ran the program. */
static ssize_t read_exec_status(exec_run *r)
{
    unsigned char msg[5];
    ssize_t n = read(r->fst, msg, sizeof msg);
    if (n == 5) {
        r->exec_in_chdir = msg[0];
        memcpy(&r->exec_errno, msg + 1, 4);
    }
    return n;
}

static void write_stdin(exec_run *r)
{
    ssize_t n = write(r->fin, r->in_data + r->in_off, r->in_len - r->in_off);
    if (n > 0)
        r->in_off += (size_t)n;
    if ((n < 0 && errno != EAGAIN && errno != EINTR) || r->in_off >= r->in_len) {
        close(r->fin);
        r->fin = -1;
    }
}

/* Timeout or termination: kill the child's process group and take what output is left. */
static void kill_child(exec_run *r)
{
    kill(-r->pid, SIGKILL);
    kill(r->pid, SIGKILL);
    /* Not a blocking waitpid: a child stuck writing to a file system we
     * froze dies only once the auto-thaw (a timer of ours) has run. */
    for (int k = 0; k < 1000 && waitpid(r->pid, &r->status, WNOHANG) == 0; k++) {
        service_timers();
        sleep_ms(10);
    }
    if (r->fout >= 0)
        capture_read(&r->fout, &r->out);
    if (r->ferr >= 0)
        capture_read(&r->ferr, &r->err);
}

/* How long the next poll may wait: until the deadline (or the end of the grace), at most 100 ms,
 * no later than our next timer. */
static int poll_wait_ms(exec_run *r, double t, int npipes)
{
    double until = r->reaped ? r->grace : r->deadline;
    int ms = (int)((until - t) * 1000) + 1;
    /* wake at least every 100 ms: child exit, timers, termination */
    if (ms > 100)
        ms = 100;
    int tm = next_timer_ms(100);
    if (tm < ms)
        ms = tm;
    if (npipes == 0) {
        /* only the exit is left to wait for: back off 1, 2, 4 .. 64 ms */
        if (ms > r->idle_ms)
            ms = r->idle_ms;
        if (r->idle_ms < 64)
            r->idle_ms *= 2;
    }
    return ms;
}

/* Wait for the open pipes, then read output, write stdin, read the exec status. */
static void poll_pipes(exec_run *r, double t)
{
    struct pollfd pf[4];
    int np = 0, iout = -1, ierr = -1, iin = -1, ist = -1;
    if (r->fout >= 0) {
        pf[np] = (struct pollfd){r->fout, POLLIN, 0};
        iout = np++;
    }
    if (r->ferr >= 0) {
        pf[np] = (struct pollfd){r->ferr, POLLIN, 0};
        ierr = np++;
    }
    if (r->fin >= 0) {
        pf[np] = (struct pollfd){r->fin, POLLOUT, 0};
        iin = np++;
    }
    if (r->fst >= 0) {
        pf[np] = (struct pollfd){r->fst, POLLIN, 0};
        ist = np++;
    }
    int pr = poll(pf, (nfds_t)np, poll_wait_ms(r, t, np));
    if (pr <= 0)
        return;
    if (iout >= 0 && pf[iout].revents)
        capture_read(&r->fout, &r->out);
    if (ierr >= 0 && pf[ierr].revents)
        capture_read(&r->ferr, &r->err);
    if (iin >= 0 && pf[iin].revents)
        write_stdin(r);
    if (ist >= 0 && pf[ist].revents) {
        ssize_t n = read_exec_status(r);
        if (n >= 0 || errno != EAGAIN) {
            close(r->fst);
            r->fst = -1;
        }
    }
}

/* One round of waiting for the child; returns 1 when the exec is over. */
static int wait_round(exec_run *r)
{
    service_timers();
    if (!r->reaped && waitpid(r->pid, &r->status, WNOHANG) == r->pid) {
        r->reaped = 1;
        r->grace = now_mono() + 1.0; /* let background children's output drain briefly */
    }
    if (r->reaped && r->fout < 0 && r->ferr < 0 && r->fst < 0)
        return 1;
    double t = now_mono();
    if (r->reaped && t >= r->grace)
        return 1; /* a background grandchild holds the pipes: stop waiting for it */
    if (!r->reaped && (t >= r->deadline || g_term)) {
        r->timed_out = !g_term || t >= r->deadline;
        kill_child(r);
        return 1;
    }
    poll_pipes(r, t);
    return 0;
}

/* Close our ends; a status message still unread is read first. */
static void close_ends(exec_run *r)
{
    if (r->fin >= 0)
        close(r->fin);
    if (r->fout >= 0)
        close(r->fout);
    if (r->ferr >= 0)
        close(r->ferr);
    if (r->fst >= 0) {
        read_exec_status(r);
        close(r->fst);
    }
}

static void write_result(const exec_run *r, jw *w)
{
    jw_key(w, "exit_code");
    if (WIFEXITED(r->status))
        jw_i64(w, WEXITSTATUS(r->status));
    else
        jw_null(w);
    jw_key(w, "signal");
    if (WIFSIGNALED(r->status))
        jw_i64(w, WTERMSIG(r->status));
    else
        jw_null(w);
    kv_bool(w, "timed_out", r->timed_out);
    jw_key(w, "stdout");
    jw_str(w, r->out.buf.p ? r->out.buf.p : "", r->out.buf.len);
    jw_key(w, "stderr");
    jw_str(w, r->err.buf.p ? r->err.buf.p : "", r->err.buf.len);
    kv_bool(w, "stdout_truncated", r->out.truncated);
    kv_bool(w, "stderr_truncated", r->err.truncated);
    kv_dbl(w, "seconds", now_mono() - r->t0);
}

int cmd_exec(const jval *args, jw *w, errbuf *e)
{
    exec_req q;
    exec_run r = {0};
    if (exec_args(args, &q, e) < 0 || start_child(&q, &r, e) < 0)
        return -1;
    while (!wait_round(&r))
        ;
    close_ends(&r);
    int rc = 0;
    if (r.exec_errno)
        rc = fail(e, "%s %.200s: %s", r.exec_in_chdir ? "chdir" : "exec", r.exec_in_chdir ? q.cwd : q.argv->items[0]->s,
                  strerror(r.exec_errno));
    else
        write_result(&r, w);
    sb_free(&r.out.buf);
    sb_free(&r.err.buf);
    return rc;
}
