"""Compile matrix: the registered kernel variants compile on this (GPU-less) machine for each
target they claim, and their PTX/SASS shows the hardware path they claim to use.

Which (target, variant) pairs: :func:`cute_kernels.registry.compile_matrix`, every variant on the
main targets and the portable ``sm80.*`` kernels on every target; this suite compiles its
representative set (``ci=True``), ``cute-kernels compile --arch <target>`` the full one.

The evidence regexes live with each kernel config (``KernelConfig.evidence``); this test only
enforces them, plus: the PTX ``.target`` is the requested arch, no variant spills registers to
local memory (``STL``/``LDL`` in SASS, when nvdisasm is installed), and the normalized PTX of every
variant hashes to the digest committed in ``tests/cpu/ptx_digests.json`` (a refactor changes no
generated code; docs/design/architecture.md#ptx-digests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cute_kernels.jit.compiler import nvdisasm_path
from cute_kernels.jit.evidence import compile_with_evidence
from cute_kernels.jit.ptx_digest import compare_digests, ptx_digest, read_digests
from cute_kernels.jit.spec import ALL_TARGETS
from cute_kernels.registry import compile_matrix

pytestmark = pytest.mark.compile

CASES = compile_matrix(ci=True)
DIGESTS = Path(__file__).with_name("ptx_digests.json")
EXPECTED = read_digests(DIGESTS)


def _regenerate(arch: str) -> str:
    return (f"if the change is intended, regenerate the digests: PYTHONPATH=$PWD python -m cute_kernels compile "
            f"--arch {arch} --digests {DIGESTS.relative_to(DIGESTS.parents[2])}")


@pytest.mark.parametrize("arch,config", CASES, ids=[f"{a}-{c.label()}" for a, c in CASES])
def test_variant_compiles_with_evidence(arch, config):
    compiled, ev = compile_with_evidence(config, arch)
    assert ev.ptx_target == arch
    assert not ev.missing, f"{config.label()} on {arch}: PTX lacks {ev.missing}"
    assert all(n > 0 for n in ev.ptx.values())
    key = f"{arch}:{config.label()}"
    digest = ptx_digest(compiled.ptx or "")
    assert EXPECTED.get(key) == digest, (f"{key}: normalized PTX {digest} differs from {DIGESTS.name} "
                                         f"({EXPECTED.get(key)}); {_regenerate(arch)}")
    if compiled.sass is not None:
        assert "STL" not in ev.sass and "LDL" not in ev.sass, f"register spills: {ev.sass}"
        _assert_wgmma_not_serialized(compiled)
    budget = getattr(config, "registers", None)
    if budget is not None and compiled.cubin is not None:
        _assert_register_budget(config, budget, compiled.cubin)


def _assert_register_budget(config, budget, cubin):
    """The SM100 kernels reconfigure registers per warpgroup role (setmaxnreg): the roles must
    share the pool the launch allocated (the kernel's register count, rounded up to the 8-register
    allocation unit, x its threads), which must fit the SM's 64K; and no local-memory frame."""
    from cute_kernels.jit.cubin import resources
    from cute_kernels.plans.hw import REGISTERS_PER_SM

    res = resources(cubin)
    launch = (res["registers"] + 7) // 8 * 8
    pool = launch * budget.threads
    assert pool <= REGISTERS_PER_SM, f"{config.label()}: {launch} registers x {budget.threads} threads"
    assert budget.total <= pool, f"{config.label()}: roles {dict(budget.roles)} need {budget.total} of {pool}"
    assert res["frame_bytes"] == 0, f"{config.label()}: {res['frame_bytes']} bytes of local memory"


def _assert_wgmma_not_serialized(compiled):
    """A WGMMA pipeline that ptxas serializes (a ``WARPGROUP.DEPBAR`` after every ``HGMMA``) loses
    its overlap without any error: ptxas reports C7512/C7515 only at info level. A software
    pipeline once did that because the compiler placed the zeroing of O's accumulators behind an
    in-flight QK WGMMA (docs/design/qsa.md#tried-and-rejected)."""
    import re

    hgmma = len(re.findall(r"\bHGMMA", compiled.sass))
    depbar = len(re.findall(r"WARPGROUP\.DEPBAR", compiled.sass))
    if hgmma and not _wgmma_serialization_expected(compiled.config):
        assert depbar < hgmma / 2, f"{compiled.config.label()}: {depbar} WARPGROUP.DEPBAR for {hgmma} HGMMA"


def _wgmma_serialization_expected(config) -> bool:
    """ptxas serializes the FP8 paged-decode kernel's WGMMAs (C7512, "insufficient register
    resources" at its 3-4 CTAs/SM); unserialized builds at fewer CTAs/SM were measured no faster
    (docs/design/sm90-decode.md#occupancy-against-wgmma-serialization), so that one is accepted."""
    return config.kernel_id == "sm90.decode" and getattr(config, "kv_dtype", "") == "fp8_e4m3"


@pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
def test_serialization_check_flags_a_serialized_kernel(monkeypatch):
    """Known answer for the check above: the FP8 decode kernel is serialized (24 DEPBAR for 24
    HGMMA at D 128), so without its exemption the check must fail."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_decode import make_decode_config

    cfg = make_decode_config(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16,
                             split=False)
    compiled = compile_config(cfg, "sm_90a", artifacts=True)
    monkeypatch.setitem(globals(), "_wgmma_serialization_expected", lambda c: False)
    with pytest.raises(AssertionError, match="WARPGROUP.DEPBAR"):
        _assert_wgmma_not_serialized(compiled)


def test_every_target_has_variants():
    for arch in ALL_TARGETS:
        assert any(t == arch for t, _ in CASES), arch


def test_digest_file_lists_exactly_the_registered_variants():
    """A variant added to (or removed from) the registry needs its digest written (or dropped):
    the file covers the full matrix, of which this suite compiles the representative part."""
    full = compile_matrix()
    assert {(t, c.label()) for t, c in CASES} <= {(t, c.label()) for t, c in full}
    for arch in ALL_TARGETS:
        labels = {f"{arch}:{c.label()}" for t, c in full if t == arch}
        diff = compare_digests({k: v for k, v in EXPECTED.items() if k.startswith(f"{arch}:")},
                               dict.fromkeys(labels, "?"))
        assert not [d for d in diff if not d.startswith("changed")], f"{diff}; {_regenerate(arch)}"


@pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm (nvidia-cuda-nvdisasm) not installed")
def test_sass_evidence_of_hopper_probe():
    from cute_kernels.plans.probes import Sm90ProbeConfig

    _, ev = compile_with_evidence(Sm90ProbeConfig(), "sm_90a")
    assert ev.sass.get("HGMMA", 0) > 0 and ev.sass.get("UTMALDG", 0) > 0, ev.sass


def test_wrong_target_is_refused():
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.probes import Sm90ProbeConfig

    with pytest.raises(ValueError, match="does not compile for sm_100a"):
        compile_config(Sm90ProbeConfig(), "sm_100a")


def _longest_load_store_alternation(ptx: str) -> int:
    """Longest run of global accesses that switch between a load and a store every instruction:
    a load the compiler could not hoist above an aliasing store, i.e. one serialized round trip
    each."""
    import re

    ops = [m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+ )?((?:ld|st)\.global)", ptx, re.M)]
    best = cur = 0
    for a, b in zip(ops, ops[1:]):
        cur = cur + 1 if a != b else 0
        best = max(best, cur)
    return best


@pytest.mark.parametrize("kind", ["tile-bf16", "row-bf16", "row-fp8"])
def test_qsa_gather_copies_whole_lines_with_immediate_offsets(kind):
    """The gather warps are issue-bound: each cp.async must carry its row's shared and global
    offsets as immediates (one base register pair per row, computed once), not ~20 instructions
    of shuffles and swizzle arithmetic per copy as before (``copy_lines``)."""
    import re

    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_qsa import make_qsa_config
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config

    kv = "fp8_e4m3" if kind.endswith("fp8") else "bf16"
    shape = dict(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, gate=True)
    cfg = make_qsa_tile_config(**shape) if kind.startswith("tile") else make_qsa_config(**shape, split=False)
    res = compile_config(cfg, "sm_90a", artifacts=True)
    # (the per-row kernel's copies carry the L2 evict-first policy: ``.L2::cache_hint``)
    copies = re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::cache_hint)? \[%r\d+(\+\d+)?\], \[%rd\d+(\+\d+)?\]",
                        res.ptx)
    assert copies and all(s_off or g_off for s_off, g_off in copies[1:]), copies[:4]
    if res.sass:  # the DSL's nvdisasm: at most a few instructions between a row's copies
        lines = [line for line in res.sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        at = [i for i, line in enumerate(lines) if "LDGSTS" in line]
        gaps = sorted(b - a for a, b in zip(at, at[1:]))
        assert gaps[len(gaps) // 2] <= 2, gaps


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_qsa_row_tile_overlap_variant(kv):
    """``overlap`` (one consumer warpgroup): each tile's QK is issued with the previous tile's PV,
    the softmax waits only for the QK (``wgmma.wait_group 1``), and the two P buffers fit the
    consumer's registers without spills; two consumer warpgroups refuse it."""
    import re

    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config

    shape = dict(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, gate=True)
    roles = {} if kv == "fp8_e4m3" else dict(consumers=1, producers=4)
    res = compile_config(make_qsa_tile_config(**shape, overlap=True, **roles), "sm_90a", artifacts=True)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", res.ptx)
    assert waits.count("1") >= 1, waits
    # QK (16 k-steps at D 256) and PV (4 k-steps of 16 tokens) of the prologue, loop and epilogue
    assert res.ptx.count("wgmma.mma_async") >= 16 + 2 * (16 + 4) + 4
    if res.sass:
        assert not re.search(r"\b(STL|LDL)\b", res.sass), "register spills"
    with pytest.raises(ValueError, match="overlap needs a single consumer warpgroup"):
        make_qsa_tile_config(**shape, overlap=True, consumers=2, producers=4, gather_groups=1)


def _loads_before_first_use(sass: str) -> int:
    """Global loads issued after ``griddepcontrol.wait`` (``ACQBULK``) before the first
    instruction that reads the first such load's result (the request's length)."""
    lines = [line.split(";")[0] for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    start = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    first = next(i for i in range(start, len(lines)) if re.search(r"\bLDG\b", lines[i]))
    dst = re.search(r"LDG\S* (R\d+),", lines[first]).group(1)
    use = next(i for i in range(first + 1, len(lines)) if re.search(rf"\b{dst}\b", lines[i]))
    return sum(bool(re.search(r"\bLDG\b", line)) for line in lines[first:use])


def test_decode_strided_split_loads_page_table_with_seq_len():
    """Strided split tiles: the producer's first page-table load is issued before anything waits
    for the request's length, so the two loads are in flight together (contiguous ranges need
    the length first: one load). Non-split and dynamic schedules refuse ``strided``."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_decode import Sm90DecodeConfig, make_decode_config

    shape = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1, page_size=16, split=True)
    strided = compile_config(make_decode_config(**shape, strided=True), "sm_90a", artifacts=True)
    contiguous = compile_config(make_decode_config(**shape, strided=False), "sm_90a", artifacts=True)
    if not strided.sass:
        pytest.skip("no nvdisasm: the SASS order cannot be read")
    assert _loads_before_first_use(strided.sass) >= 2
    assert _loads_before_first_use(contiguous.sass) == 1
    assert not make_decode_config(**{**shape, "split": False}, strided=True).strided  # nothing to stride
    with pytest.raises(ValueError, match="strided tiles are a static split schedule"):
        Sm90DecodeConfig(split=True, dynamic=True, strided=True)


def test_decode_cluster_merge_reads_partials_through_dsmem():
    """The cluster merge: partials cross the cluster through DSMEM (``mapa`` +
    ``ld.shared::cluster``) between two cluster barriers, with no global arrival atomic and no
    global partial stores; the global fused merge keeps its atomic. The config refuses it without
    a static split."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_decode import Sm90DecodeConfig, make_decode_config

    shape = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=4, q_len=1, page_size=16, split=True)
    cluster = compile_config(make_decode_config(**shape, cluster=True), "sm_90a", artifacts=True).ptx
    fused = compile_config(make_decode_config(**shape), "sm_90a", artifacts=True).ptx
    assert len(re.findall(r"barrier\.cluster\.arrive", cluster)) == 2
    assert len(re.findall(r"barrier\.cluster\.wait", cluster)) == 2
    assert re.search(r"mapa\.shared::cluster", cluster) and re.search(r"ld\.shared::cluster\.v4\.f32", cluster)
    assert not re.search(r"\batom\.", cluster) and not re.search(r"st\.global\.f32", cluster)
    assert re.search(r"\batom\.", fused) and not re.search(r"barrier\.cluster", fused)
    with pytest.raises(ValueError, match="cluster merge needs a static split"):
        Sm90DecodeConfig(split=False, cluster=True)
    with pytest.raises(ValueError, match="cluster merge needs a static split"):
        Sm90DecodeConfig(split=True, dynamic=True, cluster=True)
    with pytest.raises(ValueError, match="do not fit"):  # 64 rows x 257 words > 2 stages x 64 x 64 B
        Sm90DecodeConfig(split=True, cluster=True, head_dim=64, group=16, q_len=4, stages=2)


def _gate_load_runs(ptx: str) -> list[int]:
    """Sizes of the runs of 16-bit global loads (only the gate is read that way) that no branch
    and no global store interrupts, in program order."""
    import re

    runs, cur = [], 0
    for line in ptx.splitlines():
        if re.search(r"\bld\.global(\.v2)?\.b16\b", line):
            cur += 1
        elif cur and re.search(r"\bbra\b|\bst\.global", line):
            runs, cur = runs + [cur], 0
    return runs + [cur] if cur else runs


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_gated_qsa_epilogues_batch_their_gate_loads(kv):
    """The QSA output gate is read per output element; since the gate and the output may alias,
    the compiler keeps program order between them. Each gated epilogue must issue its gate loads in
    batches before the stores. Before this fix, the row-tile epilogue alternated 128 loads with 128
    stores. ncu then put 37-40 % of the kernel's stall samples there. Batched but each under its
    row's branch, the loads still waited one by one (ncu SASS: a stall on every gate conversion)."""
    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_qsa import make_qsa_config
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config

    shape = dict(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, gate=True)
    for cfg in (make_qsa_tile_config(**shape), make_qsa_tile_config(**shape, gate_vec=1),
                make_qsa_config(**shape, split=False)):
        ptx = compile_config(cfg, "sm_90a", artifacts=True).ptx
        assert _longest_load_store_alternation(ptx) <= 4, cfg.label()
        # a load under a row's branch waits inside it; 4-byte pairs in the row-tile kernel
        # one run of loads per storing warpgroup (the row tiles' two consumer groups store half
        # each): every element's gate load of that group, none under a branch
        runs = _gate_load_runs(ptx)
        if cfg.kernel_id == "sm90.qsa_tile":
            per_group = 128 // cfg.gate_vec // cfg.consumers
            assert runs == [per_group] * cfg.consumers, (cfg.label(), runs)
        else:
            assert runs == [32], (cfg.label(), runs)


def test_decode_l2_policy_descriptor_prefetch_and_staged_merge():
    """The paged decode's K/V TMA loads carry the evict-first L2 policy operand, the producer
    prefetches both TMA descriptors ahead of the PDL wait, and a split kernel's fused merge
    stages the partials with ``cp.async``; each is gone with its tuning field off. The QSA
    per-row gather carries the same policy, the row-tile gather does not."""
    import re

    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_decode import make_decode_config
    from cute_kernels.plans.sm90_qsa import make_qsa_config
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config
    from cute_kernels.roles.fragments import EVICT_FIRST_POLICY

    shape = dict(q_dtype="bf16", kv_dtype="fp8_e4m3", head_dim=128, group=8, q_len=1, page_size=16, split=True)
    on = compile_config(make_decode_config(**shape), "sm_90a", artifacts=True).ptx
    off = compile_config(make_decode_config(**shape, evict_first=False, prefetch_desc=False, smem_merge=False),
                         "sm_90a", artifacts=True).ptx
    policy = f"mov.b64 \t%rd\\d+, {EVICT_FIRST_POLICY};"
    assert re.search(policy, on) and not re.search(policy, off)
    assert on.count("prefetch.tensormap") == 2 and "prefetch.tensormap" not in off
    wait = on.index("griddepcontrol.wait")
    assert all(m.start() < wait for m in re.finditer("prefetch.tensormap", on))
    assert "cp.async.cg.shared.global" in on and "cp.async.cg.shared.global" not in off
    # nothing the merge copies may come through L1: other SMs wrote it in this kernel, and an L1
    # line holding a neighbouring (request, head)'s LSEs may have been read before they were final
    assert "cp.async.ca" not in on

    qsa = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=256, group=12, page_size=1568, gate=True)
    row = compile_config(make_qsa_config(**qsa, split=False), "sm_90a", artifacts=True).ptx
    tile = compile_config(make_qsa_tile_config(**qsa), "sm_90a", artifacts=True).ptx
    assert "cp.async.cg.shared.global.L2::cache_hint" in row
    assert "L2::cache_hint" not in tile


@pytest.mark.parametrize("splits", [2, 3, 4, 11, 16, 33])
def test_qsa_merge_issues_every_split_of_a_group_before_using_one(splits):
    """The QSA merge's shape is chosen from the launch's split count: every split in one round
    trip (its 16-byte partial loads all issued before the first weight), up to 16 per thread and
    beyond that shared by ``lanes`` threads per chunk (combined by butterfly shuffles), never
    more loads than the next power of two (idle predicated loads cost at small S)."""
    import re

    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_qsa_merge import QsaMergeConfig, merge_shape

    group, lanes = merge_shape(splits)
    assert (group, lanes) == {2: (2, 1), 3: (4, 1), 4: (4, 1), 11: (16, 1), 16: (16, 1), 33: (16, 4)}[splits]
    ptx = compile_config(QsaMergeConfig(group=group, lanes=lanes), "sm_90a", artifacts=True).ptx
    body = ptx[ptx.index("griddepcontrol.wait"):]
    first_use = body.index("ex2.approx")
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", body[:first_use])) == group
    assert ("shfl.sync.bfly" in body) == (lanes > 1)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_qsa_per_row_gather_releases_k_before_v(kv):
    """The per-row QSA gather of a split launch (``kv_barriers``, its default) issues a slot's K
    copies, arrives on the slot's K barrier, then issues its V copies and arrives on the V
    barrier, so QK can start while V is in flight; off (the unsplit default), K and V copies
    interleave under one arrival. The row tiles refuse it."""
    import re

    from cute_kernels.jit.compiler import compile_config
    from cute_kernels.plans.sm90_qsa import make_qsa_config
    from cute_kernels.plans.sm90_qsa_tile import make_qsa_tile_config

    shape = dict(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, split=True, gate=False)

    def copy_sequence(cfg):
        ptx = compile_config(cfg, "sm_90a", artifacts=True).ptx
        seq = "".join("A" if "mbarrier.arrive" in ln else "c" for ln in ptx.splitlines() if "cp.async" in ln)
        return re.sub(r"c+", lambda m: f"c{len(m.group())}", seq)

    n = 32 if kv == "bf16" else 16  # K (or V) copies of one producer warp per slot
    assert copy_sequence(make_qsa_config(**shape)) == f"c{n}Ac{n}A"
    assert copy_sequence(make_qsa_config(**shape, kv_barriers=False)) == f"c{2 * n}A"
    assert copy_sequence(make_qsa_config(**{**shape, "split": False})) == f"c{2 * n}A"
    with pytest.raises(ValueError, match="kv_barriers"):
        make_qsa_tile_config(q_dtype="bf16", kv_dtype=kv, head_dim=256, group=12, page_size=1568, gate=True,
                             kv_barriers=True)
