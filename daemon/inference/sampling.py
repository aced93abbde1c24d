"""Per-request sampling: parameters, their wire forms, a seeded token sampler, stop strings.

Why not mlx-lm's ``make_sampler`` as is: it draws from MLX's global random state, so two
requests running at once would disturb each other and a seed could not reproduce a request.
:class:`TokenSampler` keeps its own key per request and splits it every step; everything else
is mlx-lm's own step, in mlx-lm's order (``generate_step``): logits processors (repetition
penalty), ``logprobs = logits - logsumexp(logits)``, then the sampler on the log
probabilities (greedy argmax, or ``apply_top_p``, ``apply_min_p``, ``apply_top_k`` and a
categorical draw). A :class:`TokenSampler` is itself an mlx-lm ``Sampler`` and exposes its
``logits_processors``, so mlx-lm's ``generate_step`` run with them is the exact reference of
what a stage samples.

Settings travel in three shapes: the local API's protobuf ``Sampling``, :class:`SamplingParams`
and the data plane's protobuf ``Sampling``. :func:`sampling_from_message` and
:func:`sampling_to_message` are the one conversion each way, for both messages; the field
list is derived once from the dataclass (:data:`SAMPLING_FIELDS`).

MLX is imported only when a sampler is built, so the parameters (and the data plane's pure
stage core, which carries them) import no MLX.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from meshd.inference.grammar import Constraint

if TYPE_CHECKING:
    import mlx.core as mx

    from meshd.inference.grammar import GrammarMask

MAX_TOKENS_LIMIT = 32768
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
REPETITION_CONTEXT_SIZE = 20
MAX_SEED = 2**63 - 1
REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder makes of bytes that are not (yet) a character


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler. ``temperature == 0`` means greedy (argmax).

    ``top_p == 1``, ``top_k == 0``, ``min_p == 0`` and ``repetition_penalty == 1`` disable those
    filters. ``seed=None`` draws a fresh seed per request (see :attr:`TokenSampler.seed`).
    ``constraint``: a grammar the answer follows (structured outputs, see
    :mod:`meshd.inference.grammar`); None for free text.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())
    constraint: Constraint | None = None
    # False: the client named no max_tokens, so the router may lower the default to what fits
    # the plan's context; one it named is kept (and refused when it does not fit). Known only
    # where the request enters (the APIs); not a setting of the sampler, not on the wire.
    max_tokens_given: bool = field(default=True, compare=False)
    # Whether the request may start from a prompt prefix the stages keep and leave its own
    # (the prefix cache); a client opts out for a benchmark. Travels as the Start's flag.
    prefix_cache: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        _check_finite_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0 or not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}.")
        _check_finite_range("min_p", self.min_p, 0.0, 1.0)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                "repetition_penalty must be in (0, 10] (1 disables it), "
                f"got {self.repetition_penalty}."
            )
        if self.seed is not None and not (
            isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}.")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}."
            )
        _check_stop_strings(self.stop)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint, got {self.constraint!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_finite_range(name: str, value: float, low: float, high: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}.")


def _check_stop_strings(stop: tuple[str, ...]) -> None:
    if not isinstance(stop, tuple):
        raise ValueError(f"stop must be a tuple of strings, got {type(stop).__name__}.")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"At most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}.")
    for item in stop:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"Each stop string must be a non-empty str of at most {MAX_STOP_STRING_CHARS} "
                f"characters, got {item!r}."
            )


# --- Wire forms -------------------------------------------------------------------------------

# The scalar settings a Sampling message carries, in the dataclass's order; ``stop`` (a list)
# only the local API's message has: stop strings are applied where the request was asked.
# ``constraint`` (a message of its own) only the data plane's has: the APIs build it.
SAMPLING_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in fields(SamplingParams)
    if f.name not in ("stop", "max_tokens_given", "prefix_cache", "constraint")
)

M = TypeVar("M")


def sampling_from_message(message: Any) -> SamplingParams:
    """The settings in a protobuf ``Sampling`` (the local API's or the data plane's), validated.

    A field the message marks as unset (``optional`` in the proto) takes the dataclass's
    default. Raises ValueError naming the first bad value.
    """
    by_name = message.DESCRIPTOR.fields_by_name
    present: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        descriptor = by_name.get(name)
        if descriptor is None or (descriptor.has_presence and not message.HasField(name)):
            continue
        present[name] = getattr(message, name)
    stop = tuple(message.stop) if "stop" in by_name else ()
    constraint = None
    if "constraint" in by_name and message.HasField("constraint"):
        constraint = Constraint(message.constraint.kind, message.constraint.grammar)
    return SamplingParams(
        **present, stop=stop, constraint=constraint, max_tokens_given="max_tokens" in present
    )


def sampling_to_message(params: SamplingParams, message: M) -> M:
    """Fill the protobuf ``Sampling`` ``message`` with ``params`` (a seed of None stays unset,
    stop strings only where the message has them) and return it."""
    by_name = message.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    for name in SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None and name in by_name:
            setattr(message, name, value)
    if "stop" in by_name:
        message.stop.extend(params.stop)  # type: ignore[attr-defined]
    if params.constraint is not None:
        if "constraint" not in by_name:
            raise ValueError(f"{type(message).__name__} cannot carry a constraint")
        message.constraint.kind = params.constraint.kind  # type: ignore[attr-defined]
        message.constraint.grammar = params.constraint.grammar  # type: ignore[attr-defined]
    return message


# --- Sampling ---------------------------------------------------------------------------------


class TokenSampler:
    """Turns one request's last-position logits into token ids, deterministically per seed.

    The random key is the request's own: ``key_{n+1}, draw_n = split(key_n)``, so the same seed
    and the same logits give the same tokens no matter what else runs in the process.
    ``grammar``: the request's structured-output mask (its constraint on this model's
    tokenizer), applied after the logits processors and advanced with each sampled token.
    """

    def __init__(self, params: SamplingParams, grammar: GrammarMask | None = None) -> None:
        # Imported here: mlx_lm pulls in transformers (~0.6 s), which a daemon should not pay
        # for at start-up, and the parameters above must stay importable without MLX.
        import mlx.core as mx
        from mlx_lm.sample_utils import make_logits_processors

        self._mx = mx
        self.params = params
        self.grammar = grammar
        self.seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        self._key = mx.random.key(self.seed)
        self.logits_processors = make_logits_processors(
            repetition_penalty=(
                params.repetition_penalty if params.repetition_penalty != 1.0 else None
            ),
            repetition_context_size=REPETITION_CONTEXT_SIZE,
        )

    def advance(self, draws: int) -> None:
        """Skip ``draws`` random draws: a resumed request continues its random sequence."""
        for _ in range(draws if not self.params.greedy else 0):
            self._key, _ = self._mx.random.split(self._key)

    def sample(self, logits: mx.array, context: list[int]) -> int:
        """Next token id from the last position's logits ``(1, vocab)``, as mlx-lm's
        ``generate_step`` computes it. ``context`` is what the logits processors look at:
        the prompt and the tokens generated so far (the repetition penalty uses the last 20).
        """
        mx = self._mx
        logits = logits.reshape(1, -1)
        if self.logits_processors and context:
            tokens = mx.array(context)
            for processor in self.logits_processors:
                logits = processor(tokens, logits)
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = int(self(logprobs).item())
        if self.grammar is not None:
            self.grammar.accept(token)
        return token

    def __call__(self, logprobs: mx.array) -> mx.array:
        """An mlx-lm ``Sampler``: a token from log probabilities ``(1, vocab)``, drawn with
        this request's own key (greedy: the argmax)."""
        mx = self._mx
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        logprobs = self._filter(logprobs)
        self._key, draw_key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=draw_key)

    def _filter(self, logprobs: mx.array) -> mx.array:
        """top_p, then min_p, then top_k: the order of mlx-lm's ``make_sampler``."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        params = self.params
        if params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if 0 < params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, params.top_k)
        return logprobs


@dataclass(frozen=True)
class StopUpdate:
    """What a token added to the visible text: ``text`` to emit now, and whether to stop."""

    text: str
    stopped: bool


class StopChecker:
    """Streams detokenized text and ends it at the first stop string, which is not emitted.

    Text that could still turn out to start a stop string is held back until the next token
    decides it, so nothing emitted ever has to be taken back.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        """``tokenizer`` is mlx-lm's ``TokenizerWrapper`` (its ``detokenizer`` streams text)."""
        self._detokenizer = tokenizer.detokenizer
        self._detokenizer.reset()
        self._stop = tuple(stop)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far (without any stop string)."""
        return self._text[: self._emitted]

    def add_token(self, token_id: int) -> StopUpdate:
        """Feed one generated token; returns the newly emittable text."""
        if self.stopped:
            return StopUpdate("", True)
        self._detokenizer.add_token(token_id)
        self._text += self._detokenizer.last_segment
        return self._advance(final=False)

    def finish(self) -> StopUpdate:
        """Flush what the detokenizer and the hold-back kept (call when generation ends).

        The detokenizer holds back bytes that do not yet form a whole UTF-8 character and,
        when generation ends (max_tokens, a cancel), decodes them as U+FFFD: a replacement
        character the model never produced. Such a trailing incomplete character is dropped.
        """
        if self.stopped:
            return StopUpdate("", True)
        self._detokenizer.finalize()
        self._text += self._detokenizer.last_segment.rstrip(REPLACEMENT_CHARACTER)
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> StopUpdate:
        stop_at = self._first_stop()
        if stop_at is not None:
            self.stopped = True
            return self._emit_up_to(stop_at, stopped=True)
        end = len(self._text) if final else len(self._text) - self._held_back()
        return self._emit_up_to(max(end, self._emitted), stopped=False)

    def _emit_up_to(self, end: int, *, stopped: bool) -> StopUpdate:
        new_text = self._text[self._emitted : end]
        self._emitted = end
        return StopUpdate(new_text, stopped)

    def _first_stop(self) -> int | None:
        """Start of the earliest stop string in the text not yet emitted, if any.

        No stop string can begin inside emitted text: its start would have been held back.
        """
        positions = [
            found for stop in self._stop if (found := self._text.find(stop, self._emitted)) != -1
        ]
        return min(positions) if positions else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
