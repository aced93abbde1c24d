"""One installed plan as the data plane's roles see it (the facade owns the table of them).

The origin reads a plan's stages, tokenizer and model config; the stage runtime its engine;
the facade loads them and resolves ``ready`` once loaded. All on the asyncio thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshd.inference.assignment import Assignment, StageSpec

if TYPE_CHECKING:  # the engine imports MLX
    from meshd.inference.stage.engine import StageEngine


@dataclass(eq=False)
class InstalledPlan:
    assignment: Assignment
    index: int | None  # this node's stage, None when it holds none
    engine: StageEngine | None
    ready: asyncio.Future[None]  # resolved once the tokenizer and the stage are loaded
    tokenizer: Any = None  # mlx-lm's TokenizerWrapper (chat template included)
    config: dict[str, Any] = field(default_factory=dict)  # the model's config.json

    @property
    def plan_id(self) -> str:
        return self.assignment.plan_id

    def stage(self, index: int) -> StageSpec:
        return self.assignment.stages[index]

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's settings: multimodal configs (e.g. Qwen3.5) nest them under
        ``text_config``; top-level keys fill what it leaves out."""
        nested = self.config.get("text_config")
        return {**self.config, **nested} if isinstance(nested, dict) else self.config

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.get("vocab_size", 0))

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.get("hidden_size", 1))
