"""The package's layers, read from its import graph: each layer builds on the ones below it only, so
any one can be read, tested and changed without the ones above it, and no cycle can form between
them. Bottom to top:

    base (ragckpt/*.py: errors, options, sizes, ...) -> format -> planner -> storage -> checkpoint
    -> reshard -> convert, integrations -> the `ragckpt` facade (ragckpt/__init__.py) -> cli

A module may import its own layer and the ones below; nothing below cli imports cli; and no
ragckpt module is imported inside a function, where such an import would hide a dependency (or a
cycle) from a reader and from this test. A function may still defer another import that costs
start-up time (torch, rich; see `ragckpt.lazy`), with a comment beside it saying so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: layer of each package, bottom first; packages on one line share a layer
LAYERS: list[tuple[str, ...]] = [
    ("ragckpt",),  # the base: modules directly in ragckpt/
    ("ragckpt.format",),
    ("ragckpt.planner",),
    ("ragckpt.storage",),
    ("ragckpt.checkpoint",),
    ("ragckpt.reshard",),
    ("ragckpt.convert", "ragckpt.integrations"),
    ("ragckpt.__init__",),  # the facade
    ("cli",),
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
CLI = RANK["cli"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of a module of ours, None for anything else. `ragckpt` itself is the facade; a
    module directly in ragckpt/ is the base."""
    parts = module.split(".")
    if parts[0] == "cli":
        return CLI
    if parts[0] != "ragckpt":
        return None
    if len(parts) == 1:
        return RANK["ragckpt.__init__"]
    sub = ".".join(parts[:2])
    if sub in RANK:
        return RANK[sub]
    assert not (ROOT / "ragckpt" / parts[1]).is_dir(), f"package {sub} has no layer in LAYERS: give it one"
    return RANK["ragckpt"]


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> list[str]:
    """The modules an import statement loads: for `from X import y`, X.y where that is a module of
    ours, else X (whose `__init__` it runs and whose name y it takes)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = here.split(".") if is_package else here.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join([*pkg, base] if base else pkg)
    return [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]


def in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def commented(node: ast.stmt, lines: list[str], parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether a comment sits on the import's lines or the line above it, or above the run of
    imports it ends (one comment for a group)."""
    first = node.lineno
    body = getattr(parents[node], "body", [])
    at = next((i for i, x in enumerate(body) if x is node), 0)
    while at > 0 and isinstance(body[at - 1], (ast.Import, ast.ImportFrom)) and body[at - 1].end_lineno == first - 1:
        at -= 1
        first = body[at].lineno
    return any("#" in line for line in lines[max(first - 2, 0):node.end_lineno])


def problems() -> list[str]:
    found = []
    paths = sorted([*ROOT.glob("ragckpt/**/*.py"), *ROOT.glob("cli/**/*.py")])
    assert paths, ROOT
    for path in paths:
        here = module_name(path)
        own = layer_of(here)
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
            deferred = in_function(node, parents)
            if deferred and not commented(node, lines, parents):
                found.append(f"{where}  (imported inside a function with no comment saying why)")
            for target in imported(node, here, path.name == "__init__.py"):
                theirs = layer_of(target)
                if theirs is None:
                    continue
                if theirs == CLI and own != CLI:
                    found.append(f"{where}  (imports the CLI from below it)")
                elif theirs > own:
                    found.append(f"{where}  (imports layer {LAYERS[theirs][0]} from layer {LAYERS[own][0]})")
                if target.split(".")[0] == "ragckpt" and deferred:
                    found.append(f"{where}  (a ragckpt module imported inside a function)")
    return sorted(set(found))


def test_every_import_goes_down_the_layers():
    found = problems()
    assert not found, "\n" + "\n".join(found)


@pytest.mark.parametrize(("module", "layer"), [
    ("ragckpt", "ragckpt.__init__"), ("ragckpt.errors", "ragckpt"), ("ragckpt.format.layout", "ragckpt.format"),
    ("ragckpt.planner.state", "ragckpt.planner"), ("ragckpt.integrations.fsdp2", "ragckpt.integrations"),
    ("cli.commands.hf", "cli"),
])
def test_modules_are_placed_by_their_path(module, layer):
    assert layer_of(module) == RANK[layer]


def test_an_import_names_the_module_it_loads():
    tree = ast.parse("from ragckpt import reshard, __version__\nfrom ..store import Store\n")
    first, second = tree.body
    assert imported(first, "ragckpt.checkpoint.manifest", False) == ["ragckpt.reshard", "ragckpt"]
    assert imported(second, "ragckpt.storage.lock", False) == ["ragckpt.store"]
    assert imported(second, "ragckpt.storage.remote.x", False) == ["ragckpt.storage.store"]
