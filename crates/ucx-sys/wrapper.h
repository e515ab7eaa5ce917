/* What ucx-sys binds: UCP (the protocol layer) and the status codes of UCS. */
#include <ucp/api/ucp.h>
