"""The package's layout rules (docs/layout.md): short modules, imports only as the layout
document's table allows, no import cycle between the subpackages (lazy imports included), no op
module reaching into a sibling op module's private names, and a layout document that names every
module."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_vocabstats"
MODULES = sorted(PACKAGE.rglob("*.py"))
# The op modules of ops/: each op family's folder (the private helpers _math, _checks, ... and
# the engine are shared by design; these hold Functions and their own math, and may only share
# through public names), and the fused heads' shared checks.
FAMILIES = ("stats", "topk", "sampling")
OP_MODULES = {f"{family}.{p.stem}" for family in FAMILIES
              for p in (PACKAGE / "ops" / family).glob("*.py") if p.stem != "__init__"}
OP_MODULES.add("hidden_checks")


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """``(module, names)`` of every import in the file, relative ones resolved, at any depth."""
    package = _name(path) if path.name == "__init__.py" else _name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def _unit(module: str) -> str | None:
    """The subpackage or top-level module of the package a module belongs to."""
    parts = module.split(".")
    if parts[0] != "megatron_vocabstats" or len(parts) < 2:
        return None
    return parts[1]


# The units of the package: its top-level modules and subpackages (``__init__``: the package).
UNITS = {p.stem for p in PACKAGE.glob("*.py")} | {
    p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def _rules(header: str = "| unit |") -> dict[str, set[str]]:
    """The table of docs/layout.md's "Import rules" whose header row starts with ``header``:
    ``{name: the names it may import}``."""
    lines = (ROOT / "docs" / "layout.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rules = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, allowed = (c.strip() for c in line.strip().strip("|").split("|"))
        rules[name.strip("`")] = set(re.findall(r"`([.\w]+)`", allowed))
    return rules


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_are_short_and_leave_import_rules_to_the_layout_document(path):
    assert len(path.read_text().splitlines()) < 400
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert docstring, "a module docstring states the module's purpose"
    assert "May import" not in docstring, "import rules live in docs/layout.md's table"


@pytest.mark.parametrize("module", sorted(_rules("| ops module |")))
def test_shared_ops_modules_import_as_the_layout_document_says(module):
    allowed = _rules("| ops module |")[module]
    imported = set()
    for node in ast.walk(ast.parse((PACKAGE / "ops" / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = [node.module] if node.module else [alias.name for alias in node.names]
            imported.update("." * (node.level - 1) + name for name in names)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("megatron_vocabstats") for a in node.names)
    assert imported <= allowed, f"ops/{module}.py imports {sorted(imported - allowed)}"


def test_imports_follow_the_layout_documents_rules():
    rules = _rules()
    assert set(rules) == UNITS, f"docs/layout.md's import rules name {sorted(rules)}"
    broken = []
    for path in MODULES:
        here = _unit(_name(path)) or "__init__"
        for module, names in _imports(path):
            for target in [module] + [f"{module}.{n}" for n in names] if module else []:
                there = _unit(target)
                if there in UNITS and there != here and there not in rules[here]:
                    broken.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not broken, f"not allowed by docs/layout.md's import rules: {sorted(set(broken))}"


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        here = _unit(_name(path))
        for module, names in _imports(path):
            targets = [module] + [f"{module}.{n}" for n in names] if module else []
            for target in targets:
                there = _unit(target)
                if here and there and here != there:
                    graph.setdefault(here, set()).add(there)

    def reachable(start):
        seen, stack = set(), [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    cycles = sorted((a, b) for a in graph for b in graph[a] if a in reachable(b))
    assert not cycles, (cycles, graph)
    assert "megatron" not in reachable("ops"), "the ops never import the Megatron integration"
    importers = sorted(unit for unit in graph if unit != "integrations"
                       and "integrations" in graph[unit])
    assert not importers, f"{importers} import integrations/ (nothing in the package may)"


@pytest.mark.parametrize("name", sorted(OP_MODULES))
def test_op_modules_use_only_public_names_of_their_siblings(name):
    path = PACKAGE / "ops" / f"{name.replace('.', '/')}.py"
    for module, names in _imports(path):
        sibling = module.removeprefix("megatron_vocabstats.ops.")
        if sibling in OP_MODULES:
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{name} imports private {private} of ops.{sibling}"


def test_layout_document_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    def named(path):
        if path.name == "__init__.py":  # a package: its folder
            return path.parent == PACKAGE or f"{path.parent.relative_to(PACKAGE)}/" in text
        folder = f"{path.parent.relative_to(PACKAGE)}/"
        return (path.name == "__main__.py" or f"{path.relative_to(PACKAGE)}" in text
                or (folder in text and f"`{path.name}`" in text))

    missing = [str(p.relative_to(PACKAGE)) for p in MODULES if not named(p)]
    assert not missing, missing


def test_one_options_object():
    # Each option is declared once (ops.options: a keyword set's Annotated Option): the checked
    # config has a field per core option (vocab_size and vocab_start make its layout),
    # StatsOptions (losses, Megatron settings) carries a subset under the same names, and each
    # op's signature lists its keyword set with the declared defaults.
    import dataclasses
    import inspect

    import megatron_vocabstats as mv
    from megatron_vocabstats.ops import options

    core = set(options.STATS_OPTIONS)
    config = {f.name for f in dataclasses.fields(options.StatsConfig)}
    assert config == core - set(options.LAYOUT_OPTIONS) | {"layout"}
    assert {f.name for f in dataclasses.fields(mv.StatsOptions)} <= core
    declared = {**options.STATS_OPTIONS, **options.LINEAR_HEAD_OPTIONS}
    for op in (mv.vocab_parallel_stats, mv.linear_vocab_parallel_stats, mv.vocab_parallel_topk,
               mv.vocab_parallel_sampling_logprobs, mv.linear_vocab_parallel_cross_entropy):
        for param in inspect.signature(op).parameters.values():
            if param.name in declared and param.kind is param.KEYWORD_ONLY:
                assert param.default == declared[param.name].default, (op, param)
    assert "argmax" in inspect.signature(mv.vocab_parallel_stats).parameters
    # An unknown option reaching the checks is an error, not a silently dropped keyword.
    from megatron_vocabstats.ops._checks import checked_config

    with pytest.raises(TypeError, match="unknown option 'tempreature'"):
        checked_config(__import__("torch").randn(2, 8), None, None, tempreature=0.5)
    # The losses' options object runs the same declared checks at construction.
    with pytest.raises(ValueError, match="kernel must be one of"):
        mv.StatsOptions(kernel="bogus")
    assert type(mv.StatsOptions(entropy=__import__("numpy").str_("grad")).entropy) is str


@pytest.mark.parametrize("call, bad", [
    ("vocab_parallel_topk", "label_smoothing"),
    ("vocab_parallel_topk_logits", "temperature"),
    ("vocab_parallel_logprobs", "bogus"),
    ("linear_vocab_parallel_stats", "bogus"),
    ("vocab_parallel_topk", "kernel"),  # top-k has no Triton backend
    ("vocab_parallel_sampling_logprobs", "entropy"),
    ("linear_vocab_parallel_topk", "accumulate_into_main_grad"),  # not differentiable
])
def test_wrappers_name_an_undeclared_keyword(call, bad):
    import torch

    import megatron_vocabstats as mv

    logits, target = torch.randn(3, 8), torch.tensor([1, 2, 3])
    args = {"vocab_parallel_topk": (logits, 2), "vocab_parallel_topk_logits": (logits, 2),
            "linear_vocab_parallel_stats": (torch.randn(3, 4), torch.randn(8, 4), target),
            "linear_vocab_parallel_topk": (torch.randn(3, 4), torch.randn(8, 4), 2)}
    with pytest.raises(TypeError, match=rf"{call}\(\) got an unexpected keyword argument '{bad}'"):
        getattr(mv, call)(*args.get(call, (logits, target)), **{bad: 1})



def test_tests_readme_indexes_every_test_file():
    """tests/README.md's index names every test file of tests/unit, and no file that is gone."""
    named = set(re.findall(r"`(test_\w+\.py)`", (ROOT / "tests" / "README.md").read_text()))
    files = {p.name for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    assert not files - named, f"add to tests/README.md's index: {sorted(files - named)}"
    assert not named - files, f"gone, still in tests/README.md: {sorted(named - files)}"
