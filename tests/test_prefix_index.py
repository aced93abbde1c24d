"""The prefix cache's bookkeeping alone: the index a stage keeps, and the stage core's use of
it across a pipeline, without MLX or gRPC (``tests/test_prefix_cache.py`` runs the arrays).

The index decides which kept prefix a request starts from and what is evicted; the core
forwards the first stage's choice (its length and digest) and a later stage either follows
it with its own slot or refuses the request as CACHE_MISS, which the origin runs again
without the cache.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.core import StageCore
from meshd.inference.stage.prefix import PrefixIndex, common_prefix, prefix_digest, token_bytes
from meshd.inference.stage_events import (
    ActivationFrame,
    Advanced,
    DropSlots,
    EndFrame,
    FailureKind,
    Finish,
    Hidden,
    Release,
    RequestStart,
    Sampled,
    SendActivation,
    SendFailure,
    SendToken,
    StartFrame,
    TokenFrame,
    request_steps,
)
from tests.test_stage_core import plan_of  # the same hand-made plans

pytestmark = pytest.mark.unit

T0 = 100.0
SYSTEM = tuple(range(10, 40))


# --- The index ----------------------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=3000),
    st.lists(st.integers(0, 2**32 - 1), max_size=50),
    st.integers(0, 3000),
)
def test_common_prefix_is_the_number_of_equal_leading_tokens(shared, tail, cut):
    a = shared + tail
    b = shared[:cut] + [t ^ 1 for t in shared[cut : cut + 1]] + shared[cut + 1 :]
    expected = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert common_prefix(token_bytes(a), token_bytes(b)) == expected


def test_the_longest_shared_prefix_wins_within_the_limit():
    index = PrefixIndex(trimmable=True)
    _short, _ = index.insert(SYSTEM)
    long, _ = index.insert((*SYSTEM, 1, 2, 3, 4))
    assert index.ids() == [long]  # it extends the short one: that one goes
    slot, length = index.lookup(token_bytes((*SYSTEM, 1, 2, 9)), limit=100)
    assert (slot.slot_id, length) == (long, len(SYSTEM) + 2)
    _, length = index.lookup(token_bytes((*SYSTEM, 1, 2, 3, 4)), limit=len(SYSTEM) + 3)
    assert length == len(SYSTEM) + 3  # the request keeps its last position to compute
    assert index.lookup(token_bytes((7, 8, 9)), limit=10) is None
    assert (index.stats.lookups, index.stats.hits) == (3, 2)


def test_conversations_that_share_a_system_prompt_each_keep_their_slot():
    index = PrefixIndex(trimmable=True)
    a, _ = index.insert((*SYSTEM, 1, 1, 1))
    b, replaced = index.insert((*SYSTEM, 2, 2))
    assert replaced == [] and index.ids() == [a, b]
    slot, _ = index.lookup(token_bytes((*SYSTEM, 1, 1, 1, 5)), limit=99)
    assert slot.slot_id == a


def test_caches_that_cannot_be_cut_reuse_only_a_whole_slot():
    index = PrefixIndex(trimmable=False)
    kept, _ = index.insert((*SYSTEM, 1, 2))
    assert index.lookup(token_bytes((*SYSTEM, 1, 3)), limit=99) is None
    slot, length = index.lookup(token_bytes((*SYSTEM, 1, 2, 3)), limit=99)
    assert (slot.slot_id, length) == (kept, len(SYSTEM) + 2)
    other, replaced = index.insert((*SYSTEM, 1, 2, 3, 4))
    assert replaced == [] and set(index.ids()) == {kept, other}  # a shorter one stays useful


def test_a_request_takes_a_slot_it_extends_and_copies_one_it_departs_from():
    index = PrefixIndex(trimmable=True)
    kept, _ = index.insert((*SYSTEM, 1, 2, 3))
    slot, length = index.lookup(token_bytes((*SYSTEM, 1, 2, 3, 4)), limit=99)
    use, dropped = index.use(slot, length, room=None)
    assert use.take and use.slot == kept and index.ids() == [] and dropped == []
    kept, _ = index.insert((*SYSTEM, 1, 2, 3))
    slot, length = index.lookup(token_bytes((*SYSTEM, 9)), limit=99)
    use, _ = index.use(slot, length, room=None)
    assert not use.take and use.length == len(SYSTEM) and index.ids() == [kept]
    assert index.evict_to(0) == []  # pinned until the engine copied it
    index.unpin(kept)
    assert index.evict_to(0) == [kept] and index.tokens == 0


def test_without_room_for_a_copy_the_request_takes_the_slot():
    index = PrefixIndex(trimmable=True)
    other, _ = index.insert((1, 2, 3, 4, 5, 6))
    _kept, _ = index.insert((*SYSTEM, 1, 2, 3))
    slot, length = index.lookup(token_bytes((*SYSTEM, 9)), limit=99)
    use, dropped = index.use(slot, length, room=len(SYSTEM))
    assert dropped == [other]  # least recently used first
    assert use.take and index.ids() == []


def test_eviction_is_least_recently_used_and_bounded_by_slots():
    index = PrefixIndex(trimmable=True, max_slots=2)
    _first, _ = index.insert((1, 1))
    second, _ = index.insert((2, 2))
    index.lookup(token_bytes((1, 1, 5)), limit=9)
    slot, length = index.lookup(token_bytes((1, 1, 5)), limit=9)
    index.use(slot, length, room=None)  # takes it (extends it whole)
    third, _ = index.insert((3, 3))
    fourth, _ = index.insert((4, 4))
    assert index.evict_to(None) == [second] and index.ids() == [third, fourth]
    assert index.evict_to(2) == [third] and index.tokens == 2


def test_a_later_stage_finds_its_slot_by_the_digest_of_the_kept_positions():
    index = PrefixIndex(trimmable=True)
    kept, _ = index.insert((*SYSTEM, 1, 2, 3))
    digest = prefix_digest((*SYSTEM, 1), len(SYSTEM) + 1)
    assert index.follow(digest, len(SYSTEM) + 1).slot_id == kept
    assert index.follow(prefix_digest((*SYSTEM, 2), len(SYSTEM) + 1), len(SYSTEM) + 1) is None
    assert index.stats.misses_followed == 1


def test_steps_after_a_kept_prefix_cover_only_the_rest():
    assert request_steps(10, 0, 4) == (4, 4, 1, 1)
    assert request_steps(10, 0, 4, reuse=6) == (3, 1)
    assert request_steps(10, 3, 4, reuse=9) == (1, 1, 1, 1)
    assert request_steps(10, 3, 4, reuse=11) == (1, 1)
    with pytest.raises(ValueError, match="cannot reuse"):
        request_steps(10, 0, 4, reuse=10)


# --- The core, over a pipeline of two stages ----------------------------------------------------


def start_of(prompt: tuple[int, ...], **fields) -> RequestStart:
    return RequestStart(
        origin="o",
        prompt=prompt,
        prompt_length=len(prompt),
        sampling=SamplingParams(max_tokens=3),
        eos_ids=frozenset({99}),
        prefill_chunk=8,
        **fields,
    )


class Pipeline:
    """Stages a (first) and b (last) of one plan, their frames carried by hand."""

    def __init__(self, *, b_keeps: bool = True) -> None:
        self.plan = plan_of("p", "a", "b")
        self.a = StageCore("a")
        self.b = StageCore("b", prefix_cache=b_keeps)
        for core in (self.a, self.b):
            core.add_plan(self.plan)
            core.plan_loaded("p", prefix_trimmable=True)
        self.actions: list = []

    def run(self, request: str, prompt: tuple[int, ...], **fields) -> list:
        """One request to its end (its tokens 5, 6 then the max_tokens-th): every action."""
        actions = self.a.on_start(
            StartFrame("o", "p", request, start_of(prompt, **fields)), None, T0
        )
        forwarded = None
        for _ in range(50):
            moved = False
            for work in self.a.next_batch(T0):
                moved = True
                for action in self.a.on_computed(work, Hidden(f"h{work.step}", 0.0), T0):
                    actions.append(action)
                    if isinstance(action, SendActivation):
                        forwarded = action.start or forwarded
                        frame = ActivationFrame(
                            "a",
                            "p",
                            request,
                            action.step,
                            "x",
                            0.0,
                            action.start,
                            tokens=work.positions,
                        )
                        actions += self.b.on_activation(frame, None, T0)
            for work in self.b.next_batch(T0):
                moved = True
                result = Sampled(5 + work.step, b"", 0.0) if work.head else Advanced(0.0)
                for action in self.b.on_computed(work, result, T0):
                    actions.append(action)
                    if isinstance(action, SendToken) and "a" in action.to:
                        frame = TokenFrame(
                            "b", "p", request, action.token_id, action.index, action.finish
                        )
                        actions += self.a.on_token(frame, None, T0)
            if not moved:
                break
        actions += self.a.on_end(EndFrame("o", "p", request))
        self.forwarded = forwarded
        return actions


def test_the_second_stage_follows_the_first_and_both_keep_the_same_sequence():
    pipeline = Pipeline()
    prompt = (*SYSTEM, 1, 2)
    first = pipeline.run("r1", prompt)
    kept = [a for a in first if isinstance(a, Release) and a.keep_as is not None]
    assert len(kept) == 2 and {a.positions for a in kept} == {len(prompt) + 2}
    answer = tuple(a.token_id for a in first if isinstance(a, SendToken))
    second = pipeline.run("r2", (*prompt, *answer, 9))
    assert pipeline.forwarded.reuse == len(prompt) + 2  # prompt and 2 of its 3 tokens
    assert pipeline.forwarded.prompt == ()  # the prefix travels as its length and digest
    tokens = [a for a in second if isinstance(a, SendToken)]
    assert tokens[0].cached == len(prompt) + 2 and all(t.cached == 0 for t in tokens[1:])
    assert not [a for a in second if isinstance(a, SendFailure)]
    for core in (pipeline.a, pipeline.b):
        view = core.prefix_view("p")
        assert view is not None and (view.slots, view.hits) == (1, 1)


def test_a_stage_without_the_prefix_refuses_as_a_cache_miss():
    pipeline = Pipeline(b_keeps=False)
    pipeline.run("r1", SYSTEM)
    second = pipeline.run("r2", (*SYSTEM, 3))
    (failure,) = [a for a in second if isinstance(a, SendFailure)]
    assert failure.kind is FailureKind.CACHE_MISS and failure.to == "o"
    assert "keeps no cached prefix" in failure.message


def test_a_request_that_opts_out_neither_reuses_nor_leaves_a_prefix():
    pipeline = Pipeline()
    pipeline.run("r1", SYSTEM)
    actions = pipeline.run("r2", (*SYSTEM, 3), prefix_cache=False)
    assert pipeline.forwarded.reuse == 0
    assert all(a.keep_as is None for a in actions if isinstance(a, Release))
    assert pipeline.a.prefix_view("p").slots == 1


def test_a_plan_within_its_kv_budget_evicts_to_admit():
    """One stage, reserved KV 2 x 64: kept prefixes and the running requests' reservations
    never hold more; the least recently used prefix makes room."""
    plan = replace(plan_of("p", "a"), context_length=64, concurrency=2)
    core = StageCore("a")
    core.add_plan(plan)
    core.plan_loaded("p", prefix_trimmable=True)
    dropped: list[int] = []
    for i in range(5):
        prompt = tuple(range(100 * i, 100 * i + 50))
        actions = core.on_start(StartFrame("o", "p", f"r{i}", start_of(prompt)), None, T0)
        while works := core.next_batch(T0):
            for work in works:
                result = Sampled(7, b"", 0.0) if work.head else Advanced(0.0)
                actions += core.on_computed(work, result, T0)
        dropped += [s for a in actions if isinstance(a, DropSlots) for s in a.slot_ids]
        kept = [a for a in actions if isinstance(a, Release) and a.keep_as is not None]
        assert len(kept) == 1 and kept[0].positions == 52  # the prompt and 2 of 3 tokens
        assert core.prefix_view("p").tokens <= 128
    assert dropped and core.prefix_view("p").evicted == len(dropped)
    assert core.prefix_view("p").slots == 2  # two of 52 fit in 128


def test_the_first_stage_keeps_only_what_every_stage_computed_of_a_request_cut_short():
    """The origin ends a request mid-answer (a stop string, a client gone): the first stage
    may have handed out steps the others never ran, so it keeps only the positions a token
    from the last stage proved (every later stage holds at least those, and can follow)."""
    pipeline = Pipeline()
    prompt = (*SYSTEM, 1, 2)
    a = pipeline.a
    actions = a.on_start(StartFrame("o", "p", "r1", start_of(prompt)), None, T0)
    while works := a.next_batch(T0):  # the prompt, through stage a only
        for work in works:
            actions += a.on_computed(work, Hidden("h", 0.0), T0)
    first = TokenFrame("b", "p", "r1", 5, 0, Finish.NONE)
    actions += a.on_token(first, None, T0)  # token 0 came back: the prompt ran everywhere
    (step,) = a.next_batch(T0)  # its step: handed out, never reaching stage b
    assert step.positions == (5,)
    ended = a.on_end(EndFrame("o", "p", "r1"))
    (release,) = [x for x in ended if isinstance(x, Release)]
    assert (release.positions, release.keep) == (len(prompt) + 1, len(prompt))
    assert a.prefix_view("p").tokens == len(prompt)
