"""ext_proc's layout is its architecture: a module imports only from its own layer or below.

Top to bottom: tools and the CLI → server/admin → envoy_protocol → services → legs and the
response handlers → fleet (what is learned about engines in the background) → planning →
derender → frontend → the shared bottom (config, errors, protocol, ...). `scheduler/` is
pure: it imports nothing of ext_proc and no I/O or asyncio."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [
    {
        "ext_proc",  # the package's __init__
        "ext_proc.config",
        "ext_proc.errors",
        "ext_proc.protocol",
        "ext_proc.model_files",
        "ext_proc.byte_budget",
        "ext_proc.loop_lag",
        "ext_proc.extras",  # what needs an optional part names its extra
        "ext_proc.obfuscation",  # the token codec: at the boundary of every layer that sees ids
        "ext_proc.observability",  # metrics, traces, stage logs: every layer reports to it
    },
    {"ext_proc.frontend"},
    {"ext_proc.derender"},
    {"ext_proc.planning"},
    {"ext_proc.fleet"},
    {"ext_proc.legs", "ext_proc.response_handlers"},
    {"ext_proc.services"},
    {"ext_proc.envoy_protocol"},
    {"ext_proc.server", "ext_proc.admin", "ext_proc.workers"},
    {"ext_proc.tools", "ext_proc.cli"},
]


def _layer(module: str) -> int | None:
    for depth, names in reversed(list(enumerate(LAYERS))):
        if any(module == name or (name != "ext_proc" and module.startswith(name + ".")) for name in names):
            return depth
    return None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_no_module_imports_upward() -> None:
    upward = []
    for path in sorted((ROOT / "ext_proc").rglob("*.py")):
        module = _module(path)
        own = _layer(module)
        assert own is not None, f"{module} belongs to no layer: add it to LAYERS"
        for imported in _imports(path):
            target = _layer(imported)
            if target is not None and target > own:
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_the_scheduler_is_pure() -> None:
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        imported = _imports(path)
        assert not {i for i in imported if i.split(".")[0] in {"ext_proc", "asyncio", "httpx", "grpc", "socket"}}, path


def test_the_envoy_adapter_holds_only_the_protocol() -> None:
    # The protocol, the plan's messages and what the request's record is told: nothing else.
    assert len((ROOT / "ext_proc/envoy_protocol/exchange.py").read_text().splitlines()) < 210
