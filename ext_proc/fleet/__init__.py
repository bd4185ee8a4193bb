"""What the gateway learns about its engines in the background, off the request path:
capability records (`capabilities.py`), their load (`engine_metrics.py`), their KV cache
events (`kv_events.py`), LoRA adapters loaded on them (`lora.py`), and the HTTP client every
engine call shares (`http_client.py`). Requests read what this room learned (through the
scheduler); nothing here runs for one request."""
