/* The LMDB I/O process in C: _lmdb_server.py's protocol, without Python in the loop.
 *
 * Built on first use by hiermem/tiers/native.py with the system's C compiler against
 * liblmdb (Debian: liblmdb-dev), and run by hiermem.tiers.lmdb_process.LmdbProcess as
 *
 *     lmdb_server PATH MAP_SIZE MODE SYNC PARENT WRITEMAP MAX_DBS
 *
 * with _lmdb_server.py's arguments, requests and replies (see that file's docstring):
 * ops R (read groups of sorted distinct u64 ids), W (commit groups and the metadata
 * value in one transaction) and Q (quit); replies 0 ok, 1 map full, 2 error.  The
 * environment is opened with the flags py-lmdb's lmdb.open uses for the same arguments
 * (MDB_NOTLS, no read-ahead, no memory initialisation, MDB_NOSYNC unless SYNC).
 *
 * Why: the disk tier's background reads and write-backs are bound by LMDB's cost per
 * row, and py-lmdb adds about as much again per row (a Python object per key and
 * value, joins and copies); here a read is one cursor walk over the sorted ids that
 * copies each value straight into the reply, a write one cursor walk that appends the
 * ids past the last key. */
#define _GNU_SOURCE
#include <errno.h>
#include <lmdb.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#define MAX_TABLES 4096

static MDB_env *env;
static MDB_dbi meta_dbi;
static MDB_dbi dbis[MAX_TABLES];
static unsigned char have_dbi[MAX_TABLES];
static int writable;

/* -- framing ---------------------------------------------------------------------------- */

static int read_exact(void *buf, size_t n) {
    char *p = buf;
    while (n) {
        ssize_t got = read(0, p, n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static void write_exact(const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t put = write(1, p, n);
        if (put < 0 && errno == EINTR) continue;
        if (put <= 0) _exit(1); /* the parent is gone */
        p += put;
        n -= (size_t)put;
    }
}

static void reply(unsigned char status, const void *payload, uint64_t n) {
    unsigned char hdr[9];
    hdr[0] = status;
    memcpy(hdr + 1, &n, 8);
    write_exact(hdr, 9);
    if (n) write_exact(payload, n);
}

static char errbuf[512];

static void reply_error(void) { reply(2, errbuf, strlen(errbuf)); }

/* A growable reply buffer. */
static char *out;
static size_t out_cap;

static int reserve(size_t n) {
    if (n <= out_cap) return 0;
    size_t cap = out_cap ? out_cap : 1 << 20;
    while (cap < n) cap *= 2;
    char *p = realloc(out, cap);
    if (!p) return -1;
    out = p;
    out_cap = cap;
    return 0;
}

/* A request's payload, bounds-checked. */
typedef struct {
    const char *p;
    size_t left;
} Reader;

static int take(Reader *r, void *dst, size_t n) {
    if (r->left < n) return -1;
    memcpy(dst, r->p, n);
    r->p += n;
    r->left -= n;
    return 0;
}

static const char *skip(Reader *r, size_t n) {
    if (r->left < n) return NULL;
    const char *p = r->p;
    r->p += n;
    r->left -= n;
    return p;
}

/* One group's header and ids: u32 table, u32 size (floats per record in a read, bytes per
 * record in a write), u64 n, n u64 ids.  -1: the payload ends inside it. */
typedef struct {
    uint32_t table, size;
    uint64_t n;
    const char *ids;
} Group;

static int take_group(Reader *r, Group *g) {
    if (take(r, &g->table, 4) || take(r, &g->size, 4) || take(r, &g->n, 8)) return -1;
    if (g->n > r->left / 8) return -1;
    g->ids = skip(r, g->n * 8);
    return 0;
}

/* -- databases -------------------------------------------------------------------------- */

/* Table t's database, opened on first use; 0 and *dbi set, MDB_NOTFOUND when the table has
 * none yet, another LMDB error code otherwise. */
static int table_dbi(uint32_t t, MDB_dbi *dbi) {
    if (t >= MAX_TABLES) return MDB_NOTFOUND;
    if (have_dbi[t]) {
        *dbi = dbis[t];
        return 0;
    }
    char name[24];
    snprintf(name, sizeof name, "t%u", t);
    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (rc) return rc;
    rc = mdb_dbi_open(txn, name, MDB_INTEGERKEY, &dbis[t]);
    if (rc) {
        mdb_txn_abort(txn);
        return rc;
    }
    rc = mdb_txn_commit(txn); /* keeps the handle for later transactions */
    if (rc) return rc;
    have_dbi[t] = 1;
    *dbi = dbis[t];
    return 0;
}

/* -- requests --------------------------------------------------------------------------- */

enum { OK = 0, MAP_FULL = 1, FAILED = 2, RESIZED = 3 };

static int lmdb_error(const char *doing, int rc) {
    if (rc == MDB_MAP_RESIZED) return RESIZED;
    if (rc == MDB_MAP_FULL) return MAP_FULL;
    snprintf(errbuf, sizeof errbuf, "Error: %s: %s", doing, mdb_strerror(rc));
    return FAILED;
}

static int bad_request(void) {
    snprintf(errbuf, sizeof errbuf, "ValueError: malformed request");
    return FAILED;
}

static int do_read(const char *raw, uint64_t len, uint64_t *reply_len) {
    Reader r = {raw, len};
    uint32_t ngroups;
    if (take(&r, &ngroups, 4)) return bad_request();
    /* first pass: the reply's size, and each table's database opened (before the read
     * transaction: a transaction sees only the handles opened before it began) */
    Reader scan = r;
    size_t need = 0;
    for (uint32_t i = 0; i < ngroups; i++) {
        Group g;
        if (take_group(&scan, &g)) return bad_request();
        need += g.n + g.n * (size_t)g.size * 4;
        MDB_dbi dbi;
        int rc = g.n ? table_dbi(g.table, &dbi) : 0;
        if (rc && rc != MDB_NOTFOUND) return lmdb_error("mdb_dbi_open", rc);
    }
    if (reserve(need ? need : 1)) {
        snprintf(errbuf, sizeof errbuf, "MemoryError: a reply of %zu bytes", need);
        return FAILED;
    }
    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (rc) return lmdb_error("mdb_txn_begin", rc);
    char *o = out;
    int status = OK;
    for (uint32_t i = 0; i < ngroups && status == OK; i++) {
        Group g;
        take_group(&r, &g); /* checked in the first pass */
        uint32_t table = g.table, width = g.size;
        uint64_t n = g.n;
        const char *ids = g.ids;
        unsigned char *found = (unsigned char *)o;
        char *rec = o + n;
        size_t rb = (size_t)width * 4;
        memset(found, 0, n);
        memset(rec, 0, n * rb);
        o += n + n * rb;
        MDB_dbi dbi;
        rc = n ? table_dbi(table, &dbi) : MDB_NOTFOUND; /* opened above, or none */
        if (rc == MDB_NOTFOUND) continue;
        if (rc) {
            status = lmdb_error("mdb_dbi_open", rc);
            break;
        }
        MDB_cursor *cur;
        if ((rc = mdb_cursor_open(txn, dbi, &cur))) {
            status = lmdb_error("mdb_cursor_open", rc);
            break;
        }
        for (uint64_t i = 0; i < n; i++) {
            uint64_t id;
            memcpy(&id, ids + i * 8, 8);
            MDB_val k = {8, &id}, v;
            rc = mdb_cursor_get(cur, &k, &v, MDB_SET_KEY);
            if (rc == MDB_NOTFOUND) continue;
            if (rc) {
                status = lmdb_error("mdb_cursor_get", rc);
                break;
            }
            if (v.mv_size != rb) {
                snprintf(errbuf, sizeof errbuf, "ValueError: corrupt store: records are not %u floats", width);
                status = FAILED;
                break;
            }
            found[i] = 1;
            memcpy(rec + i * rb, v.mv_data, rb);
        }
        mdb_cursor_close(cur);
    }
    mdb_txn_abort(txn);
    *reply_len = need;
    return status;
}

static int do_write(const char *raw, uint64_t len) {
    Reader r = {raw, len};
    uint32_t ngroups;
    if (take(&r, &ngroups, 4)) return bad_request();
    /* validate the whole request before the transaction */
    Reader scan = r;
    for (uint32_t i = 0; i < ngroups; i++) {
        Group g;
        if (take_group(&scan, &g)) return bad_request();
        if (g.size && g.n > scan.left / g.size) return bad_request();
        if (!skip(&scan, g.n * (size_t)g.size)) return bad_request();
        MDB_dbi dbi;
        int rc = table_dbi(g.table, &dbi);
        if (rc == MDB_NOTFOUND) {
            snprintf(errbuf, sizeof errbuf, "ValueError: table %u has no database", g.table);
            return FAILED;
        }
        if (rc) return lmdb_error("mdb_dbi_open", rc);
    }
    uint32_t mlen;
    if (take(&scan, &mlen, 4) || scan.left < mlen) return bad_request();
    const char *meta = scan.p;

    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, 0, &txn);
    if (rc) return lmdb_error("mdb_txn_begin", rc);
    int status = OK;
    for (uint32_t i = 0; i < ngroups && status == OK; i++) {
        Group g;
        take_group(&r, &g); /* checked above */
        uint32_t rb = g.size;
        uint64_t n = g.n;
        const char *ids = g.ids;
        const char *vals = skip(&r, n * (size_t)rb);
        MDB_dbi dbi;
        table_dbi(g.table, &dbi);
        MDB_cursor *cur;
        if ((rc = mdb_cursor_open(txn, dbi, &cur))) {
            status = lmdb_error("mdb_cursor_open", rc);
            break;
        }
        /* ids past the last key are appended (no descent); the others are put in order */
        uint64_t last = 0;
        int any = 0;
        MDB_val k, v;
        rc = mdb_cursor_get(cur, &k, &v, MDB_LAST);
        if (rc == 0 && k.mv_size == 8) {
            memcpy(&last, k.mv_data, 8);
            any = 1;
        } else if (rc && rc != MDB_NOTFOUND) {
            status = lmdb_error("mdb_cursor_get", rc);
        }
        uint64_t prev = 0;
        for (uint64_t i = 0; i < n && status == OK; i++) {
            uint64_t id;
            memcpy(&id, ids + i * 8, 8);
            if (i && id <= prev) {
                snprintf(errbuf, sizeof errbuf, "ValueError: LMDB refused appended keys: ids not distinct and ascending");
                status = FAILED;
                break;
            }
            prev = id;
            MDB_val kk = {8, &id}, vv = {rb, (void *)(vals + i * (size_t)rb)};
            unsigned flags = (!any || id > last) ? MDB_APPEND : 0;
            rc = mdb_cursor_put(cur, &kk, &vv, flags);
            if (rc) status = lmdb_error("mdb_cursor_put", rc);
        }
        mdb_cursor_close(cur);
    }
    if (status == OK && mlen) {
        MDB_val k = {5, "store"}, v = {mlen, (void *)meta};
        rc = mdb_put(txn, meta_dbi, &k, &v, 0);
        if (rc) status = lmdb_error("mdb_put", rc);
    }
    if (status != OK) {
        mdb_txn_abort(txn);
        return status;
    }
    rc = mdb_txn_commit(txn);
    return rc ? lmdb_error("mdb_txn_commit", rc) : OK;
}

/* -- main ------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: lmdb_server PATH MAP_SIZE MODE SYNC PARENT WRITEMAP MAX_DBS\n");
        return 2;
    }
    const char *path = argv[1];
    size_t map_size = strtoull(argv[2], NULL, 10);
    writable = argv[3][0] == 'w';
    int sync = argv[4][0] == '1';
    pid_t parent = (pid_t)atol(argv[5]);
    int writemap = writable && argv[6][0] == '1';
    unsigned max_dbs = (unsigned)strtoul(argv[7], NULL, 10);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0); /* the parent died before the line above */
    signal(SIGPIPE, SIG_DFL);

    unsigned flags = MDB_NOTLS | MDB_NORDAHEAD | MDB_NOMEMINIT | (sync ? 0 : MDB_NOSYNC) |
                     (writable ? 0 : MDB_RDONLY) | (writemap ? MDB_WRITEMAP : 0);
    int rc = mdb_env_create(&env);
    if (!rc) rc = mdb_env_set_mapsize(env, map_size);
    if (!rc) rc = mdb_env_set_maxdbs(env, max_dbs);
    if (!rc) rc = mdb_env_set_maxreaders(env, 126);
    if (!rc) rc = mdb_env_open(env, path, flags, 0755);
    if (!rc) {
        MDB_txn *txn;
        rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
        if (!rc) {
            rc = mdb_dbi_open(txn, "meta", 0, &meta_dbi);
            if (rc) mdb_txn_abort(txn);
            else rc = mdb_txn_commit(txn);
        }
    }
    if (rc) {
        snprintf(errbuf, sizeof errbuf, "cannot open %s: %s", path, mdb_strerror(rc));
        reply_error();
        return 1;
    }
    reply(0, "hiermem-lmdb", 12);

    char *req = NULL;
    size_t req_cap = 0;
    for (;;) {
        unsigned char hdr[9];
        if (read_exact(hdr, 9)) return 0;
        uint64_t n;
        memcpy(&n, hdr + 1, 8);
        if (n > req_cap) {
            char *p = realloc(req, n);
            if (!p) {
                snprintf(errbuf, sizeof errbuf, "MemoryError: a request of %llu bytes", (unsigned long long)n);
                reply_error();
                return 1; /* the request is still in the pipe: this process cannot go on */
            }
            req = p;
            req_cap = n;
        }
        if (n && read_exact(req, n)) return 0;
        char op = (char)hdr[0];
        if (op == 'Q') return 0;
        int status = RESIZED;
        uint64_t reply_len = 0;
        for (int attempt = 0; attempt < 3 && status == RESIZED; attempt++) {
            if (op == 'R') {
                status = do_read(req, n, &reply_len);
            } else if (op == 'W' && writable) {
                status = do_write(req, n);
            } else {
                snprintf(errbuf, sizeof errbuf, "bad request b'%c'", op);
                status = FAILED;
            }
            if (status == RESIZED) mdb_env_set_mapsize(env, 0); /* another process grew the map: adopt its size */
        }
        if (status == OK) reply(0, out, op == 'R' ? reply_len : 0);
        else if (status == MAP_FULL) reply(1, "map full", 8);
        else if (status == RESIZED) reply(2, "map resized repeatedly", 22);
        else reply_error();
    }
}
