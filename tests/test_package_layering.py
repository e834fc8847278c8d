"""Dependencies point down (docs/design.md): the base (megatron/) imports no plugin, no plugin imports another,
no package imports another package's private names, and no two parts import each other. Read from the source, so
a late import inside a function (or one for type checking only) counts too."""

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


def _module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module):
    """What an import loop is judged between: a module of a package's top level (``megatron.training.plugins``,
    ``megascan.recorder``), or a subpackage as a whole (``megascan.aggregate``, ``megascan.detection``)."""
    depth = 3 if module.startswith("megatron.") else 2
    return ".".join(module.split(".")[:depth])


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


def test_no_plugin_imports_another():
    found = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for plugin in PLUGINS for path, line, module, _ in _imports(plugin)
             if module.split(".")[0] in PLUGINS and module.split(".")[0] != plugin]
    assert found == []


def _import_graph():
    """{part: the parts it imports}, over the base and the plugins (see ``_part``)."""
    folders = ("megatron/training", "megatron/inference", *PLUGINS)
    modules = {_module_name(path) for folder in folders for path in (REPO / folder).rglob("*.py")}
    graph = {_part(module): set() for module in modules}
    for folder in folders:
        for path, _, module, names in _imports(folder):
            targets = [f"{module}.{name}" if f"{module}.{name}" in modules else module for name in names] or [module]
            here = _part(_module_name(path))
            graph[here] |= {_part(target) for target in targets if target in modules and _part(target) != here}
    return graph


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for following in graph[todo.pop()] - seen:
            seen.add(following)
            todo.append(following)
    return seen


def test_no_two_parts_import_each_other():
    """E.g. the loop's contract (plugins.py) and the loop (training.py); MegaScan's aggregate/, which merges
    traces, and detection/, which judges the merged trace (the command that runs both is aggregate_cli.py)."""
    graph = _import_graph()
    loops = sorted(f"{part} -> {other} -> ... -> {part}" for part in graph for other in graph[part]
                   if part in _reachable(graph, other))
    assert loops == []
