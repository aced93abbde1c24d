"""What this node has loaded for the data plane, and how a new load shares it.

A plan's stage loads on the compute thread, so while a new plan loads, requests of a
draining plan on the same node wait (MLX evaluations stay on one thread). What a load reads
depends on what is here already:

* an installed plan whose stage is identical (same model, layers, embedding and head): the
  new stage adopts its weights and reads nothing;
* else the loaded stage of the same model that shares the most layers with it (an installed
  plan's, or the spare an uninstalled plan left): it takes those layers and reads the rest;
* the tokenizer and config of the last plan, when it ran the same model files.

:class:`LoadedStages` keeps that state for the :class:`meshd.inference.serving.dataplane.DataPlane`
that owns it (it shares the facade's table of installed plans) and counts what each load
read or kept (:class:`StageLoads`, shown by ``meshd status``). All on the asyncio thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshd.inference.assignment import Assignment
from meshd.inference.installed import InstalledPlan
from meshd.inference.stage.engine import StageEngine, StageKey
from meshd.inference.tensor_parallel.engine import TensorParallelEngine
from meshd.runtime.compute import ComputeExecutor

if TYPE_CHECKING:  # the stage model imports mlx-lm: only where a stage is loaded
    from meshd.inference.stage.model import StageModel

SPARE_KEEP_S = 20.0  # how long an uninstalled plan's stage waits for a plan to take it over


@dataclass(frozen=True)
class StageLoads:
    """Stages this node built since it started, and what they read or kept (a stage whose
    layers an installed plan already holds adopts them: nothing is read again)."""

    stage_loads: int = 0
    layers_loaded: int = 0
    bytes_loaded: int = 0
    layers_kept: int = 0


class LoadedStages:
    """The stages and tokenizer this node holds, and the loads that reuse them.

    ``plans`` is the data plane's table of installed plans (shared, not copied: the facade
    adds and removes plans, this reads them); loads run on ``compute``.
    """

    def __init__(
        self,
        node_id: str,
        plans: Mapping[str, InstalledPlan],
        compute: ComputeExecutor,
        tokenizer_folder: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self._tokenizer_folder = tokenizer_folder  # tokenizers kept between processes
        self._plans = plans
        self._compute = compute
        # How this node moved between plans (`meshd status`): replaced whole after each load,
        # read from the trio thread.
        self.loads = StageLoads()
        self._spare: tuple[StageModel, Path] | None = None  # see keep_spare
        self._spare_timer: asyncio.TimerHandle | None = None
        self._tokenizer_cache: tuple[tuple[Any, ...], tuple[Any, dict[str, Any]]] | None = None

    async def tokenizer_for(self, model_dir: Path) -> tuple[Any, dict[str, Any]]:
        """The model's tokenizer and config: the last plan's when it ran the same files (a
        re-plan, a resume after a lost node), else loaded (0.3-1 s for SmolLM2's here: the
        longest part of installing a plan whose layers are mostly kept). mlx-lm's wrapper is
        shared safely: each request streams through its own copy of the detokenizer. A
        tokenizer a daemon loaded before from the same files is read from the model store's
        ``tokenizers`` folder (~0.13 s instead of ~0.5 s of CPU; meshd.models.tokenizer_cache)."""
        key = await asyncio.to_thread(_tokenizer_key, model_dir)
        if self._tokenizer_cache is not None and self._tokenizer_cache[0] == key:
            return self._tokenizer_cache[1]
        loaded = await asyncio.to_thread(_load_tokenizer, model_dir, self._tokenizer_folder)
        self._tokenizer_cache = (key, loaded)
        return loaded

    async def load_engine(self, engine: StageEngine) -> None:
        """Load on the compute thread, sharing weights with an installed identical stage."""
        twin = next(
            (
                p.engine
                for p in self._plans.values()
                if p.engine is not None
                and p.engine is not engine
                and p.engine.key == engine.key
                and not isinstance(p.engine, TensorParallelEngine)  # its weights are elsewhere
            ),
            None,
        )
        # The stage a just-uninstalled plan left (see keep_spare) serves this load or none:
        # either way this node stops holding it now.
        spare, self._spare = self._spare, None
        donors = [] if twin is not None else self._donor_for(engine.key, spare)
        del spare
        await self._compute.run(_load_sharing, engine, twin, donors)
        layers = engine.key.layer_end - engine.key.layer_start
        done = self.loads
        if twin is not None:
            self.loads = replace(done, layers_kept=done.layers_kept + layers)
        else:
            assert engine.stage is not None
            kept, kept_bytes = engine.stage.adopted_layers, engine.stage.adopted_bytes
            self.loads = replace(
                done,
                stage_loads=done.stage_loads + 1,
                layers_loaded=done.layers_loaded + layers - kept,
                bytes_loaded=done.bytes_loaded + engine.weight_bytes - kept_bytes,
                layers_kept=done.layers_kept + kept,
            )

    def _pipeline_engines(self) -> list[tuple[str, StageEngine]]:
        """(plan id, engine) of the installed plans with a pipeline stage here: the stages
        whose weights this process holds (a tensor-parallel stage's live in its runners)."""
        return [
            (plan_id, plan.engine)
            for plan_id, plan in self._plans.items()
            if plan.engine is not None and not isinstance(plan.engine, TensorParallelEngine)
        ]

    def _donor_for(self, key: StageKey, spare: tuple[StageModel, Path] | None) -> list[StageModel]:
        """The loaded stage of the same model that shares the most layers with ``key`` (an
        installed plan's, or ``spare``, the one an uninstalled plan left), as a one-element
        list for load_stage to take its common layers from (empty: none shares any)."""
        candidates = [
            (engine.stage, engine.key.model_dir)
            for _, engine in self._pipeline_engines()
            if engine.stage is not None
        ]
        if spare is not None:
            candidates.append(spare)
        best_common, best = 0, None
        for stage, model_dir in candidates:
            if model_dir != key.model_dir:
                continue
            common = min(key.layer_end, stage.layer_end) - max(key.layer_start, stage.layer_start)
            if common > best_common:
                best_common, best = common, stage
        return [best] if best is not None else []

    def stages_to_free_for(self, assignment: Assignment) -> list[str]:
        """Installed plans whose stage here holds layers ``assignment``'s stage here does not
        run: loading the new stage next to them holds the old and the new weights at once.

        Plans with the same stage, or one that contains the new stage whole (it adopts them
        all, reading nothing), are not in the way; nor are tensor-parallel stages (their
        weights live in runner processes) or plans of another model.
        """
        index = assignment.stage_index(self.node_id)
        if index is None or assignment.stages[index].tensor_parallel:
            return []
        spec = assignment.stages[index]
        in_the_way = []
        for plan_id, engine in self._pipeline_engines():
            if plan_id == assignment.plan_id or engine.key.model_dir != assignment.model_dir:
                continue
            key = engine.key
            contains = (
                key.layer_start <= spec.layer_start
                and spec.layer_end <= key.layer_end
                and (key.has_embedding or not spec.has_embedding)
                and (key.has_head or not spec.has_head)
            )
            if not contains:
                in_the_way.append(plan_id)
        return in_the_way

    def keep_spare(self, plan: InstalledPlan) -> None:
        """An uninstalled plan's loaded stage stays (briefly) for the next plan to take its
        layers from: a lost member withdraws a plan a moment before the next one commits.

        Not when another installed plan still runs a stage here: that plan was loaded (it
        took what it shares already), and the spare would only hold memory the budget does
        not count. Call it once ``plan`` is out of the table of installed plans."""
        engine = plan.engine
        if engine is None or engine.stage is None or isinstance(engine, TensorParallelEngine):
            return
        if self._pipeline_engines():
            return
        self._spare = (engine.stage, engine.key.model_dir)
        if self._spare_timer is not None:
            self._spare_timer.cancel()
        self._spare_timer = asyncio.get_running_loop().call_later(SPARE_KEEP_S, self._drop_spare)

    def close(self) -> None:
        """Hold no spare any more (the node is shutting down)."""
        if self._spare_timer is not None:
            self._spare_timer.cancel()
        self._drop_spare()

    def _drop_spare(self) -> None:
        self._spare = None
        self._spare_timer = None


def _load_sharing(engine: StageEngine, twin: StageEngine | None, donors: list[StageModel]) -> None:
    """Compute thread: load ``engine``, adopting ``twin``'s weights when it has them, else
    taking the layers it shares with ``donors`` (emptied by the load)."""
    engine.load(twin.stage if twin is not None else None, donors)


def _load_tokenizer(model_dir: Path, folder: Path | None) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's tokenizer wrapper (with the config's EOS ids, as mlx_lm.load does), kept in
    ``folder`` between processes, + config."""
    from mlx_lm.utils import load_config

    from meshd.models.tokenizer_cache import load_tokenizer

    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir, config.get("eos_token_id"), folder)
    return tokenizer, config


def _tokenizer_key(model_dir: Path) -> tuple[Any, ...]:
    """What identifies the tokenizer a model folder gives: the folder and the name, size and
    modification time of every file in it but the weights (a folder rewritten with another
    model's files gets another key)."""
    from meshd.models.tokenizer_cache import tokenizer_files

    return (str(Path(model_dir).resolve()), tuple(tokenizer_files(model_dir)))
