"""LoRA adapter placement: which instances list an adapter, which run it now, and how well
an instance would take one more request for it.

A vLLM engine batches at most `max_loras` distinct adapters at once; a request for another
one waits until a slot frees. So a request for an adapter is best sent where that adapter
already runs, then where a slot is free. A hot adapter still spreads: an instance with
`spread_requests` of its requests in flight stops being the first choice for more.

What an instance lists comes from its `/v1/models` (or a load the gateway did); what it runs
comes from the leases committed to it. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


class AdapterPlacement:
    def __init__(self, max_loras: int = 1, spread_requests: int = 8) -> None:
        if max_loras < 1 or spread_requests < 1:
            raise ValueError("max_loras and spread_requests must be positive")
        self.max_loras = max_loras
        self.spread_requests = spread_requests
        self._registered: dict[str, frozenset[str]] = {}  # address -> adapters it lists
        # The gateway's own loads, numbered: a listing fetched before a load cannot unlist it
        self._loads = 0
        self._loaded: dict[str, dict[str, int]] = {}  # address -> adapter -> its load's number
        self._leases: dict[str, tuple[str, str]] = {}  # lease id -> (address, adapter)
        self._running: dict[str, Counter[str]] = {}  # address -> adapter -> requests in flight

    # -- what each instance lists -----------------------------------------------------

    def mark(self) -> int:
        """Now, in the gateway's loads: what a listing fetched from here on knows of them."""
        return self._loads

    def set_registered(self, address: str, adapters: Iterable[str], since: int | None = None) -> None:
        """The instance's `/v1/models` lists these adapters (and no others). `since`: the
        `mark()` taken before the listing was fetched; an adapter the gateway loaded after
        it stays listed (the listing may have left before the load)."""
        later = {a for a, n in self._loaded.get(address, {}).items() if since is not None and n > since}
        self._registered[address] = frozenset(adapters) | later

    def add_registered(self, address: str, adapter: str) -> None:
        """The gateway loaded the adapter on the instance."""
        self._loads += 1
        self._loaded.setdefault(address, {})[adapter] = self._loads
        self._registered[address] = self.registered(address) | {adapter}

    def forget(self, address: str) -> None:
        """The instance left the pool: what it lists and what the gateway loaded there go.
        Requests still running there keep their leases until they finish."""
        self._registered.pop(address, None)
        self._loaded.pop(address, None)

    def registered(self, address: str) -> frozenset[str]:
        return self._registered.get(address, frozenset())

    def holders(self, adapter: str) -> set[str]:
        """The instances that list the adapter."""
        return {address for address, adapters in self._registered.items() if adapter in adapters}

    # -- what each instance runs now ------------------------------------------------------

    def started(self, lease_id: str, address: str, adapter: str) -> None:
        self.finished(lease_id)  # a lease id reused: it moves, it is not counted twice
        self._leases[lease_id] = (address, adapter)
        self._running.setdefault(address, Counter())[adapter] += 1

    def finished(self, lease_id: str) -> None:
        """Idempotent: every exit path may call it; an unknown lease is ignored."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        address, adapter = lease
        running = self._running[address]
        running[adapter] -= 1
        if running[adapter] <= 0:
            del running[adapter]  # no longer takes an adapter slot

    def running(self, address: str) -> dict[str, int]:
        """Adapter -> its requests in flight on the instance."""
        return dict(self._running.get(address, {}))

    # -- ranking ---------------------------------------------------------------------------

    def tier(self, address: str, adapter: str) -> int:
        """How well the instance takes one more request for the adapter, lower is better.

        0: it runs the adapter now, with fewer than `spread_requests` of its requests: the
           request joins the running batch.
        1: it does not run it, lists it, and runs fewer than `max_loras` adapters: the
           adapter starts at once.
        2: it does not run it and runs fewer than `max_loras` adapters, but does not list it
           (it must be loaded first); or it runs it with `spread_requests` or more already
           (no wait there, but a free slot elsewhere should take the overflow first).
        3: it does not run it and runs `max_loras` other adapters: the request would wait.
        """
        running = self._running.get(address, Counter())
        if adapter in running:
            return 0 if running[adapter] < self.spread_requests else 2
        if len(running) >= self.max_loras:
            return 3
        return 1 if adapter in self.registered(address) else 2

    def snapshot(self, address: str) -> dict[str, Any]:
        return {"registered": sorted(self.registered(address)), "running": self.running(address)}
