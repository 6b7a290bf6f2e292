/* LMDB's own cost per row, without Python: the floor under the disk tier's reads and
 * writes (scripts/bench_lmdb_native.py builds and runs it; see there).
 *
 *   lmdb_native fill DIR TABLES ROWS BYTES          one integerkey sub-database per table,
 *                                                   t0..t{TABLES-1}, ROWS ids each, BYTES-byte values
 *   lmdb_native steps DIR TABLES BYTES IDS OUT      run the steps of file IDS, write the
 *                                                   per-step read and write seconds to OUT
 *
 * IDS: int64 little-endian: the number of steps, then per step its row count and that many
 * (table, id) pairs, sorted by table then id (the order the store reads and writes them in).
 * A step reads its rows in one read transaction (mdb_get, each value copied out, as the
 * store copies records into its array), then writes them back in one write transaction
 * (mdb_put, then commit).  The environment is opened as the store opens its own: no sync
 * per commit, write map, no read-ahead, no memory initialisation. */
#include <lmdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                              \
    do {                                                                      \
        int rc_ = (x);                                                        \
        if (rc_) {                                                            \
            fprintf(stderr, "lmdb_native: %s: %s\n", #x, mdb_strerror(rc_)); \
            exit(2);                                                          \
        }                                                                     \
    } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static MDB_env *open_env(const char *dir, int tables) {
    MDB_env *env;
    CHECK(mdb_env_create(&env));
    CHECK(mdb_env_set_mapsize(env, (size_t)16 << 30));
    CHECK(mdb_env_set_maxdbs(env, (MDB_dbi)tables + 1));
    CHECK(mdb_env_open(env, dir, MDB_NOSYNC | MDB_WRITEMAP | MDB_NORDAHEAD | MDB_NOMEMINIT, 0600));
    return env;
}

static void open_dbs(MDB_env *env, int tables, unsigned flags, MDB_dbi *dbi) {
    MDB_txn *txn;
    char name[16];
    CHECK(mdb_txn_begin(env, NULL, 0, &txn));
    for (int t = 0; t < tables; t++) {
        snprintf(name, sizeof name, "t%d", t);
        CHECK(mdb_dbi_open(txn, name, flags | MDB_INTEGERKEY, &dbi[t]));
    }
    CHECK(mdb_txn_commit(txn));
}

static int fill(const char *dir, int tables, long rows, int bytes) {
    MDB_env *env = open_env(dir, tables);
    MDB_dbi dbi[256];
    open_dbs(env, tables, MDB_CREATE, dbi);
    char *val = calloc(1, (size_t)bytes);
    for (int t = 0; t < tables; t++) {
        MDB_txn *txn;
        CHECK(mdb_txn_begin(env, NULL, 0, &txn));
        for (uint64_t i = 0; i < (uint64_t)rows; i++) {
            MDB_val k = {8, &i}, v = {(size_t)bytes, val};
            CHECK(mdb_put(txn, dbi[t], &k, &v, MDB_APPEND));
        }
        CHECK(mdb_txn_commit(txn));
    }
    mdb_env_close(env);
    free(val);
    return 0;
}

static int steps(const char *dir, int tables, int bytes, const char *ids_path, const char *out_path) {
    FILE *f = fopen(ids_path, "rb");
    if (!f) {
        perror(ids_path);
        return 2;
    }
    int64_t nsteps;
    if (fread(&nsteps, 8, 1, f) != 1) return 2;
    MDB_env *env = open_env(dir, tables);
    MDB_dbi dbi[256];
    open_dbs(env, tables, 0, dbi);
    FILE *out = fopen(out_path, "wb");
    if (!out) {
        perror(out_path);
        return 2;
    }
    for (int64_t s = 0; s < nsteps; s++) {
        int64_t n;
        if (fread(&n, 8, 1, f) != 1) return 2;
        int64_t *pairs = malloc((size_t)n * 16);
        char *rec = malloc((size_t)n * (size_t)bytes);
        if ((int64_t)fread(pairs, 16, (size_t)n, f) != n) return 2;
        MDB_txn *txn;
        double t0 = now();
        CHECK(mdb_txn_begin(env, NULL, MDB_RDONLY, &txn));
        for (int64_t i = 0; i < n; i++) {
            uint64_t id = (uint64_t)pairs[2 * i + 1];
            MDB_val k = {8, &id}, v;
            CHECK(mdb_get(txn, dbi[pairs[2 * i]], &k, &v));
            memcpy(rec + i * bytes, v.mv_data, (size_t)bytes);
        }
        mdb_txn_abort(txn);
        double t1 = now();
        CHECK(mdb_txn_begin(env, NULL, 0, &txn));
        for (int64_t i = 0; i < n; i++) {
            uint64_t id = (uint64_t)pairs[2 * i + 1];
            MDB_val k = {8, &id}, v = {(size_t)bytes, rec + i * bytes};
            CHECK(mdb_put(txn, dbi[pairs[2 * i]], &k, &v, 0));
        }
        CHECK(mdb_txn_commit(txn));
        double t2 = now();
        double dt[2] = {t1 - t0, t2 - t1};
        fwrite(dt, 8, 2, out);
        free(pairs);
        free(rec);
    }
    fclose(out);
    fclose(f);
    mdb_env_close(env);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 6 && !strcmp(argv[1], "fill"))
        return fill(argv[2], atoi(argv[3]), atol(argv[4]), atoi(argv[5]));
    if (argc == 7 && !strcmp(argv[1], "steps"))
        return steps(argv[2], atoi(argv[3]), atoi(argv[4]), argv[5], argv[6]);
    fprintf(stderr, "usage: lmdb_native fill DIR TABLES ROWS BYTES | steps DIR TABLES BYTES IDS OUT\n");
    return 2;
}
