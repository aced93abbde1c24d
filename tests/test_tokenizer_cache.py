"""A model's tokenizer kept between processes (meshd.models.tokenizer_cache): the kept
tokenizer of the embedded model answers as the one mlx-lm loads; a kept file not signed with
this user's key, one that others may write, and one that names anything but tokenizer parts
are never run but replaced; new files (in subfolders too) or other EOS ids give another key."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from meshd.models import tokenizer_cache
from meshd.models.store import ModelEntry
from meshd.models.tokenizer_cache import (
    KEY_FILE,
    RefusedPickle,
    _signature,
    _TokenizerUnpickler,
    load_tokenizer,
    read_tokenizer,
    tokenizer_key,
    user_key,
)

pytestmark = pytest.mark.integration

TEXTS = ["Hello, world!", "  spaces\tand\nlines  ", "naïve café — 東京 🚀", "<|im_end|> x"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def model_dir(tmp_path: Path, default_model_entry: ModelEntry) -> Path:
    """The embedded model's files but its weights, in a folder of this test's own."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in default_model_entry.path.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, folder / path.name)
    return folder


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    fresh = {"read": 0, "loaded": 0}
    monkeypatch.setattr(tokenizer_cache, "counts", fresh)
    return fresh


def behaviour(tokenizer: Any) -> dict[str, Any]:
    """What a daemon asks of a tokenizer: ids, texts, chat prompts, EOS, streaming text."""
    ids = [tokenizer.encode(text) for text in TEXTS]
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    streamed = []
    for token in ids[2]:
        detokenizer.add_token(token)
        streamed.append(detokenizer.last_segment)
    detokenizer.finalize()
    return {
        "ids": ids,
        "decoded": [tokenizer.decode(i) for i in ids],
        "chat": tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True),
        "chat_text": tokenizer.apply_chat_template(
            MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
        ),
        "eos": sorted(tokenizer.eos_token_ids),
        "streamed": [*streamed, detokenizer.last_segment],
        "detokenizer": type(detokenizer).__name__,
        "thinking": tokenizer.has_thinking,
        "tool_calling": tokenizer.has_tool_calling,
        "vocabulary": len(tokenizer.vocab),
    }


def test_the_kept_tokenizer_answers_as_the_loaded_one(
    tmp_path: Path, model_dir: Path, counts: dict[str, int]
) -> None:
    folder = tmp_path / "tokenizers"
    loaded = load_tokenizer(model_dir, [2], folder)
    assert counts == {"read": 0, "loaded": 1}
    [kept_file] = folder.glob("tokenizer-*.pickle")
    assert kept_file.stat().st_mode & 0o777 == 0o600
    kept = load_tokenizer(model_dir, [2], folder)
    assert counts == {"read": 1, "loaded": 1}
    assert kept is not loaded
    assert behaviour(kept) == behaviour(loaded)
    assert behaviour(kept)["detokenizer"] == "BPEStreamingDetokenizer"


class Payload:
    """A pickle that runs a command when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed-with-the-key"])
def test_a_kept_file_naming_anything_else_is_not_run_but_replaced(
    tmp_path: Path,
    model_dir: Path,
    counts: dict[str, int],
    caplog: pytest.LogCaptureFixture,
    signed: bool,
) -> None:
    """Unsigned bytes (anyone's) are never unpickled; even bytes signed with this user's key
    resolve tokenizer parts only."""
    folder = tmp_path / "tokenizers"
    marker = tmp_path / "ran"
    data = pickle.dumps(Payload(marker))
    key = user_key(folder) if signed else b"\0" * 32
    file = folder / f"tokenizer-{tokenizer_key(model_dir, [2])}.pickle"
    folder.mkdir(exist_ok=True)
    file.write_bytes(_signature(key, file, data) + data)
    file.chmod(0o600)
    tokenizer = load_tokenizer(model_dir, [2], folder)
    assert not marker.exists()
    expected = "names posix.system" if signed else "not written by this user's meshd"
    assert expected in caplog.text
    assert counts == {"read": 0, "loaded": 1}
    # Replaced by the tokenizer, signed:
    assert tokenizer.encode("Hello") == read_tokenizer(file, user_key(folder)).encode("Hello")
    assert (folder / KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_a_kept_file_renamed_to_another_key_is_not_read(
    tmp_path: Path, model_dir: Path, counts: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The signature covers the name: one model's tokenizer (or EOS ids) never serves another."""
    folder = tmp_path / "tokenizers"
    load_tokenizer(model_dir, [2], folder)
    [kept] = folder.glob("tokenizer-*.pickle")
    kept.rename(folder / f"tokenizer-{tokenizer_key(model_dir, [0])}.pickle")
    tokenizer = load_tokenizer(model_dir, [0], folder)
    assert "not written by this user's meshd" in caplog.text
    assert counts == {"read": 0, "loaded": 2}
    assert 0 in tokenizer.eos_token_ids


def test_a_key_others_may_read_keeps_nothing(
    tmp_path: Path, model_dir: Path, counts: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "tokenizers"
    user_key(folder)
    (folder / KEY_FILE).chmod(0o644)
    load_tokenizer(model_dir, None, folder)
    load_tokenizer(model_dir, None, folder)
    assert counts == {"read": 0, "loaded": 2}
    assert "not a private file of this user" in caplog.text
    assert not list(folder.glob("tokenizer-*.pickle"))


def test_a_kept_file_others_may_write_is_ignored_and_replaced(
    tmp_path: Path, model_dir: Path, counts: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "tokenizers"
    load_tokenizer(model_dir, None, folder)
    [file] = folder.glob("tokenizer-*.pickle")
    file.chmod(0o666)
    load_tokenizer(model_dir, None, folder)
    assert "not a private file of this user" in caplog.text
    assert counts == {"read": 0, "loaded": 2}
    assert file.stat().st_mode & 0o777 == 0o600
    load_tokenizer(model_dir, None, folder)
    assert counts == {"read": 1, "loaded": 2}


def test_other_files_or_eos_ids_give_another_key(model_dir: Path) -> None:
    key = tokenizer_key(model_dir, [2])
    assert tokenizer_key(model_dir, [2]) == key
    assert tokenizer_key(model_dir, [2, 7]) != key
    (model_dir / "model-00001-of-00001.safetensors").write_bytes(b"weights are not read")
    assert tokenizer_key(model_dir, [2]) == key
    config = model_dir / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    moved = tokenizer_key(model_dir, [2])
    assert moved != key
    templates = model_dir / "additional_chat_templates"  # transformers reads these too
    templates.mkdir()
    (templates / "tool_use.jinja").write_text("{{ messages }}")
    assert tokenizer_key(model_dir, [2]) != moved


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("builtins", "eval"),
        ("subprocess", "Popen"),
        ("transformers.dynamic_module_utils", "get_class_from_dynamic_module"),
        ("mlx_lm.tokenizer_utils", "load"),  # a function of an allowed module
        ("antigravity", "geohash"),  # a module with side effects: refused before its import
        # Dotted names reach through an allowed module to anything:
        ("mlx_lm.tool_parsers.json_tools", "json.codecs.builtins.exec"),
        ("mlx_lm.tokenizer_utils", "inspect.attrgetter"),
        ("mlx_lm.tool_parsers.json_tools", "json"),  # a module, not its parser
        ("transformers.tokenization_utils_base", "BatchEncoding"),  # not a tokenizer class
        ("transformers.tokenization_utils_tokenizers", "AddedToken"),  # re-exported
    ],
)
def test_the_unpickler_resolves_tokenizer_parts_only(module: str, name: str) -> None:
    unpickler = _TokenizerUnpickler(io.BytesIO(b""))
    with pytest.raises(RefusedPickle, match=f"names {module}.{name}"):
        unpickler.find_class(module, name)
    assert "antigravity" not in sys.modules
    assert unpickler.find_class("tokenizers", "Tokenizer").__name__ == "Tokenizer"
    assert unpickler.find_class("functools", "partial").__name__ == "partial"
    parser = unpickler.find_class("mlx_lm.tool_parsers.json_tools", "parse_tool_call")
    assert parser.__module__ == "mlx_lm.tool_parsers.json_tools"
