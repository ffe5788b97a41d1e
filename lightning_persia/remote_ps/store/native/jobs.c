/* A training request's kernels: the lookups and the sparse updates of many tables in one call, and the admission of
 * the ids a table's lookup did not find. They work on the id index (id_index.c) and the rows (store.h). */
#include "store.h"

/* ---- a request of many tables in one call ------------------------------------------------------------------
 * A training step asks a shard for every table of the model at once; one call per table would cost more in
 * dispatch than in work. The caller holds the lock of every table of the jobs. */

/* The fields every job begins with (jobs.py's _HEAD): a table's index and rows (store.h), the job's ids and a row
 * for each (what `rows` holds on the way in and out is each job's own). */
#define JOB_HEAD           \
    void *index;           \
    const int64_t *chunks; \
    int64_t shift, stride; \
    const int64_t *ids;    \
    int64_t n;             \
    int64_t *rows;

typedef struct {
    JOB_HEAD                 /* rows, out: the row of each id, -1 when absent */
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
    JOB_HEAD                 /* ids strictly increasing (unique), else nothing is applied and not_unique is set;
                                rows: scratch */
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

/* ---- admitting the ids a training lookup did not find ------------------------------------------------------
 * A training step brings ids a table has never seen (most of a growing table's requests). Admitting them in
 * tensor ops took a dozen dispatches per table and request (unique, the initial rows, their fields, the index),
 * more than the lookup itself; here it is one pass: each absent id gets the next row of `fresh`, its record
 * (id, Uniform initial weights bit for bit as lp_uniform_rows, first access value, version, initial optimizer
 * state) is written, the id indexed, and its weights copied to the lookup's output. An id that occurs twice is
 * admitted once: the second occurrence finds the row of the first. */

typedef struct {
    JOB_HEAD                   /* rows, in: the find's rows (-1: absent; -2: read from disk, left there, not
                                  admitted); out: the rows admitted filled in */
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
