/* Native kernels of the parameter server's hot path: the id index of a table and the shard-ownership check.
 *
 * Called through ctypes on the buffers of contiguous CPU tensors (see __init__.py); each call does the work
 * of one table operation in one pass, where the tensor version costs a dozen dispatched ops per probe pass.
 * The hash is lightning_persia.ops.hashing's splitmix64 finaliser, bit for bit, so both implementations
 * place and find ids in the same slots.
 */
#include <stdint.h>

#define EMPTY (-1)
#define TOMBSTONE (-2)

static const uint64_t SLOT_SALT = 0x9E3779B97F4A7C15ULL;
static const uint64_t SHARD_SALT = 0x2545F4914F6CDD1DULL;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* rows[i]: the row of ids[i], or -1 when absent; positions[i]: its slot (the ending empty slot when absent). */
void lp_index_find(const int32_t *slots, int64_t num_slots, const int64_t *keys, const int64_t *ids, int64_t n,
                   int64_t *rows, int64_t *positions) {
    const uint64_t mask = (uint64_t)num_slots - 1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        uint64_t p = mix64((uint64_t)id ^ SLOT_SALT) & mask;
        for (;;) {
            const int32_t s = slots[p];
            if (s == EMPTY) {
                rows[i] = -1;
                break;
            }
            if (s >= 0 && keys[s] == id) {
                rows[i] = s;
                break;
            }
            p = (p + 1) & mask;
        }
        positions[i] = (int64_t)p;
    }
}

/* Puts rows[i] in the first free (empty or tombstone) slot of ids[i]'s chain; returns the tombstones reused. */
int64_t lp_index_place(int32_t *slots, int64_t num_slots, const int64_t *ids, const int32_t *rows, int64_t n) {
    const uint64_t mask = (uint64_t)num_slots - 1;
    int64_t reused = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t p = mix64((uint64_t)ids[i] ^ SLOT_SALT) & mask;
        while (slots[p] >= 0) p = (p + 1) & mask;
        reused += slots[p] == TOMBSTONE;
        slots[p] = rows[i];
    }
    return reused;
}

/* Index of the first id not owned by shard `shard` of `num_shards`, or -1 when all are. */
int64_t lp_first_foreign(const int64_t *ids, int64_t n, int64_t num_shards, int64_t shard) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t h = mix64((uint64_t)ids[i] ^ SHARD_SALT) & 0x7FFFFFFFFFFFFFFFULL;
        if ((int64_t)(h % (uint64_t)num_shards) != shard) return i;
    }
    return -1;
}
