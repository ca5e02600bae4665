"""`specdecode formats`: the format grammar, and one small run on the real model."""

import json
import sys

import pytest

from specdecode.bench.formats import format_name, parse_format
from specdecode.core.quant import ACTIVATIONS, DEFAULT_ACTIVATIONS
from tests.helpers import run_specdecode


def test_parse_format():
    d = DEFAULT_ACTIVATIONS
    other = next(a for a in ACTIVATIONS if a != d)
    assert parse_format("bfloat16:int8") == ("bfloat16", "int8", "auto", d)
    assert parse_format(" float32 ") == ("float32", "native", "auto", d)
    assert parse_format("bfloat16:native:static") == ("bfloat16", "native", "static", d)
    assert parse_format(f"bfloat16:q4:auto:{other}") == ("bfloat16", "q4", "auto", other)
    assert format_name(*parse_format(f"bfloat16:q4::{other}")) == f"bfloat16:q4:{other}"
    assert format_name(*parse_format(f"bfloat16:q4:static:{d}")) == "bfloat16:q4:static"
    assert format_name(*parse_format(f"bfloat16:native::{other}")) == "bfloat16:native"  # no quantized layers
    for bad in ("bfloat16:int4", "bfloat16:native:fast", "bfloat16:int8:auto:x", "bfloat16:int8:auto:int8:x"):
        with pytest.raises(ValueError, match="weights one of native, int8, q4, kernels one of auto, static and "
                                             "activations one of int16, int8, mixed"):
            parse_format(bad)


@pytest.mark.model
def test_formats_command_measures_speed_and_quality(tmp_path):
    passages = tmp_path / "passages.jsonl"
    passages.write_text('{"text": "The mitochondria is the powerhouse of the cell. It makes ATP from glucose."}\n'
                        '{"text": "Paris is the capital of France, and Berlin is the capital of Germany."}\n')
    out = tmp_path / "formats.json"
    bench = tmp_path / "llama-bench"  # a stand-in: a batch of k tokens "costs" (k + 1) ms, the arguments kept
    bench.write_text(f"#!{sys.executable}\nimport json, sys\na = sys.argv[1:]\n"
                     f"open({str(tmp_path / 'args.txt')!r}, 'a').write(' '.join(a) + '\\n')\n"
                     "k = int(a[a.index('-p') + 1])\nprint(json.dumps([{'samples_ns': [(k + 1) * 1e6] * 2}]))\n")
    bench.chmod(0o755)
    # a stand-in for llama-cpp-python: every passage position gives the true next token half the probability
    # (one logit log(V - 1) among V - 1 zeros), so its perplexity is exactly 2; greedy it answers 7, 7, ...
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "llama_cpp.py").write_text(
        "import json, math, numpy as np\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        f"        open({str(tmp_path / 'llama.txt')!r}, 'a').write(json.dumps(kw) + '\\n')\n"
        "        self.kw = kw\n"
        "    def reset(self):\n"
        "        self.scores = None\n"
        "    def eval(self, ids):\n"
        "        v = 49152\n"
        "        self.scores = np.zeros((self.kw['n_ctx'], v), dtype=np.float32)\n"
        "        for i, t in enumerate(ids[1:]):\n"
        "            self.scores[i, t] = math.log(v - 1)\n"
        "    def generate(self, ids, **kw):\n"
        "        while True:\n"
        "            yield 7\n")
    run_specdecode("formats", "--formats", "bfloat16,bfloat16:int8,bfloat16:native:static", "--ks", "1,3",
                   "--repeats", "1",
                   "--num-prompts", "2", "--max-new-tokens", "6", "--passages", str(passages), "--threads", "2",
                   "--llama-bench", str(bench), "--llama-cpp", "--out", str(out), env={"PYTHONPATH": str(fake)})
    result = json.loads(out.read_text())
    assert result["formats"] == ["bfloat16:native", "bfloat16:int8", "bfloat16:native:static"]
    assert result["reference"] == "bfloat16:native"
    ref, int8, static = result["rows"]
    assert ref["kernels"]["mode"] == "auto"
    assert static["kernels"] == {"mode": "static", "source": "static", "choices": {}}
    assert static["top1_agreement"] > 0.9  # the same formula (bf16: identical here; summation order may differ)
    assert ref["top1_agreement"] == 1.0 and ref["greedy_identical"] == ref["greedy_prompts"] == 2
    assert 0.5 < int8["top1_agreement"] <= 1.0 and ref["passage_tokens"] == int8["passage_tokens"] > 20
    assert int8["perplexity"] == pytest.approx(ref["perplexity"], rel=0.2)  # int8 is close, not a broken model
    for row in result["rows"]:
        assert set(row["forward_ms"]) == {"1", "3"} and row["verify_cost"]["1"] == 1.0
    assert result["fingerprint"]["threads"] == 2
    llama = result["llama_cpp"]  # llama.cpp's curve beside ours: the same GGUF, depth and threads
    assert llama["forward_ms"] == {"1": 2.0, "3": 4.0} and llama["verify_cost"]["3"] == 2.0
    assert llama["perplexity"] == pytest.approx(2.0, rel=1e-4) and llama["passage_tokens"] == ref["passage_tokens"]
    assert 0 <= llama["top1_agreement"] <= 1 and llama["greedy_prompts"] == 2
    assert llama["greedy_identical"] == 0 and llama["mean_first_divergence"] == 0  # 7 is nobody's first answer
    opened = [json.loads(line) for line in (tmp_path / "llama.txt").read_text().splitlines()]
    assert [o.get("logits_all", False) for o in opened] == [True, False] and all(o["n_threads"] == 2 for o in opened)
    calls = (tmp_path / "args.txt").read_text().splitlines()
    assert len(calls) == 2 and all("-d 200 -t 2" in c and c.startswith("-m ") and ".gguf" in c for c in calls)


def test_llama_cpp_without_its_extra_is_refused_before_any_work(tmp_path):
    empty = tmp_path / "no_llama_cpp"  # llama_cpp shadowed by a module that fails to import, as if not installed
    empty.mkdir()
    (empty / "llama_cpp.py").write_text("raise ImportError('no llama_cpp here')\n")
    out = run_specdecode("formats", "--formats", "bfloat16", "--llama-cpp", check=False,
                         env={"PYTHONPATH": str(empty)})
    assert out.returncode != 0 and "pip install 'specdecode[llamacpp]'" in out.stderr
    assert "timing" not in out.stderr


def test_weights_flag_is_refused_with_the_choices():
    out = run_specdecode("generate", "hi", "--weights", "int4", check=False)
    assert out.returncode == 2 and "invalid choice: 'int4'" in out.stderr and "native" in out.stderr
