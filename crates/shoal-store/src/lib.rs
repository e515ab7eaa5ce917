//! shoal-store
