"""Observability (RFC 可观测性): Prometheus metrics (`metrics.py`), OpenTelemetry traces
(`tracing.py`), the RFC's stage logs (`stage_log.py`), and one request's record that feeds all
three (`request.py`)."""
