"""Capability negotiation (RFC 能力协商): what every engine and render endpoint serves,
learned before a client request pays for it. What is asked of each endpoint and how its
answers parse is `capability_probe.py`'s; this module keeps the records, schedules the
probes and liveness checks, and applies what the records decide.

Probes run at start-up, every `capabilities.interval_s`, after a breaker's half-open probe
and after a generate answered "no token-only route"; an endpoint that cannot be reached is
tried again with backoff, so an engine started later joins without a restart. Between
probes, every engine's `GET /health` every `capabilities.health_interval_s` (and at once
after a client request failed on it) tells a dead engine from a live one within about a
second. A failed probe or liveness check takes the engine out of routing at once: its last
good record stays (what `tito engines` and `/debug/state` show), marked with why (`error`),
until a probe passes again; a dead engine's first passing liveness check brings that probe
on at once. The decisions are pure (`scheduler/capabilities.py`); this module only fetches,
parses and applies them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import httpx

from ext_proc.config import InstanceConfig, PoolConfig, TitoConfig
from ext_proc.fleet.capability_probe import Prober, failure_reason
from ext_proc.frontend.model_catalog import ModelCatalog
from ext_proc.frontend.tokenization import TokenizationService
from scheduler import Role, Scheduler
from scheduler.capabilities import (
    Assessment,
    EngineCapabilities,
    Expected,
    RenderCapabilities,
    assess,
    canary_reference,
    unready_pools,
)

log = logging.getLogger("tito.capabilities")


# -- the records and what they decide -------------------------------------------------------


@dataclass
class _Due:
    at: float = 0.0  # next probe (the monotonic clock)
    backoff_s: float = 0.0  # > 0 while the endpoint cannot be probed


class Capabilities:
    """Every engine's and render endpoint's record, refreshed in the background; each round
    ends by applying the assessments to the scheduler and to tokenization."""

    def __init__(
        self,
        config: TitoConfig,
        scheduler: Scheduler,
        tokenization: TokenizationService,
        http: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self._config = config
        self._settings = config.capabilities
        self._scheduler = scheduler
        self._catalog = catalog or ModelCatalog(config.model)
        self._tokenization = tokenization
        self._clock = clock
        settings = self._settings
        self._prober = Prober(
            http, settings.timeout_s, config.model.served_name, tokenization.codec, settings.health_timeout_s
        )
        # Every engine instance with its pool's config and its own (the config's, then those
        # that `join` and `leave` as discovery finds them)
        self._instances = {i.address: (p, i) for p in config.pools for i in p.instances}
        self.engines: dict[str, EngineCapabilities | None] = dict.fromkeys(self._instances)
        self.assessments: dict[str, Assessment] = {}
        pool = tokenization.pool
        self.renders: dict[str, RenderCapabilities | None] = {m.name: None for m in pool.members} if pool else {}
        self.render_used: dict[str, bool] = {}
        self._reference: tuple[int, ...] | None = None  # the canary ids of the last decision
        self._due: dict[str, _Due] = {name: _Due() for name in [*self.renders, *self.engines]}
        self._health_due: dict[str, float] = dict.fromkeys(self.engines, 0.0)  # next liveness check
        # Engines whose last liveness check failed (and no probe passed since): their next
        # passing check brings on the full probe at once
        self._down: set[str] = set()
        self._late: dict[str, int] = {}  # liveness checks in a row that got no answer in time
        self._lora_marks: dict[str, int] = {}  # the gateway's loads each engine's listing knows of
        self._probing: set[str] = set()  # endpoints whose probe runs now
        self._checking: set[str] = set()  # engines whose liveness check runs now
        self._wake = asyncio.Event()
        self.rounds = 0

    # -- membership

    def join(self, pool: PoolConfig, instance: InstanceConfig) -> None:
        """A discovered instance: probed now; it routes once its record is complete."""
        address = instance.address
        if address in self._instances:
            return
        self._instances[address] = (pool, instance)
        self.engines[address] = None
        self._due[address] = _Due(self._clock())
        self._health_due[address] = self._clock() + self._settings.health_interval_s
        self._wake.set()

    def leave(self, address: str) -> None:
        """The instance left: its record, checks and listing go (a probe of it still running
        finds it gone and keeps nothing)."""
        self._instances.pop(address, None)
        for table in (self.engines, self.assessments, self._due, self._health_due, self._lora_marks, self._late):
            table.pop(address, None)
        self._down.discard(address)
        self._catalog.forget(address)

    # -- when to probe

    def probe_soon(self, address: str) -> None:
        """Refresh this engine's record now (a breaker probe ended, generate said it has no
        token-only route)."""
        if address in self._due:
            self._due[address] = _Due(self._clock(), self._due[address].backoff_s)
            self._wake.set()

    def breaker_changed(self, address: str, state: str) -> None:
        """A half-open probe ended (the breaker closed or opened again): the engine may have
        restarted as something else."""
        if state in ("closed", "open"):
            self.probe_soon(address)

    def engine_failed(self, address: str) -> None:
        """A client request's leg failed on this engine (no connection, a reset, an error
        answer): its liveness check now tells a dead engine (held out at once) from a live
        one that answered badly (the breaker's business)."""
        if address in self._health_due:
            self._health_due[address] = self._clock()
            self._wake.set()

    async def run(self) -> None:
        """Probes and liveness checks as they fall due, each in a task of its own: a probe
        waiting out its timeouts on a hung engine holds up no other engine's check."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                for work in self._start_due():
                    task = asyncio.create_task(work)
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                wait = self._next_due() - self._clock()
                if wait > 0:  # (asyncio.timeout: 3.11's wait_for can swallow a cancellation)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._wake.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_due(self) -> list[Coroutine[Any, Any, None]]:
        """What falls due now, marked as running before it starts (so it is started once)."""
        now = self._clock()
        work = []
        probes = [name for name, due in self._due.items() if due.at <= now and name not in self._probing]
        if probes:  # probed together: their decision sees every new record (the canary reference)
            self._probing.update(probes)
            work.append(self._probe_round(probes))
        for address, at in self._health_due.items():
            if at <= now and address not in self._checking:
                self._checking.add(address)
                work.append(self.check(address))
        return work

    def _next_due(self) -> float:
        """When the next probe or check falls due (what runs now wakes the loop as it ends)."""
        pending = [due.at for name, due in self._due.items() if name not in self._probing]
        pending += [at for address, at in self._health_due.items() if address not in self._checking]
        return min(pending, default=self._clock() + self._settings.health_interval_s)

    async def _probe_round(self, names: list[str]) -> None:
        try:
            await self.refresh(names)
        finally:
            self._probing.difference_update(names)
            self._wake.set()

    async def check(self, address: str) -> None:
        """One liveness check of this engine, now."""
        try:
            failure = await self._prober.alive(address)
            self._late.pop(address, None)
            if address in self._instances:  # (it may have left meanwhile)
                self._checked(address, failure)
        except httpx.PoolTimeout:
            pass  # nothing learned: the next check asks again
        except httpx.TimeoutException as exc:  # late: dead only when it keeps being late
            late = self._late[address] = self._late.get(address, 0) + 1
            if late >= self._late_limit(address) and address in self._instances:
                self._checked(address, failure_reason(exc))
        finally:
            self._checking.discard(address)
            if address in self._instances:
                self._health_due[address] = self._clock() + self._settings.health_interval_s
            self._wake.set()

    def _checked(self, address: str, failure: str | None) -> None:
        """A liveness check's verdict (`failure`: why the engine is not alive). A failed one
        holds the engine out now and schedules its probe with the backoff; one that keeps
        failing changes nothing more (nor pushes the probe further out). The first one that
        passes after that brings the probe on at once, not after its backoff."""
        if failure is None:
            if address in self._down:
                self._down.discard(address)
                self.probe_soon(address)
            return
        if address in self._down:
            return
        self._down.add(address)
        self._failed(address, failure)
        self._schedule(address, failure)
        self.decide()

    async def refresh(self, names: list[str] | None = None) -> None:
        """Probe these endpoints (default: all) together, then decide."""
        names = list(self._due) if names is None else names
        await asyncio.gather(*(self._probe(name) for name in names))
        self.rounds += 1
        self.decide()

    async def _probe(self, name: str) -> None:
        now = self._clock()
        lora_mark = self._scheduler.lora.mark()  # an adapter loaded while this probe runs stays listed
        is_render = name in self.renders
        try:
            if is_render:
                assert self._tokenization.pool is not None
                member = self._tokenization.pool.member(name)
                record: Any = await self._prober.render(name, member.url, member.renderer, now)
            else:
                record = await self._prober.engine(name, now, *self._fingerprint(name))
        except Exception as exc:  # noqa: BLE001 - whatever it was, the endpoint is probed again later
            if name not in self._due:
                return  # it left while probed
            failure = failure_reason(exc)
            old = self.renders.get(name)
            if is_render and (old is None or old.error is None):  # an engine's verdict says it (`_log`)
                log.warning("capabilities of render %s: %s; trying again", name, failure)
            if not self._busy(name, exc):
                self._failed(name, failure)
            self._schedule(name, failure)
            return
        if name not in self._due:
            return  # it left while probed
        (self.renders if is_render else self.engines)[name] = record
        if not is_render:
            self._lora_marks[name] = lora_mark
        self._down.discard(name)  # it answered: a check that fails from now on holds it out again
        self._schedule(name, None)

    def _fingerprint(self, address: str) -> tuple[str | None, bool]:
        """What the engine's probe needs of its `system_fingerprint`: the one known while its
        record stands (a restarted engine fails a check first, and is asked again), and
        whether to ask: a union engine's, when configured. Prefill and decode engines hold KV
        connectors, whose storage a request that is not a handoff should not touch."""
        old = self.engines.get(address)
        known = old.system_fingerprint if old is not None and old.error is None else None
        joined = self._instances.get(address)
        union = joined is not None and Role(joined[0].role) is Role.UNION
        return known, union and self._settings.fingerprint

    def _late_limit(self, address: str) -> int:
        """Late liveness answers in a row that make an engine dead: `health_timeouts`, three
        times that while it has legs running (a saturated engine's server answers late; a
        hung one's legs stall, which relay and the breakers deal with meanwhile)."""
        serving = self._scheduler.ledger.active_requests(address) > 0
        return self._settings.health_timeouts * (3 if serving else 1)

    def _busy(self, name: str, exc: Exception) -> bool:
        """A refresh of a routing engine's record that got no answer in time: a busy engine
        (its liveness checks decide whether it is dead); its record stands, retried soon."""
        record = self.engines.get(name)
        late = isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.PoolTimeout)
        return late and record is not None and record.complete and record.error is None

    def _failed(self, name: str, failure: str) -> None:
        """The endpoint failed a probe or liveness check: its last good record stays (what it
        said is still shown), marked with why it is out now."""
        records: dict[str, Any] = self.renders if name in self.renders else self.engines
        old = records[name]
        if old is not None:
            records[name] = replace(old, error=failure)
        else:
            kind = RenderCapabilities if name in self.renders else EngineCapabilities
            records[name] = kind(name, probed_at=self._clock(), error=failure)

    def _schedule(self, name: str, failure: str | None) -> None:
        s, due = self._settings, self._due[name]
        if failure is None:
            self._due[name] = _Due(self._clock() + s.interval_s)
            return
        backoff = min(max(due.backoff_s * 2, s.retry_min_s), s.retry_max_s)
        self._due[name] = _Due(self._clock() + backoff, backoff)

    # -- what the records decide

    def reference(self) -> tuple[int, ...] | None:
        renders = {name: r.canary if r is not None else None for name, r in self.renders.items()}
        return canary_reference(renders, (r.canary for r in self.engines.values() if r is not None))

    def decide(self) -> None:
        reference = self._reference = self.reference()
        for name, render in self.renders.items():
            used = render is None or render.canary is None or reference is None or render.canary == reference
            if self.render_used.get(name, True) != used:
                if used:
                    log.info("render %s: its canary agrees again; used", name)
                else:
                    log.error("render %s: tokenizer mismatch (its canary ids differ from the engines'); not used", name)
            self.render_used[name] = used
            if self._tokenization.pool is not None:
                self._tokenization.pool.hold_out(name, not used)
        native_allowed = not self._config.obfuscation.enable
        for address, (pool, instance) in self._instances.items():
            record = self.engines[address]
            verdict = assess(
                record, self._expected(pool, instance), self._settings.on_mismatch, reference, native_allowed
            )
            self._apply(address, Role(pool.role), verdict)

    def _expected(self, pool: PoolConfig, instance: InstanceConfig) -> Expected:
        """What the config says: the model, its context, the pool's block size, and the hash
        the prefix index computes when the instance's KV events feed it."""
        events = instance.kv_events is not None and self._config.scheduler.prefix_source == "kv_events"
        model = self._config.model
        return Expected(model.served_name, model.max_model_len, pool.block_size, "sha256_cbor" if events else None)

    def _apply(self, address: str, role: Role, verdict: Assessment) -> None:
        before = self.assessments.get(address)
        self.assessments[address] = verdict
        adopted = verdict.adopted
        context = adopted.get("max_model_len")
        self._scheduler.set_capabilities(
            address, verdict.held_out, verdict.token_only, context if isinstance(context, int) else None
        )
        record = self.engines[address]
        if record is not None and verdict.routes:  # its models and adapters, as it lists them
            self._catalog.listed(address, [dict(card) for card in record.model_cards], record.system_fingerprint)
            self._scheduler.lora.set_registered(address, record.lora_adapters, self._lora_marks.get(address))
        elif record is None or record.error is None:
            # held out for what it serves; one out only for a failure keeps its listing (a
            # request for one of its adapters gets a 503 while it is down, not a 404)
            self._catalog.forget(address)
            self._scheduler.lora.set_registered(address, ())
        block = adopted.get("block_size")
        if isinstance(block, int) and not self._others_use(address, role, self._scheduler.block_size(role)):
            self._scheduler.adopt_block_size(role, block)  # no engine of the pool hashes the configured size
        index_size = self._scheduler.block_size(role)
        unlike_index = "hash_algo" in adopted or (record is not None and record.block_size not in (None, index_size))
        self._scheduler.ignore_kv_events(address, verdict.routes and index_size is not None and unlike_index)
        if before != verdict:
            self._log(address, verdict)

    def _others_use(self, address: str, role: Role, block_size: int | None) -> bool:
        """Another engine of the role's pool hashes blocks of this size and routes, or is out
        only for a failure (an outage does not change the pool's index under it)."""
        for instance in self._scheduler.pools[role].instances:
            record, verdict = self.engines.get(instance.address), self.assessments.get(instance.address)
            if instance.address == address or record is None or verdict is None:
                continue
            member = verdict.routes or (record.error is not None and record.complete)
            if member and record.block_size == block_size:
                return True
        return False

    def _log(self, address: str, verdict: Assessment) -> None:
        if not verdict.routes:
            log.warning("engine %s held out: %s", address, verdict.held_out)
            return
        path = "token-only" if verdict.token_only else "native (no token-only generate)"
        adopted = "; adopted " + ", ".join(verdict.differences) if verdict.adopted else ""
        log.info("engine %s routes, %s%s", address, path, adopted)

    # -- what operators see

    def ready(self) -> bool:
        return not self.unready()

    def unready(self) -> dict[str, str]:
        """The pools none of whose engines routes, each with why (`/ready` names them)."""
        return unready_pools(
            {
                pool.name: {instance.address: self._held_out(instance.address) for instance in pool.instances}
                for pool in self._scheduler.pools.values()
            }
        )

    def _held_out(self, address: str) -> str | None:
        verdict = self.assessments.get(address)
        if verdict is None:
            return "no capability record: not probed yet"
        return None if verdict.routes else verdict.held_out

    def snapshot(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "on_mismatch": self._settings.on_mismatch,
            # what each pool's prefix index hashes in (the config's, or adopted from its engines)
            "block_sizes": {role.value: self._scheduler.block_size(role) for role in self._scheduler.pools},
            "engines": {address: self.describe_engine(address) for address in self.engines},
            "render": {name: self.describe_render(name) for name in self.renders},
        }

    def describe_engine(self, address: str) -> dict[str, Any]:
        record = self.engines[address]
        verdict = self.assessments.get(address)
        out: dict[str, Any] = {"complete": record is not None and record.complete}
        if record is not None:
            out |= {
                "version": record.version,
                "served_models": list(record.served_models),
                "root": record.root,
                "max_model_len": record.max_model_len,
                "lora_adapters": list(record.lora_adapters),
                "block_size": record.block_size,
                "hash_algo": record.hash_algo,
                "kv_event_sources": list(record.kv_event_sources),
                "token_only": record.token_only.value,
                "tokenizer": self._tokenizer(record.canary),
                "age_s": round(self._clock() - record.probed_at, 3),
                "error": record.error,
            }
        if verdict is not None:
            out |= {
                "routes": verdict.routes,
                "path": "token_only" if verdict.token_only else "native",
                "differences": list(verdict.differences),
                "adopted": dict(verdict.adopted),
                "held_out": verdict.held_out,
            }
        return out

    def describe_render(self, name: str) -> dict[str, Any]:
        record = self.renders[name]
        out: dict[str, Any] = {"used": self.render_used.get(name, True)}
        if record is not None:
            out |= {
                "version": record.version,
                "served_models": list(record.served_models),
                "max_model_len": record.max_model_len,
                "tokenizer": self._tokenizer(record.canary),
                "canary_ids": len(record.canary or ()),
                "error": record.error,
            }
        return out

    def _tokenizer(self, canary: tuple[int, ...] | None) -> str:
        if canary is None:
            return "unchecked"
        return "agrees" if canary == self._reference else "mismatch"
