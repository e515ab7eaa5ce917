#define _GNU_SOURCE
// The least a receiver can do with a builder's connections: accept, read, count, discard.
// scripts/conn_scaling.py runs it in the builder's place (`--receive sink`) as the peer of
// the builder's CPU per GB: what the kernel alone costs per GB at each connection count.
// It answers nothing, so the sources must not wait for a reply (the `direct` policy).
//
// With KEEP > 0 it keeps what it reads, as a builder keeps fragments until their slice is
// built: each read that brings data leaves its buffer kept and takes a new one (malloc);
// the KEEP most recent are kept, the oldest freed when another is kept. The kernel's copy then writes into
// memory freed a while ago rather than into one buffer that stays in the cache.
//
// usage: tcp_sink PORT CONNECTIONS [READ_BYTES, default 65536 [KEEP, default 0]]; prints
// one JSON line once CONNECTIONS connections have been accepted and all have ended (or
// fails after 60 s with nothing to do).
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) { fprintf(stderr, "usage: tcp_sink PORT CONNECTIONS [READ_BYTES [KEEP]]\n"); return 2; }
    int port = atoi(argv[1]); long want = atol(argv[2]);
    size_t size = argc >= 4 ? (size_t)atol(argv[3]) : 1 << 16;
    long keep = argc == 5 ? atol(argv[4]) : 0;
    if (size < 1 || size > 1 << 24) { fprintf(stderr, "tcp_sink: READ_BYTES from 1 to 16 MiB\n"); return 2; }
    if (keep < 0 || keep > 1 << 16) { fprintf(stderr, "tcp_sink: KEEP from 0 to 65536\n"); return 2; }
    int l = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4096)) { perror("listen"); return 1; }
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = l}, evs[256];
    epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev);
    char *buf = malloc(size);
    char **kept = keep ? calloc((size_t)keep, sizeof *kept) : NULL;
    long next_kept = 0;
    if (!buf || (keep && !kept)) { perror("malloc"); return 1; }
    long accepted = 0, live = 0; unsigned long long bytes = 0, reads = 0;
    struct timespec first = {0}, last = {0};
    while (accepted < want || live > 0) {
        int n = epoll_wait(ep, evs, 256, 60000);
        if (n <= 0) { fprintf(stderr, "tcp_sink: nothing for 60 s\n"); return 1; }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == l) {
                int c;
                while ((c = accept4(l, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = c};
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &e);
                    accepted++; live++;
                }
                continue;
            }
            // Edge-triggered, and a short read ends the round as in tokio; once the peer
            // has ended, read on to the 0 that says so.
            for (;;) {
                ssize_t r = read(fd, buf, size);
                reads++;
                if (r < 0 && errno == EINTR) continue;
                if (r > 0) {
                    clock_gettime(CLOCK_MONOTONIC, &last);
                    if (!bytes) first = last;
                    bytes += r;
                    if (keep) {
                        free(kept[next_kept]);
                        kept[next_kept] = buf;
                        next_kept = (next_kept + 1) % keep;
                        if (!(buf = malloc(size))) { perror("malloc"); return 1; }
                    }
                    if ((size_t)r == size || (evs[i].events & EPOLLRDHUP)) continue;
                } else if (r == 0 || errno != EAGAIN) {
                    close(fd);
                    live--;
                }
                break;
            }
        }
    }
    double span = (last.tv_sec - first.tv_sec) + 1e-9 * (last.tv_nsec - first.tv_nsec);
    printf("{\"bytes\": %llu, \"reads\": %llu, \"connections\": %ld, \"span_s\": %.6f}\n", bytes, reads,
           accepted, span);
    return 0;
}
