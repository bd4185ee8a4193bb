"""The base of every config section (`ext_proc/config.py` and its `config_*.py` modules):
a pydantic model that refuses keys it does not define, so a misspelt key fails at start-up
instead of being ignored. It is a module of its own because every config module builds on
it and `config.py` imports the others (a base defined there would be an import cycle)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
