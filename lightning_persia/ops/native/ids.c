/* Kernels over ids: each table's unique ids, the first id another shard owns, and each id's routing slot.
 *
 * Called through ctypes on the buffers of CPU tensors (see ids.py). The hash is hash.h's, which the store's kernels
 * (remote_ps/store/native) hash with too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hash.h"

/* ---- shard ownership ------------------------------------------------------------------------------------ */

/* Index of the first id whose slot `owners` (one entry per slot; `slots` a power of two) does not give to `shard`,
 * or -1 when all are its own. The slot is ops/hashing.py's slot_of, the owners ops/shard_map.py's map. */
int64_t lp_first_foreign(const int64_t *ids, int64_t n, const int64_t *owners, int64_t slots, int64_t shard) {
    const uint64_t mask = (uint64_t)slots - 1;
    for (int64_t i = 0; i < n; ++i)
        if (owners[mix64((uint64_t)ids[i] ^ SHARD_SALT) & mask] != shard) return i;
    return -1;
}

/* Each id's routing slot, ops/hashing.py's slot_of (`slots` a power of two), into out. A move's point finds its
 * slots' rows by the slot of every row of a table: 10M ids a wave take 0.55 s of CPU as tensor operations. */
void lp_slot_of(const int64_t *ids, int64_t n, int64_t slots, int64_t *out) {
    const uint64_t mask = (uint64_t)slots - 1;
    for (int64_t i = 0; i < n; ++i) out[i] = (int64_t)(mix64((uint64_t)ids[i] ^ SHARD_SALT) & mask);
}

/* ---- a batch's ids deduplicated, table by table (the trainer's planning of a lookup) -----------------------
 * Table t's ids are ids[starts[t] .. starts[t + 1]). Writes each table's unique ids in ascending order into
 * `unique` (tables one after another), how many into counts[t], and for every id its position among its own
 * table's unique ids into inverse. A hash table per table (twice its ids' slots, so it stays in the caches for a
 * batch's few thousand ids a table) finds the unique ids in one pass; only they are sorted. Returns 0, or -1 when
 * memory for the scratch space cannot be had. */

typedef struct { int64_t id; int64_t first; } seen_t;

static int by_id(const void *a, const void *b) {
    int64_t x = ((const seen_t *)a)->id, y = ((const seen_t *)b)->id;
    return (x > y) - (x < y);
}

int64_t lp_unique_by_table(const int64_t *ids, const int64_t *starts, int64_t num_tables, int64_t *unique, int64_t *counts,
                           int64_t *inverse) {
    int64_t widest = 0;
    for (int64_t t = 0; t < num_tables; t++)
        if (starts[t + 1] - starts[t] > widest) widest = starts[t + 1] - starts[t];
    int64_t slots = 16;
    while (slots < 2 * widest) slots <<= 1;
    int32_t *slot_of = malloc(sizeof(int32_t) * (size_t)slots);
    seen_t *seen = malloc(sizeof(seen_t) * (size_t)(widest ? widest : 1));
    int64_t *rank = malloc(sizeof(int64_t) * (size_t)(widest ? widest : 1));
    if (!slot_of || !seen || !rank) {
        free(slot_of);
        free(seen);
        free(rank);
        return -1;
    }
    int64_t written = 0;
    for (int64_t t = 0; t < num_tables; t++) {
        const int64_t first = starts[t], n = starts[t + 1] - starts[t];
        int64_t size = 16;
        while (size < 2 * n) size <<= 1;
        const uint64_t mask = (uint64_t)size - 1;
        memset(slot_of, 0xFF, sizeof(int32_t) * (size_t)size);
        int64_t found = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t id = ids[first + i];
            uint64_t s = mix64((uint64_t)id ^ SLOT_SALT) & mask;
            while (slot_of[s] >= 0 && seen[slot_of[s]].id != id) s = (s + 1) & mask;
            if (slot_of[s] < 0) {
                slot_of[s] = (int32_t)found;
                seen[found].id = id;
                seen[found].first = found;
                found++;
            }
            inverse[first + i] = slot_of[s];
        }
        qsort(seen, (size_t)found, sizeof(seen_t), by_id);
        for (int64_t u = 0; u < found; u++) {
            rank[seen[u].first] = u;
            unique[written + u] = seen[u].id;
        }
        for (int64_t i = 0; i < n; i++) inverse[first + i] = rank[inverse[first + i]];
        counts[t] = found;
        written += found;
    }
    free(slot_of);
    free(seen);
    free(rank);
    return 0;
}
