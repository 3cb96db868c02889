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

int cmd_exec(const jval *args, jw *w, errbuf *e)
{
    exec_req q;
    if (exec_args(args, &q, e) < 0)
        return -1;
    const jval *argv_v = q.argv, *env_v = q.env;
    const char *cwd = q.cwd;

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
        if (!err && env_v)
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
    const char *in_data = q.in_data;
    size_t in_len = q.in_len, in_off = 0;
    if (in_len == 0) {
        close(fin);
        fin = -1;
    }

    capture out = {.cap = q.cap}, err = {.cap = q.cap};
    int status = 0, reaped = 0, timed_out = 0, exec_errno = 0, exec_in_chdir = 0;
    double deadline = t0 + q.timeout_s, grace = 0;
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
