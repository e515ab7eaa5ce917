/* The source SDK's submission benchmark in C (scripts/bench_sdk.py runs it).
 *
 *   submit_bench CONFIG.toml SOURCE SIZE COUNT [copy|lent]
 *
 * Submits COUNT fragments of SIZE bytes for board SOURCE, fragment i into slice
 * first + i, then closes. `copy` (default): from one buffer a readout would reuse,
 * shoal_source_submit_slice copies it. `lent`: from a ring of 256 buffers, as a readout
 * with a DMA ring, lent with shoal_source_submit_slice_lent; shoal's release callback puts
 * each back and the submitter waits for a free one. Prints one JSON object: submitting and
 * closing times (s, CLOCK_MONOTONIC) and the end-of-run report. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shoal.h"

#define RING 256

/* The ring of free buffers: a stack under a mutex, refilled by shoal's threads. */
struct ring {
    pthread_mutex_t lock;
    pthread_cond_t freed;
    uint8_t *free[RING];
    int n_free;
};

static void release(void *user, const uint8_t *data, size_t len) {
    (void)len;
    struct ring *r = user;
    pthread_mutex_lock(&r->lock);
    r->free[r->n_free++] = (uint8_t *)data;
    pthread_cond_signal(&r->freed);
    pthread_mutex_unlock(&r->lock);
}

static uint8_t *take(struct ring *r) {
    pthread_mutex_lock(&r->lock);
    while (r->n_free == 0) pthread_cond_wait(&r->freed, &r->lock);
    uint8_t *b = r->free[--r->n_free];
    pthread_mutex_unlock(&r->lock);
    return b;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: %s CONFIG.toml SOURCE SIZE COUNT [copy|lent]\n", argv[0]);
        return 2;
    }
    uint32_t source = (uint32_t)strtoul(argv[2], NULL, 10);
    size_t size = (size_t)strtoull(argv[3], NULL, 10);
    uint64_t count = strtoull(argv[4], NULL, 10);
    int lent = argc == 6 && strcmp(argv[5], "lent") == 0;
    size_t cap = size ? size : 1;

    static struct ring ring = {.lock = PTHREAD_MUTEX_INITIALIZER, .freed = PTHREAD_COND_INITIALIZER};
    for (int i = 0; i < (lent ? RING : 1); i++) {
        uint8_t *b = malloc(cap);
        if (!b) return 1;
        for (size_t j = 0; j < size; j++) b[j] = (uint8_t)(j * 7);
        ring.free[ring.n_free++] = b;
    }

    ShoalSource *src = NULL;
    if (shoal_source_open(argv[1], &src) != SHOAL_STATUS_OK) {
        fprintf(stderr, "submit_bench: %s\n", shoal_last_error());
        return 1;
    }
    uint64_t first = shoal_source_first_slice(src);
    double t0 = now_s();
    for (uint64_t i = 0; i < count; i++) {
        int rc;
        if (lent) {
            uint8_t *b = take(&ring);
            b[0] = (uint8_t)i; /* the readout's fresh data */
            rc = shoal_source_submit_slice_lent(src, source, first + i, b, size, release, &ring);
        } else {
            ring.free[0][0] = (uint8_t)i;
            rc = shoal_source_submit_slice(src, source, first + i, ring.free[0], size);
        }
        if (rc != SHOAL_STATUS_OK) {
            fprintf(stderr, "submit_bench: fragment %llu refused (%d): %s\n", (unsigned long long)i, rc,
                    shoal_last_error());
            return 1;
        }
    }
    double t1 = now_s();
    char *report = NULL;
    if (shoal_source_close(src, &report) != SHOAL_STATUS_OK) {
        fprintf(stderr, "submit_bench: close: %s\n", shoal_last_error());
        return 1;
    }
    double t2 = now_s();
    printf("{\"submit_s\": %.6f, \"close_s\": %.6f, \"report\": %s}\n", t1 - t0, t2 - t1, report);
    shoal_string_free(report);
    if (ring.n_free != (lent ? RING : 1)) {
        fprintf(stderr, "submit_bench: %d of the ring's buffers not released\n", (lent ? RING : 1) - ring.n_free);
        return 1;
    }
    for (int i = 0; i < ring.n_free; i++) free(ring.free[i]);
    return 0;
}
