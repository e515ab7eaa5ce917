/*
 * shoal_filter.h: the C ABI of shoal's filter plug-ins (docs/plugins.md).
 *
 * A plug-in is a shared library a builder loads with
 *
 *     [builder.filter]
 *     plugin = "path/libmyfilter.so"
 *     config = "any text, handed to shoal_filter_init"
 *
 * It exports the four functions declared at the end. The builder calls, on its filter
 * thread (one thread per builder process: a plug-in needs no locking of its own state):
 *
 *   shoal_filter_abi_version()   once at load; must return SHOAL_FILTER_ABI_VERSION as the
 *                                plug-in was compiled with it (checked, refused otherwise)
 *   shoal_filter_init()          once, before the first slice
 *   shoal_filter_process()       once per complete slice, in slice order
 *   shoal_filter_cleanup()       once, after the last slice
 *
 * Lifetimes: everything a slice view points to is valid only during the call of
 * shoal_filter_process; copy what you keep. Events are handed back during that call with
 * host->emit_event, which copies them.
 *
 * All integers little-endian as on the host; the structs are laid out as C lays them out
 * with these exact member types (no packing pragmas).
 */
#ifndef SHOAL_FILTER_H
#define SHOAL_FILTER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any change of the structs or functions below. */
#define SHOAL_FILTER_ABI_VERSION 1u

/* Frame flags a fragment may carry (docs/wire-format.md). */
#define SHOAL_FRAGMENT_TRUNCATED (1u << 0)
#define SHOAL_FRAGMENT_CUT_OFF (1u << 1)
#define SHOAL_FRAGMENT_BURST (1u << 2)
#define SHOAL_FRAGMENT_OPAQUE (1u << 10)

/* Size of one hit record in a payload: channel u8, time u32 LE (ns since the slice
 * start), amplitude u8. Waveform records (263 bytes) may follow the hits. */
#define SHOAL_HIT_RECORD_LEN 6u

/* One source's fragment of the slice. */
typedef struct shoal_fragment_view {
    uint32_t source;      /* source (board) id */
    uint32_t flags;       /* SHOAL_FRAGMENT_* bits */
    uint32_t hit_count;   /* hit records at the start of payload */
    uint32_t reserved;    /* 0 */
    const uint8_t *payload;
    uint64_t payload_len;
} shoal_fragment_view;

/* A complete slice: one fragment per source that sent one. */
typedef struct shoal_slice_view {
    uint64_t slice;          /* slice number */
    uint64_t slice_start_ns; /* UNIX ns */
    uint64_t slice_ns;       /* slice length */
    const shoal_fragment_view *fragments;
    uint64_t fragment_count;
} shoal_slice_view;

/* One hit of a selected event. */
typedef struct shoal_event_hit {
    uint32_t source;
    uint32_t time_ns;    /* ns since the slice start */
    uint8_t channel;
    uint8_t amplitude;
    uint8_t triggered;   /* 1: took part in the trigger decision; 0: snapshot hit */
    uint8_t reserved;    /* 0 */
} shoal_event_hit;

/* What the host gives the plug-in for one slice. */
typedef struct shoal_filter_host {
    void *ctx;
    /* Hands back one selected event: its trigger bits, how many further triggers were
     * merged into it, its hits (copied). Returns 0, or -1 when the event is malformed
     * (no hit, a source not in the slice, a time past the slice's end): the event is
     * refused and counted, the slice goes on. */
    int32_t (*emit_event)(void *ctx, uint32_t trigger_mask, uint32_t overlays, const shoal_event_hit *hits,
                          uint64_t hit_count);
} shoal_filter_host;

/* The functions a plug-in exports. Return 0 on success; anything else is a failure: at
 * init the builder refuses to start (with `error`, NUL-terminated, as the message), at
 * process the slice is counted `filter_failed` (its events so far are kept). */
uint32_t shoal_filter_abi_version(void);
int32_t shoal_filter_init(const char *config, void **state, char *error, size_t error_len);
int32_t shoal_filter_process(void *state, const shoal_slice_view *slice, const shoal_filter_host *host);
void shoal_filter_cleanup(void *state);

#ifdef __cplusplus
}
#endif

#endif /* SHOAL_FILTER_H */
