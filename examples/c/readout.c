/* A readout program that hands its boards' fragments to shoal through libshoal.
 *
 *   readout CONFIG.toml FIRST_SOURCE N_SOURCES SLICES SLICE_MS
 *
 * CONFIG.toml is any shoal configuration whose [source] ids are the boards this program
 * reads and whose input_time_base is "run" (data times count from the run's start). Each
 * board's fragment of each slice is submitted with its data time; at the end the program
 * flushes, closes and prints the end-of-run report (JSON) on stdout. */
#include <stdio.h>
#include <stdlib.h>

#include "pattern.h"
#include "shoal.h"

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s CONFIG.toml FIRST_SOURCE N_SOURCES SLICES SLICE_MS\n", argv[0]);
        return 2;
    }
    uint32_t first = (uint32_t)strtoul(argv[2], NULL, 10);
    uint32_t n = (uint32_t)strtoul(argv[3], NULL, 10);
    uint64_t slices = strtoull(argv[4], NULL, 10);
    uint64_t slice_ns = strtoull(argv[5], NULL, 10) * 1000000ull;

    ShoalSource *src = NULL;
    if (shoal_source_open(argv[1], &src) != SHOAL_STATUS_OK) {
        fprintf(stderr, "readout: cannot open the source: %s\n", shoal_last_error());
        return 1;
    }
    fprintf(stderr, "readout: libshoal %s, run starts at slice %llu\n", shoal_version(),
            (unsigned long long)shoal_source_first_slice(src));

    uint8_t buf[SHOAL_EXAMPLE_MAX_PAYLOAD];
    unsigned refused = 0;
    for (uint64_t slice = 0; slice < slices; slice++) {
        for (uint32_t s = first; s < first + n; s++) {
            size_t len = example_payload(buf, s, slice);
            /* The board's time of its data: somewhere inside the slice. */
            uint64_t t = slice * slice_ns + (uint64_t)s * 1000u;
            int rc = shoal_source_submit(src, s, t, buf, len);
            if (rc != SHOAL_STATUS_OK) {
                /* Refused fragments are counted in the report; say why once. */
                if (refused++ == 0)
                    fprintf(stderr, "readout: fragment refused (%d): %s\n", rc, shoal_last_error());
            }
        }
    }
    /* A mistake on purpose: a board this program does not host. Refused and counted. */
    if (shoal_source_submit(src, 99999, 0, buf, 10) != SHOAL_STATUS_REFUSED) {
        fprintf(stderr, "readout: an unknown source was not refused\n");
        return 1;
    }
    fprintf(stderr, "readout: as expected: %s\n", shoal_last_error());

    if (shoal_source_flush(src, 60000) != SHOAL_STATUS_OK)
        fprintf(stderr, "readout: flush: %s\n", shoal_last_error());
    char *report = NULL;
    if (shoal_source_close(src, &report) != SHOAL_STATUS_OK) {
        fprintf(stderr, "readout: close: %s\n", shoal_last_error());
        return 1;
    }
    printf("%s\n", report);
    shoal_string_free(report);
    return refused == 0 ? 0 : 1;
}
