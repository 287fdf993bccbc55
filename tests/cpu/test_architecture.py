"""The rules of the house (docs/architecture.md), checked from the source.

The import graph of ``rubin_compile`` is built with ``ast`` from every module, function-local imports included
(imports under ``if TYPE_CHECKING:`` are for type checkers only and never run, so they are not edges). An import
``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to ``a.b``; the parent packages
Python initialises on the way are not edges (every module would otherwise depend on ``rubin_compile/__init__``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rubin_compile"

# Imports of the package's own modules inside a function: only these, each for the reason given.
LOCAL_IMPORTS_ALLOWED = {
    (
        "rubin_compile.kernels.triton",
        "rubin_compile.kernels.triton.moe",
    ): "registering the Triton kernel must need neither Triton nor a GPU; the kernels load when one runs",
    (
        "rubin_compile.kernels.triton",
        "rubin_compile.kernels.triton.attention",
    ): "as for the MoE kernels: the decode attention kernels load when one runs",
    (
        "rubin_compile.kernels.triton",
        "rubin_compile.kernels.triton.gemm",
    ): "as for the MoE kernels: the small-M GEMM kernels (and their tuned table) load when one runs",
    (
        "rubin_compile.kernels.triton",
        "rubin_compile.kernels.triton.route",
    ): "as for the MoE kernels: the fused routing kernels load when one runs",
    (
        "rubin_compile.passes.inline_kernels",
        "rubin_compile.kernels.triton.launch",
    ): "the pipeline imports without Triton; the launcher (which imports it) loads when a node is traced",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """(imported module, line, inside a function) for every import that runs."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, int, bool]] = []
        self.depth = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = self.module.split(".")
            package = package if self.is_package else package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self.found.append((full if full in MODULES else base, node.lineno, self.depth > 0))


def imports() -> dict[str, list[tuple[str, int, bool]]]:
    out = {}
    for name, path in MODULES.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out[name] = visitor.found
    return out


IMPORTS = imports()


def edges() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in found if target in MODULES} for m, found in IMPORTS.items()}


def in_package(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_import_graph_has_no_cycle():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        (
            "rubin_compile.ops",
            (
                "rubin_compile.passes",
                "rubin_compile.kernels",
                "rubin_compile.integrations",
                "rubin_compile.runtime",
                "rubin_compile.backend",
                "rubin_compile.options",
            ),
        ),
        ("rubin_compile.kernels", ("rubin_compile.passes", "rubin_compile.integrations", "rubin_compile.backend")),
        ("rubin_compile.runtime", ("rubin_compile.passes", "rubin_compile.kernels", "rubin_compile.integrations")),
        ("rubin_compile.passes", ("rubin_compile.integrations", "rubin_compile.backend")),
        ("rubin_compile.target", ("rubin_compile",)),
        ("rubin_compile.errors", ("rubin_compile",)),
    ],
)
def test_layers_import_only_downwards(layer, forbidden):
    allowed = {"rubin_compile.errors"} - {layer}  # the leaf every layer may raise from
    bad = [
        f"{m} imports {target} (line {line})"
        for m, found in IMPORTS.items()
        if in_package(m, layer)
        for target, line, _ in found
        if in_package(target, *forbidden) and target != m and target not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_vllm_is_imported_only_in_integrations():
    bad = [
        f"{m} imports {target} (line {line})"
        for m, found in IMPORTS.items()
        if not in_package(m, "rubin_compile.integrations")
        for target, line, _ in found
        if in_package(target, "vllm")
    ]
    assert not bad, "\n".join(bad)


def test_own_modules_are_imported_at_the_top():
    local = {
        (m, target): line
        for m, found in IMPORTS.items()
        for target, line, inside in found
        if inside and in_package(target, "rubin_compile")
    }
    unexpected = [
        f"{m} imports {t} inside a function (line {line})"
        for (m, t), line in local.items()
        if (m, t) not in LOCAL_IMPORTS_ALLOWED
    ]
    assert not unexpected, "\n".join(unexpected)
    assert set(local) == set(LOCAL_IMPORTS_ALLOWED), "an allowed local import is gone: drop it from the list"


def test_every_pass_module_is_in_the_pipeline():
    """A newcomer finds the pipeline by listing passes/: every pass module is one entry of PIPELINE."""
    from rubin_compile.passes import PIPELINE

    helpers = {"__init__", "base", "fx", "manager"}
    modules = sorted(
        p.stem
        for p in (PACKAGE / "passes").iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.stem not in helpers
    )
    assert sorted(p.name for p in PIPELINE) == modules


def test_every_kernel_module_is_listed_once():
    """Adding a kernel is one module listed in kernels/__init__.py."""
    listed = [target for target, _, _ in IMPORTS["rubin_compile.kernels"]]
    modules = sorted(
        module_name(p)
        for p in (PACKAGE / "kernels").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )
    assert sorted(listed) == modules and len(set(listed)) == len(listed)


# --------------------------------------------------------------------------------------------------
# references to files
# --------------------------------------------------------------------------------------------------

# A path as the code and docs cite them: from the repository root, or from the package (ops/moe.py).
PATH = re.compile(
    r"(?<![\w/.-])((?:docs|benchmarks|tests|examples|rubin_compile|ops|kernels|passes|runtime|debug|"
    r"integrations)/[\w./-]*\w\.(?:py|md|json|log|sh))"
)
OUTSIDE = re.compile(r"\b(?:DESIGN|CONTEXT|STYLE)\.md\b|project" r" brief")  # split: this line would cite it


def cited_files() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [
        *MODULES.values(),
        *docs,
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "benchmarks").glob("*.py")),
        *sorted((ROOT / "examples").glob("*.py")),
    ]


def test_every_cited_file_is_in_the_repository():
    missing, outside = [], []
    for path in cited_files():
        text = path.read_text()
        for ref in PATH.findall(text):
            if not ((ROOT / ref).exists() or (PACKAGE / ref).exists()):
                missing.append(f"{path.relative_to(ROOT)} cites {ref}")
        outside += [f"{path.relative_to(ROOT)} cites {m}" for m in OUTSIDE.findall(text)]
    assert not missing, "\n".join(missing)
    assert not outside, "files outside the repository:\n" + "\n".join(outside)


# --------------------------------------------------------------------------------------------------
# tests draw their random data reproducibly
# --------------------------------------------------------------------------------------------------

UNSEEDED = re.compile(
    r"torch\.seed\(\)|random\.Random\(\)|\brandom\.(?:random|randrange|randint|choice|shuffle|sample)\("
)


def test_tests_draw_random_data_only_from_seeded_generators():
    """conftest seeds torch from each test's id and ``seeded_random`` gives module fixtures their own seeded
    generator: a failure reproduces by test id. ``torch.seed()`` (reseeds from the clock) and module-level
    ``random`` calls would not."""
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted((ROOT / "tests").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if UNSEEDED.search(line) and p.name != Path(__file__).name
    ]
    assert not found, "\n".join(found)
