"""Token ids → a pipeline's answer (chat or completions), streamed or whole: in process with
vLLM's own detokenizer and parsers (`in_process.py`, `model.py`, `session.py`, `chat.py`,
`completions.py`), or through the render sidecar's `/derender` (`sidecar.py`). A client API
that answers in another shape converts this answer in its own room (`ext_proc/api/`)."""
