/* The fields of a table's rows: gathered, scattered, set, swept for eviction, and the initial rows of new ids.
 * (The layout of the rows in chunks is store.h's.) */
#include "store.h"

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
/* NAME_4, NAME_8, NAME_32, NAME_64 and NAME_any (any width), and the call of the one for `width`. */
#define ROW_LOOPS(NAME, PREFETCH_OP, COPY)                 \
    ROW_LOOP(NAME##_4, 4, PREFETCH_OP, COPY(4))            \
    ROW_LOOP(NAME##_8, 8, PREFETCH_OP, COPY(8))            \
    ROW_LOOP(NAME##_32, 32, PREFETCH_OP, COPY(32))         \
    ROW_LOOP(NAME##_64, 64, PREFETCH_OP, COPY(64))         \
    ROW_LOOP(NAME##_any, width, PREFETCH_OP, COPY(width))
#define BY_WIDTH(NAME, ...)                    \
    switch (width) {                           \
        case 4: NAME##_4(__VA_ARGS__); break;   \
        case 8: NAME##_8(__VA_ARGS__); break;   \
        case 32: NAME##_32(__VA_ARGS__); break; \
        case 64: NAME##_64(__VA_ARGS__); break; \
        default: NAME##_any(__VA_ARGS__);       \
    }
ROW_LOOPS(gather, PREFETCH_SPAN, GATHER)
ROW_LOOPS(scatter, PREFETCH_WRITE_SPAN, SCATTER)

/* out[i] = the field of row rows[i]; rows[i] < 0 leaves out[i] as it is. */
void lp_gather(const int64_t *chunks, int64_t shift, int64_t stride, int64_t offset, int64_t width, const int64_t *rows,
               int64_t n, char *out) {
    const rows_t t = {chunks, shift, stride};
    BY_WIDTH(gather, &t, offset, width, rows, n, out)
}

/* The field of row rows[i] = src[i]; rows[i] < 0 is skipped. */
void lp_scatter(const int64_t *chunks, int64_t shift, int64_t stride, int64_t offset, int64_t width, const int64_t *rows,
                int64_t n, const char *src) {
    const rows_t t = {chunks, shift, stride};
    char *data = (char *)(intptr_t)src; /* read only: the loops share one signature */
    BY_WIDTH(scatter, &t, offset, width, rows, n, data)
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

/* Rows first .. first + n - 1 (of one chunk) that a snapshot keeps, ascending, into out; returns how many. Kept: the
 * int32 version at version_offset is at most `point` and, where `since` is not 0, above it; the int32 access at
 * access_offset is not `free_mark`; and, where slot_mask is given, the routing slot of the int64 id at id_offset
 * (ops/hashing.py's slot_of over `slots` slots, a power of two) is set in it.
 * A live move's wave reads every row of its source this way, in one pass over the records (3.6 ns a row), under the
 * table's lock: as tensor operations over strided views of the fields (compare, mask, nonzero, gather the ids, hash,
 * look up the slot) a wave's read of a 5M-row table took 0.20 s of CPU, copy included, against 0.09 s now. */
int64_t lp_select_kept(const int64_t *chunks, int64_t shift, int64_t stride, int64_t first, int64_t n,
                       int64_t version_offset, int64_t access_offset, int64_t id_offset, int64_t point, int64_t since,
                       int32_t free_mark, const uint8_t *slot_mask, int64_t slots, int64_t *out) {
    const rows_t t = {chunks, shift, stride};
    const uint64_t slot_bits = (uint64_t)slots - 1;
    int64_t found = 0;
    for (int64_t row = first; row < first + n; ++row) {
        const char *r = record(&t, row);
        int32_t version, access;
        memcpy(&version, r + version_offset, 4);
        memcpy(&access, r + access_offset, 4);
        if (version > point || (since && version <= since) || access == free_mark) continue;
        if (slot_mask) {
            int64_t id;
            memcpy(&id, r + id_offset, 8);
            if (!slot_mask[mix64((uint64_t)id ^ SHARD_SALT) & slot_bits]) continue;
        }
        out[found++] = row;
    }
    return found;
}

/* ---- initial rows (the words: store.h's row_word) ------------------------------------------------------- */

/* out[i * cols + c]: the word of column c of id ids[i]'s initial row. */
void lp_row_bits(const int64_t *ids, int64_t n, int64_t key, int64_t cols, int64_t *out) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t row_key = mix64((uint64_t)ids[i] ^ (uint64_t)key);
        for (int64_t c = 0; c < cols; ++c) out[i * cols + c] = (int64_t)row_word(row_key, c);
    }
}

/* out[i * cols + c]: column c of id ids[i]'s Uniform(low, high) initial row (store.h's uniform_at). */
void lp_uniform_rows(const int64_t *ids, int64_t n, int64_t key, int64_t cols, double low, double high, float *out) {
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t row_key = mix64((uint64_t)ids[i] ^ (uint64_t)key);
        for (int64_t c = 0; c < cols; ++c) out[i * cols + c] = uniform_at(row_key, c, low, high);
    }
}
