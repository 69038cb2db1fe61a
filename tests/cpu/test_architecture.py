"""The package's structure, checked on its sources: host-only plans, imports that run one way,
kernels that compose roles instead of inheriting each other, small modules.

Layers, lowest first (docs/design/architecture.md#layers): jit < roles < kernels < plans < ops <
dispatch < cli. A module may import its own layer and the layers below it, at module level and
inside functions alike.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cute_kernels", "dispatch")
LAYERS = ("jit", "roles", "kernels", "plans", "ops", "dispatch", "cli")
MAX_LINES = 800

# module (or package prefix) -> layer; the longest matching prefix wins
LAYER_OF = {
    "cute_kernels.jit": "jit",
    "cute_kernels._nvtx": "jit",
    "cute_kernels.roles": "roles",
    "cute_kernels.sm80": "kernels",
    "cute_kernels.sm90": "kernels",
    "cute_kernels.sm100": "kernels",
    "cute_kernels.common": "kernels",
    "cute_kernels.plans": "plans",
    "cute_kernels.registry": "plans",
    "cute_kernels": "ops",  # the package facade (public ops resolved lazily through the registry)
    "cute_kernels.ops": "ops",
    "cute_kernels.reference": "ops",
    "cute_kernels.reference_qsa_union": "ops",
    "cute_kernels.testing": "ops",
    "cute_kernels.warmup": "ops",
    "cute_kernels.qsa_warmup": "ops",
    "dispatch": "dispatch",
    "cute_kernels.cli": "cli",
    "cute_kernels.__main__": "cli",
    "cute_kernels.bench": "cli",
}

# (importer, imported) edges that go upward on purpose, inside a function, with the reason: none.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to LAYER_OF (and to docs/design/architecture.md)")
    return LAYER_OF[best]


def _imports(module: str, path: Path):
    """(imported project module, line, inside a function) for every import statement."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # ``from pkg import submodule`` imports the submodule; ``from mod import name`` the module
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                target = name
                while target not in MODULES and "." in target:
                    target = target.rpartition(".")[0]
                yield target, node.lineno, id(node) in functions


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_run_one_way():
    """No module imports a layer above its own, at module level or inside a function (a
    function-level import that goes upward hides a cycle)."""
    upward = []
    for module, path in MODULES.items():
        mine = LAYERS.index(layer_of(module))
        for target, line, in_function in _imports(module, path):
            theirs = LAYERS.index(layer_of(target))
            if theirs > mine and not (in_function and (module, target) in ALLOWED_UPWARD):
                where = "inside a function" if in_function else "at module level"
                upward.append(f"{path.relative_to(ROOT)}:{line}: {layer_of(module)} imports {layer_of(target)} "
                              f"({target}) {where}")
    assert not upward, "\n".join(upward)


def test_kernels_and_roles_never_import_torch():
    bad = []
    for module, path in MODULES.items():
        if layer_of(module) in ("jit", "roles", "kernels", "plans"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] == "torch" for n in names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_plans_registry_and_dispatch_import_without_the_dsl_or_torch():
    """Every module under plans/ (and the registry, the launcher core and the dispatcher) imports
    with ``cutlass`` and ``torch`` made unimportable, and the configs, the compile matrix and a
    plan can be built there."""
    plans = sorted(m for m in MODULES if m.startswith("cute_kernels.plans"))
    code = "\n".join([
        "import sys, importlib",
        "sys.modules['cutlass'] = None; sys.modules['torch'] = None",
        f"for m in {plans + ['cute_kernels.registry', 'cute_kernels.ops._launch', 'dispatch']!r}:",
        "    importlib.import_module(m)",
        "from cute_kernels import registry",
        "configs = registry.variants()",
        "assert len(configs) > 50 and all(c.signature() and c.label() for c in configs)",
        "import dispatch",
        "assert dispatch.plan(arch='sm90', phase='decode', kv_cache_dtype='fp8', model_dtype='bf16', head_dim=128,"
        " num_q_heads=32, num_kv_heads=8, page_size=16).kernel == 'sm90.decode'",
        "from cute_kernels.plans.sm90_qsa_launch import qsa_variants",
        "assert qsa_variants(head_dim=256, num_q_heads=24, num_kv_heads=2, page_size=1568, kv_cache_dtype='fp8',"
        " block_table_width=16)",
    ])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_kernel_or_role_class_inherits_another():
    """Kernels compose roles; none inherits another kernel's (or a role's) class."""
    bad = []
    for module, path in MODULES.items():
        if layer_of(module) in ("roles", "kernels"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.bases:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}({ast.unparse(node.bases[0])})")
    assert not bad, bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_source_file_over_the_limit(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{module}: {lines} lines (split it into smaller modules)"
