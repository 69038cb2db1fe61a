"""Device roles that kernels compose (see the README map)."""
