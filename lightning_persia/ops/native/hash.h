/* The ids' hash, shared by the trainer's kernels (ids.c) and the parameter server store's
 * (remote_ps/store/native/store.h includes this file): lightning_persia.ops.hashing's splitmix64 finaliser and its
 * salts, bit for bit, so that the trainer and the shards place and index an id alike. */
#ifndef LP_HASH_H
#define LP_HASH_H

#include <stdint.h>

static const uint64_t SLOT_SALT = 0x9E3779B97F4A7C15ULL;
static const uint64_t SHARD_SALT = 0x2545F4914F6CDD1DULL;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#endif
