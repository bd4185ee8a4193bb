"""The Envoy ext_proc protocol and nothing else: one HTTP stream's phases (`exchange.py`), its
reader task and outbox (`stream.py`), a processor-owned answer (`owned.py`), the
ProcessingResponse builders (`messages.py`) and what Envoy's headers say about engines
(`verdicts.py`). Plans come from `services.py`; answers from the response handlers."""
