"""Beam search's choices (`legs/beam.py`) as native vLLM's `BeamSearchOnlineMixin` makes them:
which candidates a step keeps, and how complete beams are ranked."""

from __future__ import annotations

import numpy as np
import pytest

from ext_proc.legs.beam import Beam, Search, _candidates, best, score


def test_a_step_offers_the_engines_candidates_in_its_order() -> None:
    tops = [(7, -1.2, 3), (1, -0.5, 1), (2, -0.9, 2), (4, -1.5, 4)]  # sampled (rank 3) first
    choice = {"finish_reason": "length", "logprobs": {"content": [_entry(tops)]}}
    assert _candidates(choice) == ("length", [(7, -1.2), (1, -0.5), (2, -0.9), (4, -1.5)])


def test_a_step_without_logprobs_offers_no_candidate() -> None:
    assert _candidates({"finish_reason": "abort", "logprobs": None}) == ("abort", [])


def test_the_best_candidates_are_chosen_best_first_as_numpy_chooses_them() -> None:
    values = [-1.0, -0.25, -3.0, -0.25, -0.5, -2.0]
    candidates = [(v, i, Beam([0]), []) for i, v in enumerate(values)]
    for width in (1, 2, 3, 6, 8):
        logprobs = -np.array(values)
        if len(values) <= width:
            expected = list(np.argsort(logprobs))
        else:
            top = np.argpartition(logprobs, width - 1)[:width]
            expected = list(top[np.argsort(logprobs[top])])
        assert best(candidates, width) == [int(i) for i in expected]
        assert [values[i] for i in best(candidates, width)] == sorted(values, reverse=True)[:width]


@pytest.mark.parametrize("penalty", [0.5, 1.0, 2.0])
def test_a_beam_is_scored_by_its_length_without_a_final_eos(penalty: float) -> None:
    eos = 2
    assert score(Beam([5, 6, 7, eos], -3.0), eos, penalty) == pytest.approx(-3.0 / 3**penalty)
    assert score(Beam([5, 6, 7, 8], -3.0), eos, penalty) == pytest.approx(-3.0 / 4**penalty)
    assert score(Beam([eos], -1.0), eos, penalty) == -1.0  # never divided by zero


EOS = 2


def _search(width: int = 2, keep_eos: bool = False, ignore_eos: bool = False, penalty: float = 1.0) -> Search:
    return Search(width, EOS, ignore_eos, keep_eos, 1.0, penalty)


def test_an_eos_candidate_completes_its_beam_and_the_best_others_live_on() -> None:
    beams = [Beam([9], -1.0), Beam([8], -2.0)]
    steps = [("length", [(5, -0.5), (EOS, -0.1), (6, -3.0)]), ("length", [(7, -0.2), (4, -0.3)])]
    completed: list[Beam] = []
    live = _search().advance(beams, steps, completed)
    assert [(b.tokens, b.cum_logprob) for b in live] == [([9, 5], -1.5), ([8, 7], -2.2)]
    assert [(b.tokens, b.cum_logprob, b.finish_reason, b.stop_reason) for b in completed] == [
        ([9], -1.1, "stop", EOS)  # without its EOS, unless include_stop_str_in_output
    ]
    kept: list[Beam] = []
    _search(keep_eos=True).advance(beams, steps, kept)
    assert kept[0].tokens == [9, EOS]
    ignored: list[Beam] = []
    live = _search(ignore_eos=True).advance(beams, steps, ignored)
    assert not ignored and [b.tokens for b in live] == [[9, EOS], [9, 5]]


def test_an_aborted_step_ends_every_live_beam_as_aborted() -> None:
    beams = [Beam([9, 5], -1.0), Beam([9, 6], -2.0)]
    completed: list[Beam] = [Beam([9], -0.5, finish_reason="stop")]
    assert _search().advance(beams, [("abort", []), ("length", [(7, -0.1)])], completed) == []
    assert [b.finish_reason for b in completed] == ["stop", "abort", "abort"]


def test_the_answer_is_the_best_beams_by_length_penalized_score_ties_in_completion_order() -> None:
    short = Beam([1, 1, EOS], -2.0, finish_reason="stop")  # length 2: -1.0 at penalty 1
    long = Beam([1, 1, 1, 1], -3.6)  # length 4: -0.9
    tied = Beam([1, 3, EOS], -2.0, finish_reason="stop")
    assert _search(width=2).best([short, long, tied]) == [long, short]
    assert _search(width=2, penalty=0.0).best([short, long, tied]) == [short, tied]  # raw cumulative logprob


def _entry(tops: list[tuple[int, float, int]]) -> dict[str, object]:
    token, logprob, rank = tops[0]
    return {
        "token_id": token,
        "logprob": logprob,
        "rank": rank,
        "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in tops],
    }
