"""From a rendered request to dispatch decisions: breakers, admission, policy, prefix index.

Two steps per engine leg: `pick` chooses an instance of a pool (by role) and changes
nothing; `commit` takes the leg's lease in the ledger, claims a half-open probe and records
the prefix. A request with several legs (prefill then decode) picks every leg first, so a
leg that cannot be placed leaves nothing behind.

A request for a LoRA adapter goes to the instances that list it (`lora.py` ranks them: where
it runs, then where a slot is free), and its prefix blocks are its adapter's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.breaker import BreakerConfig, BreakerState, CircuitBreaker
from scheduler.engine_load import EngineLoad, EngineLoads
from scheduler.instances import Capability, Instance, Pool, Role
from scheduler.kv_block_hash import DEFAULT_SEED, BlockHasher
from scheduler.kv_events import BlockRemoved, BlockStored, EventFeeds, KvEvent
from scheduler.ledger import TokenLedger
from scheduler.lora import AdapterPlacement
from scheduler.policies import Candidate, Policy
from scheduler.prefix_index import PrefixIndex

NO_RECORD = "no capability record yet"  # why a gated instance does not route before its probe


@dataclass(frozen=True)
class ScheduleRequest:
    """What scheduling may look at: the final prompt token ids, never text."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1  # choices: each may generate max_tokens
    other_prompts_demand: int = 0  # the rest of a multi-prompt batch (its prompts + n × max_tokens each)
    # False for a decode leg: the prompt's tokens are charged to the prefill instance
    charge_prompt: bool = True
    adapter: str | None = None  # the LoRA adapter the request names as `model` (None: the base model)
    adapter_path: str | None = None  # its path as the engines see it: part of their KV block hashes
    # The only instances it may go to ("ip:port"), when the data plane names a subset (a GIE
    # gateway's hint); None: any instance of the pool.
    within: frozenset[str] | None = None

    @property
    def demand(self) -> int:
        """What admission charges: the prompt plus every token the engine may generate."""
        prompt = len(self.prompt_token_ids) if self.charge_prompt else 0
        return prompt + self.n * self.max_tokens + self.other_prompts_demand


@dataclass(frozen=True)
class Pick:
    """An instance chosen for one leg (and the fallbacks Envoy may retry on): nothing taken yet."""

    request: ScheduleRequest
    role: Role
    instance: Instance
    fallbacks: tuple[Instance, ...] = ()
    matched_tokens: int = 0
    hashes: tuple[int, ...] = field(default=(), repr=False)
    at: float = 0.0  # when it was picked (the clock of `pick`)
    # the chosen instance does not list the request's adapter: load it there first (or let the
    # engine resolve it); its fallbacks do not list it either
    loads_adapter: bool = False
    # every instance that could serve it had its breaker open: picked as if none were
    panic: bool = False

    @property
    def hosts(self) -> tuple[str, ...]:
        """The override_host list for Envoy: chosen instance first, then retry targets."""
        return (self.instance.address, *(f.address for f in self.fallbacks))


@dataclass(frozen=True)
class Decision:
    """A committed leg: `request_id` names its lease."""

    request_id: str
    instance: Instance
    fallbacks: tuple[Instance, ...] = field(default=())
    matched_tokens: int = 0

    @property
    def hosts(self) -> tuple[str, ...]:
        return (self.instance.address, *(f.address for f in self.fallbacks))


@dataclass(frozen=True)
class Rejection:
    status: int  # 429: over budget; 503: no healthy instance
    reason: str


class Scheduler:
    def __init__(
        self,
        pools: list[Pool],
        policy: Policy,
        ledger: TokenLedger | None = None,
        breaker: BreakerConfig | None = None,
        prefix_index: PrefixIndex | None = None,
        max_fallbacks: int = 2,
        prefix_index_max_blocks: int = 1 << 20,
        prefix_source: str = "routing",
        kv_events_lag_s: float = 5.0,
        hash_seed: str = DEFAULT_SEED,
        load_source: str = "ledger",
        engine_metrics_stale_s: float = 5.0,
        gated: bool = False,
        lora: AdapterPlacement | None = None,
    ) -> None:
        # A pool may start empty when its instances are discovered (they `join` later).
        self.pools = {p.role: p for p in pools}
        if not (Role.UNION in self.pools or {Role.PREFILL, Role.DECODE} <= set(self.pools)):
            raise ValueError("a union pool, or a prefill and a decode pool")
        self.policy = policy
        self.ledger = ledger or TokenLedger()
        # One prefix index per pool that prefills (union, prefill), in its engines' block size;
        # fed by KV cache events, it hashes blocks as the engines do.
        if prefix_source not in ("routing", "kv_events"):
            raise ValueError(f"prefix_source: routing or kv_events, not {prefix_source}")
        self.prefix_source = prefix_source
        self._hash_seed, self._prefix_index_max_blocks = hash_seed, prefix_index_max_blocks
        self.prefix_indexes: dict[Role, PrefixIndex] = {
            role: prefix_index
            or PrefixIndex(
                pool.block_size,
                prefix_index_max_blocks,
                BlockHasher(pool.block_size, hash_seed) if prefix_source == "kv_events" else None,
            )
            for role, pool in self.pools.items()
            if role is not Role.DECODE
        }
        self.feeds = EventFeeds(kv_events_lag_s)
        # What ranking counts as an instance's load: this process's ledger, or that combined
        # with the engine's own figures (other processors' traffic included). Admission stays
        # on the ledger either way.
        if load_source not in ("ledger", "engine_metrics"):
            raise ValueError(f"load_source: ledger or engine_metrics, not {load_source}")
        self.load_source = load_source
        self.engine_loads = EngineLoads(engine_metrics_stale_s)
        self.max_fallbacks = max_fallbacks
        breaker = breaker or BreakerConfig()
        self._breaker_config = breaker
        self.instances = [i for p in self.pools.values() for i in p.instances]
        self.breakers = {i.address: CircuitBreaker(breaker) for i in self.instances}
        # Engines without token-only generate (their capability record, or a 403/404/501 from
        # generate): they get native requests only.
        self.token_only_unsupported: set[str] = set()
        # Engines that do not route, with why: no complete capability record yet (every one,
        # when `gated`: they join as their records arrive), or held out by it.
        self.gated = gated
        self.held_out: dict[str, str] = {i.address: NO_RECORD for i in self.instances if gated}
        self.max_model_lens: dict[str, int] = {}  # what an engine's record says it holds (adopted)
        self.events_ignored: set[str] = set()  # KV events hashed unlike the index: routing records instead
        self.lora = lora or AdapterPlacement()  # which instances list and run which LoRA adapters

    # -- membership: instances that join and leave a pool while it serves

    def join(self, instance: Instance) -> None:
        """A new instance of its role's pool. With capability negotiation on (`gated`) it
        routes once its record arrives; its breaker, load and index state start empty."""
        pool = self.pools.get(instance.role)
        if pool is None or instance.address in self.breakers:
            return
        self.pools[instance.role] = replace(pool, instances=(*pool.instances, instance))
        self.instances.append(instance)
        self.breakers[instance.address] = CircuitBreaker(self._breaker_config)
        if self.gated:
            self.held_out[instance.address] = NO_RECORD

    def leave(self, address: str) -> None:
        """The instance left its pool: it takes no new leg, and every per-instance state goes
        (breaker, records, load samples, index blocks, adapter listing). Legs running there
        keep their leases until they finish (`finish` releases them as usual)."""
        instance = next((i for i in self.instances if i.address == address), None)
        if instance is None:
            return
        pool = self.pools[instance.role]
        self.pools[instance.role] = replace(pool, instances=tuple(i for i in pool.instances if i.address != address))
        self.instances.remove(instance)
        del self.breakers[address]
        for table in (self.held_out, self.max_model_lens):
            table.pop(address, None)
        self.token_only_unsupported.discard(address)
        self.events_ignored.discard(address)
        self.engine_loads.forget(address)
        self.feeds.forget(address)
        self.lora.forget(address)
        index = self.prefix_indexes.get(instance.role)
        if index is not None:
            index.clear(address)

    @property
    def pool(self) -> Pool:
        """The pool that serves requests alone (union), else the decode pool."""
        return self.pools[Role.UNION if Role.UNION in self.pools else Role.DECODE]

    @property
    def prefix_index(self) -> PrefixIndex:
        role = Role.UNION if Role.UNION in self.prefix_indexes else Role.PREFILL  # (an empty index is falsy)
        return self.prefix_indexes[role]

    def mark_token_only_unsupported(self, address: str) -> None:
        if address in self.breakers:
            self.token_only_unsupported.add(address)

    def supports_token_only(self, address: str) -> bool:
        return address not in self.token_only_unsupported

    def set_capabilities(
        self, address: str, held_out: str | None, token_only: bool, max_model_len: int | None = None
    ) -> None:
        """What an engine's capability record decides: whether it routes (`held_out`: why
        not), whether it takes token-only generate, and the context it holds (adopted)."""
        if address not in self.breakers:
            return
        if held_out is None:
            self.held_out.pop(address, None)
        else:
            self.held_out[address] = held_out
        if token_only:
            self.token_only_unsupported.discard(address)
        else:
            self.token_only_unsupported.add(address)
        if max_model_len is None:
            self.max_model_lens.pop(address, None)
        else:
            self.max_model_lens[address] = max_model_len

    def block_size(self, role: Role) -> int | None:
        """The block size the role's prefix index hashes in (None: not indexed)."""
        index = self.prefix_indexes.get(role)
        return index.block_size if index is not None else None

    def adopt_block_size(self, role: Role, block_size: int) -> None:
        """The pool's engines hash KV blocks of another size than configured: its prefix
        index starts over in theirs (what it held was hashed in the old size)."""
        index = self.prefix_indexes.get(role)
        if index is None or index.block_size == block_size:
            return
        hasher = BlockHasher(block_size, self._hash_seed) if self.prefix_source == "kv_events" else None
        self.prefix_indexes[role] = PrefixIndex(block_size, self._prefix_index_max_blocks, hasher)

    def ignore_kv_events(self, address: str, ignore: bool) -> None:
        """An engine hashes its KV events another way (algorithm): the index learns what it
        holds from routing records instead."""
        if ignore:
            self.events_ignored.add(address)
        else:
            self.events_ignored.discard(address)

    def _event_fed(self, address: str, now: float) -> bool:
        return address not in self.events_ignored and self.feeds.event_fed(address, now)

    def pick(
        self,
        request: ScheduleRequest,
        now: float,
        role: Role = Role.UNION,
        exclude: Iterable[str] = (),
        needs: Capability | None = None,
        panic: bool = False,
    ) -> Pick | Rejection:
        """The best instance of the role's pool for this leg, or why there is none.

        `panic`: when every breaker that could serve it is open, pick as if none were (Envoy's
        panic routing; the caller's last resort, the Pick says so) instead of refusing."""
        pool = self.pools.get(role)
        skip = set(exclude)
        eligible = [
            (n, i)
            for n, i in enumerate(pool.instances if pool else ())
            if i.address not in skip
            and (needs is None or needs in i.capabilities)
            and (request.within is None or i.address in request.within)
        ]
        if not eligible:
            kind = f"{role.value} engine instance" + (f" with {needs.value}" if needs is not None else "")
            inside = " in the request's endpoint subset" if request.within is not None else ""
            return Rejection(503, f"no {kind}{inside}" + (" left to try" if skip else ""))
        usable = [(n, i) for n, i in eligible if i.address not in self.held_out]
        if not usable:
            reasons = "; ".join(f"{i.address}: {self.held_out[i.address]}" for _, i in eligible)
            return Rejection(503, f"no {role.value} engine instance routes ({reasons})")
        fits = [(n, i) for n, i in usable if self._fits(i.address, request)]
        if usable and not fits:
            limit = max(self.max_model_lens[i.address] for _, i in usable)
            needed = self._context(request)
            return Rejection(400, f"the request needs {needed} tokens of context; the engines hold at most {limit}")
        healthy = [(n, i) for n, i in fits if self.breakers[i.address].allows(now)]
        panic = panic and not healthy
        if panic:
            healthy = fits
        elif not healthy:
            return Rejection(503, f"no healthy {role.value} engine instance (all circuit breakers open)")
        demand = request.demand
        if not self.ledger.global_room(demand):
            return Rejection(429, f"gateway token budget exhausted ({demand} tokens requested)")
        roomy = [(n, i) for n, i in healthy if self.ledger.instance_room(i.address, demand)]
        if not roomy:
            return Rejection(429, f"every engine instance is at its token budget ({demand} tokens requested)")
        roomy, loads_adapter = self._listing(request, roomy)
        index = self.prefix_indexes.get(role) if self.policy.uses_prefix else None
        hashes = self._hashes(index, request) if index is not None else []
        matched = index.match(hashes) if index is not None and hashes else {}
        block = index.block_size if index is not None else 0
        candidates = []
        for n, i in roomy:
            tokens, requests = self._load(i.address, now)
            candidates.append(Candidate(i, n, tokens, requests, matched.get(i.address, 0) * block))
        ranked = self._by_adapter_tier(request, self.policy.rank(candidates, len(request.prompt_token_ids)))
        chosen = ranked[0]
        fallbacks = tuple(c.instance for c in ranked[1 : 1 + self.max_fallbacks])
        return Pick(
            request, role, chosen.instance, fallbacks, chosen.matched_tokens, tuple(hashes), now, loads_adapter, panic
        )

    @staticmethod
    def _hashes(index: PrefixIndex, request: ScheduleRequest) -> list[int]:
        """The prompt's blocks under its adapter: KV computed for another adapter never matches."""
        return index.hashes(request.prompt_token_ids, request.adapter, request.adapter_path)

    def _listing(
        self, request: ScheduleRequest, roomy: list[tuple[int, Instance]]
    ) -> tuple[list[tuple[int, Instance]], bool]:
        """For an adapter: only the instances that list it (another would answer 404), or all
        when none does (True: the chosen one must load it). One registration state either way,
        so the fallbacks are in the chosen one's."""
        if request.adapter is None:
            return roomy, False
        listing = [(n, i) for n, i in roomy if request.adapter in self.lora.registered(i.address)]
        return (listing, False) if listing else (roomy, True)

    def _by_adapter_tier(self, request: ScheduleRequest, ranked: list[Candidate]) -> list[Candidate]:
        """Where the adapter runs (or has a free slot) first; stable, so the policy's order
        holds within a tier."""
        adapter = request.adapter
        if adapter is None:
            return ranked
        return sorted(ranked, key=lambda c: self.lora.tier(c.instance.address, adapter))

    @staticmethod
    def _context(request: ScheduleRequest) -> int:
        return len(request.prompt_token_ids) + request.max_tokens

    def _fits(self, address: str, request: ScheduleRequest) -> bool:
        """The prompt and its generation fit the context the engine's record says it holds."""
        limit = self.max_model_lens.get(address)
        return limit is None or self._context(request) <= limit

    def commit(self, pick: Pick) -> Decision:
        """Take the leg's lease (keyed by its request id), claim a half-open probe, and
        remember where the prompt's blocks now live."""
        address = pick.instance.address
        self.ledger.acquire(pick.request.request_id, address, pick.request.demand)
        self.breakers[address].on_dispatch()
        self.engine_loads.committed(address, pick.request.demand)
        if pick.request.adapter is not None:
            self.lora.started(pick.request.request_id, address, pick.request.adapter)
        index = self.prefix_indexes.get(pick.role)
        if pick.hashes and index is not None:
            if self._event_fed(address, pick.at):  # the engine's events will say what it holds
                self.feeds.committed(address, pick.at)
            else:
                index.record(pick.hashes, address)
        return Decision(pick.request.request_id, pick.instance, pick.fallbacks, pick.matched_tokens)

    def schedule(self, request: ScheduleRequest, now: float, role: Role = Role.UNION) -> Decision | Rejection:
        """One leg, picked and committed."""
        picked = self.pick(request, now, role)
        return picked if isinstance(picked, Rejection) else self.commit(picked)

    def saturated(self, kv_usage: float | None, waiting: int | None, now: float) -> bool:
        """Every routable engine that serves a whole answer (union, else decode) is past a
        threshold by its fresh metrics: KV cache use or requests waiting. An engine with no
        fresh sample counts as not saturated (the budget still bounds what it gets)."""
        if kv_usage is None and waiting is None:
            return False
        pool = self.pools.get(Role.UNION) or self.pools.get(Role.DECODE)
        routable = [i.address for i in (pool.instances if pool else ()) if i.address not in self.held_out]
        samples = [self.engine_loads.fresh(address, now) for address in routable]
        return bool(samples) and all(
            s is not None
            and ((kv_usage is not None and s.kv_usage >= kv_usage) or (waiting is not None and s.waiting >= waiting))
            for s in samples
        )

    def passthrough_hosts(self, within: frozenset[str] | None = None) -> tuple[str, ...]:
        """Where a non-inference request (e.g. `/v1/models`) may go: instances with a closed
        breaker, least busy first, else any (of `within`, when given: none there, none). It
        takes no lease and no half-open probe, and its outcome is never breaker input."""
        members = [i for i in self.pool.instances if within is None or i.address in within]
        instances = [i for i in members if i.address not in self.held_out] or members
        closed = [i for i in instances if self.breakers[i.address].state is BreakerState.CLOSED]
        ranked = sorted(closed or instances, key=lambda i: self.ledger.active_requests(i.address))
        return tuple(i.address for i in ranked)

    def finish(self, request_id: str, now: float, failed: Iterable[str] = (), served_by: str | None = None) -> None:
        """Release a leg's tokens and tell the breakers what the engines did.

        `failed`: instances that failed this leg (refused, reset, 5xx); `served_by`: the
        instance that answered. Neither: no engine verdict (e.g. the client left first).
        """
        lease = self.ledger.release(request_id)
        self.lora.finished(request_id)
        verdict = False
        for address in failed:
            if address in self.breakers:
                self.breakers[address].record_failure(now)
                verdict |= lease is not None and address == lease.address
        if served_by in self.breakers:
            self.breakers[served_by].record_success()
            verdict |= lease is not None and served_by == lease.address
        if lease is not None and not verdict and lease.address in self.breakers:  # (it may have left)
            self.breakers[lease.address].record_abandoned()

    def _load(self, address: str, now: float) -> tuple[int, int]:
        """(active tokens, active requests) as ranking sees them."""
        tokens, requests = self.ledger.active_tokens(address), self.ledger.active_requests(address)
        if self.load_source != "engine_metrics":
            return tokens, requests
        return self.engine_loads.active(address, now, tokens, requests)

    def engine_load(self, address: str, load: EngineLoad) -> None:
        """An instance's engine reported its load (a sample of its metrics)."""
        if address in self.breakers:
            self.engine_loads.sampled(address, load)

    def _held(self, instance: Instance) -> int:
        """Blocks the index says the instance holds (0 for a decode instance: not indexed)."""
        index = self.prefix_indexes.get(instance.role)
        return index.held(instance.address) if index is not None else 0

    def _load_snapshot(self, address: str, now: float) -> dict[str, Any]:
        fed = self.load_source == "engine_metrics" and self.engine_loads.fresh(address, now) is not None
        engine = self.engine_loads.describe(address, now)
        return {"load_source": "engine_metrics" if fed else "ledger", **({"engine": engine} if engine else {})}

    def kv_events(self, address: str, events: Iterable[KvEvent]) -> None:
        """An instance's engine reported what its KV cache now holds (or no longer holds)."""
        instance = next((i for i in self.instances if i.address == address), None)
        index = self.prefix_indexes.get(instance.role) if instance is not None else None
        if index is None or address in self.events_ignored:
            # a decode instance (its cache is filled by handoffs, not scheduled on), or one
            # whose events are hashed unlike the index
            return
        for event in events:
            if isinstance(event, BlockStored):
                index.record(event.block_hashes, address)
            elif isinstance(event, BlockRemoved):
                index.remove(event.block_hashes, address)
            else:
                index.clear(address)
        self.feeds.received(address)

    def snapshot(self, now: float = 0.0) -> dict[str, Any]:
        return {
            "prefix_source": self.prefix_source,
            "policy": type(self.policy).__name__,
            "total_active_tokens": self.ledger.total_tokens,
            # this process's share of the budgets (AdmissionConfig: split between processes)
            "token_budgets": {"global": self.ledger.global_budget, "instance": self.ledger.instance_budget},
            "active_requests": self.ledger.active_leases,
            "prefix_index_blocks": sum(len(index) for index in set(self.prefix_indexes.values())),
            "instances": {
                i.address: {
                    "role": i.role.value,
                    "active_tokens": self.ledger.active_tokens(i.address),
                    "active_requests": self.ledger.active_requests(i.address),
                    "breaker": self.breakers[i.address].state.value,
                    "consecutive_failures": self.breakers[i.address].failures,
                    "token_only": self.supports_token_only(i.address),
                    "prefix_source": "kv_events" if self._event_fed(i.address, now) else "routing",
                    "routes": i.address not in self.held_out,
                    **({"held_out": self.held_out[i.address]} if i.address in self.held_out else {}),
                    "prefix_blocks": self._held(i),
                    "adapters": self.lora.snapshot(i.address),
                    **self._load_snapshot(i.address, now),
                }
                for i in self.instances
            },
        }
