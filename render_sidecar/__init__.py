"""The vLLM render sidecar: gateway config -> a `vllm launch render` process."""
