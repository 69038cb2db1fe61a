"""Device roles: small pieces of device code (CuTe DSL) that kernels compose.

A role is a plain object built from a kernel's static configuration, whose ``@cute.jit`` methods
the kernel calls while it is traced; no kernel class inherits another. Roles never import plans
or torch: what they need arrives through their constructor. Map: docs/design/architecture.md#roles.

- :mod:`.fragments`: inline-PTX primitives (ldmatrix, exact FP8 widening, DSMEM and ``.cg`` loads...);
- :mod:`.fdiv`: correctly rounded division by one scale; :mod:`.pdl`: programmatic dependent launch;
- :mod:`.merge`: merges of split partials (a row over its splits, the fused last-CTA merge through L2
  or shared memory, the cluster merge through DSMEM) and the split-partial epilogue;
- :mod:`.paged_kv`: the paged K/V producer (TMA page boxes, page-table lookahead, invalid pages as zeros);
- :mod:`.widen`: FP8 -> 16-bit widening of K/V register fragments;
- :mod:`.softmax`: the swap-AB MMAs, per-thread state and online-softmax step (tokens on M), and the
  quad-local online softmax of the query-on-M form;
- :mod:`.query`: Q staging into shared memory (with the FP8 path's scaling and permutation);
- :mod:`.warp_rows_out`: the portable prefill's output per warp, through the warp's own staged query rows;
- :mod:`.qsa_gather`: the QSA gather (index and page lookups, zero-filling cp.async, the pipeline);
- the paged prefill's roles: :mod:`.prefill_blocks` (its index math, pure Python), :mod:`.paged_kv_tma`
  (K/V page boxes per tile), :mod:`.online_softmax` (the masked online softmax with the query rows on
  M) and :mod:`.smem_fp8` (FP8 tiles widened or transposed in shared memory, the query narrowed, P
  packed into WGMMA A fragments).
"""
