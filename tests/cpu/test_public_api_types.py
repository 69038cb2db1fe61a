"""Every public function carries annotations on every argument and on its return (the typed API
that ``py.typed`` promises); ``python -m mypy`` then checks callers against them."""

from __future__ import annotations

import importlib
import inspect
import typing

import pytest

import cute_kernels
import dispatch

PUBLIC_MODULES = ("cute_kernels.reference", "cute_kernels.warmup", "cute_kernels.qsa_warmup")


def _missing(fn) -> list[str]:
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _public_functions():
    for name in cute_kernels.__all__:
        obj = getattr(cute_kernels, name)
        if inspect.isfunction(obj):
            yield f"cute_kernels.{name}", obj
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module_name:
                yield f"{module_name}.{name}", obj
    for name in dispatch.__all__:
        obj = getattr(dispatch, name)
        if inspect.isfunction(obj):
            yield f"dispatch.{name}", obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and (attr == "__init__" or not attr.startswith("_")):
                    yield f"dispatch.{name}.{attr}", member


PUBLIC = dict(_public_functions())


def test_the_public_surface_is_found():
    for name in ("cute_kernels.paged_decode", "cute_kernels.merge_states", "cute_kernels.quantize_query",
                 "cute_kernels.write_kv_cache", "cute_kernels.qsa_sparse_attention", "cute_kernels.warmup",
                 "cute_kernels.reference.paged_decode", "dispatch.plan", "dispatch.parse_arch",
                 "dispatch.AttentionLayer.forward"):
        assert name in PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_argument_and_return_is_annotated(name):
    assert _missing(PUBLIC[name]) == [], f"{name}: unannotated"


@pytest.mark.parametrize("name", ["cute_kernels.paged_decode", "cute_kernels.paged_prefill"])
def test_return_lse_selects_the_return_type(name):
    """Three overloads: ``return_lse`` False (default) -> Tensor, True -> (out, lse), a bool -> either."""
    fn = PUBLIC[name]
    overloads = typing.get_overloads(fn) if hasattr(typing, "get_overloads") else None
    if overloads is None:
        pytest.skip("typing.get_overloads needs Python 3.11")
    returns = [inspect.signature(o).parameters["return_lse"].annotation for o in overloads]
    assert returns == ["Literal[False]", "Literal[True]", "bool"]
