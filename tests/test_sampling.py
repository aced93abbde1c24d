"""Per-request sampling: seeded determinism, filters, stop strings and parameter validation."""

import math
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from meshd.inference.sampling import (
    MAX_TOKENS_LIMIT,
    SAMPLING_FIELDS,
    SamplingParams,
    StopChecker,
    TokenSampler,
    sampling_from_message,
    sampling_to_message,
)
from tests.support.random_model import write_byte_level_tokenizer

pytestmark = pytest.mark.unit

VOCAB = 300


def random_logits(step: int) -> mx.array:
    """Varied logits of one decode step, fixed per step (independent of global state)."""
    return 2.0 * mx.random.normal((1, VOCAB), key=mx.random.key(1000 + step))


def sample_run(params: SamplingParams, steps: int = 40) -> list[int]:
    sampler = TokenSampler(params)
    generated: list[int] = []
    for step in range(steps):
        generated.append(sampler.sample(random_logits(step), generated))
    return generated


def test_same_seed_same_tokens_and_global_random_state_is_irrelevant() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42)
    first = sample_run(params)
    mx.random.seed(7)
    mx.eval(mx.random.uniform(shape=(10,)))
    assert sample_run(params) == first
    assert len(set(first)) > 10


def test_different_seeds_give_different_tokens() -> None:
    runs = {tuple(sample_run(SamplingParams(temperature=1.0, seed=seed))) for seed in range(4)}
    assert len(runs) == 4


def test_no_seed_draws_a_fresh_one_and_reports_it() -> None:
    first, second = TokenSampler(SamplingParams(temperature=1.0)), TokenSampler(SamplingParams())
    assert first.seed != second.seed
    replay = TokenSampler(SamplingParams(temperature=1.0, seed=first.seed))
    logits = random_logits(0)
    assert [first.sample(logits, []) for _ in range(5)] == [
        replay.sample(logits, []) for _ in range(5)
    ]


def test_greedy_is_argmax() -> None:
    sampler = TokenSampler(SamplingParams(temperature=0.0))
    for step in range(10):
        logits = random_logits(step)
        assert sampler.sample(logits, []) == mx.argmax(logits).item()


@pytest.mark.parametrize(
    "filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_tight_filters_leave_only_the_best_token(filters: dict[str, Any]) -> None:
    sampler = TokenSampler(SamplingParams(temperature=1.5, seed=3, **filters))
    for step in range(10):
        logits = random_logits(step)
        assert sampler.sample(logits, []) == mx.argmax(logits).item()


def test_top_k_samples_only_among_the_k_best() -> None:
    logits = random_logits(0)
    best_five = set(mx.argsort(-logits[0])[:5].tolist())
    sampler = TokenSampler(SamplingParams(temperature=5.0, top_k=5, seed=11))
    drawn = {sampler.sample(logits, []) for _ in range(100)}
    assert drawn <= best_five and len(drawn) > 1


def test_temperature_sampling_follows_softmax() -> None:
    logits = mx.array([[0.0, math.log(3.0)] + [-1e9] * (VOCAB - 2)])
    sampler = TokenSampler(SamplingParams(temperature=1.0, seed=5))
    draws = [sampler.sample(logits, []) for _ in range(1000)]
    assert set(draws) <= {0, 1}
    assert 0.70 < draws.count(1) / len(draws) < 0.80  # expected 0.75, sd ~0.014


def test_repetition_penalty_moves_greedy_off_a_repeated_token() -> None:
    logits = mx.zeros((1, VOCAB))
    logits[0, 7] = 2.0
    logits[0, 9] = 1.5
    plain = TokenSampler(SamplingParams())
    penalized = TokenSampler(SamplingParams(repetition_penalty=1.5))
    assert plain.sample(logits, [7, 7]) == 7
    assert penalized.sample(logits, [7, 7]) == 9
    assert penalized.sample(logits, []) == 7


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", 1.1, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("seed", -3, "seed"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", MAX_TOKENS_LIMIT + 1, "max_tokens"),
        ("stop", ("",), "stop string"),
        ("stop", ["x"], "tuple"),
    ],
)
def test_invalid_parameters_are_rejected(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tokenizer")
    write_byte_level_tokenizer(path, VOCAB)
    return load_tokenizer(path)


def stream(tokenizer: Any, text: str, stop: tuple[str, ...]) -> tuple[list[str], bool, str]:
    """Feed ``text`` token by token; the emitted pieces, whether it stopped, and the total."""
    checker = StopChecker(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text):
        update = checker.add_token(token)
        pieces.append(update.text)
        if update.stopped:
            return pieces, True, checker.text
    pieces.append(checker.finish().text)
    return pieces, False, checker.text


def test_stop_string_is_trimmed_and_ends_the_stream(tokenizer: Any) -> None:
    pieces, stopped, text = stream(tokenizer, "Hello world. STOP and more", ("STOP",))
    assert stopped
    assert text == "Hello world. "
    assert "".join(pieces) == text


def test_text_that_only_starts_like_a_stop_string_is_released(tokenizer: Any) -> None:
    pieces, stopped, text = stream(tokenizer, "a STAR is not a STOP", ("STOP", "zzz"))
    assert stopped and text == "a STAR is not a "
    pieces, stopped, text = stream(tokenizer, "ends with ST", ("STOP",))
    assert not stopped and text == "ends with ST"
    assert pieces[-1].endswith("ST"), "the held-back prefix comes out at finish"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    _, stopped, text = stream(tokenizer, "one\n\ntwo END three", ("END", "\n\n"))
    assert stopped and text == "one"


def test_without_stop_strings_everything_streams(tokenizer: Any) -> None:
    pieces, stopped, text = stream(tokenizer, "plain text, ünïcode too", ())
    assert not stopped and text == "plain text, ünïcode too" and "".join(pieces) == text


def test_concurrent_requests_have_independent_stop_checkers(tokenizer: Any) -> None:
    """Each checker gets its own copy of the streaming detokenizer from the wrapper."""
    first, second = StopChecker(tokenizer, ("!",)), StopChecker(tokenizer, ())
    for a, b in zip(tokenizer.encode("abc!def"), tokenizer.encode("xyz wvu"), strict=True):
        first.add_token(a)
        second.add_token(b)
    second.finish()
    assert first.stopped and first.text == "abc"
    assert second.text == "xyz wvu"


# --- Wire forms -------------------------------------------------------------------------------


def test_both_sampling_messages_carry_exactly_the_dataclass_fields() -> None:
    """One field list, derived from SamplingParams: a field added to one shape and not the
    others fails here instead of being dropped on the way."""
    from meshd.wire import dataplane_pb2, pb

    api_fields = set(pb.Sampling.DESCRIPTOR.fields_by_name)
    plane_fields = set(dataplane_pb2.Sampling.DESCRIPTOR.fields_by_name)
    assert api_fields == {*SAMPLING_FIELDS, "stop"}
    # Stop strings stay with the origin; a constraint (structured outputs) goes to the stages.
    assert plane_fields == {*SAMPLING_FIELDS, "constraint"}


def test_settings_survive_both_wire_forms() -> None:
    from meshd.wire import dataplane_pb2, pb

    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=2**62,
        max_tokens=99, stop=("END", "\n\n"),
    )  # fmt: skip
    assert sampling_from_message(sampling_to_message(params, pb.Sampling())) == params
    plane = sampling_from_message(sampling_to_message(params, dataplane_pb2.Sampling()))
    assert plane == SamplingParams(**{**vars(params), "stop": ()})


def test_unset_api_fields_take_the_defaults_and_bad_ones_are_refused() -> None:
    from meshd.wire import pb

    assert sampling_from_message(pb.Sampling()) == SamplingParams()
    assert sampling_from_message(pb.Sampling(seed=0)).seed == 0  # set, even if zero
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_message(pb.Sampling(top_p=0.0))


def test_the_sampler_is_an_mlx_lm_sampler_over_log_probabilities() -> None:
    """``sample`` is mlx-lm's step (processors, logprobs, sampler): calling the sampler on
    mlx-lm's log probabilities draws the same token with the same key sequence."""
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, seed=9)
    by_step, by_sampler = TokenSampler(params), TokenSampler(params)
    context = [3, 4, 5]
    for step in range(8):
        logits = random_logits(step)
        expected = by_step.sample(logits, context)
        processed = logits
        for processor in by_sampler.logits_processors:
            processed = processor(mx.array(context), processed)
        logprobs = processed - mx.logsumexp(processed, keepdims=True)
        assert by_sampler(logprobs).item() == expected
        context.append(expected)


def test_a_resumed_sampler_continues_the_random_sequence() -> None:
    params = SamplingParams(temperature=1.0, seed=21)
    whole = sample_run(params, steps=10)
    resumed = TokenSampler(params)
    resumed.advance(4)
    assert [resumed.sample(random_logits(step), []) for step in range(4, 10)] == whole[4:]


@pytest.mark.parametrize("text", ["caf\u00e9", "snow \u2603", "go \U0001f680"])
def test_a_character_cut_by_max_tokens_is_held_back_never_a_replacement(
    tokenizer: Any, text: str
) -> None:
    """The byte-level tokenizer spends one token per byte: stop after each prefix of the
    tokens (as max_tokens would) and the text is the whole characters so far, never U+FFFD."""
    tokens = tokenizer.encode(text)
    assert len(tokens) > len(text), "the last character takes several tokens"
    for cut in range(1, len(tokens) + 1):
        checker = StopChecker(tokenizer, ())
        pieces = [checker.add_token(token).text for token in tokens[:cut]]
        pieces.append(checker.finish().text)
        emitted = "".join(pieces)
        assert "\ufffd" not in emitted, (cut, emitted)
        assert text.startswith(emitted), (cut, emitted)
    assert emitted == text


def test_a_replacement_character_inside_the_text_is_kept(tokenizer: Any) -> None:
    """Invalid bytes the model produced before the end stay visible (as U+FFFD)."""
    invalid_then_text = [*tokenizer.encode("a")[:1], *tokenizer.encode("\u00e9")[:1]]
    invalid_then_text += tokenizer.encode(" ok")
    checker = StopChecker(tokenizer, ())
    pieces = [checker.add_token(token).text for token in invalid_then_text]
    pieces.append(checker.finish().text)
    assert "".join(pieces) == "a\ufffd ok"
