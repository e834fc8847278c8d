"""Dependencies point down (../shared/DESIGN.md): the base (megatron/) imports no plugin. Read from the source, so
a late import inside a function counts too."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ("megascan", "megadpp", "megafbd", "megascope")


def _imports(folder):
    """(file, line, imported module, [names]) of every import in ``folder``'s Python files."""
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, node.lineno, alias.name, []
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.lineno, node.module, [alias.name for alias in node.names]


def test_the_base_imports_no_plugin():
    found = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path, line, module, _ in _imports("megatron") if module.split(".")[0] in PLUGINS]
    assert found == []
