"""The prefix cache's index at one stage: which token sequences the stage keeps the KV of.

Agents send the whole conversation again every turn, so a new request mostly begins with
what an earlier one computed. Each stage keeps the caches of its layers for recent requests
as *slots*; a new request starts from the slot that shares the longest prefix with its
context and computes only the positions after it, on every stage.

This index is the bookkeeping only, pure as the stage core that owns it: token sequences,
their sizes, which slot a request starts from, which slots make room. The arrays live with
the engine (:meth:`meshd.inference.stage.engine.StageEngine.start_from_slot`), which the core
drives with ids. Rules, mlx-lm's ``LRUPromptCache``'s where they exist:

* A slot is cut at the common prefix (``trimmable``: every layer a plain KV cache). A stage
  with sliding-window or recurrent layers reuses a slot only when its whole sequence is a
  prefix of the new context (their caches cannot drop positions).
* A request keeps at least its last context position to compute: that step gives its logits.
* Inserting a sequence drops the slots it extends (a conversation's turn replaces its turn
  before). Conversations that share only a system prompt each keep their own slot.
* Eviction: least recently used first, down to a number of tokens the stage core gives (the
  plan's reserved KV less what its running requests reserve), and at most ``max_slots``.
* A later stage follows the first stage's choice: the Start says how many positions it kept
  and a digest of them (:func:`prefix_digest`); a stage that holds no slot with that prefix
  cannot compute the rest, and says so (the origin then retries without the cache).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.inference.stage_events import SlotUse

DEFAULT_MAX_SLOTS = 32
_BLOCK = 4096  # bytes compared at once when looking for the first differing token


def token_bytes(tokens: Sequence[int]) -> bytes:
    """A token sequence as little-endian uint32 bytes (how slots keep and compare them)."""
    packed = array("I", tokens)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 4 bytes wide here")
    return packed.tobytes()


def prefix_digest(tokens: Sequence[int] | bytes, length: int) -> bytes:
    """The digest of the first ``length`` tokens: what a later stage checks its slot by."""
    raw = tokens if isinstance(tokens, bytes) else token_bytes(tokens[:length])
    return hashlib.blake2b(raw[: 4 * length], digest_size=16).digest()


def common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two sequences (as :func:`token_bytes`) share from the start."""
    limit = min(len(a), len(b))
    start = 0
    while start < limit:  # whole blocks compare in C; only the block that differs is walked
        end = min(start + _BLOCK, limit)
        if a[start:end] != b[start:end]:
            while a[start : start + 4] == b[start : start + 4]:
                start += 4
            return start // 4
        start = end
    return limit // 4


@dataclass(slots=True)
class Slot:
    """One kept sequence: ``tokens`` (as :func:`token_bytes`) whose KV the engine holds."""

    slot_id: int
    tokens: bytes
    pinned: int = 0  # requests that start from it and have not copied it yet

    @property
    def length(self) -> int:
        return len(self.tokens) // 4


@dataclass(slots=True)
class PrefixStats:
    """What the index did since its stage was loaded (for status and metrics)."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one position
    reused_tokens: int = 0
    evicted: int = 0
    misses_followed: int = 0  # a later stage lacked the slot the first stage chose


@dataclass(frozen=True, slots=True)
class PrefixCacheView:
    """One plan's stage's prefix cache as status and metrics show it (an immutable snapshot
    the stage runtime publishes, so any thread may read it)."""

    plan_id: str
    stage_index: int
    slots: int
    tokens: int
    budget_tokens: int  # KV positions the plan reserves here with its running requests (0: any)
    lookups: int
    hits: int
    reused_tokens: int
    evicted: int


class PrefixIndex:
    """The slots of one stage (one model's layer range on this node), in LRU order."""

    def __init__(self, *, trimmable: bool, max_slots: int = DEFAULT_MAX_SLOTS) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        self.trimmable = trimmable
        self.max_slots = max_slots
        self.stats = PrefixStats()
        self._slots: OrderedDict[int, Slot] = OrderedDict()  # least recently used first
        self._next_id = 1
        self.tokens = 0  # positions the slots hold together

    def __len__(self) -> int:
        return len(self._slots)

    def ids(self) -> list[int]:
        return list(self._slots)

    def lookup(self, context: bytes, limit: int) -> tuple[Slot, int] | None:
        """The slot a request of ``context`` starts from and the positions it keeps (at most
        ``limit``), or None; the longest reuse wins, the most recently used among equals."""
        self.stats.lookups += 1
        best: tuple[Slot, int] | None = None
        for slot in reversed(self._slots.values()):
            shared = min(common_prefix(slot.tokens, context), limit)
            if not self.trimmable and shared != slot.length:
                continue  # its caches cannot be cut: only a slot it extends whole
            if shared > 0 and (best is None or shared > best[1]):
                best = (slot, shared)
        if best is not None:
            self.stats.hits += 1
            self.stats.reused_tokens += best[1]
        return best

    def follow(self, digest: bytes, length: int) -> Slot | None:
        """A later stage: the slot whose first ``length`` positions are those the first stage
        kept (by their digest), or None when this stage holds none."""
        for slot in reversed(self._slots.values()):
            if slot.length < length or (not self.trimmable and slot.length != length):
                continue
            if prefix_digest(slot.tokens, length) == digest:
                self.stats.lookups += 1
                self.stats.hits += 1
                self.stats.reused_tokens += length
                return slot
        self.stats.misses_followed += 1
        return None

    def use(self, slot: Slot, length: int, *, room: int | None) -> tuple[SlotUse, list[int]]:
        """A request starts from ``slot`` keeping ``length`` positions; least recently used
        slots make room for it (``room``: tokens the slots may hold beside the request; None:
        no bound). The request takes the slot when it extends it whole (its own end replaces
        it) or when even then there is no room for a copy; else the slot stays, pinned until
        the engine copied it (:meth:`unpin`). The use, and the slots evicted."""
        if length == slot.length:
            self._remove(slot.slot_id)
            return SlotUse(slot.slot_id, length, take=True), self.evict_to(room)
        slot.pinned += 1
        dropped = self.evict_to(room)
        if room is not None and self.tokens > room:
            self._remove(slot.slot_id)
            return SlotUse(slot.slot_id, length, take=True), dropped
        self._slots.move_to_end(slot.slot_id)
        return SlotUse(slot.slot_id, length, take=False), dropped

    def unpin(self, slot_id: int) -> None:
        """The engine copied the slot for a request: it may be evicted again."""
        slot = self._slots.get(slot_id)
        if slot is not None and slot.pinned:
            slot.pinned -= 1

    def insert(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """Keep ``tokens``' KV as a new slot: its id, and the slots it replaces (a slot whose
        whole sequence it extends, when the caches can be cut to it again)."""
        raw = token_bytes(tokens)
        replaced = [
            slot.slot_id
            for slot in self._slots.values()
            if not slot.pinned
            and (self.trimmable or slot.length == len(tokens))
            and common_prefix(slot.tokens, raw) == slot.length
        ]
        for slot_id in replaced:
            self._remove(slot_id)
        slot = Slot(self._next_id, raw)
        self._next_id += 1
        self._slots[slot.slot_id] = slot
        self.tokens += slot.length
        return slot.slot_id, replaced

    def evict_to(self, room: int | None) -> list[int]:
        """Drop least recently used slots until they hold at most ``room`` tokens (None: no
        bound but ``max_slots``); pinned slots stay. The ids dropped."""
        dropped: list[int] = []
        for slot in list(self._slots.values()):
            over = len(self._slots) > self.max_slots or (room is not None and self.tokens > room)
            if not over:
                break
            if slot.pinned:
                continue
            self._remove(slot.slot_id)
            dropped.append(slot.slot_id)
        self.stats.evicted += len(dropped)
        return dropped

    def clear(self) -> list[int]:
        """Forget every slot (the stage's layers are going): their ids."""
        dropped = list(self._slots)
        self._slots.clear()
        self.tokens = 0
        return dropped

    def _remove(self, slot_id: int) -> None:
        slot = self._slots.pop(slot_id)
        self.tokens -= slot.length
