"""A mixture-of-experts model larger than any node's budget runs across namespaced daemons.

Three daemons, one network namespace each (real mDNS over the test's bridge, mutual TLS), each
allowed 120 MB, hold a random DeepSeek-V3-architecture model (the one Kimi K2 uses: multi-head
latent attention, 12 routed experts and a shared one per layer, a dense first layer) of about
93 MB in float32: with KV cache, activations and overhead no node could hold it alone. The
partitioner plans it with today's dense-model description (it over-estimates an MoE's compute,
which does not matter for fitting). The answer over the local API must be mlx-lm's own greedy
answer in one process, and every node must stay within its budget by MLX's allocator counters
as `meshd status` reports them, holding only its share of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.api import client
from meshd.wire import pb
from tests.support.memory_checks import assert_nodes_hold_only_their_share

pytestmark = pytest.mark.netns

BUDGET = 120_000_000
PROMPT = "mixture of experts, split three ways " * 4
MAX_TOKENS = 24
# The memory strategy, as in test_inference_e2e: its plan does not move with link-measurement
# noise, which would otherwise replace the committed plan under a starting request.
NETNS_ARGS = ["--interface", "eth0", "--strategy", "memory"]
MOE_OVERRIDES = {
    "hidden_size": 256,
    "intermediate_size": 1024,  # the dense first layer
    "num_hidden_layers": 8,
    "vocab_size": 4096,
    "n_routed_experts": 12,
    "moe_intermediate_size": 256,
    "kv_lora_rank": 128,
    "q_lora_rank": 192,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
}


@pytest.fixture(scope="module")
def big_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.random_model import make_architecture_dir

    folder = tmp_path_factory.mktemp("moe") / "tiny-deepseek-v3"
    return make_architecture_dir(folder, "deepseek_v3", seed=3, overrides=MOE_OVERRIDES)


def mlx_lm_answer(model_dir: Path) -> str:
    """The greedy answer of one mlx-lm process, streamed by mlx-lm's own detokenizer."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    return "".join(
        response.text
        for response in stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)
    )


def test_moe_bigger_than_any_node_answers_across_namespaced_daemons(
    daemons, netns_mesh, mesh_token, big_moe
) -> None:
    from meshd.models.info import read_model_spec

    weights = read_model_spec(big_moe).total_weight_bytes
    assert 0.75 * BUDGET < weights < 2 * BUDGET  # no node holds it with KV, activations, overhead
    mesh = netns_mesh(3)
    args = [*NETNS_ARGS, "--join", mesh_token, "--model", str(big_moe)]
    args += ["--memory-budget", "120MB", "--context-length", "256"]
    nodes = [daemons([*args, "--name", f"host{i}"], netns=mesh.nodes[i].ns) for i in range(3)]
    for node in nodes:
        node.wait_for(
            lambda s: bool(s.agreement.active_plan_id) and len(s.agreement.members) == 3,
            60,
            "a committed plan over 3 nodes",
        )
    plan = json.loads(nodes[0].status().agreement.plan_json)
    assert len(plan["stages"]) == 3

    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.Sampling(max_tokens=MAX_TOKENS))
    text, done = [], None
    for event in client.stream_generation(nodes[2].api, request, timeout_s=120):
        if event.HasField("done"):
            done = event.done
        else:
            text.append(event.text)
    assert done is not None and done.completion_tokens > 0
    # A random model's bytes are rarely valid UTF-8: where max_tokens cuts a character, mlx-lm
    # flushes it as U+FFFD and the mesh holds it back (it never sends a character the model
    # did not produce); everything before is the same text.
    assert "".join(text) == mlx_lm_answer(big_moe).removesuffix("\ufffd")

    assert_nodes_hold_only_their_share(nodes, plan, BUDGET, weights)
