/* Native kernels of the parameter server's hot path: the id index of a table, gathers and scatters of rows kept
 * in fixed-size chunks, and the shard-ownership check.
 *
 * Called through ctypes on the buffers of CPU tensors (see __init__.py). A table of hundreds of millions of rows
 * lives far outside the caches, so every kernel walks its ids in blocks and prefetches the memory of a whole block
 * before it touches any of it: a block's cache misses then overlap instead of queueing one behind the other.
 * The hash is lightning_persia.ops.hashing's splitmix64 finaliser, bit for bit.
 */
#define _DEFAULT_SOURCE /* madvise */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const uint64_t SLOT_SALT = 0x9E3779B97F4A7C15ULL;
static const uint64_t SHARD_SALT = 0x2545F4914F6CDD1DULL;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

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

/* The row loops below, instantiated for the common field widths: a memcpy of a constant size is a move or two,
 * where one of a variable size is a library call per row. */
#define ROW_LOOP(NAME, WIDTH, PREFETCH_OP, COPY)                                                                      \
    static void NAME(const rows_t *t, int64_t offset, int64_t width, const int64_t *rows, int64_t n, char *data) {    \
        (void)width;                                                                                                    \
        for (int64_t start = 0; start < n; start += BLOCK) {                                                            \
            const int64_t end = start + BLOCK < n ? start + BLOCK : n;                                                  \
            for (int64_t i = start; i < end; ++i)                                                                       \
                if (rows[i] >= 0) PREFETCH_OP(record(t, rows[i]) + offset, (WIDTH));                                    \
            for (int64_t i = start; i < end; ++i) {                                                                     \
                if (rows[i] < 0) continue;                                                                              \
                char *field = record(t, rows[i]) + offset;                                                              \
                COPY;                                                                                                   \
            }                                                                                                           \
        }                                                                                                               \
    }
#define GATHER(WIDTH) memcpy(data + i * (WIDTH), field, (size_t)(WIDTH))
#define SCATTER(WIDTH) memcpy(field, data + i * (WIDTH), (size_t)(WIDTH))
ROW_LOOP(gather_4, 4, PREFETCH_SPAN, GATHER(4))
ROW_LOOP(gather_8, 8, PREFETCH_SPAN, GATHER(8))
ROW_LOOP(gather_32, 32, PREFETCH_SPAN, GATHER(32))
ROW_LOOP(gather_64, 64, PREFETCH_SPAN, GATHER(64))
ROW_LOOP(gather_any, width, PREFETCH_SPAN, GATHER(width))
ROW_LOOP(scatter_4, 4, PREFETCH_WRITE_SPAN, SCATTER(4))
ROW_LOOP(scatter_8, 8, PREFETCH_WRITE_SPAN, SCATTER(8))
ROW_LOOP(scatter_32, 32, PREFETCH_WRITE_SPAN, SCATTER(32))
ROW_LOOP(scatter_64, 64, PREFETCH_WRITE_SPAN, SCATTER(64))
ROW_LOOP(scatter_any, width, PREFETCH_WRITE_SPAN, SCATTER(width))

/* out[i] = the field of row rows[i]; rows[i] < 0 leaves out[i] as it is. */
void lp_gather(const int64_t *chunks, int64_t shift, int64_t stride, int64_t offset, int64_t width, const int64_t *rows,
               int64_t n, char *out) {
    const rows_t t = {chunks, shift, stride};
    switch (width) {
        case 4: gather_4(&t, offset, width, rows, n, out); break;
        case 8: gather_8(&t, offset, width, rows, n, out); break;
        case 32: gather_32(&t, offset, width, rows, n, out); break;
        case 64: gather_64(&t, offset, width, rows, n, out); break;
        default: gather_any(&t, offset, width, rows, n, out);
    }
}

/* The field of row rows[i] = src[i]; rows[i] < 0 is skipped. */
void lp_scatter(const int64_t *chunks, int64_t shift, int64_t stride, int64_t offset, int64_t width, const int64_t *rows,
                int64_t n, const char *src) {
    const rows_t t = {chunks, shift, stride};
    char *data = (char *)(intptr_t)src; /* read only: the loops share one signature */
    switch (width) {
        case 4: scatter_4(&t, offset, width, rows, n, data); break;
        case 8: scatter_8(&t, offset, width, rows, n, data); break;
        case 32: scatter_32(&t, offset, width, rows, n, data); break;
        case 64: scatter_64(&t, offset, width, rows, n, data); break;
        default: scatter_any(&t, offset, width, rows, n, data);
    }
}

/* Several fields of each row in one pass over the records (a chunk copied for a checkpoint, or rows loaded
 * from one): fields k = 0 .. count-1 are width[k] bytes at offset[k] of a record, and data[k] the address of
 * their [n, width[k]] array. `to_rows` writes the arrays into the rows; otherwise the rows into the arrays. */
void lp_fields(const int64_t *chunks, int64_t shift, int64_t stride, const int64_t *rows, int64_t n, int64_t count,
               const int64_t *offset, const int64_t *width, const int64_t *data, int32_t to_rows) {
    const rows_t t = {chunks, shift, stride};
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        for (int64_t i = start; i < end; ++i)
            if (rows[i] >= 0) PREFETCH_WRITE_SPAN(record(&t, rows[i]), stride);
        for (int64_t i = start; i < end; ++i) {
            if (rows[i] < 0) continue;
            char *r = record(&t, rows[i]);
            for (int64_t k = 0; k < count; ++k) {
                char *array = (char *)(intptr_t)data[k] + i * width[k];
                if (to_rows) memcpy(r + offset[k], array, (size_t)width[k]);
                else memcpy(array, r + offset[k], (size_t)width[k]);
            }
        }
    }
}

static inline void set_i32(char *cell, int32_t value, int32_t add) {
    int32_t current;
    memcpy(&current, cell, 4);
    current = add ? current + value : value;
    memcpy(cell, &current, 4);
}

/* The int32 field of rows[i] (>= 0) becomes `value`, or grows by `value` when `add` is set. */
void lp_set_i32(const int64_t *chunks, int64_t shift, int64_t stride, int64_t offset, const int64_t *rows, int64_t n,
                int32_t value, int32_t add) {
    const rows_t t = {chunks, shift, stride};
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        for (int64_t i = start; i < end; ++i)
            if (rows[i] >= 0) PREFETCH_WRITE(record(&t, rows[i]) + offset);
        for (int64_t i = start; i < end; ++i)
            if (rows[i] >= 0) set_i32(record(&t, rows[i]) + offset, value, add);
    }
}

/* Up to `count` positions i < n, in order, whose int32 value values[i * stride] is at most `threshold` and not
 * `free_mark`, into out; returns how many. *stop: the position after the last one taken (0 for a count of 0), or n
 * where fewer were found.
 * An eviction's sweep over a field of strided records: one pass that ends at the last row it needs. */
int64_t lp_select_at_most(const int32_t *values, int64_t stride, int64_t n, int32_t threshold, int32_t free_mark,
                          int64_t count, int64_t *out, int64_t *stop) {
    int64_t found = 0;
    for (int64_t i = 0; i < n && found < count; ++i) {
        const int32_t value = values[i * stride];
        if (value <= threshold && value != free_mark) out[found++] = i;
    }
    *stop = found < count ? n : found ? out[found - 1] + 1 : 0;
    return found;
}

/* ---- the id index ------------------------------------------------------------------------------------------
 * id -> row of a table. The keys themselves stay in the table's ids field (row-aligned), so a slot holds a row
 * number and a one-byte tag (8 bits of the id's hash) that spares reading the key of almost every other slot.
 *
 * Slots come in buckets of 12, one cache line each; a probe reads the home bucket, then the next ones while they
 * are full and marked `overflowed` (an insert passed through them). The index is split into 2^PART_BITS
 * partitions by the top bits of the hash, each grown on its own (to a load of 0.5, once it reaches a load
 * between 0.72 and 0.94 that differs per partition), so growing the table rehashes a small slice at a time: no
 * request ever waits for the whole index to be rebuilt, whatever the table size. Bucket counts need not be powers
 * of two (the home bucket is a multiply-shift of 32 hash bits), so a partition grows by what its load asks.
 *
 * A rebuild reads the key of every live row of its partition (a cache miss each: ~5 ms for 80k rows, measured in
 * benchmarks/results/2026-11-25-scale-history.md), and the partitions that pass their load in one insert call
 * come in random numbers: up to five rebuilds of ~290k rows each in one 65,536-id request at 300M rows with 1,024
 * partitions, 0.1 s of a table's lock. So an insert call
 * rehashes at most REBUILD_BUDGET rows (beyond it, a partition past its load still takes ids, up to FULL_LOAD,
 * and grows in a later call), and 4,096 partitions keep one rebuild a small part of that. The budget must stay
 * above what inserting asks for on average: growing from a load L to 0.5 rehashes 0.5 / (L - 0.5) rows per row
 * inserted: 1.6 over the spread of L, ~105k rows per 65,536 new ids (a target of 0.55 would ask 2.3: the target
 * is chosen for this as much as for memory). */

#define SLOTS 12
#define EMPTY_TAG 0
#define TOMB_TAG 1
#define PART_BITS 12
#define PARTS (1 << PART_BITS)
#define TARGET_LOAD 0.5
#define FULL_LOAD 0.97     /* a partition whose rebuild was put off grows at this load whatever the budget */
#define REBUILD_BUDGET (1 << 17) /* live rows one insert call rehashes before it puts off further rebuilds */
#define REHASH_AHEAD 64
#define POPULATE_MIN_BYTES (1 << 20) /* calloc maps allocations this large afresh: untouched pages */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

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

static double max_load(uint32_t part) { /* 0.72 .. 0.94, spread over the partitions so they grow at different times */
    return 0.72 + 0.22 * (double)(mix64(part + 1) >> 11) / (double)(1ULL << 53);
}

/* Commits the pages of a large fresh allocation in one call: the inserts that follow write its buckets in random
 * order, and a fault per page costs several times more. A kernel without MADV_POPULATE_WRITE (< 5.14) refuses it,
 * and the pages fault in as they are written. */
static void commit_pages(void *memory, size_t bytes) {
    if (bytes < POPULATE_MIN_BYTES) return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t first = (uintptr_t)memory & ~(page - 1);
    madvise((void *)first, (uintptr_t)memory + bytes - first, MADV_POPULATE_WRITE);
}

static int part_init(part_t *p, uint32_t part, uint32_t count) {
    bucket_t *buckets = calloc(count, sizeof(bucket_t));
    if (!buckets) return -1;
    commit_pages(buckets, (size_t)count * sizeof(bucket_t));
    p->buckets = buckets;
    p->count = count;
    p->live = p->used = 0;
    p->limit = (uint32_t)(max_load(part) * count * SLOTS);
    if (p->limit < 1) p->limit = 1;
    p->full = (uint32_t)(FULL_LOAD * count * SLOTS);
    if (p->full > count * SLOTS - 1) p->full = count * SLOTS - 1; /* a free slot always ends a probe */
    if (p->full < p->limit) p->full = p->limit;
    return 0;
}

/* Puts `row` in the first free slot of the chain that starts at `h`'s home bucket (the id must be absent). */
static int place(part_t *p, uint64_t h, int32_t row) {
    const uint8_t tag = tag_of(h);
    uint32_t b = home_of(h, p->count);
    for (;;) {
        bucket_t *bucket = &p->buckets[b];
        for (int s = 0; s < SLOTS; ++s) {
            if (bucket->tags[s] <= TOMB_TAG) {
                int reused = bucket->tags[s] == TOMB_TAG;
                bucket->tags[s] = tag;
                bucket->rows[s] = row;
                return reused;
            }
        }
        bucket->overflowed = 1;
        b = b + 1 == p->count ? 0 : b + 1;
    }
}

/* Slot of `id` as (bucket, slot) packed in an int64, or -1. */
static int64_t probe(const part_t *p, uint64_t h, int64_t id, const rows_t *t) {
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

/* Rebuilds partition `part` at load TARGET_LOAD for its live ids and `extra` more: x1.4-1.9 when live ids filled
 * it, smaller when tombstones did. Reads the keys of its live rows, prefetched a block at a time. */
static int rebuild(index_t *index, uint32_t part, uint32_t extra, const rows_t *t) {
    part_t *p = &index->parts[part];
    part_t fresh;
    if (part_init(&fresh, part, (uint32_t)((p->live + extra) / TARGET_LOAD / SLOTS) + 1)) return -1;
    /* a ring of rows whose records are on their way: each is placed REHASH_AHEAD rows after its prefetch */
    int32_t ring[REHASH_AHEAD];
    int64_t seen = 0;
    for (uint32_t b = 0; b < p->count; ++b) {
        for (int s = 0; s < SLOTS; ++s) {
            if (p->buckets[b].tags[s] <= TOMB_TAG) continue;
            if (seen >= REHASH_AHEAD) {
                const int32_t row = ring[seen % REHASH_AHEAD];
                place(&fresh, hash_of(key_of(t, row)), row);
            }
            ring[seen % REHASH_AHEAD] = p->buckets[b].rows[s];
            PREFETCH(record(t, ring[seen % REHASH_AHEAD]));
            seen += 1;
        }
    }
    for (int64_t i = seen > REHASH_AHEAD ? seen - REHASH_AHEAD : 0; i < seen; ++i) {
        const int32_t row = ring[i % REHASH_AHEAD];
        place(&fresh, hash_of(key_of(t, row)), row);
    }
    fresh.live = fresh.used = p->live;
    index->bucket_count += (int64_t)fresh.count - p->count;
    index->grown += 1;
    free(p->buckets);
    *p = fresh;
    return 0;
}

void *lp_index_new(void) {
    index_t *index = calloc(1, sizeof(index_t));
    if (!index) return NULL;
    for (uint32_t part = 0; part < PARTS; ++part) {
        if (part_init(&index->parts[part], part, 1)) {
            for (uint32_t q = 0; q < part; ++q) free(index->parts[q].buckets);
            free(index);
            return NULL;
        }
    }
    index->bucket_count = PARTS;
    return index;
}

void lp_index_free(void *handle) {
    index_t *index = handle;
    if (!index) return;
    for (uint32_t part = 0; part < PARTS; ++part) free(index->parts[part].buckets);
    free(index);
}

/* [live ids, bytes of buckets, partition rebuilds so far, rebuilds put off so far, ids inserted so far] */
void lp_index_info(const void *handle, int64_t *out) {
    const index_t *index = handle;
    out[0] = index->live;
    out[1] = index->bucket_count * (int64_t)sizeof(bucket_t) + (int64_t)sizeof(index_t);
    out[2] = index->grown;
    out[3] = index->put_off;
    out[4] = index->inserted;
}

/* rows[i]: the row of ids[i], or -1 when absent. With `out`, also copies the field of `width` bytes at
 * `offset` of each row found to out[i]; with `touch_offset` >= 0, writes `value` into (or, with `add`, adds it to)
 * the int32 field at `touch_offset` of each row found. One pass, software-pipelined: while id i is confirmed,
 * the record of id i + LAG and the home bucket of id i + 2 LAG are on their way, and row i - LAG is copied (its
 * fields share the record's cache lines with the id that confirmed it). */
#define LAG 16
#define RING (4 * LAG)

static inline void finish(const rows_t *t, int64_t row, int64_t offset, int64_t width, char *out, int64_t touch_offset,
                          int32_t value, int32_t add) {
    char *r = record(t, row);
    if (out) memcpy(out, r + offset, (size_t)width);
    if (touch_offset >= 0) set_i32(r + touch_offset, value, add);
}

void lp_index_find(const void *handle, const int64_t *chunks, int64_t shift, int64_t stride, const int64_t *ids, int64_t n,
                   int64_t *rows, int64_t offset, int64_t width, char *out, int64_t touch_offset, int32_t value, int32_t add) {
    const index_t *index = handle;
    const rows_t t = {chunks, shift, stride};
    uint64_t hashes[RING];
    const bucket_t *homes[RING];
    int32_t first[RING];
    for (int64_t i = -2 * LAG; i < n; ++i) {
        const int64_t a = i + 2 * LAG; /* its home bucket requested */
        if (a >= 0 && a < n) {
            const uint64_t h = hashes[a % RING] = hash_of(ids[a]);
            const part_t *p = &index->parts[part_of(h)];
            homes[a % RING] = &p->buckets[home_of(h, p->count)];
            PREFETCH(homes[a % RING]);
        }
        const int64_t b = i + LAG; /* its first tag match found, its record requested */
        if (b >= 0 && b < n) {
            const bucket_t *home = homes[b % RING];
            const uint8_t tag = tag_of(hashes[b % RING]);
            int32_t candidate = -1;
            for (int s = 0; s < SLOTS; ++s) {
                if (home->tags[s] == tag) {
                    candidate = home->rows[s];
                    PREFETCH_WRITE_SPAN(record(&t, candidate), t.stride);
                    break;
                }
            }
            first[b % RING] = candidate;
        }
        if (i >= 0 && i < n) { /* confirmed (a collision or a longer chain takes the full probe) */
            const int32_t candidate = first[i % RING];
            if (candidate >= 0 && key_of(&t, candidate) == ids[i]) {
                rows[i] = candidate;
            } else {
                const part_t *p = &index->parts[part_of(hashes[i % RING])];
                const int64_t slot = probe(p, hashes[i % RING], ids[i], &t);
                rows[i] = slot < 0 ? -1 : p->buckets[slot / SLOTS].rows[slot % SLOTS];
            }
            if (rows[i] >= 0 && (out || touch_offset >= 0))
                finish(&t, rows[i], offset, width, out ? out + i * width : NULL, touch_offset, value, add);
        }
    }
}

/* ---- a request of many tables in one call ------------------------------------------------------------------
 * A training step asks a shard for every table of the model at once; one call per table would cost more in
 * dispatch than in work. The caller holds the lock of every table of the jobs. */

typedef struct {
    void *index;
    const int64_t *chunks;
    int64_t shift, stride;
    const int64_t *ids;
    int64_t n;
    int64_t *rows;           /* out: the row of each id, -1 when absent */
    int64_t offset, width;   /* the field copied to out (width 0: none) */
    char *out;
    int64_t touch_offset;    /* < 0: no touch */
    int32_t value, add;
    int64_t missing;         /* out: ids absent */
} find_job_t;

void lp_find_many(find_job_t *jobs, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
        find_job_t *job = &jobs[j];
        lp_index_find(job->index, job->chunks, job->shift, job->stride, job->ids, job->n, job->rows, job->offset,
                      job->width, job->width ? job->out : NULL, job->touch_offset, job->value, job->add);
        int64_t missing = 0;
        for (int64_t i = 0; i < job->n; ++i) missing += job->rows[i] < 0;
        job->missing = missing;
    }
}

/* IEEE half <-> single conversions, round to nearest even (Marat Dukhan's FP16 library, as PyTorch converts). */
static inline float bits_to_f32(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

static inline float half_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_to_f32(sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized)));
}

static inline uint16_t f32_to_half(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

enum { RULE_SGD = 0, RULE_ADAGRAD = 1, RULE_ROWWISE_ADAGRAD = 2 };

typedef struct {
    void *index;
    const int64_t *chunks;
    int64_t shift, stride;
    const int64_t *ids;      /* strictly increasing (unique), else nothing is applied and not_unique is set */
    int64_t n;
    int64_t *rows;           /* scratch of n rows */
    const float *grads;      /* [n, dim] */
    int64_t dim;
    int64_t weights_offset, state_offset, version_offset;
    int32_t weights_half, rule, version, bounded;
    float lr, eps, weight_decay, bound;
    int64_t applied, absent; /* out */
    int32_t not_unique;      /* out */
} update_job_t;

static inline float load_weight(const char *weights, int32_t half, int64_t k) {
    if (half) {
        uint16_t h;
        memcpy(&h, weights + 2 * k, 2);
        return half_to_f32(h);
    }
    float w;
    memcpy(&w, weights + 4 * k, 4);
    return w;
}

static inline void store_weight(char *weights, int32_t half, int64_t k, float w) {
    if (half) {
        const uint16_t h = f32_to_half(w);
        memcpy(weights + 2 * k, &h, 2);
    } else {
        memcpy(weights + 4 * k, &w, 4);
    }
}

/* One row's update, in float32 and in the order of operations of remote_ps/store/optimizers.py. */
static void update_row(const update_job_t *job, char *r, const float *g) {
    char *weights = r + job->weights_offset;
    float *state = (float *)(void *)(r + job->state_offset); /* 4-byte aligned: records are */
    const int64_t dim = job->dim;
    const float lr = job->lr, wd = job->weight_decay;
    if (job->rule == RULE_ROWWISE_ADAGRAD) {
        float squares = 0.0f;
        for (int64_t k = 0; k < dim; ++k) {
            const float d = wd ? g[k] + wd * load_weight(weights, job->weights_half, k) : g[k];
            squares += d * d;
        }
        float s;
        memcpy(&s, state, 4);
        s += squares / (float)dim;
        memcpy(state, &s, 4);
        const float denominator = sqrtf(s) + job->eps;
        for (int64_t k = 0; k < dim; ++k) {
            const float w = load_weight(weights, job->weights_half, k);
            const float d = wd ? g[k] + wd * w : g[k];
            float updated = w + (-lr) * (d / denominator);
            if (job->bounded) updated = updated < -job->bound ? -job->bound : (updated > job->bound ? job->bound : updated);
            store_weight(weights, job->weights_half, k, updated);
        }
        return;
    }
    for (int64_t k = 0; k < dim; ++k) {
        const float w = load_weight(weights, job->weights_half, k);
        const float d = wd ? g[k] + wd * w : g[k];
        float updated;
        if (job->rule == RULE_ADAGRAD) {
            float s;
            memcpy(&s, state + k, 4);
            s += d * d;
            memcpy(state + k, &s, 4);
            updated = w + (-lr) * (d / (sqrtf(s) + job->eps));
        } else {
            updated = w + (-lr) * d;
        }
        if (job->bounded) updated = updated < -job->bound ? -job->bound : (updated > job->bound ? job->bound : updated);
        store_weight(weights, job->weights_half, k, updated);
    }
}

void lp_update_many(update_job_t *jobs, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
        update_job_t *job = &jobs[j];
        job->applied = job->absent = 0;
        job->not_unique = 0;
        for (int64_t i = 1; i < job->n; ++i) {
            if (job->ids[i] <= job->ids[i - 1]) {
                job->not_unique = 1;
                break;
            }
        }
        if (job->not_unique) continue;
        lp_index_find(job->index, job->chunks, job->shift, job->stride, job->ids, job->n, job->rows, 0, 0, NULL, -1, 0, 0);
        const rows_t t = {job->chunks, job->shift, job->stride};
        for (int64_t i = 0; i < job->n; ++i) {
            if (job->rows[i] < 0) {
                job->absent += 1;
                continue;
            }
            char *r = record(&t, job->rows[i]);
            update_row(job, r, job->grads + i * job->dim);
            memcpy(r + job->version_offset, &job->version, 4);
            job->applied += 1;
        }
    }
}

/* Indexes one absent id (hash h, its record already holding it) at `row`. An insert call rehashes at most
 * REBUILD_BUDGET live rows (`rehashed` counts them across the call). 0, or -1 out of memory. */
static int insert_one(index_t *index, const rows_t *t, uint64_t h, int32_t row, int64_t *rehashed) {
    const uint32_t part = part_of(h);
    part_t *p = &index->parts[part];
    if (p->used + 1 > p->limit) {
        if (*rehashed < REBUILD_BUDGET || p->used + 1 > p->full) {
            *rehashed += p->live;
            if (rebuild(index, part, 1, t)) return -1;
        } else if (p->used == p->limit) {
            index->put_off += 1; /* counted as the partition passes its load */
        }
    }
    const int reused = place(p, h, row);
    p->live += 1;
    p->used += !reused;
    index->live += 1;
    index->inserted += 1;
    return 0;
}

/* Adds ids (unique, absent, their records already holding them) pointing at rows. 0, or -1 out of memory
 * (the ids placed before the failure stay; the caller removes them). */
int64_t lp_index_insert(void *handle, const int64_t *chunks, int64_t shift, int64_t stride, const int64_t *ids,
                        const int64_t *rows, int64_t n) {
    index_t *index = handle;
    const rows_t t = {chunks, shift, stride};
    int64_t rehashed = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int m = (int)(start + BLOCK < n ? BLOCK : n - start);
        uint64_t hashes[BLOCK];
        for (int i = 0; i < m; ++i) {
            const uint64_t h = hashes[i] = hash_of(ids[start + i]);
            const part_t *p = &index->parts[part_of(h)];
            PREFETCH_WRITE(&p->buckets[home_of(h, p->count)]);
        }
        for (int i = 0; i < m; ++i)
            if (insert_one(index, &t, hashes[i], (int32_t)rows[start + i], &rehashed)) return -1;
    }
    return 0;
}

/* Sizes every partition for `rows` ids in all (a load that knows its row count rehashes nothing on the way). */
int64_t lp_index_reserve(void *handle, const int64_t *chunks, int64_t shift, int64_t stride, int64_t rows) {
    index_t *index = handle;
    const rows_t t = {chunks, shift, stride};
    const int64_t per_part = rows / PARTS + 1;
    for (uint32_t part = 0; part < PARTS; ++part) {
        part_t *p = &index->parts[part];
        if (per_part > p->live && (double)per_part > max_load(part) * p->count * SLOTS * 0.9 &&
            rebuild(index, part, (uint32_t)(per_part - p->live), &t))
            return -1;
    }
    return 0;
}

/* Drops the ids present (tombstones); returns how many were. A block's home buckets, then the records their tags
 * point to, are on their way before any of its ids is probed (a tombstone moves no bucket). */
int64_t lp_index_remove(void *handle, const int64_t *chunks, int64_t shift, int64_t stride, const int64_t *ids, int64_t n) {
    index_t *index = handle;
    const rows_t t = {chunks, shift, stride};
    int64_t removed = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        uint64_t hashes[BLOCK];
        const bucket_t *homes[BLOCK];
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = hashes[i - start] = hash_of(ids[i]);
            const part_t *p = &index->parts[part_of(h)];
            homes[i - start] = &p->buckets[home_of(h, p->count)];
            PREFETCH_WRITE(homes[i - start]);
        }
        for (int64_t i = start; i < end; ++i) {
            const uint8_t tag = tag_of(hashes[i - start]);
            for (int s = 0; s < SLOTS; ++s)
                if (homes[i - start]->tags[s] == tag) {
                    PREFETCH(record(&t, homes[i - start]->rows[s]));
                    break;
                }
        }
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = hashes[i - start];
            part_t *p = &index->parts[part_of(h)];
            const int64_t slot = probe(p, h, ids[i], &t);
            if (slot < 0) continue;
            p->buckets[slot / SLOTS].tags[slot % SLOTS] = TOMB_TAG;
            p->live -= 1;
            index->live -= 1;
            removed += 1;
        }
    }
    return removed;
}

/* ---- initial rows ---------------------------------------------------------------------------------------- */

/* The counter-based random word behind column c of the initial row of id: mix64(mix64(id ^ key) + c * GOLDEN)
 * (remote_ps/store/initializers.py computes the same words in tensor ops). */
static inline uint64_t row_word(uint64_t row_key, int64_t c) { return mix64(row_key + (uint64_t)c * SLOT_SALT); }

/* out[i * cols + c]: the word of column c of id ids[i]'s initial row. */
void lp_row_bits(const int64_t *ids, int64_t n, int64_t key, int64_t cols, int64_t *out) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t row_key = mix64((uint64_t)ids[i] ^ (uint64_t)key);
        for (int64_t c = 0; c < cols; ++c) out[i * cols + c] = (int64_t)row_word(row_key, c);
    }
}

/* out[i * cols + c] = (float)(low + (high - low) * u), u = (53 bits of the word + 0.5) / 2^53: a Uniform initial
 * row, in the operations and order of initializers.py (built without fused multiply-adds, so bit for bit). */
static inline float uniform_at(uint64_t row_key, int64_t c, double low, double high) {
    const double u = ((double)(row_word(row_key, c) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    return (float)(low + (high - low) * u);
}

void lp_uniform_rows(const int64_t *ids, int64_t n, int64_t key, int64_t cols, double low, double high, float *out) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t row_key = mix64((uint64_t)ids[i] ^ (uint64_t)key);
        for (int64_t c = 0; c < cols; ++c) out[i * cols + c] = uniform_at(row_key, c, low, high);
    }
}

/* ---- admitting the ids a training lookup did not find ------------------------------------------------------
 * A training step brings ids a table has never seen (most of a growing table's requests). Admitting them in
 * tensor ops took a dozen dispatches per table and request (unique, the initial rows, their fields, the index),
 * more than the lookup itself; here it is one pass: each absent id gets the next row of `fresh`, its record
 * (id, Uniform initial weights bit for bit as lp_uniform_rows, first access value, version, initial optimizer
 * state) is written, the id indexed, and its weights copied to the lookup's output. An id that occurs twice is
 * admitted once: the second occurrence finds the row of the first. */

typedef struct {
    void *index;
    const int64_t *chunks;
    int64_t shift, stride;
    const int64_t *ids;
    int64_t n;
    int64_t *rows;             /* in: the find's rows (-1: absent; -2: read from disk, left there, not admitted);
                                  out: the rows admitted filled in */
    char *out;                 /* [n, weights width]: the lookup's output, filled at the absent ids */
    int64_t dim, weights_offset;
    int32_t weights_half, access_value;
    int64_t access_offset, version_offset;
    int32_t version, pad;
    int64_t state_offset, state_bytes; /* state_bytes 0: no state field */
    const char *state;         /* the initial state of one record (state_bytes) */
    int64_t init_key;
    double low, high;          /* Uniform(low, high) initial weights */
    const int64_t *fresh;      /* rows to take, in order */
    int64_t fresh_count;
    int64_t used;              /* out: rows taken */
} admit_job_t;

/* 0; -1 out of memory (the index could not grow), -2 `fresh` ran out. Either way the ids admitted until then stay,
 * indexed, and job->used counts their rows only. */
int64_t lp_admit(admit_job_t *job) {
    index_t *index = job->index;
    const rows_t t = {job->chunks, job->shift, job->stride};
    const int64_t weight_bytes = job->dim * (job->weights_half ? 2 : 4);
    int64_t rehashed = 0;
    job->used = 0;
    for (int64_t start = 0; start < job->n; start += BLOCK) {
        const int64_t end = start + BLOCK < job->n ? start + BLOCK : job->n;
        uint64_t hashes[BLOCK];
        for (int64_t i = start; i < end; ++i) { /* a block's home buckets on their way before any is read */
            if (job->rows[i] != -1) continue;
            const uint64_t h = hashes[i - start] = hash_of(job->ids[i]);
            const part_t *p = &index->parts[part_of(h)];
            PREFETCH_WRITE(&p->buckets[home_of(h, p->count)]);
        }
        for (int64_t i = start; i < end; ++i) {
            if (job->rows[i] != -1) continue;
            const int64_t id = job->ids[i];
            const uint64_t h = hashes[i - start];
            const part_t *p = &index->parts[part_of(h)];
            const int64_t slot = probe(p, h, id, &t);
            int64_t row;
            if (slot >= 0) {
                row = p->buckets[slot / SLOTS].rows[slot % SLOTS];
            } else {
                if (job->used == job->fresh_count) return -2;
                row = job->fresh[job->used++];
                char *r = record(&t, row);
                memcpy(r, &id, 8);
                char *weights = r + job->weights_offset;
                const uint64_t row_key = mix64((uint64_t)id ^ (uint64_t)job->init_key);
                for (int64_t c = 0; c < job->dim; ++c) {
                    const float w = uniform_at(row_key, c, job->low, job->high);
                    if (job->weights_half) {
                        const uint16_t half = f32_to_half(w);
                        memcpy(weights + 2 * c, &half, 2);
                    } else {
                        memcpy(weights + 4 * c, &w, 4);
                    }
                }
                memcpy(r + job->access_offset, &job->access_value, 4);
                memcpy(r + job->version_offset, &job->version, 4);
                if (job->state_bytes) memcpy(r + job->state_offset, job->state, (size_t)job->state_bytes);
                if (insert_one(index, &t, h, (int32_t)row, &rehashed)) {
                    job->used -= 1; /* not indexed: the caller frees the row with the unused ones */
                    return -1;
                }
            }
            job->rows[i] = row;
            memcpy(job->out + i * weight_bytes, record(&t, row) + job->weights_offset, (size_t)weight_bytes);
        }
    }
    return 0;
}

/* ---- shard ownership ------------------------------------------------------------------------------------ */

/* Index of the first id not owned by shard `shard` of `num_shards`, or -1 when all are. */
int64_t lp_first_foreign(const int64_t *ids, int64_t n, int64_t num_shards, int64_t shard) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t h = mix64((uint64_t)ids[i] ^ SHARD_SALT) & 0x7FFFFFFFFFFFFFFFULL;
        if ((int64_t)(h % (uint64_t)num_shards) != shard) return i;
    }
    return -1;
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

/* ---- the disk tier's id map -------------------------------------------------------------------------------
 * Maps the ids of the rows a table keeps on disk to their slots there, in 8 bytes an entry: a 32-bit fingerprint of
 * the id's hash and the slot + 1 (0: an empty entry). The ids themselves stay on disk, in their records. A match
 * is confirmed by the caller against the record it reads (two ids share a partition and a fingerprint with odds of
 * 2^-32 a comparison); `skip` asks for the next match after a false one.
 * Linear probing in 4,096 partitions (the top 12 bits of the hash), each grown on its own when it passes a load of
 * 0.75 .. 0.85 (spread over the partitions, so that they grow at different times), to a load of 0.6: ~12 bytes an
 * id on average, ~12 GB for a billion. An id absent from the map (every new id of a growing table) reads its whole
 * run of entries: ~13 on average at a load of 0.8, ~140 at 0.94 (linear probing's expected miss). An entry's home is derived from its fingerprint, so a partition grows without
 * reading any id. Removal shifts the entries after it back (no tombstones). */

#define DM_PART_BITS 12
#define DM_PARTS (1u << DM_PART_BITS)
#define DM_TARGET_LOAD 0.6
static const uint64_t DISK_SALT = 0xD1B54A32D192ED03ULL;

typedef struct {
    uint64_t *entries;
    uint64_t size;
    uint64_t live;
    uint64_t limit; /* grows past this */
    int32_t borrowed; /* entries belong to the caller (a mapped file): never freed here */
} dm_part_t;

typedef struct { /* the entries removed from one partition since a save's point, until the save copied it */
    uint64_t *entries;
    int64_t n, capacity;
} dm_log_t;

typedef struct {
    dm_part_t parts[DM_PARTS];
    int64_t live;
    int64_t slots; /* entries allocated in all */
    int64_t boundary; /* while a save runs (see lp_dmap_save_begin): slots at or past it came after its point */
    dm_log_t *logs;   /* while a save runs: a log per partition not yet copied, NULL once copied */
    uint8_t *copied;
    int32_t save_failed;
} dmap_t;

static inline uint64_t dm_hash(int64_t id) { return mix64((uint64_t)id ^ DISK_SALT); }
static inline uint32_t dm_part_of(uint64_t h) { return (uint32_t)(h >> (64 - DM_PART_BITS)); }
static inline uint32_t dm_fp_of(uint64_t h) { return (uint32_t)(h >> (32 - DM_PART_BITS)); }
static inline uint64_t dm_home(uint32_t fp, uint64_t size) { return ((uint64_t)fp * size) >> 32; }
static inline uint64_t dm_next(uint64_t i, uint64_t size) { return i + 1 == size ? 0 : i + 1; }
/* Steps from entry `from` forward to entry `to`, wrapping (both < size): a compare, where a `%` would divide. */
static inline uint64_t dm_distance(uint64_t from, uint64_t to, uint64_t size) { return to >= from ? to - from : to + size - from; }
static double dm_max_load(uint32_t part) { return 0.75 + 0.1 * (double)(mix64(part + 7) >> 11) / (double)(1ULL << 53); }

static int dm_part_init(dm_part_t *p, uint32_t part, uint64_t size) {
    uint64_t *entries = calloc(size, sizeof(uint64_t));
    if (!entries) return -1;
    commit_pages(entries, size * sizeof(uint64_t));
    p->entries = entries;
    p->size = size;
    p->limit = (uint64_t)(dm_max_load(part) * (double)size);
    if (p->limit >= size) p->limit = size - 1; /* an empty entry always ends a probe */
    p->live = 0;
    p->borrowed = 0;
    return 0;
}

void *lp_dmap_new(void) {
    dmap_t *map = calloc(1, sizeof(dmap_t));
    if (!map) return NULL;
    for (uint32_t p = 0; p < DM_PARTS; ++p) {
        if (dm_part_init(&map->parts[p], p, 16)) {
            for (uint32_t q = 0; q < p; ++q) free(map->parts[q].entries);
            free(map);
            return NULL;
        }
    }
    map->slots = 16 * (int64_t)DM_PARTS;
    return map;
}

static void dm_save_clear(dmap_t *map) {
    if (map->logs)
        for (uint32_t p = 0; p < DM_PARTS; ++p) free(map->logs[p].entries);
    free(map->logs);
    free(map->copied);
    map->logs = NULL;
    map->copied = NULL;
}

void lp_dmap_free(void *handle) {
    dmap_t *map = handle;
    if (!map) return;
    for (uint32_t p = 0; p < DM_PARTS; ++p)
        if (!map->parts[p].borrowed) free(map->parts[p].entries);
    dm_save_clear(map);
    free(map);
}

void lp_dmap_info(const void *handle, int64_t *out) {
    const dmap_t *map = handle;
    out[0] = map->live;
    out[1] = map->slots * (int64_t)sizeof(uint64_t) + (int64_t)sizeof(dmap_t);
}

static void dm_place(dm_part_t *p, uint64_t entry) {
    uint64_t i = dm_home((uint32_t)(entry >> 32), p->size);
    while (p->entries[i]) i = dm_next(i, p->size);
    p->entries[i] = entry;
}

static int dm_grow(dmap_t *map, uint32_t part) {
    dm_part_t *p = &map->parts[part], fresh;
    if (dm_part_init(&fresh, part, (uint64_t)((double)(p->live + 1) / DM_TARGET_LOAD) + 16)) return -1;
    for (uint64_t i = 0; i < p->size; ++i)
        if (p->entries[i]) dm_place(&fresh, p->entries[i]);
    fresh.live = p->live;
    map->slots += (int64_t)fresh.size - (int64_t)p->size;
    if (!p->borrowed) free(p->entries);
    *p = fresh;
    return 0;
}

/* slots[i] of ids[i], added; an id already there is not looked for (the caller removes it first). Returns the
 * entries added, fewer than n only when memory ran out. */
int64_t lp_dmap_insert(void *handle, const int64_t *ids, const int64_t *slots, int64_t n) {
    dmap_t *map = handle;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        uint64_t hashes[BLOCK];
        for (int64_t i = start; i < end; ++i) { /* a block's home entries on their way before any is written */
            const uint64_t h = hashes[i - start] = dm_hash(ids[i]);
            const dm_part_t *p = &map->parts[dm_part_of(h)];
            PREFETCH_WRITE(&p->entries[dm_home(dm_fp_of(h), p->size)]);
        }
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = hashes[i - start];
            const uint32_t part = dm_part_of(h);
            if (map->parts[part].live + 1 > map->parts[part].limit && dm_grow(map, part)) return i;
            dm_place(&map->parts[part], ((uint64_t)dm_fp_of(h) << 32) | (uint64_t)(slots[i] + 1));
            map->parts[part].live += 1;
            map->live += 1;
        }
    }
    return n;
}

/* out[i]: the slot of the (skip[i] + 1)-th entry whose fingerprint matches ids[i] (skip NULL: the first), or -1. */
void lp_dmap_find(const void *handle, const int64_t *ids, int64_t n, const int64_t *skip, int64_t *out) {
    const dmap_t *map = handle;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = dm_hash(ids[i]);
            const dm_part_t *p = &map->parts[dm_part_of(h)];
            PREFETCH(&p->entries[dm_home(dm_fp_of(h), p->size)]);
        }
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = dm_hash(ids[i]);
            const dm_part_t *p = &map->parts[dm_part_of(h)];
            const uint32_t fp = dm_fp_of(h);
            int64_t pass = skip ? skip[i] : 0, found = -1;
            for (uint64_t j = dm_home(fp, p->size); p->entries[j]; j = dm_next(j, p->size)) {
                if ((uint32_t)(p->entries[j] >> 32) == fp && pass-- == 0) {
                    found = (int64_t)(p->entries[j] & 0xFFFFFFFFULL) - 1;
                    break;
                }
            }
            out[i] = found;
        }
    }
}

/* Keeps `entry` (of `slot`), about to leave partition `part`, for the save under way if it still needs it: a
 * partition not yet copied, a slot from before the save's point (see lp_dmap_save_begin). */
static void dm_log_leaving(dmap_t *map, uint32_t part, uint64_t entry, int64_t slot) {
    if (!map->logs || map->copied[part] || slot >= map->boundary) return;
    dm_log_t *log = &map->logs[part];
    if (log->n == log->capacity) {
        const int64_t capacity = log->capacity ? 2 * log->capacity : 64;
        uint64_t *grown = realloc(log->entries, (size_t)capacity * sizeof(uint64_t));
        if (!grown) map->save_failed = 1;
        else log->entries = grown, log->capacity = capacity;
    }
    if (log->n < log->capacity) log->entries[log->n++] = entry;
}

/* Re-points the entry (ids[i], from[i]) of each i where present to slot to[i], in place: the same id has the same
 * fingerprint and home, so one probe does what a removal and an insertion would in two. Returns how many were
 * present. A save under way keeps the old entry, as after lp_dmap_remove. */
int64_t lp_dmap_move(void *handle, const int64_t *ids, const int64_t *from, const int64_t *to, int64_t n) {
    dmap_t *map = handle;
    int64_t moved = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        for (int64_t i = start; i < end; ++i) { /* a block's home entries on their way before any is read */
            const uint64_t h = dm_hash(ids[i]);
            const dm_part_t *p = &map->parts[dm_part_of(h)];
            PREFETCH_WRITE(&p->entries[dm_home(dm_fp_of(h), p->size)]);
        }
        for (int64_t i = start; i < end; ++i) {
            const uint64_t h = dm_hash(ids[i]);
            const uint32_t part = dm_part_of(h);
            dm_part_t *p = &map->parts[part];
            const uint64_t key = (uint64_t)dm_fp_of(h) << 32, entry = key | (uint64_t)(from[i] + 1);
            uint64_t j = dm_home(dm_fp_of(h), p->size);
            while (p->entries[j] && p->entries[j] != entry) j = dm_next(j, p->size);
            if (!p->entries[j]) continue;
            dm_log_leaving(map, part, entry, from[i]);
            p->entries[j] = key | (uint64_t)(to[i] + 1);
            moved += 1;
        }
    }
    return moved;
}

/* Drops the entry (ids[i], slots[i]) of each i where present; returns how many were. */
int64_t lp_dmap_remove(void *handle, const int64_t *ids, const int64_t *slots, int64_t n) {
    dmap_t *map = handle;
    int64_t removed = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (i % BLOCK == 0) { /* the next block's home entries on their way */
            for (int64_t j = i; j < i + BLOCK && j < n; ++j) {
                const uint64_t hj = dm_hash(ids[j]);
                const dm_part_t *pj = &map->parts[dm_part_of(hj)];
                PREFETCH_WRITE(&pj->entries[dm_home(dm_fp_of(hj), pj->size)]);
            }
        }
        const uint64_t h = dm_hash(ids[i]);
        dm_part_t *p = &map->parts[dm_part_of(h)];
        const uint64_t entry = ((uint64_t)dm_fp_of(h) << 32) | (uint64_t)(slots[i] + 1), size = p->size;
        uint64_t j = dm_home(dm_fp_of(h), size);
        while (p->entries[j] && p->entries[j] != entry) j = dm_next(j, size);
        if (!p->entries[j]) continue;
        dm_log_leaving(map, dm_part_of(h), entry, slots[i]);
        /* backward shift: an entry after the hole moves into it unless its home lies cyclically in (hole, entry] */
        uint64_t hole = j;
        for (uint64_t k = dm_next(hole, size); p->entries[k]; k = dm_next(k, size)) {
            const uint64_t home = dm_home((uint32_t)(p->entries[k] >> 32), size);
            if (dm_distance(home, k, size) >= dm_distance(hole, k, size)) {
                p->entries[hole] = p->entries[k];
                hole = k;
            }
        }
        p->entries[hole] = 0;
        p->live -= 1;
        map->live -= 1;
        removed += 1;
    }
    return removed;
}

/* For each slot s = slots[i], bit s & 7 of byte (s & (2^shift - 1)) >> 3 of the bits at pages[s >> shift] becomes
 * `value` (each segment's live slots, a bit each, 2^shift bits a segment); changed[page] counts the bits of each
 * page that were not `value` before. Returns -1, or the first i whose page is absent (0, or past num_pages), having
 * set the bits before it. */
int64_t lp_set_bits(const int64_t *pages, int64_t num_pages, int64_t shift, const int64_t *slots, int64_t n, int32_t value,
                    int64_t *changed) {
    const int64_t mask = (1LL << shift) - 1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t page = slots[i] >> shift;
        if (slots[i] < 0 || page >= num_pages || !pages[page]) return i;
        uint8_t *byte = (uint8_t *)(intptr_t)pages[page] + ((slots[i] & mask) >> 3);
        const uint8_t bit = (uint8_t)(1u << (slots[i] & 7));
        changed[page] += ((*byte & bit) != 0) != (value != 0);
        if (value) *byte |= bit;
        else *byte &= (uint8_t)~bit;
    }
    return -1;
}

/* out[i]: the bit of slots[i] as lp_set_bits addresses it (1: set), 0 where the slot is < 0 or its page absent. */
void lp_get_bits(const int64_t *pages, int64_t num_pages, int64_t shift, const int64_t *slots, int64_t n, uint8_t *out) {
    const int64_t mask = (1LL << shift) - 1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t page = slots[i] >> shift;
        out[i] = slots[i] >= 0 && page < num_pages && pages[page]
                     ? (((const uint8_t *)(intptr_t)pages[page])[(slots[i] & mask) >> 3] >> (slots[i] & 7)) & 1
                     : 0;
    }
}

/* Reads the records of `slots` (record r of segment r >> shift: `stride` bytes at (r & (2^shift - 1)) * stride of
 * the file fds[r >> shift]) into out[into[i]] (into NULL: out[i]), in the order given (the caller sorts them:
 * neighbouring records share their pages); a slot < 0 leaves its row of out as it is. A record among the first
 * mapped[s] of a segment mapped at bases[s] (populated: its pages in the process's page tables) is copied from
 * there, any other read with pread; reads[s] counts the records read of each segment. Returns 0, or -(i + 1) for the first record that could not be read
 * whole, its errno in *error (0: the file ends before it). */
int64_t lp_read_records(const int64_t *fds, const int64_t *bases, const int64_t *mapped, int64_t *reads, int64_t shift,
                        int64_t stride, const int64_t *slots, int64_t n, const int64_t *into, char *out, int64_t *error) {
    const int64_t mask = (1LL << shift) - 1;
    int64_t checked = -1, size = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        const int64_t segment = slots[i] >> shift, offset = (slots[i] & mask) * stride;
        char *row = out + (into ? into[i] : i) * stride;
        reads[segment] += 1;
        if (bases[segment] && (slots[i] & mask) < mapped[segment]) {
            if (segment != checked) { /* a file that shrank under the tier: its lost records are errors, not SIGBUS */
                struct stat info;
                if (fstat((int)fds[segment], &info)) {
                    *error = errno;
                    return -(i + 1);
                }
                checked = segment;
                size = (int64_t)info.st_size;
            }
            if (offset + stride > size) {
                *error = 0;
                return -(i + 1);
            }
            memcpy(row, (const char *)(intptr_t)bases[segment] + offset, (size_t)stride);
            continue;
        }
        errno = 0;
        if (pread((int)fds[segment], row, (size_t)stride, (off_t)offset) != stride) {
            *error = errno;
            return -(i + 1);
        }
    }
    return 0;
}

/* The first `bytes` of file `fd` mapped read-only and shared (a segment's records, see lp_read_records), or with
 * `private` as a copy on write (a saved id map adopted by lp_dmap_adopt: what is written stays in the process);
 * NULL when the mapping fails, its errno in *error. */
void *lp_map_file(int64_t fd, int64_t bytes, int64_t private, int64_t *error) {
    void *address = mmap(NULL, (size_t)bytes, private ? PROT_READ | PROT_WRITE : PROT_READ, private ? MAP_PRIVATE : MAP_SHARED,
                         (int)fd, 0);
    if (address == MAP_FAILED) {
        *error = errno;
        return NULL;
    }
    madvise(address, (size_t)bytes, MADV_RANDOM); /* records and hash probes: no read-ahead of their neighbours */
    return address;
}

void lp_unmap_file(void *address, int64_t bytes) { munmap(address, (size_t)bytes); }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

/* Puts `bytes` of a mapping at `address` into the process's page tables (reading what the page cache lacks), or
 * with `drop` takes them out (the page cache keeps them). Returns 0, or the errno. */
int64_t lp_map_pages(void *address, int64_t bytes, int64_t drop) {
    return madvise(address, (size_t)bytes, drop ? MADV_DONTNEED : MADV_POPULATE_READ) ? errno : 0;
}

/* ---- the id map in a checkpoint ----------------------------------------------------------------------------
 * A save copies the map as it was at its point one partition at a time, while the table serves between two
 * partitions: entries added after the point (their slots at or past `boundary`: demotions write new segments) are
 * left out of a copy, and entries removed after the point (promotions, expiry) are logged until their partition is
 * copied, then put back into the copy. A restarted shard adopts the copies (mapped from the checkpoint) instead of
 * indexing every id again. */

/* Starts a save whose point is now: slots at or past `boundary` are written after it. Returns 0, or -1 without
 * memory for the logs (any earlier save's logs are dropped first). */
int64_t lp_dmap_save_begin(void *handle, int64_t boundary) {
    dmap_t *map = handle;
    dm_save_clear(map);
    map->logs = calloc(DM_PARTS, sizeof(dm_log_t));
    map->copied = calloc(DM_PARTS, 1);
    map->save_failed = 0;
    map->boundary = boundary;
    if (!map->logs || !map->copied) {
        dm_save_clear(map);
        return -1;
    }
    return 0;
}

/* Partition `part` as at the save's point, into out (zeroed by the caller, `capacity` entries): returns its size in
 * entries, its live entries in *live; -(size) when out is too small (nothing copied), -1 LL << 62 when no save runs
 * or a log could not grow (the save must fail). */
int64_t lp_dmap_save_part(void *handle, int64_t part, uint64_t *out, int64_t capacity, int64_t *live) {
    dmap_t *map = handle;
    if (!map->logs || map->save_failed) return -(1LL << 62);
    const dm_part_t *p = &map->parts[part];
    if ((int64_t)p->size > capacity) return -(int64_t)p->size;
    dm_part_t copy = {out, p->size, 0, p->size, 1};
    for (uint64_t i = 0; i < p->size; ++i) {
        const uint64_t entry = p->entries[i];
        if (entry && (int64_t)(entry & 0xFFFFFFFFULL) - 1 < map->boundary) dm_place(&copy, entry), copy.live += 1;
    }
    const dm_log_t *log = &map->logs[part];
    for (int64_t i = 0; i < log->n; ++i) dm_place(&copy, log->entries[i]), copy.live += 1;
    free(map->logs[part].entries);
    map->logs[part] = (dm_log_t){0};
    map->copied[part] = 1;
    *live = (int64_t)copy.live;
    return (int64_t)p->size;
}

/* Ends a save (done or abandoned): nothing is logged any more. */
void lp_dmap_save_end(void *handle) { dm_save_clear(handle); }

/* Partition `part` of an empty map takes `entries` (`size` entries, `live` of them set, as lp_dmap_save_part wrote
 * them): the caller's memory, kept until lp_dmap_free, never freed here (a grown partition moves into its own).
 * Returns 0, or -1 when the partition is not empty or the sizes cannot be. */
int64_t lp_dmap_adopt(void *handle, int64_t part, uint64_t *entries, int64_t size, int64_t live) {
    dmap_t *map = handle;
    dm_part_t *p = &map->parts[part];
    if (p->live || size < 16 || live < 0 || live >= size) return -1;
    map->slots += size - (int64_t)p->size;
    if (!p->borrowed) free(p->entries);
    p->entries = entries;
    p->size = (uint64_t)size;
    p->live = (uint64_t)live;
    p->limit = (uint64_t)(dm_max_load((uint32_t)part) * (double)size);
    if (p->limit >= p->size) p->limit = p->size - 1;
    if (p->limit < p->live) p->limit = p->live; /* full as saved: the next insert grows it */
    p->borrowed = 1;
    map->live += live;
    return 0;
}
