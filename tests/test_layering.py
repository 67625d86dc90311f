"""The house has floors: each package imports only the ones below it, and no module imports its way
back to itself (every import counts, those inside functions too: a lazy import is still a
dependency). Read from the source with ast, nothing imported.

    kvcascade/              assembles and starts everything (Ray included) (may import any floor)
    deploy/                 local processes and cluster checks, for tests and benchmarks
    router/   worker/       the two sides, which never import each other
    loadtest/               a client of the servers' APIs
    contracts/              what both sides share: state, models, tokenizers, the gRPC server
    protos/   kernels/      the wire contract and block hash; the GPU kernels
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What each package may import of ours, besides itself.
ALLOWED = {
    "protos": set(),
    "kernels": set(),
    "contracts": {"protos"},
    "worker": {"contracts", "protos", "kernels"},
    "router": {"contracts", "protos"},
    "loadtest": {"protos"},
    "deploy": {"contracts", "protos"},  # local processes for tests and benchmarks, cluster checks
    "kvcascade": {"deploy", "contracts", "router", "worker", "protos", "kernels", "loadtest"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from a.b import c`` counts as a.b, or a.b.c when
    that is a module)."""
    modules = {_module_name(p): p for pkg in ALLOWED for p in (REPO / pkg).rglob("*.py")
               if "_pb2" not in p.name}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t.split(".")[0] in ALLOWED and t != name)
        graph[name] = {d for d in deps if d in modules}
    return graph


def test_no_package_imports_one_above_it_or_beside_it() -> None:
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in _imports().items() for dep in deps
                   if (src := mod.split(".")[0]) != (dst := dep.split(".")[0]) and dst not in ALLOWED[src])
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_its_way_back_to_itself() -> None:
    graph = _imports()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*stack[stack.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_router_code_imports_no_torch() -> None:
    """Importing what `kvcascade router` runs loads none of the engine's dependencies (and the router
    process keeps transformers from loading torch: tests/router/test_tokenizers.py)."""
    import subprocess
    import sys

    code = ("import sys, kvcascade.cli, kvcascade.launch, router.router, router.grpc_api, router.http_api, "
            "router.http_workers, contracts.stores, contracts.tokenizers; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
