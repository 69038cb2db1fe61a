"""The merges fused into the SM90 paged decode kernel (device role).

With a split-KV launch each split CTA normalizes its fp32 partial output and base-2 LSE, and the
splits of one (request, KV head) merge without a second launch:

- **global (fused) merge**: each CTA publishes its partial to global memory (fence + one atomic on
  a per-(request, KV head) arrival counter); the last CTA to arrive reads every partial back from
  L2 (``ld.global.cg``: other SMs wrote them), or first stages them all in its idle K/V stages
  with ``cp.async`` when they fit (``smem_merge``: one L2 round trip instead of several), writes
  the output and the LSE, and resets the counter for the next launch or graph replay;
- **cluster merge**: the split CTAs form one thread-block cluster; each leaves its partial in its
  own idle K stages and merges a share of the rows from the others' shared memory (DSMEM).

Both weigh splits with :func:`cute_kernels.roles.merge.add_split` (empty splits selected away).
Design: docs/design/sm90-decode.md#the-design-as-it-stands and docs/design/merge.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .balanced_chunks import merge_slot
from .fragments import (
    cp_async_16,
    load_cg_f32x4,
    load_dsmem_f32,
    load_dsmem_f32x4,
    load_shared_f32,
    load_shared_f32x4,
    special_register,
    store_shared_f32,
)
from .merge import add_split
from .softmax import BAR_MMA


class SplitMerge:
    """Output and merge of a swap-AB consumer's ``rows = G x q_len`` query rows (``N`` padded) of
    head dim ``D``. ``merge``: None (no split: the output is written directly), ``"global"`` or
    ``"cluster"``. The merge tuning (``merge_slots`` and ``merge_slot_bytes`` of the staged
    merge, splits in flight per thread ``merge_group`` / ``cluster_group``) comes from the plan.
    The consumer writes its normalized partial and LSE where :meth:`part_lse_offset` says (its
    epilogue stays in the kernel's consumer: moved into a function of its own, the traced IR
    differs and so does the PTX)."""

    def __init__(self, *, D: int, N: int, G: int, q_len: int, merge: str | None, smem_merge: bool, dynamic: bool,
                 merge_slots: int, merge_slot_bytes: int, merge_group: int, cluster_group: int,
                 warps: int, num_threads: int):
        self.D, self.N, self.G, self.q_len = D, N, G, q_len
        self.rows = G * q_len
        self.split, self.cluster = merge is not None, merge == "cluster"
        self.smem_merge, self.dynamic = smem_merge, dynamic
        self.merge_slots, self.merge_slot_bytes = merge_slots, merge_slot_bytes
        self.merge_group, self.cluster_group = merge_group, cluster_group
        self.warps, self.num_threads = warps, num_threads

    @cute.jit
    def merge_splits(self, mO, mLse, mPartO, mPartLse, mCounter, sFlag, num_splits, batch_idx, kv_head, tidx,
                     kv_bases, slots=None):
        """The last of the request's split CTAs (per KV head) to finish merges all partials.

        Saves a second kernel launch on the critical path of small batches. Each CTA
        publishes its partial (fence + one atomic per CTA on a per-(request, head) counter); the
        CTA that sees count S-1 reads every split's partial from L2 (``ld.global.cg``: another
        SM wrote them), writes the final output and LSE, and resets the counter to 0 so that the
        next launch (or CUDA-graph replay) starts clean.

        ``smem_merge``: when every split's partial fits the (now idle) K and V stages, the merging
        CTA first copies them all there with ``cp.async`` (every copy in flight at once, no
        registers held) and merges from shared memory: one L2 round trip instead of one per
        ``threads`` chunks x ``merge_group`` splits (docs/design/sm90-decode.md#l2-policy-descriptor-prefetch-staged-merge).

        ``slots`` (balanced schedule): ``(slot0, c0)``, the request's partials are in slots ``slot0,
        c0 + 1, ...`` of ``[slots, q_len, Hq, D]`` partials (:func:`balanced_chunks.merge_slot`).
        """
        G = self.G
        threads = self.warps * 32
        cute.arch.fence_acq_rel_gpu()  # my partial writes before the arrival below
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)
        counter = mCounter.iterator + (batch_idx * cute.arch.grid_dim()[1] + kv_head)
        if tidx == 0:
            sFlag[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)
        if sFlag[0] == num_splits - 1:
            cute.arch.fence_acq_rel_gpu()
            chunks = self.D // 4
            work = self.rows * chunks
            fits = False
            if const_expr(self.smem_merge):
                fits = num_splits <= self.merge_slots
            if fits:
                self.stage_partials(mPartO, mPartLse, num_splits, batch_idx, kv_head, tidx, kv_bases)
            for it in cutlass.range((work + threads - 1) // threads, unroll=1):
                idx = it * threads + tidx
                if idx < work:
                    n = idx // chunks
                    d0 = (idx % chunks) * 4
                    token = batch_idx * self.q_len + n // G
                    head = kv_head * G + n % G
                    if fits:
                        self.merge_row_chunk(mO, mLse, num_splits, token, head, d0, (kv_bases, n), self.merge_group,
                                             "smem")
                    elif const_expr(slots is None):
                        self.merge_row_chunk(mO, mLse, num_splits, token, head, d0, (mPartO, mPartLse),
                                             self.merge_group, "global")
                    else:
                        self.merge_row_chunk(mO, mLse, num_splits, token, head, d0,
                                             (mPartO, mPartLse, *slots, n // G), self.merge_group, "slots")
            if tidx == 0:
                if const_expr(slots is None):
                    counter.store(Int32(0))
                else:  # its address again rather than kept live through the merge (register pressure)
                    reset = mCounter.iterator + (batch_idx * special_register("nctaid.y") + special_register("ctaid.y"))
                    reset.store(Int32(0))
                if const_expr(self.dynamic):
                    # every CTA of the item has arrived, so none takes chunks any more: reset for
                    # the next launch (its counter sits B x Hkv entries behind the arrival counter)
                    grab = counter + cute.arch.grid_dim()[2] * cute.arch.grid_dim()[1]
                    grab.store(Int32(0))

    def part_lse_offset(self, n):
        """(Traced.) Byte offset of row ``n``'s LSE in a shared-memory partial (the cluster merge's,
        or a slot of the staged fused merge, :func:`merge_slot_bytes`): fp32 ``O[rows, D]`` first,
        then the LSEs."""
        return (self.rows * self.D + n) * 4

    @cute.jit
    def merge_slot(self, s, kv_bases):
        """(Traced.) Shared-window address of split ``s``'s partial: the K stages' slots first,
        then the V stages'."""
        k_base, v_base = kv_bases
        per = self.merge_slots // 2
        slot = self.merge_slot_bytes
        return k_base + s * slot if s < per else v_base + (s - per) * slot

    @cute.jit
    def stage_partials(self, mPartO, mPartLse, num_splits, batch_idx, kv_head, tidx, kv_bases):
        """Copy every split's partial O rows (16-byte ``cp.async.cg``) and LSEs (``ld.global.cg``
        then a shared store) of this (request, KV head) into shared memory, all in flight
        together, then wait for them and publish them to the merging threads. The K/V stages
        are idle: every tile was consumed and no TMA load is outstanding."""
        G, D, rows = self.G, self.D, self.rows
        threads = self.warps * 32
        chunks = D // 4
        per_split = rows * chunks
        for i in cutlass.range(tidx, num_splits * per_split, threads, unroll=4):
            s = i // per_split
            rem = i - s * per_split
            n = rem // chunks
            c = rem - n * chunks
            src = mPartO.iterator + cute.crd2idx((s, batch_idx * self.q_len + n // G, kv_head * G + n % G, c * 4),
                                                  mPartO.layout)
            cp_async_16(self.merge_slot(s, kv_bases) + (n * D + c * 4) * 4, src.toint())
        # The LSEs through registers with ld.global.cg: a 4-byte cp.async can only be .ca, and an
        # L1 line of another (request, KV head)'s LSEs, read by an earlier merge on this SM while
        # one of its splits was still running, would hand this merge a stale value.
        for i in cutlass.range(tidx, num_splits * rows, threads, unroll=1):
            s = i // rows
            n = i - s * rows
            lse = self.load_cg(mPartLse, (s, batch_idx * self.q_len + n // G, kv_head * G + n % G))
            store_shared_f32(self.merge_slot(s, kv_bases) + self.part_lse_offset(n), lse)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=BAR_MMA, number_of_threads=threads)

    @cute.jit
    def cluster_merge(self, mO, mLse, part_base):
        """Merge the split partials of one (KV head, request) inside its cluster (``num_splits``
        CTAs, at most MAX_CLUSTER).

        Each split CTA has left its normalized partial O and its LSE in its own shared memory
        (``part_base``). After a cluster barrier (release / acquire) CTA ``rank`` merges its share
        of the ``rows x D / 4`` four-element chunks, reading every split's chunk and LSE through
        DSMEM (CLUSTER_GROUP splits' loads in flight together, ranks past the last clamped to it
        and weighted 0), and writes the output; a second barrier keeps every CTA's shared memory
        alive until all of them have read it. Against the global fused merge this saves the
        fence, the arrival atomic and the last CTA's L2 round trip, and the merge is spread over
        all split CTAs (docs/design/sm90-decode.md#cluster-merge-for-small-split-grids)."""
        G = self.G
        # indices read again here rather than kept live through the main loop (register pressure)
        tidx = special_register("tid.x")
        rank = special_register("ctaid.x")
        kv_head = special_register("ctaid.y")
        batch_idx = special_register("ctaid.z")
        num_splits = special_register("nctaid.x")
        chunks = self.D // 4
        work = self.rows * chunks
        per = (work + num_splits - 1) // num_splits
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        for j in cutlass.range(tidx, per, self.num_threads, unroll=1):
            idx = rank * per + j
            if idx < work:
                n = idx // chunks
                d0 = (idx - n * chunks) * 4
                self.merge_row_chunk(mO, mLse, num_splits, batch_idx * self.q_len + n // G, kv_head * G + n % G,
                                     d0, (part_base, n), self.cluster_group, "dsmem")
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def merge_row_chunk(self, mO, mLse, num_splits, token, head, d0, src, group: cutlass.Constexpr,
                        source: cutlass.Constexpr):
        """Merge 4 output dims of one query row over all splits, ``group`` splits at a time. The
        partials come from global memory (``source`` "global": ``src = (mPartO, mPartLse)``, the
        fused merge), from this CTA's shared memory ("smem": ``src = ((k_base, v_base), n)``, the
        fused merge after :meth:`stage_partials`), from the cluster's shared memory ("dsmem":
        ``src = (part_base, n)``, the cluster merge) or from a balanced launch's slots ("slots":
        ``src = (mPartO, mPartLse, slot0, c0, draft token)``).

        Every load of a group (its LSEs and 16-byte partials) is issued before any is used, so a
        group costs one L2 round trip instead of one per split (this merge is on the critical
        path of every split request); indices past the last split are clamped to it and weighted
        0. Groups are combined with a running max, as in online softmax."""
        m = -Float32.inf
        total = Float32(0.0)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        lse_g = cute.make_rmem_tensor((group,), Float32)
        o_g = cute.make_rmem_tensor((group, 4), Float32)
        for g in cutlass.range((num_splits + group - 1) // group, unroll=1):
            for j in cutlass.range_constexpr(group):
                s = cutlass.min(g * group + j, num_splits - 1)
                if const_expr(source == "dsmem"):
                    part_base, n = src
                    lse_g[j] = load_dsmem_f32(part_base + self.part_lse_offset(n), s)
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_dsmem_f32x4(part_base + (n * self.D + d0) * 4, s)
                elif const_expr(source == "smem"):
                    kv_bases, n = src
                    slot = self.merge_slot(s, kv_bases)
                    lse_g[j] = load_shared_f32(slot + self.part_lse_offset(n))
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_shared_f32x4(slot + (n * self.D + d0) * 4)
                elif const_expr(source == "slots"):
                    mPartO, mPartLse, slot0, c0, tok = src
                    slot = c0 + s  # a request merging here has 2+ partials: only the first one's slot differs
                    if const_expr(j == 0):
                        slot = merge_slot(s, slot0, c0, cutlass.max)
                    lse_g[j] = self.load_cg(mPartLse, (slot, tok, head))
                    addr = (mPartO.iterator + cute.crd2idx((slot, tok, head, d0), mPartO.layout)).toint()
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_cg_f32x4(addr)
                else:
                    mPartO, mPartLse = src
                    lse_g[j] = self.load_cg(mPartLse, (s, token, head))
                    addr = (mPartO.iterator + cute.crd2idx((s, token, head, d0), mPartO.layout)).toint()
                    o_g[j, 0], o_g[j, 1], o_g[j, 2], o_g[j, 3] = load_cg_f32x4(addr)
            new_m = m
            for j in cutlass.range_constexpr(group):
                if g * group + j >= num_splits:
                    lse_g[j] = -Float32.inf
                new_m = cute.arch.fmax(new_m, lse_g[j])
            # all splits so far empty: shift by 0 so every weight is exp2(-inf) = 0 (no inf - inf)
            shift = new_m if new_m != -Float32.inf else Float32(0.0)
            alpha = cute.math.exp2(m - shift, fastmath=True)
            total = total * alpha
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] * alpha
            for j in cutlass.range_constexpr(group):
                total += add_split(acc, o_g[j, None], lse_g[j], shift, 4)
            m = new_m
        inv = Float32(0.0)
        lse = -Float32.inf
        if total > Float32(0.0):
            inv = 1.0 / total
            lse = m + cute.math.log2(total, fastmath=True)
        for e in cutlass.range_constexpr(4):
            mO[token, head, d0 + e] = (acc[e] * inv).to(mO.element_type)
        if d0 == 0:
            mLse[token, head] = lse

    @cute.jit
    def load_cg(self, tensor, coord):
        """A load that bypasses L1 (the data was written by other SMs in this kernel)."""
        return cute.arch.load(tensor.iterator + cute.crd2idx(coord, tensor.layout), Float32, cop="cg")
