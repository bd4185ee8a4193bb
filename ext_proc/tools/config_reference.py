"""The configuration reference (`docs/configuration.md`), generated from `ext_proc/config.py`
and the `config_*.py` modules it builds on, so it cannot drift: every section and key with
its type, default, environment override and the comments that explain it in the source.
`tito config-reference` prints the page (`--out` writes it); `tests/unit/test_config_reference.py`
fails when the committed page differs.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ext_proc.config import ENV_PREFIX, TitoConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# The modules whose classes are the config's own (ext_proc.config and ext_proc.config_*),
# read for their annotations and comments; pydantic's own bases are not.
CONFIG_MODULES = "ext_proc.config"
HEADER = """# Configuration reference

<!-- Generated from ext_proc/config.py by `tito config-reference --out docs/configuration.md`;
tests/unit/test_config_reference.py fails when this page and the code differ. -->

One YAML file (`tito --config FILE`, else `$TITO_CONFIG`, else the defaults below, which work
locally) and environment overrides: `TITO__<SECTION>__<KEY>=value`, double underscores
nesting, values parsed as YAML (`TITO__RENDER_CONFIG__ENDPOINT__PORT=8101` is an int, a list is
given whole: `TITO__POOLS='[{name: union, instances: [{host: 127.0.0.1, port: 8201}]}]'`).
Keys not listed here are refused at start-up.
"""


def reference() -> str:
    """The whole page."""
    sections = [HEADER]
    for path, model in _sections("", TitoConfig):
        sections.append(_section(path, model))
    return "\n".join(sections)


def _sections(path: str, model: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """Every config section under `path` (lists of sections as `name[]`), depth first."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        inner, many = _section_type(field.annotation)
        if inner is not None:
            out += _sections(f"{path}.{name}{'[]' if many else ''}".lstrip("."), inner)
    return out


def _section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section class a field holds (and whether a list of them), if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin is list:
        inner, _ = _section_type(typing.get_args(annotation)[0])
        return inner, True
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            inner, many = _section_type(arg)
            if inner is not None:
                return inner, many
    return None, False


def _section(path: str, model: type[BaseModel]) -> str:
    title = f"`{path}`" if path else "Top level"
    doc = inspect.getdoc(model) if model.__doc__ else ""
    lines = [f"## {title}", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | environment | meaning |", "|---|---|---|---|---|"]
    annotations, comments = _source(model)
    for name, field in model.model_fields.items():
        inner, many = _section_type(field.annotation)
        default = _default(field)
        if inner is not None and not many:
            default = f"section `{path + '.' if path else ''}{name}`"
        meaning = comments.get(name) or (_first_sentence(inner) if inner is not None else "")
        row = [f"`{name}`", _code(annotations.get(name, "")), default, _env(path, name), meaning]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"


def _first_sentence(model: type[BaseModel]) -> str:
    doc = " ".join((inspect.getdoc(model) or "").split()) if model.__doc__ else ""
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def _source(model: type[BaseModel]) -> tuple[dict[str, str], dict[str, str]]:
    """Each field's annotation as written, and the comments above it and on its line,
    collected from its class and the classes it inherits fields from."""
    annotations: dict[str, str] = {}
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or not cls.__module__.startswith(CONFIG_MODULES):
            continue
        source = textwrap.dedent(inspect.getsource(cls))
        by_line: dict[int, str] = {}
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                by_line[token.start[0]] = token.string.lstrip("#").strip()
        body = ast.parse(source).body[0]
        assert isinstance(body, ast.ClassDef)
        previous = body.lineno
        for statement in body.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                name = statement.target.id
                annotations[name] = ast.unparse(statement.annotation)
                lines = range(previous + 1, (statement.end_lineno or statement.lineno) + 1)
                comments[name] = " ".join(by_line[n] for n in lines if n in by_line)
            previous = statement.end_lineno or statement.lineno
    return annotations, comments


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return _code(json.dumps(value, ensure_ascii=False))


def _env(path: str, name: str) -> str:
    """The environment variable that overrides the key (none inside a list: the list is given whole)."""
    if "[]" in path:
        return ""
    parts = [*path.split("."), name] if path else [name]
    return _code(ENV_PREFIX + "__".join(p.upper() for p in parts))


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="write the page here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    page = reference()
    if args.out:
        Path(args.out).write_text(page)
    else:
        sys.stdout.write(page)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tito config-reference", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
