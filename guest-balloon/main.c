/*
 * capsule-agent: the Capsule guest agent.
 *
 * A small static program that runs inside a Linux guest and answers JSON-lines
 * requests from the host over a virtio-serial port (org.capsule.agent.0):
 * liveness (ping), memory statistics, the §4.1 "balloon" (allocate and zero
 * pages so the guest's free memory becomes zero pages / holes in the saved
 * memory image), file-system freeze/thaw and command execution.
 *
 * No libraries besides libc; no NSS (getpwnam & co.), so a static glibc build
 * runs in a bare busybox initramfs.  See PROTOCOL.md for the wire protocol.
 */
#include "agent.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const command g_handlers[] = {
    {"ping", cmd_ping},
    {"stats", cmd_stats},
    {"balloon.inflate", cmd_balloon_inflate},
    {"balloon.deflate", cmd_balloon_deflate},
    {"balloon.status", cmd_balloon_status},
    {"fs.freeze", cmd_fs_freeze},
    {"fs.thaw", cmd_fs_thaw},
    {"fs.status", cmd_fs_status},
    {"exec", cmd_exec},
};
const size_t g_nhandlers = sizeof g_handlers / sizeof g_handlers[0];

static void on_signal(int sig)
{
    (void)sig;
    g_term = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: capsule-agent [--device PATH | --stdio] [--port NAME] [--verbose]\n"
            "\n"
            "Capsule guest agent: answers JSON-lines requests (see PROTOCOL.md).\n"
            "\n"
            "  --device PATH  talk over PATH: a character device (virtio-serial port,\n"
            "                 serial line, pty), a FIFO or a unix stream socket\n"
            "  --port NAME    virtio-serial port name to look for (default %s):\n"
            "                 /dev/virtio-ports/NAME or /sys/class/virtio-ports/*/name\n"
            "  --stdio        read requests on stdin, reply on stdout; exit at EOF\n"
            "  --verbose      log every request on stderr\n"
            "  --version      print the version and exit\n"
            "  --help         this text\n",
            DEFAULT_PORT);
}

#ifndef CAPSULE_AGENT_FUZZ /* a fuzz build links libFuzzer's entry point instead */
/* The command line into g_stdio, g_verbose, g_device and g_port.  Returns -1 to go on, or the exit
 * status: 0 after --help or --version, 2 after a bad argument (with the usage on stderr). */
static int parse_options(int argc, char **argv)
{
    for (int k = 1; k < argc; k++) {
        const char *a = argv[k];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version") || !strcmp(a, "-V")) {
            printf("capsule-agent %s (protocol %d)\n", AGENT_VERSION, PROTOCOL_VERSION);
            return 0;
        } else if (!strcmp(a, "--stdio"))
            g_stdio = 1;
        else if (!strcmp(a, "--verbose") || !strcmp(a, "-v"))
            g_verbose = 1;
        else if ((!strcmp(a, "--device") || !strcmp(a, "--port")) && k + 1 < argc) {
            if (!strcmp(a, "--device"))
                g_device = argv[++k];
            else
                g_port = argv[++k];
        } else if (!strncmp(a, "--device=", 9))
            g_device = a + 9;
        else if (!strncmp(a, "--port=", 7))
            g_port = a + 7;
        else {
            fprintf(stderr, "capsule-agent: bad argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (g_stdio && g_device) {
        fprintf(stderr, "capsule-agent: --stdio and --device are exclusive\n");
        return 2;
    }
    return -1;
}

/* Before serving: the start time, the OOM score to give back, a PATH for exec, the signals. */
static void start_up(void)
{
    g_start = now_mono();
    if (read_file("/proc/self/oom_score_adj", g_oom_orig, sizeof g_oom_orig) <= 0)
        strcpy(g_oom_orig, "0\n");
    if (!getenv("PATH"))
        setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal; /* no SA_RESTART: poll() returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (g_stdio)
        sigaction(SIGHUP, &sa, NULL);
    else
        signal(SIGHUP, SIG_IGN); /* a daemon: a console hangup must not stop it */
}

/* Answer requests until stdin ends (--stdio) or a signal says stop; reopen a lost channel. */
static void serve(void)
{
    static char rbuf[65536];
    long backoff = HUP_SLEEP_MS;
    int host_gone = 0;
    if (g_stdio) {
        g_kind = KIND_STDIO;
        g_in = 0;
        g_out = 1;
    }
    while (!g_term) {
        service_timers();
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ; /* children abandoned by a timed-out exec */
        if (g_in < 0) {
            if (open_transport() < 0) {
                int t = next_timer_ms((int)backoff);
                sleep_ms(t < backoff ? t : backoff);
                backoff = backoff * 2 > REOPEN_MAX_MS ? REOPEN_MAX_MS : backoff * 2;
                continue;
            }
        }
        struct pollfd pf = {g_in, POLLIN, 0};
        int r = poll(&pf, 1, next_timer_ms(60000));
        if (r < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            sleep_ms(HUP_SLEEP_MS);
            continue;
        }
        if (r <= 0)
            continue;
        if (pf.revents & POLLNVAL) {
            g_in = g_out = -1;
            reset_line();
            if (g_stdio)
                break;
            continue;
        }
        ssize_t n = read(g_in, rbuf, sizeof rbuf);
        if (n > 0) {
            if (host_gone)
                logmsg("host connected");
            host_gone = 0;
            backoff = HUP_SLEEP_MS;
            feed(rbuf, (size_t)n);
            continue;
        }
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        /* EOF or error */
        if (g_stdio) {
            if (n < 0)
                logmsg("stdin: %s", strerror(errno));
            break;
        }
        reset_line(); /* a half-received request belongs to the old host session */
        g_need_newline = 0;
        if (n == 0 && g_kind == KIND_CHR && !g_is_tty) {
            /* virtio-serial: EOF (and POLLHUP) while no host has the port open.
             * Keep the port, look again shortly; data arriving ends this. */
            if (!host_gone)
                logmsg("host not connected; waiting");
            host_gone++;
            int t = next_timer_ms(HUP_SLEEP_MS);
            sleep_ms(t < HUP_SLEEP_MS ? t : HUP_SLEEP_MS);
            /* Every ~10 s of silence, reopen: if the port was hot-unplugged
             * and plugged again, the old descriptor would never wake up.
             * A host may have connected and written during the sleep, and a
             * close discards what the port holds unread (virtio_console drops
             * it at release): the host's request would be lost and it would
             * wait for a reply that never comes. So read once more first;
             * only a port that is still silent is reopened. */
            if (host_gone % EOF_REOPEN_ROUNDS == 0) {
                ssize_t m = read(g_in, rbuf, sizeof rbuf);
                if (m > 0) {
                    logmsg("host connected");
                    host_gone = 0;
                    feed(rbuf, (size_t)m);
                    continue;
                }
                close_transport();
                g_reopened_quietly = 1;
                host_gone = 1;
            }
            continue;
        }
        /* socket closed, tty hung up, device error: reopen with back-off */
        logmsg("connection lost (%s); reopening", n == 0 ? "EOF" : strerror(errno));
        close_transport();
        sleep_ms(backoff);
        backoff = backoff * 2 > REOPEN_MAX_MS ? REOPEN_MAX_MS : backoff * 2;
    }
}

int main(int argc, char **argv)
{
    int rc = parse_options(argc, argv);
    if (rc >= 0)
        return rc;
    start_up();
    serve();
    /* leaving (stdin EOF or SIGTERM): never leave the guest frozen or squeezed */
    if (g_nfrozen)
        thaw_all(NULL);
    balloon_release(ULLONG_MAX);
    if (g_term)
        logmsg("terminated");
    return 0;
}
#endif /* CAPSULE_AGENT_FUZZ */
