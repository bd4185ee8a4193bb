"""Beam search (`use_beam_search`), run by the processor as native vLLM's API server runs it
(`BeamSearchOnlineMixin.beam_search`): for each generated token, one one-token generate per
live beam asking for 2 × n candidates; the n best continuations by cumulative logprob live
on, a candidate that is EOS completes its beam; at the end the n best beams by
length-penalized score are the answer's n choices.

Native's engines see only those one-token requests, never the client's sampling fields
(no seed, no stop strings, no grammar: its `BeamSearchParams` carry none), so neither do
these. Every step goes to the instance the leg chose (its prefix cache holds the beams'
prompts; another of the leg's hosts when it fails before answering). The answer is one whole
generate answer in engine ids, derendered as any whole answer; a streamed chat gets it in one
step, as native streams the search's single output."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

from ext_proc.derender.logprobs import NAN_LOGPROB
from ext_proc.derender.pipeline import whole_events
from ext_proc.errors import GatewayError
from ext_proc.frontend.token_only import beam_step_body, generate_response
from ext_proc.legs.generate import open_generate, read_whole
from ext_proc.legs.relay import OwnedContext, Put
from ext_proc.observability.request import current
from ext_proc.planning.plan import Owned

Position = list[tuple[int, float]]  # a step's candidates (id, logprob), in the engine's order


@dataclass
class Beam:
    tokens: list[int]  # the prompt's ids, then the beam's
    cum_logprob: float = 0.0
    positions: list[Position] = field(default_factory=list)  # the candidates of each step it took
    finish_reason: str | None = None
    stop_reason: int | None = None


def score(beam: Beam, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the sequence's length
    (prompt included, a final EOS not) to the power `length_penalty`."""
    length = len(beam.tokens) - (1 if beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / float(max(length, 1) ** length_penalty)


def best(candidates: list[tuple[float, int, Beam, Position]], width: int) -> list[int]:
    """The indexes of the `width` best candidates, best first, chosen as native chooses them
    (numpy's `argpartition` and `argsort`, so ties fall the same way)."""
    import numpy as np  # the processor's extra (vLLM) brings it; only beam search needs it

    logprobs = np.fromiter((c[0] for c in candidates), dtype=np.float64, count=len(candidates))
    if len(candidates) <= width:
        return [int(i) for i in np.argsort(-logprobs)]
    top = np.argpartition(-logprobs, width - 1)[:width]
    return [int(i) for i in top[np.argsort(-logprobs[top])]]


@dataclass(frozen=True)
class Search:
    """What of a request the search uses (native's `BeamSearchParams`), and its rules."""

    width: int  # the beams kept: the request's n
    eos: int | None  # as the engines see it
    ignore_eos: bool
    keep_eos: bool  # `include_stop_str_in_output`: a completed beam keeps its EOS
    temperature: float
    length_penalty: float

    @classmethod
    def of(cls, params: dict[str, Any], body: dict[str, Any], width: int, eos: int | None) -> Search:
        """From render's sampling params and the client's body (`length_penalty` is no
        sampling param)."""
        temperature, penalty = params.get("temperature"), body.get("length_penalty")
        return cls(
            width,
            eos,
            bool(params.get("ignore_eos")),
            bool(params.get("include_stop_str_in_output")),
            1.0 if temperature is None else float(temperature),
            1.0 if penalty is None else float(penalty),
        )

    def advance(self, beams: list[Beam], steps: list[tuple[str | None, Position]], completed: list[Beam]) -> list[Beam]:
        """The beams after one step (each beam's finish reason and candidates): an EOS candidate
        completes its beam (into `completed`), the `width` best others live on. An aborted
        step ends the search: every live beam ends as aborted (none is returned)."""
        if any(finish == "abort" for finish, _ in steps):
            for beam in beams:
                beam.finish_reason = "abort"
            completed.extend(beams)
            return []
        candidates: list[tuple[float, int, Beam, Position]] = []
        for beam, (_, position) in zip(beams, steps, strict=True):
            for token_id, logprob in position:
                cum = beam.cum_logprob + logprob
                if token_id == self.eos and not self.ignore_eos:
                    tokens = [*beam.tokens, token_id] if self.keep_eos else beam.tokens
                    completed.append(Beam(tokens, cum, [*beam.positions, position], "stop", token_id))
                else:
                    candidates.append((cum, token_id, beam, position))
        return [
            Beam([*beam.tokens, token_id], cum, [*beam.positions, position])
            for cum, token_id, beam, position in (candidates[i] for i in best(candidates, self.width))
        ]

    def best(self, beams: list[Beam]) -> list[Beam]:
        """The answer's beams: the `width` best by length-penalized score (a stable sort, as
        native's: completed beams first in the order they completed, then the live ones)."""
        return sorted(beams, key=lambda beam: score(beam, self.eos, self.length_penalty), reverse=True)[: self.width]


class BeamSearch:
    """One prompt's beam search: the fan-out's prompt stream for a `use_beam_search` request
    (`legs/fanout.py`): `open` runs the whole search, `whole` or `run` answers it."""

    def __init__(self, ctx: OwnedContext, plan: Owned, index: int) -> None:
        self._ctx = ctx
        self._plan = plan
        self.index = index
        self._leg = plan.legs[index]
        prefill = self._leg.prefill
        # every lease the leg holds (a Handoff's prefill leg too: beam steps need no KV handed over)
        self._failed: dict[str, list[str]] = {self._leg.lease_id: []}
        if prefill is not None:
            self._failed[prefill.lease_id] = []
        self._session = ctx.derender.stream(plan.tokenized, index)  # the answer is one step
        self._answer: dict[str, Any] = {}
        self._served_by: str | None = None
        self._record = current()
        self._trace: dict[str, str] = {}
        self.streaming = False  # no engine stream stays open between steps
        self.attempts = 0
        self.completion_tokens = 0
        self.cached_tokens: int | None = None

    # -- the search -----------------------------------------------------------------------

    async def open(self) -> None:
        """The whole search (GatewayError: an engine refused a step, or none answered)."""
        leg = self._leg
        prompt = leg.prompt.engine_request or leg.prompt.generate_request or {}
        params = prompt.get("sampling_params") or {}
        search = Search.of(params, self._plan.tokenized.request.body, self._plan.tokenized.n, self._eos())
        if self._record is not None:
            self._trace = self._record.leg(leg.lease_id, leg.hosts, "owned")
        prompt_ids = list(leg.prompt.engine_ids)
        beams: list[Beam] = [Beam(prompt_ids)]
        completed: list[Beam] = []
        for _ in range(leg.max_tokens):
            steps = await self._steps(prompt, beams, 2 * search.width, search.temperature)
            beams = search.advance(beams, steps, completed)
            if not beams:
                break
        completed.extend(beams)
        self._answer = self._whole(search.best(completed), len(prompt_ids), params, search.eos)

    def _eos(self) -> int | None:
        """The model's EOS as the engines see it."""
        eos = getattr(self._ctx.tokenizer, "eos_token_id", None)
        if eos is None or self._ctx.codec is None:
            return eos
        return self._ctx.codec.physical_ids([eos])[0]

    async def _steps(
        self, prompt: dict[str, Any], beams: list[Beam], candidates: int, temperature: float
    ) -> list[tuple[str | None, Position]]:
        """Each beam's next-token candidates (and its finish reason), from one engine step each.

        Asked for exactly native's k: the engine's `topk` orders tied candidates by k, and ties
        (common in bf16) then fall as native's. Where sampling put the sampled token outside
        the top k, generate cuts the k-th candidate to show it (native keeps k + 1); that one
        never outranks the beam's k - 1 better ones, unless the beam width is 1 and the best
        of them is EOS."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._step(prompt, beam.tokens, candidates, temperature)) for beam in beams]
        return [_candidates(task.result()) for task in tasks]

    async def _step(self, prompt: dict[str, Any], ids: list[int], logprobs: int, temperature: float) -> dict[str, Any]:
        leg = self._leg
        hosts = leg.hosts if self._served_by is None else (self._served_by, *leg.hosts)
        body = beam_step_body(prompt, ids, logprobs, temperature)
        failed = self._failed[leg.lease_id]
        opened = await open_generate(
            self._ctx.http, tuple(dict.fromkeys(hosts)), body, self._ctx.idle_timeout_s, failed, self._trace
        )
        try:
            answer = await read_whole(opened, self._ctx.max_response_bytes)
        finally:
            await opened.response.aclose()
        self._served_by = opened.host
        choices = generate_response(answer).get("choices") or []
        if not choices:
            raise GatewayError(502, "engine answered a beam step without a choice", code="engine_invalid_response")
        choice: dict[str, Any] = choices[0]
        if choice.get("finish_reason") == "error":
            raise GatewayError(500, "engine failed a beam search step", code="engine_error")
        return choice

    def _whole(self, beams: list[Beam], prompt_length: int, params: dict[str, Any], eos: int | None) -> dict[str, Any]:
        """The beams as one whole generate answer, in the engine's ids, each with its text."""
        choices = []
        k = params.get("logprobs")
        logprobs, shown = k is not None, None if k is None else self._shown(int(k))
        for i, beam in enumerate(beams):
            choice: dict[str, Any] = {
                "index": i,
                "token_ids": beam.tokens[prompt_length:],
                "finish_reason": beam.finish_reason or "length",
                "stop_reason": beam.stop_reason,
                "text": self._text(beam.tokens[prompt_length:], eos, params),
            }
            if logprobs:
                # (a completing EOS step has candidates but, unless kept, no token)
                pairs = zip(choice["token_ids"], beam.positions, strict=False)
                choice["logprobs"] = {"content": [_content(token, position, shown) for token, position in pairs]}
            choices.append(choice)
        completion = sum(len(c["token_ids"]) for c in choices)
        usage = {
            "prompt_tokens": prompt_length,
            "completion_tokens": completion,
            "total_tokens": prompt_length + completion,
        }
        self.completion_tokens = completion
        return {"request_id": self._leg.lease_id, "choices": choices, "usage": usage}

    def _shown(self, k: int) -> int | None:
        """How many of a step's candidates the client sees of `logprobs` k: the first k
        (chat), or k + 1 (completions), in native's dict order; -1 (None): all."""
        if k == -1:
            return None
        return k + 1 if self._plan.tokenized.shows_sampled_beside_k else k

    def _text(self, ids: list[int], eos: int | None, params: dict[str, Any]) -> str:
        """Native's text of a beam: its ids decoded at once, but for a final EOS (never
        detokenized incrementally: bytes of an unfinished character are U+FFFD here, as there)."""
        if ids and ids[-1] == eos and not params.get("ignore_eos"):
            ids = ids[:-1]
        if self._ctx.codec is not None:
            ids = self._ctx.codec.semantic_ids(ids)
        skip = params.get("skip_special_tokens")
        return str(self._ctx.tokenizer.decode(ids, skip_special_tokens=True if skip is None else bool(skip)))

    # -- the answer -----------------------------------------------------------------------

    async def whole(self) -> bytes:
        self._end(served=True)
        return orjson.dumps(self._answer)

    async def run(self, put: Put) -> None:
        events = [(event, b"") for event in whole_events(self._answer)]
        data = await self._session.steps(events)
        self._end(served=True)
        if self._record is not None:
            self._record.completion_tokens += self.completion_tokens
        if data:
            await put(data)

    # -- the end --------------------------------------------------------------------------

    def _end(self, served: bool) -> None:
        """Every lease back: the leg's with its engine's verdict, a prefill leg's unused."""
        for lease, hosts in self._failed.items():
            failed = tuple(dict.fromkeys(hosts))  # concurrent steps may fail on the same host
            served_by = self._served_by if served and lease == self._leg.lease_id else None
            self._ctx.planner.finish(lease, failed, served_by)
            if self._record is not None and lease == self._leg.lease_id:
                self._record.leg_done(lease, served_by, failed)
        self._failed.clear()

    async def aclose(self) -> None:
        self.release()

    def release(self) -> None:
        self._end(served=False)


def _candidates(choice: dict[str, Any]) -> tuple[str | None, Position]:
    """A step's finish reason and its candidates as the engine's dict holds them: the sampled
    token first, then the top k in rank order."""
    content = (choice.get("logprobs") or {}).get("content") or []
    position: Position = []
    if content:
        entry = content[0]
        position = [(int(top["token_id"]), float(top["logprob"])) for top in entry.get("top_logprobs") or [entry]]
    return choice.get("finish_reason"), position


def _content(token_id: int, position: Position, shown: int | None) -> dict[str, Any]:
    """A beam's token as a generate logprobs entry: its own logprob, and the step's candidates
    the client sees, unranked (derender shows them as they are)."""
    return {
        "token_id": token_id,
        "logprob": dict(position).get(token_id, NAN_LOGPROB),
        "top_logprobs": [{"token_id": t, "logprob": logprob} for t, logprob in position[:shown]],
    }
