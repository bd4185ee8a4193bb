"""What `tito bench` sends (`ext_proc/tools/bench.py`): the prompts, the tool and the regex
of the `--tools` workload, and `BenchOptions`, which builds request `index`'s body (the same
on both sides). A module of its own so the runner (`bench.py`) and the report
(`bench_report.py`, which echoes the options) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat", "completions"]

PROMPTS = [
    "Tell me a story about a brave little robot.",
    "Explain how a token-in/token-out gateway works, step by step.",
    "用中文讲个故事 🐉🚀，然后说 こんにちは 👋🏽",
    "List ten prime numbers and say why each one is prime.",
    "What is the weather like in Paris in spring? Answer in detail.",
]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
# Constrains the output once reasoning ended: one hermes tool call.
TOOL_REGEX = (
    r"<tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", "unit": "celsius"\}\}'
    r"\n</tool_call>"
)
THINK_END = "</think>"
THINK_END_BIAS = 4.0  # on the tiny random model: reasoning ends after ~20 tokens on average


@dataclass(frozen=True)
class BenchOptions:
    gateway: str
    native: str
    model: str = "tiny"
    concurrency: int = 8
    max_tokens: int = 256
    api: Api = "chat"
    requests: int = 16  # per side
    tools: bool = False
    warmup_rounds: int = 0  # per side, not measured
    seed: int = 1000
    timeout_s: float = 600.0
    think_end_id: int | None = None  # --tools: the `</think>` token, biased up (found by run_bench)

    def body(self, index: int) -> dict[str, Any]:
        """The request `index` (the same body on both sides)."""
        prompt = PROMPTS[index % len(PROMPTS)]
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": self.seed + index,
        }
        if self.api == "completions":
            return body | {"prompt": prompt}
        body["messages"] = [{"role": "user", "content": prompt}]
        if self.tools:
            body |= {
                "tools": [WEATHER_TOOL],
                "tool_choice": "auto",
                "structured_outputs": {"regex": TOOL_REGEX},
            }
            if self.think_end_id is not None:
                body["logit_bias"] = {str(self.think_end_id): THINK_END_BIAS}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
