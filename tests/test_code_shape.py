"""Code shape: small modules and short functions, so a newcomer can read one piece at a time.

Limits: no source file under ``flowrl/``, ``pipelines/`` or ``rewards/`` over
``MAX_FILE_LINES`` lines, no function or method over ``MAX_FUNCTION_LINES`` lines (the whole
``def``: decorators excluded, docstring included, ``end_lineno - lineno + 1``). The file limit is a
tripwire, not a design rule: a 450-line file with one job beats three files and a re-export
(issue 23), so it sits at 450.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flowrl", "pipelines", "rewards")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def _sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))


def long_files(limit: int = MAX_FILE_LINES, root: Path = ROOT) -> list[tuple[str, int]]:
    """``(path, lines)`` of every source file over ``limit`` lines, longest first."""
    out = [(p.relative_to(root).as_posix(), len(p.read_text(encoding="utf-8").splitlines())) for p in _sources(root)]
    return sorted([(p, n) for p, n in out if n > limit], key=lambda x: -x[1])


def long_functions(limit: int = MAX_FUNCTION_LINES, root: Path = ROOT) -> list[tuple[str, str, int, int]]:
    """``(path, qualified name, first line, lines)`` of every function over ``limit`` lines, longest first."""
    out = []
    for p in _sources(root):
        rel = p.relative_to(root).as_posix()
        stack = [(ast.parse(p.read_text(encoding="utf-8"), filename=str(p)), "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = f"{prefix}{getattr(child, 'name', '')}"
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        out.append((rel, name, child.lineno, n))
                    stack.append((child, name + "."))
                elif isinstance(child, ast.ClassDef):
                    stack.append((child, name + "."))
                else:
                    stack.append((child, prefix))
    return sorted(out, key=lambda x: (-x[3], x[0], x[2]))


def test_sources_are_found():
    files = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"flowrl/__init__.py", "rewards/__init__.py", "pipelines/__init__.py"} <= files


SAMPLE = '''import functools


class A:
    @functools.lru_cache
    def f(self):
        """doc"""
        x = 1
        if x:
            y = 2

        def inner():
            a = 1
            b = 2
            return a + b

        return inner


def g():
    return 1
'''


def test_the_checks_see_long_code(tmp_path):
    """The measure itself, on a made-up tree: limits are inclusive, methods and nested functions are
    named by their path, the docstring counts, decorators do not."""
    (tmp_path / "flowrl").mkdir()
    (tmp_path / "flowrl" / "m.py").write_text(SAMPLE)
    lines = len(SAMPLE.splitlines())  # 21
    assert long_files(lines, tmp_path) == [] and long_files(lines - 1, tmp_path) == [("flowrl/m.py", lines)]
    # A.f: def (line 6) .. return inner (line 17) = 12 lines; inner: 4 lines; g: 2 lines
    assert long_functions(12, tmp_path) == []
    assert long_functions(11, tmp_path) == [("flowrl/m.py", "A.f", 6, 12)]
    assert long_functions(3, tmp_path) == [("flowrl/m.py", "A.f", 6, 12), ("flowrl/m.py", "A.f.inner", 12, 4)]
    assert len(long_functions(1, tmp_path)) == 3


def test_no_source_file_over_the_limit():
    bad = long_files()
    assert not bad, (f"{len(bad)} source file(s) over {MAX_FILE_LINES} lines; split each into modules with one job:\n"
                     + "\n".join(f"  {p}: {n} lines (limit {MAX_FILE_LINES})" for p, n in bad))


def test_no_function_over_the_limit():
    bad = long_functions()
    assert not bad, (f"{len(bad)} function(s) over {MAX_FUNCTION_LINES} lines; split each into named steps:\n"
                     + "\n".join(f"  {p}:{line} {name}: {n} lines (limit {MAX_FUNCTION_LINES})"
                                 for p, name, line, n in bad))
