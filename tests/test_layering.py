"""The package's layering, read from its own imports (top-level and inside functions alike): no module
imports one that imports it back, and every import points down the layers, so a part can be read,
tested and replaced with only what lies below it."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxinfer"
# Highest first; a module may import its own layer or any below it (the longest matching name decides).
# The facade, the command line (``cli``, ``python -m jaxinfer``) and its benchmarks' parts (``bench``) on
# top; sampling and the tokenizer beside the models; the KV cache's data layout (``paged.kv_cache``)
# beside the kernels that read and write it; the names of the storage formats (``formats``, importing
# nothing) at the bottom.
LAYERS = [
    {"jaxinfer", "jaxinfer.llm", "jaxinfer.outputs", "jaxinfer.server", "jaxinfer.cli", "jaxinfer.bench",
     "jaxinfer.__main__"},
    {"jaxinfer.batching"},
    {"jaxinfer.models", "jaxinfer.quant", "jaxinfer.paged", "jaxinfer.sampling", "jaxinfer.sampling_params",
     "jaxinfer.tokenizer", "jaxinfer.gguf_tokenizer"},
    {"jaxinfer.pallas_kernels", "jaxinfer.paged.kv_cache", "jaxinfer.native", "jaxinfer.user_cache",
     "jaxinfer.formats"},
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # not its own package
                    found.add(target)
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer"
    return best[0]


@pytest.fixture(scope="module")
def graph():
    return _imports(_modules())


def test_no_import_circles(graph):
    seen, cycles = {}, []

    def visit(module, path):
        if seen.get(module) == "done":
            return
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        seen[module] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_point_down(graph):
    up = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
          if m != "jaxinfer" and _layer(t) < _layer(m)]
    assert not up, "imports that point up: " + ", ".join(sorted(up))
