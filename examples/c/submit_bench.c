/* The source SDK's submission benchmark in C (scripts/bench_sdk.py runs it).
 *
 *   submit_bench CONFIG.toml SOURCE SIZE COUNT
 *
 * Submits COUNT fragments of SIZE bytes for board SOURCE, fragment i into slice
 * first + i, from one buffer a readout would reuse (libshoal copies it), then flushes and
 * closes. Prints one JSON object: submitting and closing times (s, CLOCK_MONOTONIC) and the
 * end-of-run report. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shoal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s CONFIG.toml SOURCE SIZE COUNT\n", argv[0]);
        return 2;
    }
    uint32_t source = (uint32_t)strtoul(argv[2], NULL, 10);
    size_t size = (size_t)strtoull(argv[3], NULL, 10);
    uint64_t count = strtoull(argv[4], NULL, 10);
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 1;
    for (size_t i = 0; i < size; i++) buf[i] = (uint8_t)(i * 7);

    ShoalSource *src = NULL;
    if (shoal_source_open(argv[1], &src) != SHOAL_STATUS_OK) {
        fprintf(stderr, "submit_bench: %s\n", shoal_last_error());
        return 1;
    }
    uint64_t first = shoal_source_first_slice(src);
    double t0 = now_s();
    for (uint64_t i = 0; i < count; i++) {
        buf[0] = (uint8_t)i;
        int rc = shoal_source_submit_slice(src, source, first + i, buf, size);
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
    free(buf);
    return 0;
}
