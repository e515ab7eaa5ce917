//! shoal-detector
