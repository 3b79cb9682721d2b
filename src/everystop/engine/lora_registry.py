"""The LoRA adapters an engine serves, by name: the id each request carries (never reused, so
an unloaded adapter's cached K/V can never match a new one), and loading and unloading them
while serving."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from everystop.core.request import Request

if TYPE_CHECKING:
    from everystop.executor.executor import Executor

BASE = -1


class UnknownLoraAdapter(LookupError):
    """A request or an unload named a LoRA adapter this engine does not serve."""


class LoraConflict(RuntimeError):
    """A load under a name already served, or an unload of an adapter requests still use."""


class LoraRegistry:
    def __init__(self, configured: Iterable[tuple[str, str]]) -> None:
        # The executor loaded the configured adapters as ids 0.. in this order.
        self.ids = {name: i for i, (name, _) in enumerate(configured)}
        self.next_id = len(self.ids)

    def names(self) -> list[str]:
        return list(self.ids)

    def id_for(self, name: str) -> int:
        lora_id = self.ids.get(name)
        if lora_id is None:
            raise UnknownLoraAdapter(f"LoRA adapter {name!r} is not served here")
        return lora_id

    def check_served(self, req: Request) -> None:
        """Refuse a request made for an adapter unloaded since (its rows would find none)."""
        if req.lora_id != BASE and req.lora_id not in self.ids.values():
            raise UnknownLoraAdapter(f"request {req.request_id}: its LoRA adapter was unloaded")

    def load(self, name: str, path: str, executor: Executor) -> int:
        """Serve the adapter at `path` as `name`: LoraConflict if the name is taken,
        ValueError naming why the executor cannot load it."""
        from everystop.executor.executor import LoraExecutor

        if name in self.ids:
            raise LoraConflict(f"LoRA adapter {name!r} is already loaded")
        if not isinstance(executor, LoraExecutor):
            raise ValueError("this engine's executor serves no LoRA adapters")
        lora_id = self.next_id
        executor.load_lora(lora_id, path)
        self.next_id += 1
        self.ids[name] = lora_id
        return lora_id

    def unload(self, name: str, live: Iterable[Request], executor: Executor) -> None:
        """Stop serving `name`: refused (LoraConflict) while a live request uses it."""
        from everystop.executor.executor import LoraExecutor

        lora_id = self.id_for(name)
        users = sum(1 for req in live if req.lora_id == lora_id)
        if users:
            raise LoraConflict(f"LoRA adapter {name!r} is in use by {users} request(s); "
                               "unload it when they have finished")
        del self.ids[name]
        if isinstance(executor, LoraExecutor):
            executor.unload_lora(lora_id)
