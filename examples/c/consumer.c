/* A shared-memory slice consumer in C (docs/plugins.md, "Slice consumers").
 *
 * Attaches to a builder's slice ring, reads every slice in place and prints one JSON line
 * per slice: its number, fragments, payload bytes, hits and a checksum of the payloads
 * in source order (byte sum and position-weighted byte sum, mod 2^64), then a line with
 * the run's counters.
 *
 *   consumer SOCKET_NAME [hold_ms]      (hold_ms > 0: hold policy; 0 or absent: skip)
 *
 * Exit status: 0 at the run's end, 1 on an error (shoal_last_error() says which). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "shoal.h"

/* Adds `n` bytes at stream position *at to the two sums. */
static void checksum(uint64_t *sum, uint64_t *wsum, uint64_t *at, const uint8_t *p, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        *sum += p[i];
        *wsum += p[i] * (*at + i + 1);
    }
    *at += n;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET_NAME [hold_ms]\n", argv[0]);
        return 2;
    }
    uint64_t hold_ms = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    ShoalConsumer *c;
    if (shoal_consumer_open(argv[1], hold_ms > 0, hold_ms, 4, 60.0, &c) != SHOAL_STATUS_OK) {
        fprintf(stderr, "consumer: %s\n", shoal_last_error());
        return 1;
    }
    for (;;) {
        ShoalSlice *s;
        int st = shoal_consumer_next(c, -1, &s);
        if (st == SHOAL_STATUS_END) break;
        if (st != SHOAL_STATUS_OK) {
            fprintf(stderr, "consumer: %s\n", shoal_last_error());
            shoal_consumer_close(c);
            return 1;
        }
        ShoalSliceInfo info;
        shoal_slice_info(s, &info);
        uint64_t sum = 0, wsum = 0, at = 0, bytes = 0, hits = 0;
        for (uint64_t i = 0; i < info.fragment_count; i++) {
            ShoalFragmentRef f;
            shoal_slice_fragment(s, i, &f);
            checksum(&sum, &wsum, &at, f.payload, f.payload_len); /* read in place: no copy */
            bytes += f.payload_len;
            hits += f.hit_count;
        }
        int intact = shoal_slice_release(s);
        printf("{\"slice\": %" PRIu64 ", \"fragments\": %" PRIu64 ", \"bytes\": %" PRIu64 ", \"hits\": %" PRIu64
               ", \"sum\": %" PRIu64 ", \"wsum\": %" PRIu64
               ", \"intact\": %d}\n",
               info.slice, info.fragment_count, bytes, hits, sum, wsum, intact);
    }
    ShoalConsumerEnd end;
    shoal_consumer_end(c, &end);
    printf("{\"end\": true, \"offered\": %" PRIu64 ", \"skipped\": %" PRIu64 ", \"overrun\": %" PRIu64
           ", \"lost_before_read\": %" PRIu64 "}\n",
           end.offered, end.skipped, end.overrun, end.lost_before_read);
    shoal_consumer_close(c);
    return 0;
}
