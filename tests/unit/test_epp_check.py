"""`tito epp-check` against a fake EPP (tests/fake_epp.py) over two fake engines: a conforming
one passes every check, and each broken rule fails the check that guards it, so that no check
passes whatever the EPP does."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator

import pytest

from ext_proc import cli
from ext_proc.tools import epp_check
from ext_proc.tools.epp_check import MiniDataPlane, Request
from tests.fake_epp import PRIVATE_ROUTE, Faults, engines, serving

TIMEOUT = 5.0
HELD = 3  # the fake EPP sheds a request once more streams than this are open


@pytest.fixture(scope="module")
def pool() -> Iterator[list[str]]:
    with engines(2) as addresses:
        yield addresses


def _args(epp: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    epp_check.add_arguments(parser)
    return parser.parse_args(["--epp", epp, "--model", "m", "--timeout", str(TIMEOUT), *extra])


async def _statuses(pool: list[str], faults: Faults, *extra: str) -> dict[str, epp_check.Result]:
    async with serving(pool, faults, max_open=HELD) as (address, _):
        return {result.name: result for result in await epp_check.run_checks(_args(address, *extra))}


async def test_a_conforming_epp_passes_every_check(pool: list[str]) -> None:
    results = await _statuses(pool, Faults(), "--shed", str(HELD + 3))
    assert list(results) == list(epp_check.CHECKS)
    assert {name: r.status for name, r in results.items()} == dict.fromkeys(epp_check.CHECKS, "PASS"), results
    assert results["pick"].why.endswith(f"the EPP named {pool[1]}, {pool[0]}")  # its turns: 2nd, then 1st
    assert results["shed"].why == f"request {HELD + 1} shed with 429 while {HELD} were held"
    assert results["streaming"].why.startswith("routed to ")


@pytest.mark.parametrize(
    ("faults", "check", "why"),
    [
        (Faults(no_health=True), "health", "liveness UNIMPLEMENTED"),
        (Faults(header_differs=True), "pick", "must be equal"),
        (Faults(ignores_subset=True), "subset", "the destination names"),
        (Faults(ignores_comma_subset=True), "subset", ",192.0.2.1:9'"),
        (Faults(no_503=True), "subset-empty", "expected ImmediateResponse 503"),
        (Faults(no_503=True), "subset-foreign", "expected ImmediateResponse 503"),
        (Faults(rejects_fallback=True), "served", "the client got 502"),
        (Faults(drops_done=True), "streaming", "does not end with `data: [DONE]`"),
        (Faults(sheds_with=503), "shed", "expected ImmediateResponse 429"),
        (Faults(rewrites_path=True), "no-response-body", f"rewrote :path to '{PRIVATE_ROUTE}'"),
    ],
)
async def test_each_broken_rule_fails_its_check(pool: list[str], faults: Faults, check: str, why: str) -> None:
    results = await _statuses(pool, faults, "--only", check, "--shed", str(HELD + 3))
    assert results[check].status == "FAIL" and why in results[check].why, results[check]


async def test_an_epp_that_never_sheds_fails_within_the_limit(pool: list[str]) -> None:
    async with serving(pool, Faults(), max_open=1000) as (address, epp):
        [result] = await epp_check.run_checks(_args(address, "--only", "shed", "--shed", "4"))
    assert result.line() == "FAIL shed: no request shed with 429 while up to 4 were held"
    assert epp.open == 0  # every held stream closed


async def test_what_a_check_cannot_tell_it_skips(pool: list[str]) -> None:
    results = await _statuses(pool, Faults(lists_one=True), "--only", "s")  # served, shed, subset...
    assert results["served"].status == "SKIP" and "one endpoint per pick" in results["served"].why
    assert results["shed"].line().startswith("SKIP shed: run with --shed N")
    assert results["subset"].status == "PASS"


async def test_one_known_endpoint_passes_subset_with_a_note(pool: list[str]) -> None:
    results = await _statuses(pool[:1], Faults(), "--only", "subset")  # a pool of one
    assert results["subset"].status == "PASS" and "an EPP ignoring the subset passes too" in results["subset"].why


async def test_an_answer_the_epp_streams_itself_is_the_clients(pool: list[str]) -> None:
    results = await _statuses(pool, Faults(answers_streams=True), "--only", "streaming")
    assert results["streaming"].line() == "PASS streaming: answered by the EPP itself"


async def test_the_data_plane_reports_the_fallback_it_used_as_served(pool: list[str]) -> None:
    async with serving(pool) as (address, epp), MiniDataPlane(address, TIMEOUT) as plane:
        request = Request(epp_check.chat("m"))
        async with plane.open() as stream:
            decision = await plane.request_phase(stream, request)
            outcome = await plane.complete(stream, request, decision, skip_first=True)
    assert len(decision.endpoints) == 2 and outcome.served == decision.endpoints[1]
    assert epp.served == [decision.endpoints[1]] and outcome.answer.status == 200


async def test_an_unreachable_epp_fails_every_check_without_hanging() -> None:
    async with serving([]) as (address, _):
        pass  # its port, now closed
    results = await asyncio.wait_for(epp_check.run_checks(_args(address, "--shed", "2")), 4 * TIMEOUT)
    assert {r.status for r in results} == {"FAIL"}


@pytest.mark.parametrize(
    ("name", "valid"),
    [("10.0.0.1:8000", True), ("[fd00::1]:8000", True), ("fd00::1:8000", False), ("engine:8000", False)]
    + [("10.0.0.1", False), ("10.0.0.1:0", False), ("10.0.0.1:65536", False), ("10.0.0.1:8O", False)],
)
def test_endpoints_are_ip_port(name: str, valid: bool) -> None:
    assert epp_check.valid_endpoint(name) is valid


async def test_tito_epp_check_prints_a_line_per_check_and_fails_on_any_fail(
    pool: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    async with serving(pool, Faults(no_health=True)) as (address, _):
        argv = ["epp-check", "--epp", address, "--model", "m", "--only", "health", "--timeout", str(TIMEOUT)]
        status = await asyncio.to_thread(cli.main, argv)
    assert status == 1
    assert capsys.readouterr().out.startswith("FAIL health: not SERVING: liveness UNIMPLEMENTED")


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        epp_check.main(["--epp", "x:1", "--model", "m", "--endpoints", "10.0.0.1:80,engine:80"])
    assert exit_.value.code == 2 and "not ip:port: engine:80" in capsys.readouterr().err
    assert epp_check.main(["--epp", "x:1", "--model", "m", "--only", "nothing"]) == 2
