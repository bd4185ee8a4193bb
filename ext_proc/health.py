"""The gRPC Health Checking Protocol on the processor's ext_proc port, with the services the
Endpoint Picker protocol names (GIE `004-endpoint-picker-protocol` §Health Checking): GIE
gateways and Kubernetes' grpc probes check an EPP there, not on an HTTP port.

- `liveness`: SERVING while the process answers.
- `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor` and `""` (the server as a whole):
  SERVING when `/ready` would answer 200 (not draining, render or a stand-in tokenizer, an
  engine that routes in every pool: `admin.readiness`). Every processor replica serves
  (no leader election: each one discovers the pool and schedules by itself).
Computed at each check, so a drain or a lost pool shows at once."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.admin import readiness
from ext_proc.envoy_protocol.h2_server import NOT_FOUND, GrpcError
from ext_proc.services import Services

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
LIVENESS = "liveness"
READY_SERVICES = frozenset({"", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"})
Status = health_pb2.HealthCheckResponse.ServingStatus


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, services: Services) -> None:
        self._services = services

    def status(self, service: str) -> int | None:
        """The service's status; None: a service this server does not know."""
        if service == LIVENESS:
            return Status.Value("SERVING")
        if service in READY_SERVICES:
            ready = all(readiness(self._services).values())
            return Status.Value("SERVING" if ready else "NOT_SERVING")
        return None

    async def check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:  # the protocol's answer for an unknown service
            raise GrpcError(NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Check(  # noqa: N802 - the gRPC method name (`processor.grpc_server: grpcio`)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        try:
            return await self.check(request)
        except GrpcError as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, error.message)
            raise
