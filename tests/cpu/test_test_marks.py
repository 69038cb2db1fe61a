"""A ``pytest.mark`` on a helper is silently ignored (the test it was meant for then fails for a
missing fixture on the GPU, or runs unparametrized): every marked function is a test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _is_pytest_mark(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    parts = []
    while isinstance(target, ast.Attribute):
        parts.append(target.attr)
        target = target.value
    return isinstance(target, ast.Name) and target.id == "pytest" and parts[-1:] == ["mark"]


def _misplaced_marks(path: Path, root: Path = TESTS) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(root)}:{fn.lineno} {fn.name}" for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("test")
            and any(_is_pytest_mark(d) for d in fn.decorator_list)]


@pytest.mark.parametrize("tier", ["cpu", "gpu"])
def test_marks_decorate_tests_only(tier):
    bad = [m for path in sorted((TESTS / tier).glob("test_*.py")) for m in _misplaced_marks(path)]
    assert not bad, f"pytest marks on functions that are not tests: {bad}"


def test_the_check_sees_a_misplaced_mark(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import pytest\n@pytest.mark.parametrize('a', [1])\ndef helper(a):\n    return a\n"
                    "@pytest.mark.parametrize('a', [1])\ndef test_y(a):\n    assert a\n")
    assert [m.split()[-1] for m in _misplaced_marks(path, tmp_path)] == ["helper"]
