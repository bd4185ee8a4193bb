"""In-process derender: live state per choice, the way coupled vLLM serving derenders.

Native serving keeps, per choice, the engine's incremental detokenizer (which also holds back
and cuts stop strings) and one reasoning/tool parser object, and feeds both only each step's
new token ids. This module does exactly that with vLLM's own classes (tokenizer loading,
`IncrementalDetokenizer`, `ParserManager`, the protocol models), and assembles chunks and
responses by the rules of `OpenAIServingChat` / `OpenAIServingCompletion` (0.32), so the
client sees what the engine's own OpenAI endpoint would send. Per chunk the work is
O(new ids); nothing is replayed. Nothing here does I/O: it is CPU work called from the
derender pipeline. The parts: `model.py` (what is built once per base model), `session.py`
(a prompt's per-choice state), `chat.py` and `completions.py` (each API's chunks and answers).
"""

from __future__ import annotations

from typing import Any

from ext_proc.derender.chat import ChatStream, chat_response
from ext_proc.derender.completions import CompletionStream, completion_response
from ext_proc.derender.model import DerenderModel
from ext_proc.protocol import Pipeline, TokenizedRequest


def stream_session(
    model: DerenderModel, request: TokenizedRequest, prompt_index: int = 0
) -> ChatStream | CompletionStream:
    if request.api is Pipeline.CHAT:
        return ChatStream(model, request, prompt_index)
    return CompletionStream(model, request, prompt_index)


def derender_whole(
    model: DerenderModel, request: TokenizedRequest, generate: dict[str, Any], prompt_index: int = 0
) -> bytes:
    """One prompt's GenerateResponse -> the OpenAI JSON body native serving returns (one step
    over all ids with the same detokenizer; one `parser.parse` per choice, as natively)."""
    if request.api is Pipeline.CHAT:
        return chat_response(model, request, generate)
    return completion_response(model, request, generate, prompt_index)
