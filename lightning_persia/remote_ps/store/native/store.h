/* What the store's native kernels share: the hash, the prefetching, a table's rows in chunks, the initial rows'
 * random words and the id index's layout (id_index.c owns the index; rows.c and jobs.c read it).
 *
 * Called through ctypes on the buffers of CPU tensors (each C file's binding is the Python module of its name). A
 * table of hundreds of millions of rows lives far outside the caches, so every kernel walks its ids in blocks and
 * prefetches the memory of a whole block before it touches any of it: a block's cache misses then overlap instead
 * of queueing one behind the other. The hash is the trainer's (ops/native/hash.h: lightning_persia.ops.hashing's
 * splitmix64 finaliser, bit for bit).
 */
#ifndef LP_STORE_H
#define LP_STORE_H

#define _DEFAULT_SOURCE /* madvise */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../../ops/native/hash.h"

/* Shared by the C files of this library, not exported from it (the exported functions are the lp_* ones). */
#define INTERNAL __attribute__((visibility("hidden")))

#define BLOCK 32 /* ids whose memory is prefetched together */
#define PREFETCH(address) __builtin_prefetch((const void *)(address), 0, 0)
#define PREFETCH_WRITE(address) __builtin_prefetch((const void *)(address), 1, 0)

/* ---- rows in chunks ---------------------------------------------------------------------------------------
 * A table's rows are records of `stride` bytes (its id, versions, optimizer state and weights side by side) in
 * chunks of 2^shift records; chunks[c] is the address of chunk c. A field is `width` bytes at `offset` in every
 * record. Growing a table appends a chunk: no stored row ever moves. */

typedef struct {
    const int64_t *chunks;
    int64_t shift;
    int64_t stride;
} rows_t;

static inline char *record(const rows_t *t, int64_t row) {
    return (char *)(intptr_t)t->chunks[row >> t->shift] + (row & ((1LL << t->shift) - 1)) * t->stride;
}

/* Records are not aligned to cache lines (52 bytes for dim 16 in fp16 with row-wise Adagrad: three in four
 * straddle two lines), so a prefetch of `bytes` at `address` asks for its last line as well as its first: where
 * the hot rows lie scattered, as a disk table's promotions leave them, the second line would otherwise be a
 * demand miss per row. */
#define PREFETCH_SPAN(address, bytes) (PREFETCH(address), PREFETCH((const char *)(address) + (bytes) - 1))
#define PREFETCH_WRITE_SPAN(address, bytes) (PREFETCH_WRITE(address), PREFETCH_WRITE((const char *)(address) + (bytes) - 1))

static inline void set_i32(char *cell, int32_t value, int32_t add) {
    int32_t current;
    memcpy(&current, cell, 4);
    current = add ? current + value : value;
    memcpy(cell, &current, 4);
}

#define POPULATE_MIN_BYTES (1 << 20) /* calloc maps allocations this large afresh: untouched pages */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Commits the pages of a large fresh allocation in one call: the inserts that follow write its buckets in random
 * order, and a fault per page costs several times more. A kernel without MADV_POPULATE_WRITE (< 5.14) refuses it,
 * and the pages fault in as they are written. */
static inline void commit_pages(void *memory, size_t bytes) {
    if (bytes < POPULATE_MIN_BYTES) return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t)memory & ~(page - 1);
    madvise((void *)first, (uintptr_t)memory + bytes - first, MADV_POPULATE_WRITE);
}

/* ---- initial rows ----------------------------------------------------------------------------------------
 * The counter-based random word behind column c of the initial row of id: mix64(mix64(id ^ key) + c * GOLDEN)
 * (remote_ps/store/initializers.py computes the same words in tensor ops). */
static inline uint64_t row_word(uint64_t row_key, int64_t c) { return mix64(row_key + (uint64_t)c * SLOT_SALT); }

/* Column c of a Uniform(low, high) initial row: (float)(low + (high - low) * u), u = (53 bits of the word + 0.5) /
 * 2^53, in the operations and order of initializers.py (built without fused multiply-adds, so bit for bit). */
static inline float uniform_at(uint64_t row_key, int64_t c, double low, double high) {
    const double u = ((double)(row_word(row_key, c) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    return (float)(low + (high - low) * u);
}

/* ---- the id index's layout (see id_index.c) ------------------------------------------------------------------- */

#define SLOTS 12
#define EMPTY_TAG 0
#define TOMB_TAG 1
#define PART_BITS 12
#define PARTS (1 << PART_BITS)

typedef struct {
    uint8_t tags[SLOTS];
    uint32_t overflowed; /* an insert found this bucket full and went on to the next one */
    int32_t rows[SLOTS];
} bucket_t;

typedef struct {
    bucket_t *buckets;
    uint32_t count;    /* buckets */
    uint32_t live;     /* ids present */
    uint32_t used;     /* live + tombstones: what lengthens probes */
    uint32_t limit;    /* used may not pass this: the partition grows (or drops its tombstones) first ... */
    uint32_t full;     /* ... unless the insert call's rebuild budget is spent; and never this */
} part_t;

typedef struct {
    part_t parts[PARTS];
    int64_t live;
    int64_t bucket_count;
    int64_t grown; /* partition rebuilds so far */
    int64_t put_off; /* rebuilds an insert call left to a later one (its budget spent) */
    int64_t inserted; /* ids inserted so far: unchanged, no id became present */
} index_t;

static inline uint32_t part_of(uint64_t h) { return (uint32_t)(h >> (64 - PART_BITS)); }
static inline uint8_t tag_of(uint64_t h) { return (uint8_t)(2 + ((h >> 40) & 0xFFFF) % 254); }
static inline uint32_t home_of(uint64_t h, uint32_t count) { return (uint32_t)(((h & 0xFFFFFFFFULL) * count) >> 32); }
static inline uint64_t hash_of(int64_t id) { return mix64((uint64_t)id ^ SLOT_SALT); }

/* A row's id: the first 8 bytes of its record. */
static inline int64_t key_of(const rows_t *t, int32_t row) {
    int64_t key;
    memcpy(&key, record(t, row), 8);
    return key;
}

/* Slot of `id` as (bucket, slot) packed in an int64, or -1. */
static inline int64_t probe(const part_t *p, uint64_t h, int64_t id, const rows_t *t) {
    const uint8_t tag = tag_of(h);
    uint32_t b = home_of(h, p->count);
    for (uint32_t visited = 0; visited < p->count; ++visited) {
        const bucket_t *bucket = &p->buckets[b];
        int empty = 0;
        for (int s = 0; s < SLOTS; ++s) {
            const uint8_t tg = bucket->tags[s];
            if (tg == tag && key_of(t, bucket->rows[s]) == id) return (int64_t)b * SLOTS + s;
            empty |= tg == EMPTY_TAG;
        }
        if (empty || !bucket->overflowed) return -1;
        b = b + 1 == p->count ? 0 : b + 1;
    }
    return -1;
}

/* Indexes one absent id (hash h, its record already holding it) at `row`; see id_index.c. */
INTERNAL int insert_one(index_t *index, const rows_t *t, uint64_t h, int32_t row, int64_t *rehashed);

void lp_index_find(const void *handle, const int64_t *chunks, int64_t shift, int64_t stride, const int64_t *ids, int64_t n,
                   int64_t *rows, int64_t offset, int64_t width, char *out, int64_t touch_offset, int32_t value, int32_t add);

#endif
