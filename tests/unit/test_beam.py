"""Beam search's choices (`legs/beam.py`) as native vLLM's `BeamSearchOnlineMixin` makes them:
which candidates a step keeps, and how complete beams are ranked."""

from __future__ import annotations

import numpy as np
import pytest

from ext_proc.legs.beam import Beam, _candidates, best, score


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


def _entry(tops: list[tuple[int, float, int]]) -> dict[str, object]:
    token, logprob, rank = tops[0]
    return {
        "token_id": token,
        "logprob": logprob,
        "rank": rank,
        "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in tops],
    }
