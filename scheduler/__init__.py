"""Pure scheduling: instances and pools in, a dispatch decision out. No I/O, no asyncio."""

from scheduler.breaker import BreakerConfig, BreakerState, CircuitBreaker
from scheduler.context_budget import ContextOverflow, clamp_max_tokens
from scheduler.dispatch import Decision, Pick, Rejection, Scheduler, ScheduleRequest
from scheduler.engine_load import EngineLoad, EngineLoads
from scheduler.flow_queue import FlowQueue, Waiting
from scheduler.instances import Capability, Instance, Pool, Role
from scheduler.kv_block_hash import BlockHasher
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from scheduler.ledger import Lease, TokenLedger
from scheduler.lora import AdapterPlacement
from scheduler.policies import AffinityWeights, Candidate, KvCacheAffinity, LoadBalance, Policy, RoundRobin, make_policy
from scheduler.prefix_index import PrefixIndex, block_hashes

__all__ = [
    "FlowQueue",
    "Waiting",
    "AdapterPlacement",
    "AffinityWeights",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "BreakerConfig",
    "BreakerState",
    "Candidate",
    "Capability",
    "CircuitBreaker",
    "ContextOverflow",
    "Decision",
    "EngineLoad",
    "EngineLoads",
    "Instance",
    "KvCacheAffinity",
    "Lease",
    "LoadBalance",
    "Pick",
    "Policy",
    "Pool",
    "PrefixIndex",
    "Rejection",
    "Role",
    "RoundRobin",
    "ScheduleRequest",
    "Scheduler",
    "TokenLedger",
    "block_hashes",
    "clamp_max_tokens",
    "make_policy",
]
