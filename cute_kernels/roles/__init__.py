"""Device roles: arch-neutral pieces (DSL) that kernels compose instead of inheriting."""
