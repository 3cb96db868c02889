/* capsule-agent: the default freeze set, read from /proc/mounts and /proc/filesystems. */
#include "agent.h"

#include <stdlib.h>
#include <string.h>

static void unescape_mount(char *s)
{
    char *o = s;
    for (char *p = s; *p;) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] >= '0' && p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 4;
        } else
            *o++ = *p++;
    }
    *o = 0;
}

static int has_option(const char *opts, const char *opt)
{
    size_t l = strlen(opt);
    for (const char *p = opts; p && *p;) {
        const char *c = strchr(p, ',');
        size_t n = c ? (size_t)(c - p) : strlen(p);
        if (n == l && memcmp(p, opt, l) == 0)
            return 1;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

static int is_virtual_fs(const char *type, const char *nodev_list)
{
    static const char *const virt[] = {"proc",     "sysfs",      "devtmpfs",  "devpts",     "tmpfs",   "ramfs",
                                       "rootfs",   "cgroup",     "cgroup2",   "debugfs",    "tracefs", "securityfs",
                                       "pstore",   "bpf",        "mqueue",    "hugetlbfs",  "configfs", "fusectl",
                                       "autofs",   "binfmt_misc", "efivarfs", "nsfs",       "overlay", "squashfs",
                                       "iso9660",  "nfs",        "nfs4",      "cifs",       "9p",      "virtiofs",
                                       "selinuxfs", NULL};
    for (const char *const *v = virt; *v; v++)
        if (strcmp(type, *v) == 0)
            return 1;
    if (strncmp(type, "fuse", 4) == 0)
        return 1;
    /* /proc/filesystems marks file systems without a block device "nodev" */
    size_t l = strlen(type);
    for (const char *p = nodev_list; (p = strstr(p, type)) != NULL; p += l)
        if ((p == nodev_list || p[-1] == '\n') && (p[l] == '\n' || p[l] == 0))
            return 1;
    return 0;
}

/* Default freeze set: writable block-device file systems, in /proc/mounts order. */
int default_mounts(char ***out, int *count)
{
    static char buf[256 * 1024];
    static char fsbuf[8192];
    char nodev[4096] = "";
    size_t nl = 0;
    if (read_file("/proc/filesystems", fsbuf, sizeof fsbuf) > 0) {
        for (char *line = strtok(fsbuf, "\n"); line; line = strtok(NULL, "\n"))
            if (strncmp(line, "nodev", 5) == 0) {
                const char *name = line + 5;
                while (*name == '\t' || *name == ' ')
                    name++;
                size_t l = strlen(name);
                if (nl + l + 2 < sizeof nodev) {
                    memcpy(nodev + nl, name, l);
                    nl += l;
                    nodev[nl++] = '\n';
                    nodev[nl] = 0;
                }
            }
    }
    if (read_file("/proc/mounts", buf, sizeof buf) <= 0)
        return -1;
    char **list = NULL;
    int n = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *fields[4];
        int nf = 0;
        char *s2 = NULL;
        for (char *f = strtok_r(line, " ", &s2); f && nf < 4; f = strtok_r(NULL, " ", &s2))
            fields[nf++] = f;
        if (nf < 4)
            continue;
        char *mnt = fields[1], *type = fields[2], *opts = fields[3];
        unescape_mount(mnt);
        if (has_option(opts, "ro") || is_virtual_fs(type, nodev))
            continue;
        int dup = 0;
        for (int k = 0; k < n; k++)
            if (strcmp(list[k], mnt) == 0)
                dup = 1;
        if (dup)
            continue;
        char **nlist = realloc(list, (size_t)(n + 1) * sizeof *nlist);
        if (!nlist)
            break;
        list = nlist;
        list[n] = strdup(mnt);
        if (list[n])
            n++;
    }
    *out = list;
    *count = n;
    return 0;
}
