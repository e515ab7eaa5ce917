//! shoal-trigger
