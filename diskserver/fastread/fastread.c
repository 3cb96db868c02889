/* capsule-fastread: an nbdkit filter that serves the disk server's hits without Python.
 *
 *   nbdkit --filter=diskserver/fastread/capsule-fastread.so python diskserver/plugin.py spec=CHAIN.json
 *
 * The Python plugin (diskserver/plugin.py) stays the disk server: it opens the chain, resolves every
 * block to the layer that owns it, fetches misses from the source into shadows, verifies them and
 * persists them. This filter passes it one more parameter, fastmap=SPEC.fastmap, and the plugin writes
 * there the chain's segment map, each layer's file (a local layer's qcow2 file, a remote layer's shadow
 * data and presence bitmap) and a small shared region (diskserver/chain/fastmap.py has the layout).
 *
 * A read whose every block is zero, in a local layer, or already present in its shadow is served here:
 * preads into nbdkit's buffer on nbdkit's own threads, no interpreter, no global lock. Any other read
 * (one block missing, a file error, a map that would not load) goes down to the Python plugin whole,
 * which serves it as it always did. Shadow bits are only ever set, and only after the block's data is
 * durable, so a bit seen set means the data is there.
 *
 * Hits are counted in the shared region and noted in the read-ahead state both sides share, so the
 * plugin's stats and its sequential read-ahead see every request.
 */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#define SHIFT 12
#define BLOCK (1u << SHIFT)
#define MAGIC "CAPSFM01"
#define HEADER_BYTES 256
#define LAYER_BYTES 2048
#define PATH_BYTES 1000
#define SEG_BYTES 24
#define RING 8
#define NO_END UINT64_MAX

enum { KIND_PASS = 0, KIND_LOCAL = 1, KIND_SHADOW = 2 };
enum { C_REQUESTS, C_GUEST_BYTES, C_ZERO, C_LOCAL, C_SHADOW, C_PASSED, C_COUNT };

/* The shared region's layout, as diskserver/chain/fastmap.py writes it (little-endian). */
struct header {
    char magic[8];
    uint64_t size, nblocks, nlayers, nseg, ra_min, ra_max, reserved;
    uint64_t counters[8];
    int64_t ra_window;
    uint64_t ra_pos;
    uint64_t ra_ends[RING];
};

struct layer_rec {
    uint64_t kind, bitmap_header, nblocks;
    char data_path[PATH_BYTES];
    char bitmap_path[PATH_BYTES + 24];
};

struct seg {
    uint64_t start;
    int64_t owner;
    uint64_t host;
};

_Static_assert(sizeof(struct header) <= HEADER_BYTES, "header");
_Static_assert(sizeof(struct layer_rec) == LAYER_BYTES, "layer record");
_Static_assert(sizeof(struct seg) == SEG_BYTES, "segment");

struct layer {
    int kind, fd;
    const uint8_t *bits; /* shadow: the presence bitmap (after its header) */
    size_t bits_len;
    uint64_t nblocks;
};

static char *spec_path;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct header *shared; /* NULL: every read goes to the plugin */
static size_t shared_len;
static const struct seg *segs;
static struct layer *layers;

static int fastread_config(nbdkit_next_config *next, nbdkit_backend *nxdata, const char *key, const char *value)
{
    if (strcmp(key, "spec") == 0) {
        free(spec_path);
        spec_path = strdup(value);
        if (spec_path == NULL) {
            nbdkit_error("capsule-fastread: strdup: %m");
            return -1;
        }
        if (next(nxdata, key, value) == -1)
            return -1;
        char map[4096];
        if ((size_t)snprintf(map, sizeof map, "%s.fastmap", value) >= sizeof map) {
            nbdkit_error("capsule-fastread: spec path too long");
            return -1;
        }
        return next(nxdata, "fastmap", map);
    }
    return next(nxdata, key, value);
}

static void fastread_unload(void)
{
    free(spec_path);
}

/* Load the map the plugin wrote in its after_fork (before nbdkit took any connection). On any doubt
 * it logs why and leaves `shared` NULL: the plugin then serves every read, as without this filter. */
static void load_map(void)
{
    char path[4096];
    if (spec_path == NULL || (size_t)snprintf(path, sizeof path, "%s.fastmap", spec_path) >= sizeof path)
        return;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        nbdkit_error("capsule-fastread: %s: %m; every read goes through the plugin", path);
        return;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (size_t)st.st_size < HEADER_BYTES) {
        nbdkit_error("capsule-fastread: %s is too short; every read goes through the plugin", path);
        close(fd);
        return;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        nbdkit_error("capsule-fastread: mmap %s: %m; every read goes through the plugin", path);
        return;
    }
    struct header *h = p;
    size_t len = (size_t)st.st_size;
    if (memcmp(h->magic, MAGIC, 8) != 0 || h->nlayers > 4096 || h->nseg > (len / SEG_BYTES) ||
        HEADER_BYTES + h->nlayers * LAYER_BYTES + h->nseg * SEG_BYTES != len || h->nseg == 0) {
        nbdkit_error("capsule-fastread: %s is not a map this filter reads; every read goes through the plugin", path);
        munmap(p, len);
        return;
    }
    struct layer *ls = calloc(h->nlayers ? h->nlayers : 1, sizeof *ls);
    if (ls == NULL) {
        munmap(p, len);
        return;
    }
    const uint8_t *base = p;
    for (uint64_t i = 0; i < h->nlayers; i++) {
        const struct layer_rec *r = (const void *)(base + HEADER_BYTES + i * LAYER_BYTES);
        ls[i].fd = -1;
        ls[i].kind = KIND_PASS;
        if (r->kind == KIND_PASS || memchr(r->data_path, 0, sizeof r->data_path) == NULL)
            continue;
        int dfd = open(r->data_path, O_RDONLY | O_CLOEXEC);
        if (dfd < 0) {
            nbdkit_error("capsule-fastread: layer %llu: %s: %m; its reads go through the plugin",
                         (unsigned long long)i, r->data_path);
            continue;
        }
        if (r->kind == KIND_SHADOW) {
            size_t want = r->bitmap_header + (r->nblocks + 7) / 8;
            int bfd = memchr(r->bitmap_path, 0, sizeof r->bitmap_path) ? open(r->bitmap_path, O_RDONLY | O_CLOEXEC) : -1;
            struct stat bst;
            void *bm = MAP_FAILED;
            if (bfd >= 0 && fstat(bfd, &bst) == 0 && (size_t)bst.st_size == want)
                bm = mmap(NULL, want, PROT_READ, MAP_SHARED, bfd, 0);
            if (bfd >= 0)
                close(bfd);
            if (bm == MAP_FAILED) {
                nbdkit_error("capsule-fastread: layer %llu: cannot map the presence bitmap %s; its reads go "
                             "through the plugin", (unsigned long long)i, r->bitmap_path);
                close(dfd);
                continue;
            }
            ls[i].bits = (const uint8_t *)bm + r->bitmap_header;
            ls[i].bits_len = (r->nblocks + 7) / 8;
        } else if (r->kind != KIND_LOCAL) {
            close(dfd);
            continue;
        }
        ls[i].fd = dfd;
        ls[i].kind = (int)r->kind;
        ls[i].nblocks = r->nblocks;
    }
    segs = (const void *)(base + HEADER_BYTES + h->nlayers * LAYER_BYTES);
    layers = ls;
    shared_len = len;
    __atomic_store_n(&shared, h, __ATOMIC_RELEASE);
    nbdkit_debug("capsule-fastread: serving hits from %s (%llu segments, %llu layers)", path,
                 (unsigned long long)h->nseg, (unsigned long long)h->nlayers);
}

/* The segment holding block b: the last one starting at or before it. */
static uint64_t seg_of(const struct header *h, uint64_t b)
{
    uint64_t lo = 0, hi = h->nseg;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (segs[mid].start <= b)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static int present(const struct layer *l, uint64_t b, uint64_t e)
{
    if (e > l->nblocks || (e + 7) / 8 > l->bits_len)
        return 0;
    for (; b < e && (b & 7); b++)
        if (!(__atomic_load_n(&l->bits[b >> 3], __ATOMIC_ACQUIRE) & (1u << (b & 7))))
            return 0;
    for (; b + 8 <= e; b += 8)
        if (__atomic_load_n(&l->bits[b >> 3], __ATOMIC_ACQUIRE) != 0xff)
            return 0;
    for (; b < e; b++)
        if (!(__atomic_load_n(&l->bits[b >> 3], __ATOMIC_ACQUIRE) & (1u << (b & 7))))
            return 0;
    return 1;
}

static int pread_full(int fd, uint8_t *buf, size_t n, uint64_t off)
{
    while (n > 0) {
        ssize_t r = pread(fd, buf, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        buf += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* The plugin's read-ahead heuristic (diskserver/chain/fetch.py, _note_request) on the shared state:
 * a request is sequential when it starts where one of the last RING requests ended. Lock-free on
 * both sides: a race only perturbs the heuristic. */
static void note_request(struct header *h, uint64_t first, uint64_t end)
{
    int seq = 0;
    for (int k = 0; k < RING; k++)
        if (__atomic_load_n(&h->ra_ends[k], __ATOMIC_RELAXED) == first)
            seq = 1;
    int64_t w = 0;
    if (seq && h->ra_max) {
        int64_t prev = __atomic_load_n(&h->ra_window, __ATOMIC_RELAXED) * 2;
        w = prev > (int64_t)h->ra_min ? prev : (int64_t)h->ra_min;
        if (w < 1)
            w = 1;
        if (w > (int64_t)h->ra_max)
            w = (int64_t)h->ra_max;
    }
    __atomic_store_n(&h->ra_window, w, __ATOMIC_RELAXED);
    uint64_t pos = __atomic_fetch_add(&h->ra_pos, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&h->ra_ends[pos % RING], end, __ATOMIC_RELAXED);
}

static void count(struct header *h, int which, uint64_t n)
{
    if (n)
        __atomic_fetch_add(&h->counters[which], n, __ATOMIC_RELAXED);
}

static int fastread_pread(nbdkit_next *next, void *handle, void *buf, uint32_t count_, uint64_t offset,
                          uint32_t flags, int *err)
{
    (void)handle;
    pthread_once(&once, load_map);
    struct header *h = __atomic_load_n(&shared, __ATOMIC_ACQUIRE);
    if (h == NULL || count_ == 0 || offset + count_ > h->size)
        return next->pread(next, buf, count_, offset, flags, err);
    uint64_t stop = offset + count_;
    uint64_t first = offset >> SHIFT, end = (stop + BLOCK - 1) >> SHIFT;
    uint64_t s0 = seg_of(h, first);

    /* First pass: every block must be served here, else the whole read goes to the plugin. */
    for (uint64_t i = s0, b = first; b < end; i++) {
        uint64_t nxt = i + 1 < h->nseg ? segs[i + 1].start : h->nblocks;
        uint64_t e = nxt < end ? nxt : end;
        int64_t o = segs[i].owner;
        if (o >= 0) {
            const struct layer *l = (uint64_t)o < h->nlayers ? &layers[o] : NULL;
            if (l == NULL || l->kind == KIND_PASS || (l->kind == KIND_SHADOW && !present(l, b, e)))
                goto pass;
        }
        b = e;
    }
    uint64_t zero = 0, local = 0, shadow = 0;
    uint8_t *out = buf;
    for (uint64_t i = s0, b = first; b < end; i++) {
        uint64_t nxt = i + 1 < h->nseg ? segs[i + 1].start : h->nblocks;
        uint64_t e = nxt < end ? nxt : end;
        uint64_t lo = b << SHIFT > offset ? b << SHIFT : offset;
        uint64_t hi = e << SHIFT < stop ? e << SHIFT : stop;
        int64_t o = segs[i].owner;
        if (o < 0) {
            memset(out + (lo - offset), 0, hi - lo);
            zero += e - b;
        } else {
            const struct layer *l = &layers[o];
            uint64_t at = l->kind == KIND_LOCAL ? segs[i].host + (lo - (segs[i].start << SHIFT)) : lo;
            if (pread_full(l->fd, out + (lo - offset), hi - lo, at) < 0)
                goto pass; /* the plugin reads it again and reports what is wrong */
            if (l->kind == KIND_LOCAL)
                local += e - b;
            else
                shadow += e - b;
        }
        b = e;
    }
    note_request(h, first, end);
    count(h, C_REQUESTS, 1);
    count(h, C_GUEST_BYTES, count_);
    count(h, C_ZERO, zero);
    count(h, C_LOCAL, local);
    count(h, C_SHADOW, shadow);
    return 0;

pass:
    count(h, C_PASSED, 1);
    return next->pread(next, buf, count_, offset, flags, err);
}

static struct nbdkit_filter filter = {
    .name = "capsule-fastread",
    .longname = "Capsule disk server: hits served without the Python plugin",
    .config = fastread_config,
    .config_help = "(no parameters of its own: it reads spec= and passes fastmap= to the plugin)",
    .unload = fastread_unload,
    .pread = fastread_pread,
};

NBDKIT_REGISTER_FILTER(filter)
