"""Speculative decoding: the first stage drafts from the request's own text, the stages verify.

The pure parts first (the lookup, the first stage's core: which steps carry drafts, how the
accepted ones are counted and the rejected ones rolled back, the last stage's tokens), then
two real stages over gRPC with mutual TLS running the embedded SmolLM2 on a prompt that
invites copying: the same greedy text as without drafts, and drafts were accepted.

What drafts change: a speculative step runs 1 + k positions in one forward pass, so its
hidden states are computed in another shape than k + 1 steps of one position, and OpenBLAS
may round differently in the last bits. A greedy token can differ only where two logits
were that close; the end-to-end test checks the text is the one decoded without drafts.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
from collections.abc import Iterator

import pytest

from meshd.inference.grammar import Constraint
from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.core import StageCore
from meshd.inference.stage.drafting import DraftIndex
from meshd.inference.stage_events import (
    ActivationFrame,
    Advanced,
    Finish,
    Hidden,
    Sampled,
    SendToken,
    StartFrame,
    TokenFrame,
    Verified,
    Work,
)
from meshd.models.store import ModelEntry
from tests.support.dataplane_mesh import LoopThread, Mesh, collect
from tests.test_stage_core import T0, activation, drain, plan_of, start_of

pytestmark = pytest.mark.integration

# --- The lookup -------------------------------------------------------------------------------


def lookup(history: list[int], count: int) -> tuple[int, ...]:
    return DraftIndex(history).drafts(count)


def test_the_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert lookup(history, 2) == (2, 3)  # the latest earlier "5 6 7" came before 2 3
    assert lookup(history, 5) == (2, 3, 5, 6, 7)
    assert lookup([1, 2, 3, 9, 2, 3], 3) == (9, 2, 3)  # two tokens when three never recur
    assert lookup([1, 2, 3, 4], 3) == ()  # nothing recurs: no guess
    assert lookup(history, 0) == ()
    index = DraftIndex([4, 1, 2, 3])
    index.extend([9, 1, 2])  # appended one by one, as the tokens arrive
    assert index.drafts(3) == (3, 9, 1)
    index.append(8)
    assert index.drafts(2) == () and len(index) == 8


# --- The first stage's core -------------------------------------------------------------------

COPY = (10, 11, 12, 13, 14, 15, 10, 11)  # a prompt that repeats itself: drafts 12 13 14 15


def drafting_core(max_tokens: int = 16, **start: object) -> StageCore:
    core = StageCore("a")
    plan = plan_of("p", "a", "b")
    core.add_plan(plan)
    core.plan_loaded("p", draft_tokens=4)
    sampling = SamplingParams(max_tokens=max_tokens)
    core.on_start(
        StartFrame("o", "p", "r", start_of(COPY, chunk=64, sampling=sampling, **start)), None, T0
    )
    assert [w.tokens for w in drain(core)] == [COPY[:-1], COPY[-1:]]  # the prompt: no drafts
    return core


def token(value: int, index: int, finish: Finish = Finish.NONE) -> TokenFrame:
    return TokenFrame("b", "p", "r", value, index, finish)


def next_step(core: StageCore) -> Work:
    (work,) = core.next_batch(T0)
    core.on_computed(work, Hidden(f"h{work.step}", 0.001), T0)
    return work


def test_the_first_stage_drafts_checks_what_comes_back_and_rolls_back_the_rest() -> None:
    core = drafting_core()
    core.on_token(token(12, 0), None, T0)  # the context ends "10 11 12": 13 14 15 10 followed
    work = next_step(core)
    assert (work.tokens, work.drafts, work.rollback) == ((12, 13, 14, 15, 10), (13, 14, 15, 10), 0)
    # The last stage accepted 13 and 14, then gave 7 where the draft said 15.
    assert core.on_token(token(13, 1), None, T0) == []
    assert core.on_token(token(14, 2), None, T0) == []
    assert core.next_batch(T0) == []  # accepted drafts are in the caches: no step for them
    core.on_token(token(7, 3), None, T0)
    work = next_step(core)
    assert work.tokens[0] == 7 and work.rollback == 2  # 15 and 10 are taken back first
    assert work.drafts == ()  # "14 7" never occurred before: no guess this time


def test_every_draft_accepted_then_the_next_token_rolls_back_nothing() -> None:
    core = drafting_core()
    core.on_token(token(12, 0), None, T0)
    assert next_step(core).drafts == (13, 14, 15, 10)
    for index, value in enumerate((13, 14, 15, 10), start=1):
        assert core.on_token(token(value, index), None, T0) == []
    core.on_token(token(11, 5), None, T0)  # the token after the last draft: the next input
    work = next_step(core)
    assert work.tokens[:1] == (11,) and work.rollback == 0 and work.drafts == (12, 13, 14, 15)


def test_no_more_drafts_than_the_request_may_still_generate() -> None:
    core = drafting_core(max_tokens=4)
    core.on_token(token(12, 0), None, T0)
    assert next_step(core).drafts == (13, 14)  # tokens 1 and 2 verified, 3 the last sampled


@pytest.mark.parametrize(
    "start",
    [
        {"sampling": SamplingParams(max_tokens=16, temperature=0.7)},
        {"sampling": SamplingParams(max_tokens=16, repetition_penalty=1.2)},
        {"catch_up": True},
        {"sampling": SamplingParams(max_tokens=16, constraint=Constraint("json_object", "{}"))},
    ],
    ids=["sampled", "repetition-penalty", "catching-up", "grammar"],
)
def test_only_plain_greedy_requests_get_drafts(start: dict) -> None:
    core = StageCore("a")
    core.add_plan(plan_of("p", "a", "b"))
    core.plan_loaded("p", draft_tokens=4)
    core.on_start(StartFrame("o", "p", "r", start_of(COPY, chunk=64, **start)), None, T0)
    drain(core)
    core.on_token(token(12, 0), None, T0)
    assert next_step(core).drafts == ()


def test_a_request_in_company_gets_no_drafts() -> None:
    core = drafting_core()
    other = start_of((1, 2, 3), chunk=64, sampling=SamplingParams(max_tokens=16))
    core.on_start(StartFrame("o", "p", "r2", other), None, T0)
    core.on_token(token(12, 0), None, T0)
    works = core.next_batch(T0, max_items=4)
    assert all(w.drafts == () for w in works)  # the two decode batched instead


def test_a_single_stage_drafts_on_its_compute_thread_where_its_next_input_is() -> None:
    core = StageCore("a")
    core.add_plan(plan_of("p", "a"))
    core.plan_loaded("p", draft_tokens=4)
    start = start_of(COPY, chunk=64, sampling=SamplingParams(max_tokens=16))
    core.on_start(StartFrame("o", "p", "r", start), None, T0)
    (prefill,) = core.next_batch(T0)
    core.on_computed(prefill, Advanced(0.0), T0)
    (last,) = core.next_batch(T0)
    assert last.sampler is not None and last.sampler.draft
    (follows,) = core.next_batch(T0)  # handed out behind the step whose token it follows
    assert follows.follows and follows.draft_limit == 4 and follows.drafts == ()
    assert prefill.draft_limit == 0 and last.draft_limit == 0
    actions = core.on_computed(last, Sampled(12, b"", 0.01), T0)
    assert [a.token_id for a in actions if isinstance(a, SendToken)] == [12]
    actions = core.on_computed(follows, Verified((13, 14, 7), 0.02), T0)
    sent = [(a.token_id, a.index) for a in actions if isinstance(a, SendToken)]
    assert sent == [(13, 1), (14, 2), (7, 3)]  # its own drafts, verified on its thread


def test_a_later_stage_never_drafts() -> None:
    later = StageCore("b")
    later.add_plan(plan_of("p", "a", "b", "c"))
    later.plan_loaded("p", draft_tokens=4)
    assert later._plans["p"].draft_tokens == 0


def test_the_last_stage_sends_the_verified_tokens_in_order_counting_compute_once() -> None:
    core = StageCore("b")
    core.add_plan(plan_of("p", "a", "b"))
    core.plan_loaded("p")
    sampling = SamplingParams(max_tokens=16)
    start = start_of((1, 2), chunk=8, sampling=sampling, forwarded=True)
    core.on_activation(activation("p", "r", 0, "a", start), None, T0)
    (prefill,) = core.next_batch(T0)
    core.on_computed(prefill, Advanced(0.0), T0)
    core.on_activation(activation("p", "r", 1, "a"), None, T0)
    (last_prompt,) = core.next_batch(T0)
    core.on_computed(last_prompt, Sampled(5, b"", 0.02), T0)
    speculative = ActivationFrame("a", "p", "r", 2, "payload-2", 0.01, None, 0, (6, 7, 8))
    core.on_activation(speculative, None, T0)
    (work,) = core.next_batch(T0)
    assert work.drafts == (6, 7, 8) and work.head
    actions = core.on_computed(work, Verified((6, 7, 9), 0.03), T0)
    tokens = [a for a in actions if isinstance(a, SendToken)]
    assert [(t.token_id, t.index, t.compute_s) for t in tokens] == [
        (6, 1, 0.03),
        (7, 2, 0.0),
        (9, 3, 0.0),
    ]
    assert all(t.to == ("o", "a") for t in tokens)


def test_the_last_stage_stops_at_an_eos_inside_the_verified_tokens() -> None:
    core = StageCore("b")
    core.add_plan(plan_of("p", "a", "b"))
    core.plan_loaded("p")
    start = start_of((1, 2), chunk=8, sampling=SamplingParams(max_tokens=16), forwarded=True)
    core.on_activation(activation("p", "r", 0, "a", start), None, T0)
    (prefill,) = core.next_batch(T0)
    core.on_computed(prefill, Advanced(0.0), T0)
    core.on_activation(activation("p", "r", 1, "a"), None, T0)
    (work,) = core.next_batch(T0)
    actions = core.on_computed(work, Verified((6, 99, 7), 0.03), T0)  # 99 is the EOS
    tokens = [a for a in actions if isinstance(a, SendToken)]
    assert [(t.token_id, t.finish) for t in tokens] == [(6, Finish.NONE), (99, Finish.EOS)]


# --- Real stages over gRPC -------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    loop = LoopThread()
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        built.add_node("n1", draft_tokens=4)
        built.add_node("n2")
        yield built
    finally:
        built.close()
        loop.close()


@pytest.mark.parametrize(
    "layout",
    [[("n1", (0, 15)), ("n2", (15, 30))], [("n1", (0, 30))]],
    ids=["two-stages", "one-stage"],
)
def test_smollm2_with_drafts_gives_the_greedy_text_without_them(
    mesh: Mesh, default_model_entry: ModelEntry, layout: list
) -> None:
    """A prompt that invites copying, greedy: the same tokens with drafts as without, and
    drafts were accepted (counted where they are verified: the last stage)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_dir = default_model_entry.path
    tokenizer = load_tokenizer(model_dir)
    code = "def add_numbers(a, b):\n    reslt = a + b\n    return reslt\n"
    ask = f"Fix the typo in this code and show the whole corrected function:\n{code}"
    messages = [{"role": "user", "content": ask}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    params = SamplingParams(max_tokens=48)
    last = layout[-1][0]

    def run(request_id: str) -> tuple[list[int], tuple[int, int]]:
        assignment = mesh.assignment_for(model_dir, layout)
        mesh.install(assignment)
        try:
            plane = mesh.nodes["n1"].plane

            async def generate() -> tuple[list, object]:
                stream = plane.generate(assignment.plan_id, prompt, params, request_id=request_id)
                return await collect(stream)

            tokens, final = mesh.loop.run(generate())
            assert not isinstance(final, Exception), final
            mesh.wait_all_freed(assignment.plan_id)
            stats = mesh.loop.run(_stats(mesh, assignment.plan_id))
            return [t.token_id for t in tokens], stats[last]
        finally:
            mesh.uninstall(assignment.plan_id)

    drafted, (drafted_tokens, accepted_tokens) = run(f"with-drafts-{len(layout)}")
    assert 0 < accepted_tokens <= drafted_tokens
    print(f"drafts: {accepted_tokens} of {drafted_tokens} accepted over {len(drafted)} tokens")
    origin = mesh.nodes["n1"].plane
    origin.draft_tokens = 0  # the same plan without drafts
    try:
        plain, plain_counts = run(f"without-drafts-{len(layout)}")
    finally:
        origin.draft_tokens = 4
    assert plain_counts == (0, 0)
    assert drafted == plain
    assert "def add_numbers(a, b):" in tokenizer.decode(drafted)  # it did copy


async def _stats(mesh: Mesh, plan_id: str) -> dict[str, tuple[int, int]]:
    await asyncio.sleep(0)
    return {
        node_id: next(
            (
                (p.drafted_tokens, p.accepted_tokens)
                for p in node.plane.stats().plans
                if p.plan_id == plan_id
            ),
            (0, 0),
        )
        for node_id, node in mesh.nodes.items()
    }
