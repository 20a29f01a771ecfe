"""Layer 1: gRPC servers and channels, raw-byte streaming, authentication."""
