/* The disk tier's records: read from their segments (copied from a mapping, or read with pread), the segments'
 * files mapped and their pages brought in or dropped, and the bits of the slots that hold a live record. */
#include "store.h"

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
