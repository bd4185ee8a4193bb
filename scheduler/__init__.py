"""Pure scheduling: instances and pools in, a dispatch decision out. No I/O, no asyncio."""

from scheduler.dispatch import Decision, ScheduleRequest, Scheduler
from scheduler.instances import Instance, Pool, Role
from scheduler.policies import Policy, RoundRobin, make_policy

__all__ = [
    "Decision",
    "Instance",
    "Policy",
    "Pool",
    "Role",
    "RoundRobin",
    "ScheduleRequest",
    "Scheduler",
    "make_policy",
]
