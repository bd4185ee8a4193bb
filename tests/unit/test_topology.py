"""Which topology the planner tries, in order, for each pool layout and request shape: the
routed path (Trigger, then Handoff, on a prefill leg picked first) and the processor-owned
one (Handoff, else Trigger for a single prompt), then one instance alone (union, else a
colocating decode instance, else a Trigger one for a native batch). Pure: no scheduler runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ext_proc.planning import topology
from ext_proc.planning.topology import (
    COLOCATED,
    HANDOFF_PAIR,
    ON_UNION,
    PER_PROMPT,
    PREFILL_FIRST,
    ROUTED,
    TRIGGER_ALONE,
    TRIGGER_PAIR,
    Offer,
    Pairing,
    Shape,
    shapes,
    trigger_batch,
)
from scheduler import Capability, Instance, Pool, Role

H, T, CO = Capability.HANDOFF, Capability.TRIGGER, Capability.COLOCATION
UNION = Offer(union=True)


def pd(*modes: Capability, union: bool = False) -> Offer:
    return Offer(union=union, prefill=True, decode=True, modes=frozenset(modes))


def tried(offer: Offer, pairing: Pairing | None, batch: bool = False) -> tuple[Shape, ...]:
    return shapes(offer, pairing, batch=batch)


@pytest.mark.parametrize("pairing", [ROUTED, PER_PROMPT, None])
@pytest.mark.parametrize("batch", [False, True])
def test_a_union_pool_alone_serves_everything_alone(pairing: Pairing | None, batch: bool) -> None:
    assert tried(UNION, pairing, batch) == (ON_UNION,)


def test_handoff_pools_pair_on_both_paths_then_a_colocating_decode_instance() -> None:
    handoff = pd(H)
    assert tried(handoff, ROUTED) == (PREFILL_FIRST, HANDOFF_PAIR, COLOCATED)
    assert tried(handoff, PER_PROMPT) == (HANDOFF_PAIR, COLOCATED)
    assert tried(handoff, PER_PROMPT, batch=True) == (HANDOFF_PAIR, COLOCATED)  # a prompt of a batch
    assert tried(handoff, None, batch=True) == (COLOCATED,)  # a batch served whole
    assert not trigger_batch(handoff)


def test_trigger_pools_pair_single_prompts_and_serve_batches_natively() -> None:
    trigger = pd(T)
    # routed: the prefill leg is picked first even under Trigger (its refusal is why no pair)
    assert tried(trigger, ROUTED) == (PREFILL_FIRST, TRIGGER_PAIR, COLOCATED)
    assert tried(trigger, PER_PROMPT) == (TRIGGER_PAIR, COLOCATED)
    assert tried(trigger, PER_PROMPT, batch=True) == (COLOCATED,)  # a Trigger pool pairs no prompt of a batch
    assert tried(trigger, None, batch=True) == (COLOCATED, TRIGGER_ALONE)
    assert tried(trigger, None) == (COLOCATED,)  # a single prompt served alone never goes to Trigger alone
    assert trigger_batch(trigger)


def test_with_both_modes_the_paths_prefer_differently() -> None:
    both = pd(H, T)
    assert tried(both, ROUTED) == (PREFILL_FIRST, TRIGGER_PAIR, HANDOFF_PAIR, COLOCATED)
    assert tried(both, PER_PROMPT) == (HANDOFF_PAIR, COLOCATED)  # only the first mode offered
    assert tried(both, PER_PROMPT, batch=True) == (HANDOFF_PAIR, COLOCATED)
    assert tried(both, None, batch=True) == (COLOCATED, TRIGGER_ALONE)


def test_decode_colocation_is_no_pair_only_the_fallback() -> None:
    assert tried(pd(H, CO), ROUTED) == (PREFILL_FIRST, HANDOFF_PAIR, COLOCATED)
    assert tried(pd(T, CO), PER_PROMPT) == (TRIGGER_PAIR, COLOCATED)
    assert tried(pd(CO), PER_PROMPT) == (COLOCATED,)
    # routed pools without a pairing mode still pick (and may be refused) the prefill leg first
    assert tried(pd(CO), ROUTED) == (PREFILL_FIRST, COLOCATED)


def test_a_union_pool_beside_prefill_decode_pools_is_the_fallback() -> None:
    hybrid = pd(H, T, union=True)
    assert tried(hybrid, ROUTED) == (PREFILL_FIRST, TRIGGER_PAIR, HANDOFF_PAIR, ON_UNION)
    assert tried(hybrid, PER_PROMPT) == (HANDOFF_PAIR, ON_UNION)
    assert tried(hybrid, None, batch=True) == (ON_UNION,)
    assert not trigger_batch(hybrid)


def test_unpaired_requests_are_served_alone() -> None:
    assert tried(pd(H, T), None) == (COLOCATED,)
    # a decode pool's modes do not pair without a prefill pool
    decode_only = Offer(union=True, decode=True, modes=frozenset({H, T}))
    assert tried(decode_only, ROUTED) == (ON_UNION,) and not trigger_batch(decode_only)


def test_the_offer_is_read_from_the_scheduler_pools() -> None:
    def pool(role: Role, *caps: frozenset[Capability]) -> Pool:
        instances = tuple(Instance(f"10.0.0.{n}:80", role.value, role, c) for n, c in enumerate(caps))
        return Pool(role.value, role, instances)

    pools = {
        Role.PREFILL: pool(Role.PREFILL, frozenset()),
        Role.DECODE: pool(Role.DECODE, frozenset({H}), frozenset({CO})),
    }
    assert Offer.of(pools) == Offer(prefill=True, decode=True, modes=frozenset({H, CO}))
    assert Offer.of({Role.UNION: pool(Role.UNION, frozenset())}) == UNION


def test_the_topology_is_pure() -> None:
    tree = ast.parse(Path(topology.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "collections.abc", "dataclasses", "scheduler"}
