"""llama.cpp stacks a layer's experts into one tensor per projection (`ffn_gate_exps`: [E, I, H]),
where a Hugging Face checkpoint names every expert's matrix on its own. `ExpertSlices` serves
the per-expert names (`...experts.{e}.{proj}.weight`) as row ranges of the stacked tensor,
which is read from the file once."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from everystop.executor.layers.quant import QuantizedTensor
from everystop.executor.models.errors import ModelLoadError

_EXPERT = re.compile(r"^(?P<head>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)\.weight$")


class ExpertSlices:
    """Wraps a getter of tensors by name: a per-expert name not found is looked up as its
    stacked tensor (`...experts.{proj}.weight`, [E * rows, cols] as read) and cut to expert
    e's rows. The last `keep` stacked tensors stay at hand (a fused gate/up weight asks for
    gate and up of expert 0, then of expert 1, ...): each is read once."""

    def __init__(self, get: Callable[[str], Any], num_experts: int, keep: int = 2) -> None:
        self._get = get
        self._num_experts = num_experts
        self._keep = keep
        self._recent: OrderedDict[str, Any] = OrderedDict()

    def __call__(self, name: str) -> Any:
        match = _EXPERT.match(name)
        if match is None or self._num_experts == 0:
            return self._get(name)
        stacked_name = f"{match['head']}.{match['proj']}.weight"
        stacked = self._recent.get(stacked_name)
        if stacked is None:
            stacked = self._get(stacked_name)
            if not isinstance(stacked, QuantizedTensor) and stacked.dim() == 3:
                stacked = stacked.reshape(-1, stacked.shape[-1])  # [E, rows, cols] -> 2-D
            if stacked.shape[0] % self._num_experts:
                raise ModelLoadError(f"{stacked_name} has {stacked.shape[0]} rows, not a "
                                     f"multiple of {self._num_experts} experts")
            self._recent[stacked_name] = stacked
            while len(self._recent) > self._keep:
                self._recent.popitem(last=False)
        rows = stacked.shape[0] // self._num_experts
        e = int(match["index"])
        if e >= self._num_experts:
            raise KeyError(name)
        if isinstance(stacked, QuantizedTensor):
            return stacked.rows(e * rows, rows)
        return stacked[e * rows:(e + 1) * rows]
