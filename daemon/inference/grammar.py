"""Structured outputs: a request's answer held to a grammar (any JSON object, a JSON schema,
a tool call), with llguidance.

Why at the sampler: a grammar that only checks the answer afterwards can only refuse it; one
that masks the logits before each draw makes every answer valid, whatever the model. The
mask is llguidance's (``LLMatcher``): the set of tokens that keep the text a prefix of a
sentence of the grammar, computed from the grammar's state in a few milliseconds per token.

The API edge turns what a client asked for into a :class:`Constraint` (:func:`json_constraint`,
:func:`tool_call_constraint`) and checks it once (:func:`check_constraint`), so a schema
llguidance cannot compile is a 400 there, never a failure on a stage. The constraint then
travels with the sampling settings to the last stage, whose sampler holds a
:class:`GrammarMask`: it masks each step's logits, is advanced with each sampled token, and,
once the grammar is complete, allows only the end-of-sequence tokens, so the request ends
(finish "stop") right after the JSON value. A request resumed elsewhere replays its
generated tokens into a new mask first.

llguidance, numpy and MLX are imported only when a grammar is built or checked, so the
settings (and the pure cores that carry them) import none of them.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    from llguidance import LLTokenizer

# What a constraint holds the answer to: a JSON object (any), a JSON schema, or the model's
# tool-call syntax around the arguments of one of the tools.
CONSTRAINT_KINDS = ("json_object", "json_schema", "tool_call")
# A grammar travels with the request to every stage: far more than any real schema needs.
MAX_GRAMMAR_CHARS = 256 * 1024
# How the JSON is laid out: Python's json.dumps separators and no free whitespace. Free
# whitespace lets a small model write newlines instead of the value until max_tokens.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class Constraint:
    """A request's grammar: ``kind`` (one of :data:`CONSTRAINT_KINDS`, for logs and errors)
    and ``grammar``, llguidance's grammar text as the builders below make it."""

    kind: str
    grammar: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.grammar, str) or not 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"a constraint's grammar must be a non-empty string of at most "
                f"{MAX_GRAMMAR_CHARS} characters (a smaller schema)"
            )


# --- Building and checking (the API edge) --------------------------------------------------


def json_constraint(schema: Mapping[str, Any] | None = None) -> Constraint:
    """The answer is JSON valid against ``schema``; None: any JSON object.

    Raises ValueError when the schema is not a JSON object (llguidance's compile errors come
    from :func:`check_constraint`)."""
    from llguidance import LLMatcher

    if schema is None:
        any_object = _laid_out({"type": "object"})
        return Constraint("json_object", LLMatcher.grammar_from_json_schema(any_object))
    if not isinstance(schema, Mapping):
        raise ValueError(f"a JSON schema must be an object, got {json.dumps(schema)[:80]}")
    return Constraint("json_schema", LLMatcher.grammar_from_json_schema(_laid_out(schema)))


def tool_call_constraint(
    tools: Sequence[tuple[str, Mapping[str, Any] | None]], start: str, end: str
) -> Constraint:
    """The answer is one tool call in the JSON-between-markers syntax (``start``, a newline,
    ``{"name": NAME, "arguments": {...}}``, a newline, ``end``: what mlx-lm's ``json_tools``
    parser reads), for one of ``tools`` (name, parameters schema; None: any object), with
    arguments valid against that tool's schema."""
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": dict(parameters) if parameters else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in tools
    ]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    lark = (
        f"start: {json.dumps(start + chr(10))} %json {json.dumps(_laid_out(body))} "
        f"{json.dumps(chr(10) + end)}"
    )
    from llguidance import LLMatcher

    return Constraint("tool_call", LLMatcher.grammar_from_lark(lark))


def check_constraint(constraint: Constraint) -> None:
    """Compile the grammar once (without a tokenizer: about a millisecond): ValueError with
    llguidance's reason when it cannot be served (an unsupported keyword, a bad pattern, a
    reference it cannot resolve)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(constraint.grammar)
    if error:
        what = "tool parameters" if constraint.kind == "tool_call" else "JSON schema"
        raise ValueError(f"this {what} cannot be enforced: {error.strip()[:1000]}")


def _laid_out(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` closed (:func:`_closed`), with :data:`JSON_LAYOUT` as llguidance's options
    (the client's own ``x-guidance`` options, if any, come first and the layout wins)."""
    options = schema.get("x-guidance")
    merged = {**options, **JSON_LAYOUT} if isinstance(options, Mapping) else dict(JSON_LAYOUT)
    return {**_closed(schema), "x-guidance": merged}


def _closed(schema: Any, *, in_all_of: bool = False) -> Any:
    """``schema`` where every object that names its properties and says nothing of others
    (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``) gets
    ``additionalProperties: false``: the answer has only the properties the schema names.

    Why: JSON Schema allows any other property by default, and a small model fills that
    freedom with invented keys until max_tokens (what Pydantic's schemas, and so LangChain's
    and the openai SDK's ``parse``, leave open). The answer still validates against the
    schema as the client wrote it; OpenAI's strict mode requires the same. A schema that
    wants more says ``additionalProperties: true``. The branches of an ``allOf`` of several
    schemas are left open: each must admit the properties the others name."""
    if isinstance(schema, list):
        return [_closed(item, in_all_of=in_all_of) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples", "x-guidance"):
            closed[key] = value  # values, not schemas
        elif key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
            closed[key] = {name: _closed(item) for name, item in value.items()}
        elif key == "allOf" and isinstance(value, list):
            closed[key] = [_closed(item, in_all_of=len(value) > 1) for item in value]
        else:
            closed[key] = _closed(value)
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    names_properties = isinstance(schema.get("properties"), Mapping) and not in_all_of
    if names_properties and not any(key in schema for key in others):
        closed["additionalProperties"] = False
    return closed


# --- Serving (the last stage) --------------------------------------------------------------

_tokenizers: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's tokenizer for a model's mlx-lm ``TokenizerWrapper``, built once per loaded
    tokenizer (0.3-0.5 s for SmolLM2's 49k tokens: it indexes every token's bytes) and kept
    as long as the wrapper is. Its end-of-sequence tokens are the model's."""
    with _tokenizers_lock:
        built = _tokenizers.get(tokenizer)
        if built is None:
            from llguidance.hf import from_tokenizer

            backend = getattr(tokenizer, "_tokenizer", tokenizer)  # the Hugging Face tokenizer
            eos = sorted(tokenizer.eos_token_ids) or None
            try:
                built = from_tokenizer(backend, eos_token=eos)
            except ValueError as error:
                raise ValueError(
                    f"structured outputs need the model's fast tokenizer (tokenizer.json): {error}"
                ) from error
            _tokenizers[tokenizer] = built
        return built


class GrammarMask:
    """One request's grammar state on the last stage: masks its logits, follows its tokens.

    ``stop_ids`` are the request's end-of-sequence tokens: the only ones allowed once the
    grammar is complete (so the request ends there), and allowed wherever the grammar could
    end."""

    def __init__(
        self,
        constraint: Constraint,
        tokenizer: LLTokenizer,
        stop_ids: Collection[int] = (),
        generated: Sequence[int] = (),
    ) -> None:
        import numpy as np
        from llguidance import LLMatcher

        self.kind = constraint.kind
        self._np = np
        self._vocab = tokenizer.vocab_size
        self._matcher = LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"the {self.kind} grammar does not compile: {self._error()}")
        self._stops = np.array(sorted(set(stop_ids) or tokenizer.eos_tokens), dtype=np.int64)
        self._stop_set = frozenset(int(token) for token in self._stops)
        self._grammar_eos = np.array(tokenizer.eos_tokens, dtype=np.int64)
        self._words = np.empty((self._vocab + 31) // 32, dtype=np.int32)
        self._ended = False  # an end-of-sequence token was sampled where the grammar ends
        try:
            for token in generated:
                self.accept(token)
        except RuntimeError as error:
            raise ValueError(
                f"the tokens this request generated before do not follow its grammar: {error}"
            ) from error

    def allowed(self, vocab: int) -> Any:
        """The tokens the grammar allows next, as a numpy bool array of ``vocab`` entries (the
        logits' width: a model's head may be wider than its tokenizer's vocabulary)."""
        np = self._np
        if self._matcher.is_error():
            raise RuntimeError(f"the {self.kind} grammar failed: {self._error()}")
        allowed = np.zeros(vocab, dtype=bool)
        if not (self._ended or self._matcher.is_stopped()):
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
            width = min(vocab, self._vocab)
            allowed[:width] = bits[:width].astype(bool)
            allowed[self._grammar_eos[self._grammar_eos < vocab]] = False  # the request's, below
            if not self._matcher.is_accepting():
                return allowed
        allowed[self._stops[self._stops < vocab]] = True
        return allowed

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` ``(1, vocab)`` with every token the grammar does not allow at -inf."""
        import mlx.core as mx

        allowed = mx.array(self.allowed(logits.shape[-1])).reshape(1, -1)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def accept(self, token: int) -> None:
        """Advance the grammar by the sampled ``token`` (RuntimeError if it broke the grammar:
        the mask allowed it, so only a defect, or tokens from elsewhere, can)."""
        if self._ended or (token in self._stop_set and self._matcher.is_accepting()):
            self._ended = True  # the grammar is complete and the answer ends here
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the {self.kind} grammar: {self._error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar can end here (the JSON value or the tool call is whole)."""
        return self._matcher.is_accepting()

    def _error(self) -> str:
        """llguidance's reason, first line (the rest dumps its state and the grammar)."""
        return (self._matcher.get_error() or "no reason given").strip().splitlines()[0]
