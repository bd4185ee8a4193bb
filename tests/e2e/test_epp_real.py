"""The product promise behind a Gateway API Inference Extension gateway: `tito up`'s processor
called as the InferencePool's endpoint picker by a GIE-style Envoy (`tests/gie_gateway.py`,
ORIGINAL_DST on the destination header, none of tito's bootstrap), over the stack's real
engine: every conformance case of every API (chat, completions, Anthropic Messages, OpenAI
Responses) answers as the engine natively does, and `tito epp-check` passes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ext_proc.tools import epp_check
from ext_proc.tools.conformance import messages, openai, responses
from ext_proc.tools.conformance.core import CaseResult, new_client
from ext_proc.tools.conformance.openai_cases import CASES
from tests.conftest import RunningStack, free_port
from tests.gie_gateway import GieEnvoy, start_gie_envoy

# `tito conformance`'s lists, whole and streamed (about a minute on the tiny model).
EVERY_CASE: dict[str, tuple[Callable[..., CaseResult], Any]] = {
    **{c.name: (openai.run_case, c) for c in CASES},
    **{c.name: (messages.run_case, c) for c in messages.CASES},
    **{c.name: (responses.run_case, c) for c in responses.CASES},
}


@pytest.fixture(scope="module")
def gie(stack: RunningStack, envoy_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GieEnvoy]:
    engine = stack.config.pools[0].instances[0]
    work, port, admin = tmp_path_factory.mktemp("gie-real"), free_port(), free_port()
    envoy = start_gie_envoy(
        envoy_bin, work, port, admin, stack.config.processor.port, "original_dst", [(engine.host, engine.port)]
    )
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with new_client() as http:
        yield http


@pytest.mark.parametrize("name", list(EVERY_CASE))
def test_answers_through_a_gie_gateway_equal_native_vllm(
    name: str, stack: RunningStack, gie: GieEnvoy, client: httpx.Client
) -> None:
    run, case = EVERY_CASE[name]
    result = run(case, gie.base_url, stack.engine_url, stack.config.model.served_name, client)
    assert result.status == "PASS", f"{result.status} {name} (GIE gateway):\n" + "\n".join(result.lines)


def test_epp_check_passes_on_the_real_engine(stack: RunningStack) -> None:
    epp = f"{stack.config.processor.host}:{stack.config.processor.port}"
    assert epp_check.main(["--epp", epp, "--model", stack.config.model.served_name, "--timeout", "60"]) == 0
