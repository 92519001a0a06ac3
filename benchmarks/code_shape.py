"""The shape of the package: its largest classes and modules, and what each top-level entry holds.

Counts come from the AST of every module under ``pollen/`` of a checkout (default: this one): a
class's lines (first to last line of its body), its methods, and the ``self.x =`` attributes it sets;
a module's lines. Used for the redesign's before/after figures (issue 23, "Measured").

Run: ``python benchmarks/code_shape.py [--checkout PATH] [--top 8]``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def classes(root: Path) -> list[tuple[int, int, int, str]]:
    """``(lines, methods, attributes, "module:Class")`` for every class under ``root/pollen``."""
    found = []
    for path in sorted((root / "pollen").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = {
                target.attr
                for n in ast.walk(node)
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            }
            lines = node.end_lineno - node.lineno + 1
            found.append((lines, len(methods), len(attributes), f"{path.relative_to(root)}:{node.name}"))
    return sorted(found, reverse=True)


def modules(root: Path) -> list[tuple[int, str]]:
    return sorted(
        ((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in (root / "pollen").rglob("*.py")),
        reverse=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    root = args.checkout.resolve()
    loose = sorted(p.name for p in (root / "pollen").glob("*.py") if p.name != "__init__.py")
    print(f"checkout {root}: {len(loose)} loose modules at pollen/ top: {', '.join(loose)}")
    print(f"{'lines':>6} {'methods':>8} {'attrs':>6}  class")
    for lines, methods, attributes, name in classes(root)[: args.top]:
        print(f"{lines:>6} {methods:>8} {attributes:>6}  {name}")
    print(f"{'lines':>6}  module")
    for lines, name in modules(root)[: args.top]:
        print(f"{lines:>6}  {name}")


if __name__ == "__main__":
    main()
