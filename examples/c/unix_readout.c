/* A readout program that writes its boards' fragments to a shoal source process's unix
 * socket (source.input = "unix:PATH") in the input framing of docs/sdk.md: no library,
 * only the 32-byte header before each payload.
 *
 *   unix_readout SOCKET FIRST_SOURCE N_SOURCES SLICES SLICE_MS
 *
 * The source process must count data times from the run's start
 * (source.input_time_base = "run"). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "pattern.h"

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SOCKET FIRST_SOURCE N_SOURCES SLICES SLICE_MS\n", argv[0]);
        return 2;
    }
    uint32_t first = (uint32_t)strtoul(argv[2], NULL, 10);
    uint32_t n = (uint32_t)strtoul(argv[3], NULL, 10);
    uint64_t slices = strtoull(argv[4], NULL, 10);
    uint64_t slice_ns = strtoull(argv[5], NULL, 10) * 1000000ull;

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(argv[1]) >= sizeof addr.sun_path) {
        fprintf(stderr, "unix_readout: socket path too long\n");
        return 2;
    }
    strcpy(addr.sun_path, argv[1]);
    int fd = -1;
    /* The source process may still be starting: try for up to 30 s. */
    for (int attempt = 0; attempt < 3000; attempt++) {
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0) {
            perror("socket");
            return 1;
        }
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) break;
        close(fd);
        fd = -1;
        struct timespec ten_ms = {0, 10000000};
        nanosleep(&ten_ms, NULL);
    }
    if (fd < 0) {
        fprintf(stderr, "unix_readout: cannot connect to %s\n", argv[1]);
        return 1;
    }

    uint8_t frame[32 + SHOAL_EXAMPLE_MAX_PAYLOAD];
    for (uint64_t slice = 0; slice < slices; slice++) {
        for (uint32_t s = first; s < first + n; s++) {
            size_t len = example_payload(frame + 32, s, slice);
            memset(frame, 0, 32);
            memcpy(frame, "SHLI", 4);
            frame[4] = 1;                                       /* version */
            frame[5] = 0;                                       /* flags: a time, opaque */
            put_u32(frame + 8, s);                              /* source id */
            put_u32(frame + 12, 0);                             /* hit count */
            put_u64(frame + 16, slice * slice_ns + (uint64_t)s * 1000u); /* data time */
            put_u32(frame + 24, (uint32_t)len);                 /* payload length */
            put_u32(frame + 28, (uint32_t)slice);               /* sequence number */
            if (write_all(fd, frame, 32 + len) != 0) {
                perror("unix_readout: write");
                return 1;
            }
        }
    }
    close(fd);
    fprintf(stderr, "unix_readout: sent %llu slices of %u sources\n", (unsigned long long)slices, n);
    return 0;
}
