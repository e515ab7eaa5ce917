/*
 * l1_filter.c: shoal's built-in `l1` filter as a C plug-in (docs/plugins.md).
 *
 * Local coincidences (two hits on different channels of one source within coincidence_ns,
 * or one hit of at least high_amplitude when that is not 0) and a multiplicity trigger:
 * L1 hits on at least min_sources sources within cluster_ns fire; overlapping windows merge
 * into one event, which keeps every hit within snapshot_ns around its L1 hits. A test runs
 * it beside the built-in filter on the same slices and requires the same events.
 *
 *   cc -O2 -shared -fPIC -I include -o libl1_filter.so examples/c/filter/l1_filter.c
 *
 *   [builder.filter]
 *   plugin = "path/libl1_filter.so"
 *   config = "coincidence_ns=20 min_sources=2 cluster_ns=2200 snapshot_ns=1000"
 */
#include <shoal_filter.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint32_t coincidence_ns, cluster_ns, snapshot_ns, min_sources;
    uint8_t high_amplitude;
} params;

typedef struct {
    uint32_t time_ns;
    uint8_t channel, amplitude;
} hit;

typedef struct {
    uint32_t time_ns;
    uint32_t fragment;
    uint32_t index;
} l1_hit;

/* Reused buffers, grown as needed: no allocation per slice once warm. */
typedef struct {
    params p;
    hit **hits;        /* per fragment, sorted by (time, channel, amplitude) */
    uint8_t **flag;    /* per fragment: triggered marks */
    size_t *cap;
    size_t fragments_cap;
    l1_hit *l1;
    size_t l1_cap;
    l1_hit *l1_tmp;    /* the radix sort's other buffer */
    size_t l1_tmp_cap;
    shoal_event_hit *event;
    size_t event_cap;
    uint32_t *per_source;
} state;

static int grow(void **buf, size_t *cap, size_t want, size_t size) {
    if (want <= *cap) return 0;
    size_t n = *cap ? *cap : 64;
    while (n < want) n *= 2;
    void *b = realloc(*buf, n * size);
    if (!b) return -1;
    *buf = b;
    *cap = n;
    return 0;
}

static int cmp_hit(const void *a, const void *b) {
    const hit *x = a, *y = b;
    if (x->time_ns != y->time_ns) return x->time_ns < y->time_ns ? -1 : 1;
    if (x->channel != y->channel) return x->channel < y->channel ? -1 : 1;
    return (x->amplitude > y->amplitude) - (x->amplitude < y->amplitude);
}

static int cmp_l1(const void *a, const void *b) {
    const l1_hit *x = a, *y = b;
    if (x->time_ns != y->time_ns) return x->time_ns < y->time_ns ? -1 : 1;
    if (x->fragment != y->fragment) return x->fragment < y->fragment ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* Stable LSD radix sort of the L1 hits by time (3 passes of 11 bits). The hits arrive
 * fragment by fragment, each fragment's in index order, so sorting by time alone, stably,
 * gives the (time, fragment, index) order of the built-in filter, without a comparison
 * callback per pair as qsort needs. Returns the buffer holding the result. */
static l1_hit *sort_l1(l1_hit *a, l1_hit *tmp, size_t n) {
    size_t counts[2048];
    for (int pass = 0; pass < 3; pass++) {
        int shift = pass * 11;
        memset(counts, 0, sizeof counts);
        for (size_t i = 0; i < n; i++) counts[(a[i].time_ns >> shift) & 2047]++;
        size_t sum = 0;
        for (size_t d = 0; d < 2048; d++) {
            size_t c = counts[d];
            counts[d] = sum;
            sum += c;
        }
        for (size_t i = 0; i < n; i++) tmp[counts[(a[i].time_ns >> shift) & 2047]++] = a[i];
        l1_hit *t = a;
        a = tmp;
        tmp = t;
    }
    return a;
}

uint32_t shoal_filter_abi_version(void) { return SHOAL_FILTER_ABI_VERSION; }

int32_t shoal_filter_init(const char *config, void **out, char *error, size_t error_len) {
    params p = {20, 2200, 1000, 2, 0};
    const char *s = config;
    while (s && *s) {
        while (*s == ' ' || *s == ',' || *s == '\n') s++;
        if (!*s) break;
        char key[32];
        unsigned long value;
        int used = 0;
        if (sscanf(s, "%31[a-z_]=%lu%n", key, &value, &used) != 2) {
            snprintf(error, error_len, "config: expected key=value at \"%.20s\"", s);
            return 1;
        }
        if (!strcmp(key, "coincidence_ns")) p.coincidence_ns = (uint32_t)value;
        else if (!strcmp(key, "cluster_ns")) p.cluster_ns = (uint32_t)value;
        else if (!strcmp(key, "snapshot_ns")) p.snapshot_ns = (uint32_t)value;
        else if (!strcmp(key, "min_sources")) p.min_sources = (uint32_t)value;
        else if (!strcmp(key, "high_amplitude")) p.high_amplitude = (uint8_t)value;
        else {
            snprintf(error, error_len, "config: unknown key %s", key);
            return 1;
        }
        s += used;
    }
    if (p.min_sources == 0) {
        snprintf(error, error_len, "config: min_sources must be at least 1");
        return 1;
    }
    state *st = calloc(1, sizeof *st);
    if (!st) {
        snprintf(error, error_len, "out of memory");
        return 1;
    }
    st->p = p;
    *out = st;
    return 0;
}

static int is_l1(const hit *h, size_t n, size_t i, const params *p) {
    if (p->high_amplitude > 0 && h[i].amplitude >= p->high_amplitude) return 1;
    for (size_t j = i + 1; j < n && h[j].time_ns - h[i].time_ns <= p->coincidence_ns; j++)
        if (h[j].channel != h[i].channel) return 1;
    for (size_t j = i; j-- > 0 && h[i].time_ns - h[j].time_ns <= p->coincidence_ns;)
        if (h[j].channel != h[i].channel) return 1;
    return 0;
}

/* First index with time >= t (lower) or > t (upper) in sorted hits. */
static size_t bound(const hit *h, size_t n, uint32_t t, int upper) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (upper ? h[mid].time_ns <= t : h[mid].time_ns < t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

int32_t shoal_filter_process(void *opaque, const shoal_slice_view *slice, const shoal_filter_host *host) {
    state *st = opaque;
    const params *p = &st->p;
    size_t nf = (size_t)slice->fragment_count;
    if (nf > st->fragments_cap) {
        size_t old = st->fragments_cap;
        size_t cap = old;
        if (grow((void **)&st->hits, &cap, nf, sizeof *st->hits)) return 1;
        cap = old;
        if (grow((void **)&st->flag, &cap, nf, sizeof *st->flag)) return 1;
        cap = old;
        if (grow((void **)&st->cap, &cap, nf, sizeof *st->cap)) return 1;
        cap = old;
        if (grow((void **)&st->per_source, &cap, nf, sizeof *st->per_source)) return 1;
        for (size_t i = old; i < cap; i++) {
            st->hits[i] = NULL;
            st->flag[i] = NULL;
            st->cap[i] = 0;
        }
        st->fragments_cap = cap;
    }
    size_t *count = calloc(nf ? nf : 1, sizeof *count);
    if (!count) return 1;
    size_t n_l1 = 0;
    for (size_t f = 0; f < nf; f++) {
        const shoal_fragment_view *v = &slice->fragments[f];
        size_t n = v->hit_count;
        if ((uint64_t)n * SHOAL_HIT_RECORD_LEN > v->payload_len) n = 0; /* malformed: no hits */
        size_t cap = st->cap[f];
        if (grow((void **)&st->hits[f], &cap, n, sizeof(hit))) { free(count); return 1; }
        size_t fcap = st->cap[f];
        if (grow((void **)&st->flag[f], &fcap, n, 1)) { free(count); return 1; }
        st->cap[f] = cap < fcap ? cap : fcap;
        hit *h = st->hits[f];
        for (size_t i = 0; i < n; i++) {
            const uint8_t *r = v->payload + i * SHOAL_HIT_RECORD_LEN;
            h[i].channel = r[0];
            h[i].time_ns = (uint32_t)r[1] | (uint32_t)r[2] << 8 | (uint32_t)r[3] << 16 | (uint32_t)r[4] << 24;
            h[i].amplitude = r[5];
        }
        /* Sources usually send their hits in time order: sort only when they are not. */
        size_t unsorted = 0;
        for (size_t i = 1; i < n && !unsorted; i++) unsorted = cmp_hit(&h[i - 1], &h[i]) > 0;
        if (unsorted) qsort(h, n, sizeof *h, cmp_hit);
        memset(st->flag[f], 0, n);
        count[f] = n;
        for (size_t i = 0; i < n; i++) {
            if (!is_l1(h, n, i, p)) continue;
            if (grow((void **)&st->l1, &st->l1_cap, n_l1 + 1, sizeof *st->l1)) { free(count); return 1; }
            st->l1[n_l1++] = (l1_hit){h[i].time_ns, (uint32_t)f, (uint32_t)i};
        }
    }
    size_t l1_unsorted = 0;
    for (size_t i = 1; i < n_l1 && !l1_unsorted; i++) l1_unsorted = cmp_l1(&st->l1[i - 1], &st->l1[i]) > 0;
    if (l1_unsorted) {
        if (grow((void **)&st->l1_tmp, &st->l1_tmp_cap, n_l1, sizeof *st->l1_tmp)) { free(count); return 1; }
        l1_hit *sorted = sort_l1(st->l1, st->l1_tmp, n_l1);
        if (sorted != st->l1) { /* an odd number of passes: the result is in the other buffer */
            st->l1_tmp = st->l1;
            st->l1 = sorted;
            size_t c = st->l1_cap;
            st->l1_cap = st->l1_tmp_cap;
            st->l1_tmp_cap = c;
        }
    }

    /* Sweep: a window starts at each L1 hit and spans cluster_ns; firing windows that
     * overlap merge. */
    memset(st->per_source, 0, nf * sizeof *st->per_source);
    uint32_t distinct = 0;
    size_t end = 0;
    long w_start = -1, w_end = -1;
    int32_t rc = 0;
    for (size_t i = 0; i <= n_l1; i++) {
        int fire = 0;
        size_t j = 0;
        if (i < n_l1) {
            while (end < n_l1 && st->l1[end].time_ns - st->l1[i].time_ns <= p->cluster_ns) {
                distinct += st->per_source[st->l1[end].fragment]++ == 0;
                end++;
            }
            fire = distinct >= p->min_sources;
            j = end - 1;
        }
        if (fire && w_start >= 0 && (long)i <= w_end) {
            if ((long)j > w_end) w_end = (long)j;
        } else if (w_start >= 0 && (fire || i == n_l1)) {
            /* Emit the window [w_start, w_end]. */
            for (long k = w_start; k <= w_end; k++) st->flag[st->l1[k].fragment][st->l1[k].index] = 1;
            uint32_t t0 = st->l1[w_start].time_ns;
            t0 = t0 > p->snapshot_ns ? t0 - p->snapshot_ns : 0;
            uint32_t t1 = st->l1[w_end].time_ns;
            t1 = t1 > UINT32_MAX - p->snapshot_ns ? UINT32_MAX : t1 + p->snapshot_ns;
            size_t m = 0;
            for (size_t f = 0; f < nf; f++) {
                size_t a = bound(st->hits[f], count[f], t0, 0), b = bound(st->hits[f], count[f], t1, 1);
                if (grow((void **)&st->event, &st->event_cap, m + (b - a), sizeof *st->event)) { free(count); return 1; }
                for (size_t k = a; k < b; k++) {
                    const hit *h = &st->hits[f][k];
                    st->event[m++] = (shoal_event_hit){slice->fragments[f].source, h->time_ns, h->channel, h->amplitude,
                                                       st->flag[f][k], 0};
                }
            }
            for (long k = w_start; k <= w_end; k++) st->flag[st->l1[k].fragment][st->l1[k].index] = 0;
            if (host->emit_event(host->ctx, 1, 0, st->event, m) != 0) rc = 2;
            w_start = -1;
        }
        if (fire && w_start < 0) {
            w_start = (long)i;
            w_end = (long)j;
        }
        if (i < n_l1) distinct -= --st->per_source[st->l1[i].fragment] == 0;
    }
    free(count);
    return rc;
}

void shoal_filter_cleanup(void *opaque) {
    state *st = opaque;
    if (!st) return;
    for (size_t f = 0; f < st->fragments_cap; f++) {
        free(st->hits[f]);
        free(st->flag[f]);
    }
    free(st->hits);
    free(st->flag);
    free(st->cap);
    free(st->per_source);
    free(st->l1);
    free(st->l1_tmp);
    free(st->event);
    free(st);
}
