/* The id index of a table: id -> row. The keys themselves stay in the table's ids field (row-aligned), so a slot holds
 * a row number and a one-byte tag (8 bits of the id's hash) that spares reading the key of almost every other slot.
 *
 * Slots come in buckets of 12, one cache line each; a probe reads the home bucket, then the next ones while they are
 * full and marked `overflowed` (an insert passed through them). The index is split into 2^PART_BITS partitions by the
 * top bits of the hash, each grown on its own (to a load of 0.5, once it reaches a load between 0.72 and 0.94 that
 * differs per partition), so growing the table rehashes a small slice at a time: no request ever waits for the whole
 * index to be rebuilt, whatever the table size. Bucket counts need not be powers of two (the home bucket is a
 * multiply-shift of 32 hash bits), so a partition grows by what its load asks.
 *
 * A rebuild reads the key of every live row of its partition (a cache miss each: ~5 ms for 80k rows on the
 * development machine), and the partitions that pass their load in one insert call come in
 * random numbers: up to five rebuilds of ~290k rows each in one 65,536-id request at 300M rows with 1,024 partitions,
 * 0.1 s of a table's lock. So an insert call rehashes at most REBUILD_BUDGET rows (beyond it, a partition past its
 * load still takes ids, up to FULL_LOAD, and grows in a later call), and 4,096 partitions keep one rebuild a small
 * part of that. The budget must stay above what inserting asks for on average: growing from a load L to 0.5 rehashes
 * 0.5 / (L - 0.5) rows per row inserted: 1.6 over the spread of L, ~105k rows per 65,536 new ids (a target of 0.55
 * would ask 2.3: the target is chosen for this as much as for memory). */
#include "store.h"

#define TARGET_LOAD 0.5
#define FULL_LOAD 0.97     /* a partition whose rebuild was put off grows at this load whatever the budget */
#define REBUILD_BUDGET (1 << 17) /* live rows one insert call rehashes before it puts off further rebuilds */
#define REHASH_AHEAD 64

static double max_load(uint32_t part) { /* 0.72 .. 0.94, spread over the partitions so they grow at different times */
    return 0.72 + 0.22 * (double)(mix64(part + 1) >> 11) / (double)(1ULL << 53);
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

/* Indexes one absent id (hash h, its record already holding it) at `row`. An insert call rehashes at most
 * REBUILD_BUDGET live rows (`rehashed` counts them across the call). 0, or -1 out of memory. */
int insert_one(index_t *index, const rows_t *t, uint64_t h, int32_t row, int64_t *rehashed) {
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
