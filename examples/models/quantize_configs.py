"""Write the MLX-quantized config.json files under examples/models/ from the original ones.

What `mlx_lm.convert --quantize` writes into config.json is its `quantization` section (copied
to `quantization_config`): the default bits and group size plus one entry per module the
model's own `quant_predicate` quantizes differently (e.g. 8-bit routers of a 4-bit MoE). This
script builds each model with mlx-lm's own class, lazily (nothing is materialised), runs
mlx-lm's own `quantize_model` on it, and writes the resulting config, so the sections are
exactly what mlx-lm 0.32.2 writes, without downloading the mlx-community checkpoints' own
config files.

gpt-oss-120b-mxfp4-q8 follows the recipe its mlx-community name says: experts in MXFP4 (the
original checkpoint's format), everything else 8-bit affine.

Run: .venv/bin/python examples/models/quantize_configs.py
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

# isort: split
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map_with_path  # noqa: E402
from mlx_lm.utils import _get_classes, quantize_model  # noqa: E402

HERE = Path(__file__).resolve().parent
BITS = (8, 4)
SOURCES = ("qwen3-235b-a22b-instruct-2507", "qwen3-next-80b-a3b-instruct", "deepseek-v3")


def skeleton(config: dict[str, Any]) -> Any:
    """mlx-lm's model for `config`, cast to bfloat16 as convert does; never evaluated."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda path, value: (
                value.astype(mx.bfloat16)
                if keep(path) and mx.issubdtype(value.dtype, mx.floating)
                else value
            ),
            model.parameters(),
        )
    )
    return model


def quantized_config(config: dict[str, Any], bits: int, **extra: Any) -> dict[str, Any]:
    base = {k: v for k, v in config.items() if k not in ("quantization_config", "quantization")}
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        _, written = quantize_model(skeleton(base), base, 64, bits, **extra)
    return written  # type: ignore[no-any-return]


def write(name: str, config: dict[str, Any]) -> None:
    target = HERE / name
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {target / 'config.json'}")


def main() -> None:
    for source in SOURCES:
        config = json.loads((HERE / source / "config.json").read_text())
        for bits in BITS:
            write(f"{source}-{bits}bit", quantized_config(config, bits))
    gpt_oss = json.loads((HERE / "gpt-oss-120b" / "config.json").read_text())

    def mxfp4_experts(path: str, module: Any) -> bool | dict[str, Any]:
        if path.endswith("mlp.experts.gate_proj") or path.endswith(
            ("mlp.experts.up_proj", "mlp.experts.down_proj")
        ):
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return True

    write(
        "gpt-oss-120b-mxfp4-q8",
        quantized_config(gpt_oss, 8, quant_predicate=mxfp4_experts),
    )


if __name__ == "__main__":
    main()
