"""The endpoints file Envoy's EDS reads (ext_proc/envoy_protocol/endpoints.py): its JSON
shape, one write per distinct membership, and an atomic replace that leaves no temp file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from ext_proc.envoy_protocol.endpoints import CLUSTER, LOAD_ASSIGNMENT, EndpointsFile, load_assignment


def _hosts(document: Any) -> list[tuple[str, int]]:
    (resource,) = document["resources"]
    (locality,) = resource["endpoints"]
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in locality["lb_endpoints"]
    ]


def test_a_load_assignment_is_one_discovery_response_for_the_engines_cluster() -> None:
    members = [("10.0.0.2", 8000), ("[fd00::1]", 8000), ("10.0.0.1", 8001), ("10.0.0.1", 8000), ("10.0.0.2", 8000)]
    document = orjson.loads(load_assignment(members, 7))
    assert set(document) == {"version_info", "resources"} and document["version_info"] == "7"
    (resource,) = document["resources"]
    assert resource["@type"] == LOAD_ASSIGNMENT == "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    assert resource["cluster_name"] == CLUSTER == "engines"
    # sorted, each once, IPv6 without its URL brackets
    assert _hosts(document) == [("10.0.0.1", 8000), ("10.0.0.1", 8001), ("10.0.0.2", 8000), ("fd00::1", 8000)]
    assert load_assignment(reversed(members), 7) == load_assignment(members, 7)  # the order published: no matter


def test_no_members_is_an_empty_locality() -> None:
    document = orjson.loads(load_assignment([], 1))
    assert document["resources"][0]["endpoints"] == [{"lb_endpoints": []}]


def test_the_file_is_written_once_per_distinct_membership_with_a_growing_version(tmp_path: Path) -> None:
    path = tmp_path / "eds" / "engines.json"  # its folder is made
    file = EndpointsFile(path)
    assert file.write([("10.0.0.1", 8000), ("10.0.0.2", 8000)])
    first = path.read_bytes()
    assert orjson.loads(first)["version_info"] == "1" and file.version == 1
    assert not file.write([("10.0.0.2", 8000), ("10.0.0.1", 8000), ("10.0.0.1", 8000)])  # the same set
    assert path.read_bytes() == first and file.version == 1
    assert file.write([("10.0.0.2", 8000)])
    document = orjson.loads(path.read_bytes())
    assert document["version_info"] == "2" and _hosts(document) == [("10.0.0.2", 8000)]
    assert file.write([])  # the last one left: Envoy must forget it too
    assert orjson.loads(path.read_bytes())["version_info"] == "3" and _hosts(orjson.loads(path.read_bytes())) == []
    assert os.listdir(path.parent) == ["engines.json"]  # no temp file left behind


def test_a_failed_replace_leaves_the_old_file_and_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "engines.json"
    file = EndpointsFile(path)
    file.write([("10.0.0.1", 8000)])
    before = path.read_bytes()

    def refuse(src: str, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)  # (what write_atomically calls)
    with pytest.raises(OSError, match="disk full"):
        file.write([("10.0.0.2", 8000)])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["engines.json"]
    monkeypatch.undo()
    assert file.write([("10.0.0.2", 8000)])  # not taken as written: the next write tries again
    assert _hosts(orjson.loads(path.read_bytes())) == [("10.0.0.2", 8000)]
