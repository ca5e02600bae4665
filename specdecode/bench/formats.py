"""Weight formats and dtypes side by side (``specdecode formats``): for each
``dtype:weights[:kernels[:activations]]`` format, the cost of one target forward over k tokens (k = 1 is a
decode step, larger k a verify), held-out perplexity, top-1 agreement with the first
(reference) format on the same text, and greedy agreement with it on real prompts. Timings
interleave the formats (every format at one k before the next k), all models loaded at once,
the same threads."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.bench.methods import LlamaCppMethod, open_llama
from specdecode.core.engine import BaselineDecoder, Engine
from specdecode.core.kernels import KERNEL_MODES
from specdecode.core.model import Transformer
from specdecode.core.quant import ACTIVATIONS, DEFAULT_ACTIVATIONS
from specdecode.core.requests import GenerateOptions
from specdecode.io.llamacpp import find_llama_tool
from specdecode.io.prompts import Prompt, encode_prompt, load_prompts
from specdecode.runtime.session import RuntimeConfig, Session, start
from specdecode.runtime.weights import WEIGHT_FORMATS, weight_format

DEFAULT_FORMATS = ("float32:native", "bfloat16:native", "bfloat16:int8", "float32:int8")


def parse_format(text: str) -> tuple[str, str, str, str]:
    """``dtype:weights[:kernels[:activations]]`` (``bfloat16:int8``, ``bfloat16:native:static``,
    ``bfloat16:q4:auto:int16``); weights default to native, kernels to auto (``--kernels``), activations to
    ``--activations``'s default."""
    dtype, weights, kernels, activations, *extra = text.strip().split(":") + ["", "", ""]
    weights, kernels = weights or "native", kernels or "auto"
    activations = activations or DEFAULT_ACTIVATIONS
    if weights not in WEIGHT_FORMATS or kernels not in KERNEL_MODES or activations not in ACTIVATIONS or any(extra):
        raise ValueError(f"format {text!r}: expected dtype:weights[:kernels[:activations]] with weights one of "
                         f"{', '.join(WEIGHT_FORMATS)}, kernels one of {', '.join(KERNEL_MODES)} and activations "
                         f"one of {', '.join(ACTIVATIONS)}")
    return dtype, weights, kernels, activations


def format_name(dtype: str, weights: str, kernels: str, activations: str = DEFAULT_ACTIVATIONS) -> str:
    """``dtype:weights``, with ``:static`` when the kernels are not the default and the activations when they
    are not (quantized weights only)."""
    name = f"{dtype}:{weights}" + ("" if kernels == "auto" else f":{kernels}")
    return name + (f":{activations}" if activations != DEFAULT_ACTIVATIONS and weight_format(weights).quantized else "")


@dataclass(frozen=True)
class FormatsConfig:
    formats: tuple[str, ...] = DEFAULT_FORMATS  # the first is the reference for agreement
    model: str | None = None
    threads: int | None = None
    passages: str | None = None  # natural text for perplexity (any prompts file); None: no perplexity
    num_passages: int = 24
    max_passage_tokens: int = 512
    prompts: str | None = None  # greedy agreement (None: the built-in prompts)
    num_prompts: int | None = None
    per_category: int | None = None
    max_new_tokens: int = 64
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    context: int = 200  # cached tokens before the timed forward
    repeats: int = 7
    # llama.cpp's cost curve beside ours: llama-bench (a path, or "auto": found as llama-server is) on the
    # GGUF as it is, a batch of k prompt tokens after ``context`` cached ones; None: not measured
    llama_bench: str | None = None
    # llama.cpp's own numbers on the same GGUF (llama-cpp-python): perplexity and top-1 agreement on the same
    # passages' token ids, greedy agreement on the same prompts, against the reference format
    llama_cpp: bool = False


def forward_ms(model: Transformer, k: int, context: int, repeats: int) -> float:
    """Median ms of one forward over k new tokens after about ``context`` cached ones (greedy
    decode: k = 1). Each repeat runs one cached token later, as decoding does: a kernel that is
    fast only at a length it has seen before (oneDNN's bf16 matmul builds a primitive per shape:
    1 ms per call) shows its real cost."""
    device = model.device
    cache = model.new_cache(1, context + repeats + 1 + k)
    times = []
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context + repeats + 1), device=device),
              torch.arange(context + repeats + 1, device=device), cache)
        tokens = torch.randint(0, 1000, (1, k), device=device)
        logits_at = torch.arange(k, device=device)
        for r in range(repeats + 1):  # the first is a warm-up
            cache.truncate(context + r)
            positions = torch.arange(context + r, context + r + k, device=device)
            t0 = time.perf_counter()
            model(tokens, positions, cache, logits_at=logits_at)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def llama_bench_ms(binary: str, gguf: str, k: int, context: int, threads: int, repeats: int) -> float:
    """Median ms of one llama.cpp forward over k tokens after ``context`` cached ones (llama-bench
    ``-p k -n 0 -d context``: a batch of k, as its verify of k tokens; k = 1 its decode step)."""
    import json
    import subprocess

    cmd = [binary, "-m", gguf, "-p", str(k), "-n", "0", "-d", str(context), "-t", str(threads), "-r", str(repeats),
           "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-1000:]}")
    return float(statistics.median(json.loads(done.stdout)[0]["samples_ns"])) / 1e6


def passage_ids(prompts: list[Prompt], tokenizer, max_tokens: int) -> list[list[int]]:
    """Each prompt's text (messages joined, no chat template), cut to ``max_tokens`` tokens."""
    out = []
    for p in prompts:
        text = p.text if p.text is not None else "\n".join(str(m.get("content", "")) for m in p.messages or ())
        ids = tokenizer.encode(text)[:max_tokens]
        if len(ids) > 1:
            out.append(ids)
    return out


def teacher_forced(model: Transformer, passages: list[list[int]]) -> tuple[float, int, list[torch.Tensor]]:
    """Total negative log-likelihood, tokens scored and the top-1 prediction at each position."""
    nll, count, top1 = 0.0, 0, []
    device = model.device
    with torch.inference_mode():
        for ids in passages:
            x = torch.tensor([ids], device=device)
            logits = model(x, torch.arange(len(ids), device=device), model.new_cache(1, len(ids))).logits[0, :-1]
            target = x[0, 1:]
            nll += float(F.cross_entropy(logits.double(), target, reduction="sum"))  # see llama_teacher_forced
            count += len(ids) - 1
            top1.append(logits.argmax(-1).cpu())
    return nll, count, top1


def llama_teacher_forced(llm: Any, passages: list[list[int]]) -> tuple[float, int, list[torch.Tensor]]:
    """``teacher_forced`` for llama.cpp (a llama-cpp-python ``Llama`` with every position's logits kept)."""
    nll, count, top1 = 0.0, 0, []
    for ids in passages:
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[: len(ids) - 1], dtype=np.float32))
        target = torch.tensor(ids[1:])
        # in float64: float32's sum of 49152 exponentials drifted by 1.4e-4 of the perplexity on an AVX2 EPYC
        # (8-lane partial sums), against under 1e-4 with AVX-512's 16 lanes; in float64 it is exact to 1e-12
        nll += float(F.cross_entropy(logits.double(), target, reduction="sum"))
        count += len(ids) - 1
        top1.append(logits.argmax(-1))
    return nll, count, top1


def first_divergences(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt whose output differs from the reference's: the index of the first differing token."""
    return [next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), min(len(o), len(r)))
            for o, r in zip(outputs, reference, strict=True) if o != r]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    firsts = first_divergences(outputs, reference)
    return {"greedy_identical": len(outputs) - len(firsts), "greedy_prompts": len(outputs),
            "mean_first_divergence": statistics.fmean(firsts) if firsts else None}


def measure_formats(config: FormatsConfig, on_progress: Callable[[str], None] | None = None) -> dict:
    """Every format's speed and quality; see the module doc. Returns ``{"formats": [...], "rows": [...]}``."""
    say = on_progress or (lambda _: None)
    triples = [parse_format(f) for f in config.formats]
    if len(set(triples)) != len(triples):
        raise ValueError(f"a format is listed twice: {', '.join(config.formats)}")
    names = [format_name(*t) for t in triples]
    sessions: list[Session] = []
    for name, (dtype, weights, kernels, activations) in zip(names, triples, strict=True):
        say(f"loading {name}")
        sessions.append(start(RuntimeConfig(model=config.model, dtype=dtype, threads=config.threads, weights=weights,
                                            kernels=kernels, activations=activations, stored_graphs=False)))
    rows: list[dict] = [{"format": n, "dtype": d, "weights": w, "activations": a, "kernels": s.kernels.summary(),
                         "forward_ms": {}}
                        for n, (d, w, _, a), s in zip(names, triples, sessions, strict=True)]
    llama: dict | None = None
    gguf = sessions[0].loaded.source
    if (config.llama_bench or config.llama_cpp) and gguf.suffix.lower() != ".gguf":
        raise ValueError(f"llama.cpp runs a GGUF; the model is {gguf}")
    llm = None
    if config.llama_cpp:  # opened first: a missing extra fails before the timings

        llm = open_llama("formats --llama-cpp", gguf, sessions[0].threads,
                         n_ctx=max(config.max_passage_tokens, 2048), logits_all=True)
    if config.llama_bench:

        binary = find_llama_tool("llama-bench", None if config.llama_bench == "auto" else config.llama_bench)
        llama = {"format": "llama.cpp", "binary": binary, "model": str(gguf), "forward_ms": {}}
    for k in config.ks:  # interleaved: every format at this k before the next k
        say(f"timing k={k}")
        for row, s in zip(rows, sessions, strict=True):
            row["forward_ms"][k] = forward_ms(s.loaded.model, k, config.context, config.repeats)
        if llama is not None:
            llama["forward_ms"][k] = llama_bench_ms(llama["binary"], llama["model"], k, config.context,
                                                    sessions[0].threads, config.repeats)
    if llama is not None:
        one = llama["forward_ms"].get(1)
        llama["verify_cost"] = {k: ms / one for k, ms in llama["forward_ms"].items()} if one else {}
    for row in rows:
        one = row["forward_ms"].get(1)
        row["verify_cost"] = {k: ms / one for k, ms in row["forward_ms"].items()} if one else {}
    if llm is not None and llama is None:
        llama = {"format": "llama.cpp", "model": str(gguf)}
    scored = rows + ([llama] if llm is not None and llama is not None else [])
    tokenizer = sessions[0].loaded.tokenizer
    if config.passages:
        texts = passage_ids(load_prompts(config.passages, config.num_passages), tokenizer, config.max_passage_tokens)
        ref_top1: list[torch.Tensor] = []
        for i, row in enumerate(scored):
            say(f"perplexity {row['format']}")
            nll, count, top1 = (teacher_forced(sessions[i].loaded.model, texts) if i < len(sessions)
                                else llama_teacher_forced(llm, texts))
            ref_top1 = top1 if i == 0 else ref_top1
            agree = sum(int((a == b).sum()) for a, b in zip(top1, ref_top1, strict=True))
            row |= {"perplexity": math.exp(nll / count), "passage_tokens": count, "top1_agreement": agree / count}
    prompts = load_prompts(config.prompts, config.num_prompts, config.per_category)
    encoded = [encode_prompt(p, tokenizer) for p in prompts]
    options = GenerateOptions(max_new_tokens=config.max_new_tokens)
    outputs = []
    for row, s in zip(rows, sessions, strict=True):
        say(f"greedy {row['format']}")
        engine = Engine(s.loaded.model, s.loaded.tokenizer, BaselineDecoder(runner=s.runner))
        outputs.append([engine.generate(ids, options).token_ids for ids in encoded])
    if llm is not None and llama is not None:

        say("greedy llama.cpp")
        # its own instance: one that keeps every position's logits may round the last one differently
        greedy = LlamaCppMethod("formats --llama-cpp", gguf, sessions[0].threads, tokenizer.eos_token_ids)
        outputs.append([list(greedy.run(ids, config.max_new_tokens).token_ids or ()) for ids in encoded])
    for row, out in zip(scored, outputs, strict=True):
        row |= agreement(out, outputs[0])
    return {"formats": names, "reference": names[0], "threads": sessions[0].threads, "context": config.context,
            "max_new_tokens": config.max_new_tokens, "rows": rows, "llama_cpp": llama}
