"""OpenVINO GenAI as a bench method: ``openvino`` (its plain decoding), ``openvino:spec=eagle3`` (its EAGLE-3 with
our drafter, exported once into the cache: ``io.openvino.cached_export``) or ``openvino:spec=prompt_lookup``, on the
same prompt token ids and threads as the methods beside it, greedy.

``precision=default`` keeps OpenVINO's CPU defaults (bf16 compute where the CPU has it, dynamic 8-bit activations,
a u8 KV cache), which is what its users get and is not lossless; ``precision=f32`` asks for float32 compute, KV
cache and no dynamic quantization. The table's agreement with the first method says what each costs. Accept length
comes from GenAI's own counters: tokens over target forwards, the bonus token counted (baseline 1.0)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specdecode.bench.output import RunOutput
from specdecode.io.openvino import OV_WEIGHTS, cached_export, openvino_modules

OPENVINO_KEYS = ("spec", "draft_tokens", "ngram", "precision", "weights", "drafter")
OV_SPECS = ("none", "eagle3", "prompt_lookup")
OV_PRECISIONS = ("default", "f32")


def check_openvino(spec: str, params: dict[str, str]) -> None:
    """An ``openvino[:...]`` method string's parameters, checked before anything loads."""
    unknown = set(params) - set(OPENVINO_KEYS)
    if unknown:
        raise ValueError(f"method {spec!r}: unknown parameter(s) {sorted(unknown)}; use {', '.join(OPENVINO_KEYS)}")
    for key, allowed in (("spec", OV_SPECS), ("precision", OV_PRECISIONS), ("weights", OV_WEIGHTS)):
        if key in params and params[key] not in allowed:
            raise ValueError(f"method {spec!r}: {key} must be one of {', '.join(allowed)}")
    for key in ("draft_tokens", "ngram"):
        if key in params and not (params[key].isdigit() and int(params[key]) > 0):
            raise ValueError(f"method {spec!r}: {key} must be a positive count of tokens")


def pipeline_properties(threads: int, precision: str) -> dict[str, Any]:
    """The CPU plugin's properties GenAI passes on: our thread count, and for ``f32`` float32 compute and KV
    cache with no dynamic activation quantization."""
    props: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if precision == "f32":
        props |= {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    return props


class OpenVINOMethod:
    """One GenAI ``LLMPipeline`` on the exported target (with the draft for ``spec=eagle3``)."""

    def __init__(self, name: str, params: dict[str, str], model_source: Path, threads: int,
                 drafter_path: str | None) -> None:
        check_openvino(name, params)
        openvino_modules()  # the extra is installed, or a clear error
        try:
            import openvino_genai as genai
        except ImportError as e:
            raise ValueError(f"{name!r} needs openvino-genai ({e}): pip install 'specdecode[openvino]'") from None
        self.name, self.genai = name, genai
        self.spec = params.get("spec", "none")
        try:
            export = cached_export(model_source, params.get("drafter") or drafter_path, self.spec == "eagle3",
                                   params.get("weights", "gguf"))
        except ValueError as e:
            raise ValueError(f"method {name!r}: {e}") from None
        props = pipeline_properties(threads, params.get("precision", "default"))
        self.config = genai.GenerationConfig()
        self.config.do_sample = False
        if self.spec == "eagle3" and export.draft is not None:
            draft = genai.draft_model(str(export.draft), "CPU", **props)
            self.pipe = genai.LLMPipeline(str(export.target), "CPU", draft_model=draft, **props)
            self.config.num_assistant_tokens = int(params.get("draft_tokens", "3"))
        elif self.spec == "prompt_lookup":
            self.pipe = genai.LLMPipeline(str(export.target), "CPU", prompt_lookup=True, **props)
            self.config.num_assistant_tokens = int(params.get("draft_tokens", "5"))
            self.config.max_ngram_size = int(params.get("ngram", "3"))
        else:
            self.pipe = genai.LLMPipeline(str(export.target), "CPU", **props)
        self.export = export

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        import numpy as np
        import openvino as ov

        self.config.max_new_tokens = max_new_tokens
        ids = np.asarray([prompt_ids], dtype=np.int64)
        inputs = self.genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        first: list[float] = []

        def streamer(_: Any) -> Any:
            if not first:
                first.append(time.perf_counter())
            return self.genai.StreamingStatus.RUNNING

        t0 = time.perf_counter()
        res = self.pipe.generate(inputs, self.config, streamer)
        elapsed = time.perf_counter() - t0
        tokens = [int(t) for t in res.tokens[0]]
        stats: dict[str, Any] = {"engine": "openvino-genai"}
        if self.spec != "none":
            stats |= self.spec_stats(res, len(tokens))
        return RunOutput(tokens, elapsed, (first[0] if first else t0 + elapsed) - t0, stats)

    @staticmethod
    def spec_stats(res: Any, generated: int) -> dict[str, Any]:
        """GenAI's counters in our terms: each target forward adds one step of tokens (``m_batch_sizes``, the
        prefill's one included), so forwards = steps and accepted = tokens - forwards (as ``bench.llamaserver``).
        No accept rate: GenAI's draft-token count includes more than the drafts it verifies (it gave 3.9 a cycle
        at 3 draft tokens), and prompt lookup counts none."""
        cycles = len(res.perf_metrics.raw_metrics.m_batch_sizes)
        if cycles <= 0:
            return {}
        return {"cycles": cycles, "accept_length": generated / cycles, "accepted": generated - cycles}
