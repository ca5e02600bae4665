"""io.openvino: the target (its GGUF blocks kept) and our drafter as OpenVINO IR that OpenVINO GenAI runs as
exported: the target's logits equal ours, GenAI's EAGLE-3 in float32 gives its plain output token for token and
accepts our drafts, and what GenAI cannot run is refused by name. bench's ``openvino`` methods on top."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdecode.io.openvino import export_openvino
from tests.helpers import run_specdecode

ov = pytest.importorskip("openvino", reason="the [openvino] extra (scripts/setup.sh installs it)")
pytest.importorskip("openvino_genai")

F32 = {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
       "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
PROMPTS = ("Explain in a few sentences why the sky is blue.", "Write a Python function that reverses a string.")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_openvino(None, None, tmp_path_factory.mktemp("ov") / "smollm2")


def test_the_targets_logits_are_ours_with_the_ggufs_blocks_and_across_calls(exported, smollm):
    """Prefill, then one token on the state the prefill left: both equal our float32 model's logits (its weights
    dequantized from the same GGUF blocks the IR keeps compressed)."""
    assert exported.weights == "gguf" and exported.weight_error < 1e-5
    model = ov.Core().read_model(str(exported.target / "openvino_model.xml"))
    constants = (n for n in model.get_ops() if n.get_type_name() == "Constant")
    compressed = {n.get_output_element_type(0).get_type_name() for n in constants}
    assert {"u4", "i8"} <= compressed  # Q4_1 layers and the Q8_0 embedding stay compressed
    request = ov.Core().compile_model(model, "CPU", F32).create_infer_request()
    ids = smollm.tokenizer.encode_chat(PROMPTS[0])
    n = len(ids)

    def infer(tokens, start):
        a = np.asarray([tokens], dtype=np.int64)
        request.infer({"input_ids": a, "attention_mask": np.ones((1, start + len(tokens)), np.int64),
                       "position_ids": np.arange(start, start + len(tokens))[None], "beam_idx": np.zeros(1, np.int32)})
        return request.get_tensor("logits").data.copy()[0]

    ours_cache = smollm.model.new_cache(1, n + 4)
    with torch.no_grad():
        ref = smollm.model(torch.tensor([ids + [ids[-1]]]), torch.arange(n + 1)[None], ours_cache,
                           logits_at=torch.arange(n + 1)).logits[0].numpy()
    request.reset_state()
    got = np.concatenate([infer(ids, 0), infer([ids[-1]], n)])
    assert np.abs(got - ref).max() < 2e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()


# GenAI's pipelines run in a child process: once one has run in a process, a later SIGTERM there (another test
# raises one) crashes it
GENAI_RUN = """
import json, sys
import numpy as np, openvino as ov, openvino_genai as genai
target, draft, props, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
config = genai.GenerationConfig()
config.max_new_tokens, config.do_sample = 32, False
plain = genai.LLMPipeline(target, "CPU", **props)
spec = genai.LLMPipeline(target, "CPU", draft_model=genai.draft_model(draft, "CPU"), **props)
out = []
for ids in prompts:
    a = np.asarray([ids], dtype=np.int64)
    inputs = genai.TokenizedInputs(ov.Tensor(a), ov.Tensor(np.ones_like(a)))
    config.num_assistant_tokens = 0
    want = [int(t) for t in plain.generate(inputs, config).tokens[0]]
    config.num_assistant_tokens = 3
    res = spec.generate(inputs, config)
    out.append({"plain": want, "spec": [int(t) for t in res.tokens[0]],
                "accepted": res.extended_perf_metrics.get_num_accepted_tokens()})
print(json.dumps(out))
"""


def test_genai_runs_our_drafter_as_exported_and_float32_speculation_is_lossless(exported, smollm):
    import subprocess
    import sys

    draft = ov.Core().read_model(str(exported.draft / "openvino_model.xml"))
    assert draft.get_rt_info(["eagle3_mode"]).astype(str) == "True"
    # GenAI taps the outputs of these layers; ours the inputs of 2, 15, 27
    assert draft.get_rt_info(["hidden_layers_list"]).astype(str).split() == ["1", "14", "26"]
    assert exported.hidden_layers == [1, 14, 26]
    prompts = [smollm.tokenizer.encode_chat(p) for p in PROMPTS]
    proc = subprocess.run([sys.executable, "-c", GENAI_RUN, str(exported.target), str(exported.draft),
                           json.dumps(F32), json.dumps(prompts)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for run in runs:
        assert run["spec"] == run["plain"] and len(run["plain"]) == 32
    generated, accepted = sum(len(r["plain"]) for r in runs), sum(r["accepted"] for r in runs)
    # GenAI accepts our drafts as our engine does (about 2 tokens a forward on such prompts): taps, fc and d2t
    # wired as trained; a miswired head stays near 1
    assert generated / (generated - accepted) > 1.5


def test_what_genai_cannot_run_is_refused_by_name(tmp_path, smollm):
    from specdecode.core.drafter import random_drafter
    from specdecode.io.checkpoints import save_drafter

    save_drafter(random_drafter(smollm.model, variant=("fc_norm",)), tmp_path / "d", layout="speculators")
    with pytest.raises(ValueError, match="fc_norm cannot run in OpenVINO GenAI"):
        export_openvino(None, tmp_path / "d", tmp_path / "out")
    with pytest.raises(ValueError, match="unknown OpenVINO weights 'q8'"):
        export_openvino(None, None, tmp_path / "out", weights="q8")


def test_export_cli_then_bench_runs_openvino_beside_ours(tmp_path):
    proc = run_specdecode("export", "--format", "openvino", "--out", str(tmp_path / "ov"))
    assert "taps the outputs of target layers [1, 14, 26]" in proc.stdout
    assert json.loads((tmp_path / "ov" / "export.json").read_text())["draft"] == "draft"
    refused = run_specdecode("bench", "--methods", "baseline,openvino:spec=medusa", check=False)
    assert refused.returncode == 2 and "spec must be one of none, eagle3, prompt_lookup" in refused.stderr
    out = tmp_path / "bench.json"
    methods = ("baseline:compile=off,openvino:precision=f32,openvino:spec=eagle3,precision=f32,"
               "openvino:spec=prompt_lookup")
    run_specdecode("bench", "--methods", methods, "--num-prompts", "1", "--max-new-tokens", "16", "--warmup", "0",
                   "--no-store", "--out", str(out))
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"baseline:compile=off", "openvino:precision=f32", "openvino:spec=eagle3,precision=f32",
                         "openvino:spec=prompt_lookup"}
    assert rows["openvino:spec=eagle3,precision=f32"]["accept_length"] > 1.0
    assert rows["openvino:spec=prompt_lookup"]["accept_length"] >= 1.0
    assert "accept_rate" not in rows["openvino:spec=eagle3,precision=f32"]


def test_a_target_with_biases_an_untied_head_and_grouped_queries_gives_our_logits(tmp_path):
    """Qwen2's q/k/v biases, its own lm_head, two queries a kv head: the graph reads every weight or refuses."""
    from specdecode.io.hf import load_hf_dir
    from specdecode.io.openvino import Weights, build_target, openvino_modules
    from tests.helpers import save_tiny_hf

    save_tiny_hf(tmp_path, model_type="qwen2")
    model = load_hf_dir(tmp_path, torch.float32, "cpu")
    state = dict(model.state_dict())
    assert "layers.0.self_attn.qkv_proj.bias" in state and not model.config.tie_word_embeddings
    _, ops = openvino_modules()
    request = ov.Core().compile_model(build_target(ops, model.config, state), "CPU", F32).create_infer_request()
    ids = np.array([[5, 17, 3, 99, 42, 7]], dtype=np.int64)
    request.infer({"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(6)[None],
                   "beam_idx": np.zeros(1, np.int32)})
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), torch.arange(6)[None], model.new_cache(1, 8),
                           logits_at=torch.arange(6)).logits[0].numpy()
    assert np.abs(request.get_tensor("logits").data[0] - ref).max() < 1e-4
    with pytest.raises(ValueError, match="no place for layers.0.self_attn.extra"):
        build_target(ops, model.config, state | {"layers.0.self_attn.extra": torch.zeros(1)})
    assert Weights(state).get("nothing") is None
