//! shoal-net
