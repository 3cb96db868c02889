/* capsule-agent: the channel to the host — find the virtio-serial port (or --device), open it
 * (character device, tty, FIFO or unix socket) and close it. */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <termios.h>
#include <unistd.h>

int g_in = -1, g_out = -1; /* current connection; -1 = none */
int g_kind;
int g_is_tty;
int g_stdio;
const char *g_device; /* --device */
const char *g_port = DEFAULT_PORT;

/* Find the virtio-serial port called `name`: the udev link, or the
 * /sys/class/virtio-ports scan (busybox guests have no udev). */
static int resolve_port(const char *name, char *out, size_t outlen)
{
    snprintf(out, outlen, "/dev/virtio-ports/%s", name);
    if (access(out, F_OK) == 0)
        return 0;
    DIR *d = opendir("/sys/class/virtio-ports");
    if (!d)
        return -1;
    struct dirent *de;
    int found = -1;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char p[512], buf[256];
        snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
        int n = read_file(p, buf, sizeof buf);
        if (n <= 0)
            continue;
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
            buf[--n] = 0;
        if (strcmp(buf, name) != 0)
            continue;
        snprintf(out, outlen, "/dev/%s", de->d_name);
        if (access(out, F_OK) != 0) {
            /* no devtmpfs/mdev node: make one from the sysfs major:minor */
            snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/dev", de->d_name);
            unsigned maj, min;
            if (read_file(p, buf, sizeof buf) > 0 && sscanf(buf, "%u:%u", &maj, &min) == 2)
                mknod(out, S_IFCHR | 0600, makedev(maj, min));
        }
        found = 0;
        break;
    }
    closedir(d);
    return found;
}

static char g_last_open_err[600];
int g_reopened_quietly; /* periodic reopen of a silent port: do not log it */

static void open_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void open_err(const char *fmt, ...)
{
    char buf[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (strcmp(buf, g_last_open_err) != 0) {
        logmsg("%s (retrying)", buf);
        snprintf(g_last_open_err, sizeof g_last_open_err, "%s", buf);
    }
}

int open_transport(void)
{
    char path[600];
    if (g_device)
        snprintf(path, sizeof path, "%s", g_device);
    else if (resolve_port(g_port, path, sizeof path) < 0) {
        open_err("virtio-serial port %s not found (is the virtio_console module loaded?)", g_port);
        return -1;
    }
    struct stat st;
    if (stat(path, &st) < 0) {
        open_err("%s: %s", path, strerror(errno));
        return -1;
    }
    int fd;
    if (S_ISSOCK(st.st_mode)) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (strlen(path) >= sizeof sa.sun_path) {
            open_err("%s: socket path too long", path);
            return -1;
        }
        strcpy(sa.sun_path, path);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
            open_err("connect %s: %s", path, strerror(errno));
            if (fd >= 0)
                close(fd);
            return -1;
        }
        set_nonblock(fd);
        g_kind = KIND_SOCK;
    } else {
        fd = open(path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) {
            open_err("open %s: %s", path, strerror(errno));
            return -1;
        }
        struct termios t;
        if (tcgetattr(fd, &t) == 0) { /* a tty (pty in tests, serial line): raw bytes, no echo */
            cfmakeraw(&t);
            tcsetattr(fd, TCSANOW, &t);
            g_is_tty = 1;
        } else
            g_is_tty = 0;
        g_kind = KIND_CHR;
    }
    g_last_open_err[0] = 0;
    if (g_verbose || !g_reopened_quietly)
        logmsg("opened %s", path);
    g_reopened_quietly = 0;
    g_in = g_out = fd;
    return 0;
}

void close_transport(void)
{
    if (g_in >= 0 && !g_stdio)
        close(g_in);
    g_in = g_out = -1;
    reset_line();
    g_need_newline = 0;
}
