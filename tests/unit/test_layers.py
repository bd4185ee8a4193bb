"""ext_proc's layout is its architecture: a module imports only from its own layer or below.

Top to bottom: tools and the CLI → server/admin → envoy_protocol → services → the client APIs
(`api/`, the only room that knows which API a request came in) → legs and the response
handlers → fleet (what is learned about engines in the background) → planning → derender →
frontend → the shared bottom (config, errors, protocol, ...). `scheduler/` is
pure: it imports nothing of ext_proc and no I/O or asyncio."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [
    {
        "ext_proc",  # the package's __init__
        "ext_proc.config",
        "ext_proc.config_section",
        "ext_proc.config_edge",
        "ext_proc.config_routing",
        "ext_proc.config_discovery",
        "ext_proc.config_tenancy",
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
    {"ext_proc.tenancy"},  # API keys, flows and token quotas: admission's inputs
    {"ext_proc.planning"},
    {"ext_proc.fleet"},
    {"ext_proc.legs", "ext_proc.response_handlers"},
    {"ext_proc.api"},
    {"ext_proc.services"},
    {"ext_proc.envoy_protocol"},
    {"ext_proc.server", "ext_proc.admin", "ext_proc.health", "ext_proc.workers"},
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
    # The protocol, the plan's messages and what the request's record is told: nothing else
    # (what a GIE gateway sends and allows is read in envoy_protocol/epp.py; a request's flow,
    # its tenant, in tenancy/).
    assert len((ROOT / "ext_proc/envoy_protocol/exchange.py").read_text().splitlines()) < 250


# A client API family by name: Anthropic Messages, OpenAI Responses (chat and completions are
# the pipelines every API feeds, so below the API room they are all there is).
API_FAMILY = re.compile(r"[Aa]nthropic|ANTHROPIC|[Rr]esponses|RESPONSES|Messages|MESSAGES|count_tokens|ApiFamily")
API_ROUTE = re.compile(r"/v1/(messages|responses)\b")
# Outside the runtime's rooms: the API room itself, and the tools and CLI, which are clients of
# every API (conformance, bench); the config's default route table names handlers as data.
NAMING_ALLOWED = ("ext_proc/api/", "ext_proc/tools/", "ext_proc/cli.py", "ext_proc/config_edge.py")


def _names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every name the code itself spells (no comments, no docstrings): identifiers, attributes,
    definitions, arguments, imports, and string constants that are routes."""
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").startswith(("ext_proc", "vllm")):  # (fastapi.responses: HTTP's)
                yield node.lineno, node.module or ""
            yield from ((node.lineno, alias.asname or alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.asname or alias.name) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node.lineno, node.value


def _families(tree: ast.AST) -> list[tuple[int, str]]:
    return [(line, name) for line, name in _names(tree) if API_FAMILY.search(name) or API_ROUTE.search(name)]


def test_no_module_outside_the_api_room_names_an_api_family() -> None:
    named = []
    for path in sorted((ROOT / "ext_proc").rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative.startswith(NAMING_ALLOWED):
            continue
        tree = ast.parse(path.read_text())
        named += [f"{relative}:{line} {name}" for line, name in _families(tree)]
    assert named == []


def test_api_family_names_are_found() -> None:
    """The check above can fail: it finds each kind of name it looks for."""
    code = "from ext_proc.anthropic import Y\nclass ResponsesThing: ...\nMESSAGES = '/v1/messages'\ndef f(count_tokens): ..."
    assert {name for _, name in _families(ast.parse(code))} == {
        "ext_proc.anthropic",
        "ResponsesThing",
        "MESSAGES",
        "/v1/messages",
        "count_tokens",
    }
