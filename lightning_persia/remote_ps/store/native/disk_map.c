/* The disk tier's id map: the ids of the rows a table keeps on disk -> their slots there, in 8 bytes an entry: a
 * 32-bit fingerprint of the id's hash and the slot + 1 (0: an empty entry). The ids themselves stay on disk, in their
 * records. A match is confirmed by the caller against the record it reads (two ids share a partition and a fingerprint
 * with odds of 2^-32 a comparison); `skip` asks for the next match after a false one. Linear probing in 4,096
 * partitions (the top 12 bits of the hash), each grown on its own when it passes a load of 0.75 .. 0.85 (spread over
 * the partitions, so that they grow at different times), to a load of 0.6: ~12 bytes an id on average, ~12 GB for a
 * billion. An id absent from the map (every new id of a growing table) reads its whole run of entries: ~13 on average
 * at a load of 0.8, ~140 at 0.94 (linear probing's expected miss). An entry's home is derived from its fingerprint, so
 * a partition grows without reading any id. Removal shifts the entries after it back (no tombstones). */
#include "store.h"

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
