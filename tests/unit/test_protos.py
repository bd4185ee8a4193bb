"""The ext_proc stubs are built from the Envoy binary itself and match Envoy 1.40."""

from __future__ import annotations

from pathlib import Path

from protos import build


def test_stubs_build_from_the_envoy_binary(tmp_path: Path, envoy_bin: Path) -> None:
    out = build.build(tmp_path / "generated", envoy_bin)
    assert (out / "envoy/service/ext_proc/v3/external_processor_pb2_grpc.py").exists()
    assert (out / "envoy/__init__.py").read_text() == build.NAMESPACE_INIT
    assert not (out / "google/protobuf").exists()  # the protobuf runtime ships those


def test_stubs_have_what_envoy_1_40_speaks() -> None:
    from protos.stubs import ext_proc_pb

    fields = ext_proc_pb.ProcessingResponse.DESCRIPTOR.fields_by_name
    assert fields["streamed_immediate_response"].number == 11
    sir = ext_proc_pb.StreamedImmediateResponse.DESCRIPTOR.fields_by_name
    assert (sir["headers_response"].number, sir["body_response"].number, sir["trailers_response"].number) == (1, 2, 3)


def test_generated_code_is_not_committed() -> None:
    ignore = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "protos/generated/" in ignore
