"""Readable kernel symbols: every registered variant gets ``cute_kernels_<family>[_<variant>...]``
from its config, applied by the compiler (no kernel module names itself), and compiled PTX shows
it as the ``.entry`` name."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from cute_kernels.jit.naming import kernel_functions, kernel_symbol, named_kernels
from cute_kernels.jit.ptx_digest import normalized_ptx
from cute_kernels.registry import variants_for

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")


def _cfg(kernel_id: str, **fields):
    return SimpleNamespace(kernel_id=kernel_id, **fields)


@pytest.mark.parametrize("config,symbol", [
    (_cfg("sm90.decode", split=False, cluster=False, dynamic=False), "cute_kernels_sm90_decode"),
    (_cfg("sm90.decode", split=True, cluster=False, dynamic=False), "cute_kernels_sm90_decode_split"),
    (_cfg("sm90.decode", split=True, cluster=True, dynamic=False), "cute_kernels_sm90_decode_split_cluster"),
    (_cfg("sm90.decode", split=True, cluster=False, dynamic=True), "cute_kernels_sm90_decode_split_dynamic"),
    (_cfg("common.merge_states", pdl=True), "cute_kernels_merge_states"),
    (_cfg("common.quantize_query", rot_dim=64), "cute_kernels_quantize_query_rope"),
    (_cfg("common.quantize_query", rot_dim=0), "cute_kernels_quantize_query"),
    (_cfg("sm90.qsa", split=True, gate=True), "cute_kernels_sm90_qsa_split_gate"),
    (_cfg("sm90.qsa_tile", gate=False, overlap=True), "cute_kernels_sm90_qsa_tile_overlap"),
    (_cfg("sm100.probe"), "cute_kernels_sm100_probe"),
])
def test_symbol_from_config(config, symbol):
    assert kernel_symbol(config) == symbol


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_registered_variant_has_a_readable_symbol_and_a_kernel_to_name(arch):
    for config in variants_for(arch):
        symbol = kernel_symbol(config)
        assert re.fullmatch(r"cute_kernels(_[a-z0-9]+)+", symbol), (config.label(), symbol)
        assert len(symbol) < 64
        # the compiler can name it: the kernel class has at least one @cute.kernel
        assert kernel_functions(config.build()), config.label()


def test_naming_is_restored_after_compiling():
    config = next(c for c in variants_for("sm_90a") if c.kernel_id == "common.merge_states")
    kernel = config.build()
    (fn,) = kernel_functions(kernel)
    before = getattr(fn.__wrapped__, "_cute_dsl_name_options", None)
    with named_kernels(kernel, "cute_kernels_x"):
        assert fn.__wrapped__._cute_dsl_name_options.name_prefix == "cute_kernels_x"
    assert getattr(fn.__wrapped__, "_cute_dsl_name_options", None) == before


@pytest.mark.compile
def test_compiled_entry_names_are_readable():
    from cute_kernels.jit.compiler import compile_config

    wanted = {
        ("common.merge_states", False): "cute_kernels_merge_states_0",
        ("sm90.decode", False): "cute_kernels_sm90_decode_0",
        ("sm90.decode", True): "cute_kernels_sm90_decode_split_0",
        ("sm80.decode", True): "cute_kernels_sm80_decode_split_0",  # the portable kernel built for sm_90a
        ("sm80.prefill", False): "cute_kernels_sm80_prefill_0",
    }
    seen = {}
    for config in variants_for("sm_90a"):
        key = (config.kernel_id, bool(getattr(config, "split", False)) and not getattr(config, "cluster", False))
        if key in wanted and key not in seen:
            ptx = compile_config(config, "sm_90a", artifacts=True).ptx
            seen[key] = _ENTRY.findall(ptx)
            # the digest normalizes entry names, so renaming changes no digest
            assert wanted[key] not in normalized_ptx(ptx)
    assert seen == {key: [name] for key, name in wanted.items()}
