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
