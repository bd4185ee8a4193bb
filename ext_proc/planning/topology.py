"""Which prefill/decode topology may serve a request, in order of preference: pure (no I/O).

RFC Generate 阶段, PD-hybrid: with a prefill and a decode pool, a pair (Trigger: the decode
instance calls back for its prefill; Handoff: the prefill leg goes first); when no healthy
pair exists, a union pool, else a decode instance that may serve alone (`decode_colocation`),
else (a batch on the native path with nothing but a Trigger pool) a Trigger decode instance.

`shapes` only says what to try; the planner tries it with the scheduler's `pick` and commits
the first that places the request (`Planner._leg`). The routed path (one prompt, Envoy routes
its leg) and the processor-owned path (one leg per prompt) pair differently: `Pairing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler import Capability, Pool, Role


@dataclass(frozen=True)
class Offer:
    """What the scheduler's pools offer (the pools with instances)."""

    union: bool = False
    prefill: bool = False
    decode: bool = False
    modes: frozenset[Capability] = frozenset()  # what any of the decode pool's instances can do

    @classmethod
    def of(cls, pools: Mapping[Role, Pool]) -> Offer:
        decode = pools.get(Role.DECODE)
        instances = decode.instances if decode is not None else ()
        return cls(
            union=Role.UNION in pools,
            prefill=Role.PREFILL in pools,
            decode=decode is not None,
            modes=frozenset(c for instance in instances for c in instance.capabilities),
        )

    @property
    def pd(self) -> bool:
        """A prefill and a decode pool."""
        return self.prefill and self.decode

    def pairs_in(self, mode: Capability) -> bool:
        """The prefill/decode pools work in this mode (Handoff or Trigger)."""
        return self.pd and mode in self.modes


@dataclass(frozen=True)
class PrefillFirst:
    """Pick the prefill leg before any decode leg: the pairs after it share it (Trigger's
    leaves it uncommitted), and its refusal ends pairing."""


@dataclass(frozen=True)
class Pair:
    """A decode leg on an instance with `mode`. Handoff: with the prefill leg that goes first
    (picked before this decode leg unless `PrefillFirst` picked it), both committed. Trigger:
    the decode leg alone (its engine calls back for its prefill)."""

    mode: Capability


@dataclass(frozen=True)
class Alone:
    """One instance of `role` (with `needs`) serving the whole request, prefill included."""

    role: Role
    needs: Capability | None = None


Shape = PrefillFirst | Pair | Alone

PREFILL_FIRST = PrefillFirst()
TRIGGER_PAIR = Pair(Capability.TRIGGER)
HANDOFF_PAIR = Pair(Capability.HANDOFF)
ON_UNION = Alone(Role.UNION)
COLOCATED = Alone(Role.DECODE, Capability.COLOCATION)
TRIGGER_ALONE = Alone(Role.DECODE, Capability.TRIGGER)


@dataclass(frozen=True)
class Pairing:
    """How a path pairs prefill and decode."""

    modes: tuple[Capability, ...]  # in order of preference
    prefill_first: bool  # the prefill leg is picked before any decode leg, for Trigger too
    first_only: bool  # only the first mode the pools offer; else a refused decode leg falls to the next


# Envoy routes the leg: Trigger first, then Handoff, on the prefill leg picked first.
ROUTED = Pairing((Capability.TRIGGER, Capability.HANDOFF), prefill_first=True, first_only=False)
# The processor runs the legs, one prompt each: Handoff, else (a single prompt) Trigger.
PER_PROMPT = Pairing((Capability.HANDOFF, Capability.TRIGGER), prefill_first=False, first_only=True)


def shapes(offer: Offer, pairing: Pairing | None, *, batch: bool) -> tuple[Shape, ...]:
    """What to try for a request, in order: pairs (`pairing`; None: the request is served
    alone), then one instance alone; the last `Alone` refused is why nothing placed it.

    `batch`: the request has several prompts. A Trigger pool pairs none of them (its
    batches go native, RFC: Trigger 多 prompt 流式仍沿用原生链路); a batch served alone (no
    pairing) is served whole, natively, by a Trigger decode instance when nothing else is."""
    pairs: list[Shape] = []
    if pairing is not None and offer.pd:
        modes = [m for m in pairing.modes if m in offer.modes and not (batch and m is Capability.TRIGGER)]
        if pairing.first_only:
            modes = modes[:1]
        pairs = [*([PREFILL_FIRST] if pairing.prefill_first else []), *(Pair(m) for m in modes)]
    return (*pairs, *alone(offer, native_batch=batch and pairing is None))


def alone(offer: Offer, native_batch: bool) -> tuple[Alone, ...]:
    """One instance serving the whole request: a union instance, else a decode instance that
    may serve alone, else (`native_batch`, with nothing but a Trigger pool) a Trigger one."""
    if offer.union:
        return (ON_UNION,)
    if native_batch and trigger_batch(offer):
        return (COLOCATED, TRIGGER_ALONE)
    return (COLOCATED,)


def trigger_batch(offer: Offer) -> bool:
    """A batch has nothing but a Trigger pool to serve it: the native path."""
    return not offer.union and offer.pairs_in(Capability.TRIGGER)
