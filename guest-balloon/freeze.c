/* capsule-agent: file-system freeze — fs.freeze, fs.thaw, fs.status and thawing everything. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char *path;
    dev_t dev;
} frozen_fs;

static frozen_fs g_frozen[MAX_FROZEN];
int g_nfrozen;    /* g_frozen[0 .. g_nfrozen) are frozen */
static double g_thaw_at; /* 0 = no timer */

static int frozen_index(dev_t dev)
{
    for (int k = 0; k < g_nfrozen; k++)
        if (g_frozen[k].dev == dev)
            return k;
    return -1;
}

static void frozen_remove(int k)
{
    free(g_frozen[k].path);
    memmove(&g_frozen[k], &g_frozen[k + 1], (size_t)(g_nfrozen - k - 1) * sizeof g_frozen[0]);
    g_nfrozen--;
    if (g_nfrozen == 0)
        g_thaw_at = 0;
    oom_update(0);
}

static int fs_ioctl(const char *path, unsigned long req, dev_t *dev)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int s = errno;
        close(fd);
        errno = s;
        return -1;
    }
    *dev = st.st_dev;
    int r = req ? ioctl(fd, req, 0) : 0;
    int s = errno;
    close(fd);
    errno = s;
    return r;
}

/* Thaw everything we froze, newest first.  Returns the number of failures. */
int thaw_all(jw *w)
{
    int failures = 0;
    for (int k = g_nfrozen - 1; k >= 0; k--) {
        dev_t dev;
        int r = fs_ioctl(g_frozen[k].path, FITHAW, &dev);
        if (r < 0 && errno != EINVAL) {
            failures++;
            logmsg("thaw %s: %s", g_frozen[k].path, strerror(errno));
            continue;
        }
        if (w)
            jw_cstr(w, g_frozen[k].path);
        frozen_remove(k);
    }
    return failures;
}

static void list_frozen(jw *w, const char *key)
{
    jw_key(w, key);
    jw_open(w, '[');
    for (int k = 0; k < g_nfrozen; k++)
        jw_cstr(w, g_frozen[k].path);
    jw_close(w, ']');
}

int cmd_fs_freeze(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"mounts", "timeout_s", NULL};
    const jval *mounts;
    int explicit_list;
    double timeout_s;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "mounts", &mounts, &explicit_list, e) < 0 ||
        arg_seconds(args, "timeout_s", 30, 86400, &timeout_s, e) < 0)
        return -1;
    char **paths = NULL;
    int n = 0;
    if (explicit_list) {
        n = (int)mounts->n;
        paths = calloc((size_t)n + 1, sizeof *paths);
        if (!paths)
            return fail(e, "out of memory");
        for (int k = 0; k < n; k++)
            paths[k] = strdup(mounts->items[k]->s);
    } else if (default_mounts(&paths, &n) < 0)
        return fail(e, "cannot read /proc/mounts");

    int rc = 0;
    int first_new = g_nfrozen;
    sbuf skipped = {0};
    jw sw = {.b = &skipped};
    jw_open(&sw, '[');
    /* Freeze in reverse mount order: file systems mounted on top first. */
    for (int k = n - 1; k >= 0; k--) {
        if (!paths[k]) {
            rc = fail(e, "out of memory");
            break;
        }
        dev_t dev;
        if (fs_ioctl(paths[k], 0, &dev) < 0) {
            if (!explicit_list) {
                jw_open(&sw, '{');
                kv_str(&sw, "mount", paths[k]);
                kv_str(&sw, "error", strerror(errno));
                jw_close(&sw, '}');
                continue;
            }
            rc = fail(e, "%.200s: %s", paths[k], strerror(errno));
            break;
        }
        if (frozen_index(dev) >= 0)
            continue; /* already frozen by us (or the same fs twice) */
        if (g_nfrozen >= MAX_FROZEN) {
            rc = fail(e, "too many file systems");
            break;
        }
        if (fs_ioctl(paths[k], FIFREEZE, &dev) < 0) {
            int err = errno;
            if (!explicit_list && (err == EOPNOTSUPP || err == ENOTTY || err == EBUSY || err == EINVAL)) {
                jw_open(&sw, '{');
                kv_str(&sw, "mount", paths[k]);
                kv_str(&sw, "error", strerror(err));
                jw_close(&sw, '}');
                continue;
            }
            rc = fail(e, "freeze %.200s: %s", paths[k], strerror(err));
            break;
        }
        g_frozen[g_nfrozen].path = paths[k];
        g_frozen[g_nfrozen].dev = dev;
        paths[k] = NULL;
        g_nfrozen++;
    }
    jw_close(&sw, ']');
    for (int k = 0; k < n; k++)
        free(paths[k]);
    free(paths);
    if (rc < 0) {
        /* all or nothing: thaw what this request froze */
        for (int k = g_nfrozen - 1; k >= first_new; k--) {
            dev_t dev;
            fs_ioctl(g_frozen[k].path, FITHAW, &dev);
            frozen_remove(k);
        }
        sb_free(&skipped);
        return -1;
    }
    if (g_nfrozen > 0)
        g_thaw_at = now_mono() + timeout_s;
    oom_update(0);
    list_frozen(w, "frozen");
    jw_key(w, "skipped");
    jw_raw(w, skipped.p, skipped.len);
    sb_free(&skipped);
    kv_dbl(w, "timeout_s", timeout_s);
    return 0;
}

int cmd_fs_thaw(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {"mounts", NULL};
    const jval *mounts;
    int explicit_list;
    if (check_keys(args, allowed, e) < 0 || arg_str_array(args, "mounts", &mounts, &explicit_list, e) < 0)
        return -1;
    int failures = 0;
    char firsterr[256] = "";
    if (!explicit_list) {
        jw_key(w, "thawed");
        jw_open(w, '[');
        failures = thaw_all(w);
        /* Also sweep the default set: recovers file systems left frozen by an
         * earlier agent that was killed.  FITHAW on a thawed fs is a no-op
         * (EINVAL), so this is harmless. */
        char **paths = NULL;
        int n = 0;
        if (default_mounts(&paths, &n) == 0) {
            for (int k = 0; k < n; k++) {
                dev_t dev;
                if (paths[k] && fs_ioctl(paths[k], FITHAW, &dev) == 0) {
                    jw_cstr(w, paths[k]);
                    int i = frozen_index(dev);
                    if (i >= 0) {
                        frozen_remove(i);
                        failures--;
                    }
                }
                free(paths[k]);
            }
            free(paths);
        }
        jw_close(w, ']');
        if (failures)
            snprintf(firsterr, sizeof firsterr, "%d file system(s) failed to thaw", failures);
    } else {
        jw_key(w, "thawed");
        jw_open(w, '[');
        sbuf nf = {0};
        jw nw = {.b = &nf};
        jw_open(&nw, '[');
        for (size_t k = 0; k < mounts->n; k++) {
            const char *p = mounts->items[k]->s;
            dev_t dev = 0;
            int r = fs_ioctl(p, FITHAW, &dev);
            if (r < 0 && errno == EINVAL) {
                jw_cstr(&nw, p); /* was not frozen */
            } else if (r < 0) {
                failures++;
                if (!firsterr[0])
                    snprintf(firsterr, sizeof firsterr, "thaw %.200s: %s", p, strerror(errno));
                continue;
            } else
                jw_cstr(w, p);
            int i = frozen_index(dev);
            if (i >= 0)
                frozen_remove(i);
        }
        jw_close(&nw, ']');
        jw_close(w, ']');
        jw_key(w, "not_frozen");
        jw_raw(w, nf.p, nf.len);
        sb_free(&nf);
    }
    if (failures)
        return fail(e, "%s", firsterr);
    list_frozen(w, "still_frozen");
    return 0;
}

/* Called from the main loop (and during exec): once a freeze has lasted its timeout, thaw. */
void freeze_tick(void)
{
    if (g_nfrozen > 0 && g_thaw_at > 0 && now_mono() >= g_thaw_at) {
        int n = g_nfrozen;
        if (thaw_all(NULL) > 0)
            g_thaw_at = now_mono() + 1; /* retry in a second */
        else
            logmsg("freeze timeout: thawed %d file system(s)", n);
    }
}

/* When freeze_tick has work next (monotonic seconds), or 0: nothing while nothing is frozen. */
double freeze_due(void)
{
    return g_nfrozen > 0 && g_thaw_at > 0 ? g_thaw_at : 0;
}

int cmd_fs_status(const jval *args, jw *w, errbuf *e)
{
    static const char *const allowed[] = {NULL};
    if (check_keys(args, allowed, e) < 0)
        return -1;
    list_frozen(w, "frozen");
    jw_key(w, "thaw_in_s");
    if (g_thaw_at > 0)
        jw_dbl(w, g_thaw_at - now_mono());
    else
        jw_null(w);
    return 0;
}
