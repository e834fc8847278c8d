"""Dependencies point down (docs/design.md): the base (megatron/) imports no plugin, and no package imports
another package's private names. Read from the source, so a late import inside a function counts too."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ("megascan", "megadpp", "megafbd", "megascope")
PACKAGES = ("megatron", *PLUGINS)


def _imports(folder):
    """(file, line, imported module, [names]) of every import in ``folder``'s Python files."""
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, node.lineno, alias.name, []
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.lineno, node.module, [alias.name for alias in node.names]


def _package(module):
    """The package a module belongs to: megatron.training and megatron.inference are two, each plugin one."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "megatron" else parts[0]


def test_the_base_imports_no_plugin():
    found = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path, line, module, _ in _imports("megatron") if module.split(".")[0] in PLUGINS]
    assert found == []


def test_no_private_name_crosses_packages():
    found = []
    for folder in PACKAGES:
        for path, line, module, names in _imports(folder):
            own = _package(".".join(path.relative_to(REPO).with_suffix("").parts))
            private = [name for name in names if name.startswith("_")]
            if module.split(".")[0] in PACKAGES and _package(module) != own and private:
                found.append(f"{path.relative_to(REPO)}:{line} imports {private} from {module}")
    assert found == []
