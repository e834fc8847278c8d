"""Every public function of the typed APIs has type hints (docs/design.md): the transport, the MegaScope
wire protocol, the generation server's request parsing and its HTTP side, and the aggregation and detection APIs."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TYPED = ["megadpp/transport", "megascope/wire.py", "megatron/inference/errors.py", "megatron/inference/limits.py",
         "megatron/inference/requests.py", "megatron/inference/serving", "megascan/aggregate", "megascan/detection"]


def _public_functions(tree):
    """(qualified name, function node) of the module's public functions and its public classes' methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node, False
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        not item.name.startswith("_") or item.name in ("__init__", "__call__")):
                    yield f"{node.name}.{item.name}", item, True


def _untyped(function, is_method):
    """What of ``function``'s signature has no annotation: its parameters' names and "return"."""
    arguments = function.args
    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                  *filter(None, (arguments.vararg, arguments.kwarg))]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    if is_method and not static:
        parameters = parameters[1:]  # self or cls
    missing = [parameter.arg for parameter in parameters if parameter.annotation is None]
    if function.returns is None and function.name != "__init__":
        missing.append("return")
    return missing


def test_public_functions_of_the_typed_apis_have_type_hints():
    paths = [path for entry in TYPED for path in sorted((REPO / entry).rglob("*.py") if (REPO / entry).is_dir()
                                                        else [REPO / entry])]
    found = []
    for path in paths:
        for name, function, is_method in _public_functions(ast.parse(path.read_text())):
            if missing := _untyped(function, is_method):
                found.append(f"{path.relative_to(REPO)}:{function.lineno} {name}: {', '.join(missing)}")
    assert len(paths) > 20 and found == []
