"""A pipeline request → token ids: render (the sidecar pool `render_pool.py`, or vLLM's
renderer in process), the local tokenizer fallback (`tokenization.py`), the model catalog a
request's `model` resolves in, and the one place a token-only generate body is built
(`token_only.py`). It knows the two pipelines (chat, completions), never a client API."""
