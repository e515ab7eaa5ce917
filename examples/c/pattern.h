/* The payload the C examples send for (source, slice): its length and bytes follow from
 * the two numbers, so a test can check the builders' output byte for byte
 * (tests/python/test_sdk.py computes the same). */
#ifndef SHOAL_EXAMPLE_PATTERN_H
#define SHOAL_EXAMPLE_PATTERN_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_EXAMPLE_MAX_PAYLOAD 3100

static size_t example_payload(uint8_t *buf, uint32_t source, uint64_t slice) {
    size_t len = 100 + (size_t)((slice * 37 + (uint64_t)source * 101) % 3000);
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)((uint64_t)i ^ (slice * 31) ^ ((uint64_t)source << 3));
    return len;
}

#endif
