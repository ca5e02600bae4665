"""What ``bench --methods`` and ``sweep`` measure: the method-string grammar (one parser) and the
methods themselves, one registry (``METHODS``: each kind's grammar, what it measures, its check and its
builder). Ours (``baseline``, ``eagle3``) take ``compile=on|off`` (compiled or eager steps for that method
alone, whatever ``--compile`` says: both in one interleaved run); ``eagle3`` with no parameters is the shape
``generate`` decodes with (``--spec-config auto``: chosen by ``runtime.autospec``; the parameters given are
kept, ``spec=static`` takes ``SpecConfig()`` under them), its decoder from the one factory,
``runtime.decoders.build_decoder``. Peers run in process (``hf``, ``llamacpp``), as servers bench starts
(``llamaserver``, ``vllm``: ``bench.llamaserver``, ``bench.vllmserver``), through OpenVINO GenAI
(``bench.openvino``), or as a running server (``served``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.llamaserver import build_llamaserver
from specdecode.bench.openvino import OpenVINOMethod, check_openvino
from specdecode.bench.output import Method, RunOutput
from specdecode.bench.remote.run import RemoteError
from specdecode.bench.servers import ServedMethod
from specdecode.bench.vllmserver import build_vllm, check_vllm
from specdecode.core.compiled import CompiledRunner
from specdecode.core.costmodel import AutoSpec
from specdecode.core.drafter import Eagle3Drafter
from specdecode.core.engine import Engine, TokenDecoder, baseline_decode
from specdecode.core.requests import GenerateOptions
from specdecode.core.runner import EAGER, StepRunner
from specdecode.core.speculative import SpecConfig
from specdecode.io.loading import LoadedModel
from specdecode.runtime.autospec import SPEC_MODES, SpecChoice
from specdecode.runtime.decoders import DecoderSpec, build_decoder
from specdecode.runtime.device import synchronize
from specdecode.runtime.session import Session

EAGLE3_KEYS = {"steps": "num_steps", "topk": "topk", "draft_tokens": "num_draft_tokens"}
EAGLE3_OTHER_KEYS = ("drafter", "spec", "adapt", "ngram", "budget", "compile", "drafter_weights")


class BaselineMethod:
    """Our non-speculative decode: the reference every speedup is measured against
    (or, given a decoder, any engine decoder: EAGLE-3 configurations), with ``runner``'s steps."""

    def __init__(self, name: str, loaded: LoadedModel, decoder: TokenDecoder | None = None,
                 spec_config: SpecConfig | None = None, spec_choice: SpecChoice | None = None,
                 runner: StepRunner = EAGER) -> None:
        self.name = name
        self.model = loaded.model
        self.runner = runner
        self.spec_config = spec_config  # what an EAGLE-3 method measures (recorded with the run)
        self.spec_choice = spec_choice  # how that shape was chosen (runtime.autospec; recorded with the run)
        self.decoder = replace(decoder if decoder is not None else baseline_decode, runner=runner)
        self.engine = Engine(loaded.model, loaded.tokenizer, self.decoder)

    def prepare(self, encoded: Sequence[list[int]], max_new_tokens: int) -> int:
        """Compile now, when this method runs compiled steps, every graph its requests will need
        (``CompiledRunner.warm``), so that no timed request waits for the compiler; returns how many."""
        if not isinstance(self.runner, CompiledRunner):
            return 0
        drafter = self.decoder.drafter
        return sum(self.runner.warm(self.model, drafter, len(ids), max_new_tokens, self.spec_config)
                   for ids in encoded)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        r = self.engine.generate(prompt_ids, GenerateOptions(max_new_tokens=max_new_tokens))
        return RunOutput(r.token_ids, r.elapsed_s, r.ttft_s, dict(r.stats))


class HFMethod:
    """transformers' greedy ``generate`` on the same GGUF, dtype and threads (outside reference)."""

    def __init__(self, name: str, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        self.device = device
        src = loaded.source
        kwargs = {"gguf_file": src.name} if src.is_file() else {}
        path = src.parent if src.is_file() else src
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
        self.model = model.to(device).eval()
        self.eos = list(loaded.tokenizer.eos_token_ids)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        from transformers.generation.streamers import BaseStreamer

        first: list[float] = []

        class FirstToken(BaseStreamer):
            calls = 0

            def put(self, value):
                FirstToken.calls += 1
                if FirstToken.calls == 2:  # the first call carries the prompt
                    first.append(time.perf_counter())

            def end(self):
                pass

        x = torch.tensor([prompt_ids], device=self.device)
        synchronize(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos[0],
                                      streamer=FirstToken())
        synchronize(self.device)
        elapsed = time.perf_counter() - t0
        return RunOutput(out[0, len(prompt_ids):].tolist(), elapsed, (first[0] if first else t0 + elapsed) - t0)


def open_llama(name: str, model_path: Path, threads: int, n_ctx: int = 4096, logits_all: bool = False) -> Any:
    """llama-cpp-python's ``Llama`` on a GGUF file (``logits_all``: keep every position's logits, to score
    text), or a ValueError that names the extra to install."""
    if not (model_path.is_file() and model_path.suffix.lower() == ".gguf"):
        raise ValueError(f"{name!r} runs a GGUF file; the model is {model_path}")
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ValueError(f"{name!r} needs llama-cpp-python ({e}): pip install 'specdecode[llamacpp]' "
                         "(it builds llama.cpp from source)") from None
    extra: dict[str, Any] = {"logits_all": True} if logits_all else {}  # asked only to score text
    return Llama(model_path=str(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 verbose=False, **extra)


class LlamaCppMethod:
    """llama.cpp (through llama-cpp-python) on the same GGUF file, the same prompt token ids and
    the same threads, greedy, stopping at the same stop tokens (included in the output, as ours
    are): what a user would run instead of us, in the same table."""

    def __init__(self, name: str, model_path: Path, threads: int, stop_ids: Sequence[int]) -> None:
        self.name = name
        self.stop_ids = set(stop_ids)
        self.threads = threads
        self.llm = open_llama(name, model_path, threads)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        self.llm.reset()  # no prefix reuse from the previous prompt: every run pays its prefill
        out: list[int] = []
        first = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if tok in self.stop_ids or len(out) >= max_new_tokens:
                break
        elapsed = time.perf_counter() - t0
        return RunOutput(out, elapsed, (first or t0 + elapsed) - t0, {"engine": "llama.cpp"})


def split_methods(text: str) -> list[str]:
    """Split ``--methods`` on commas that start a new method (``eagle3:steps=2,topk=1,hf``)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if out and "=" in part and ":" not in part:
            out[-1] += "," + part  # a parameter of the method before
        else:
            out.append(part)
    return out


def parse_method(spec: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name:key=value,key=value``."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params


def eagle3_method(steps: int, topk: int, draft_tokens: int | None = None) -> str:
    """The method string of one EAGLE-3 configuration (what ``sweep`` measures)."""
    return f"eagle3:steps={steps},topk={topk}" + ("" if draft_tokens is None else f",draft_tokens={draft_tokens}")


def method_spec_request(spec: str) -> SpecConfig | AutoSpec:
    """What an ``eagle3[:...]`` method string asks for: the shape chosen by measurement around the
    parameters given (``eagle3`` alone: what ``generate`` runs), or with ``spec=static`` the
    parameters over ``SpecConfig()``."""
    name, params = parse_method(spec)
    if name != "eagle3":
        raise ValueError(f"method {spec!r} is not an eagle3 configuration")
    unknown = set(params) - set(EAGLE3_KEYS) - set(EAGLE3_OTHER_KEYS)
    if unknown:
        raise ValueError(f"method {spec!r}: unknown parameter(s) {sorted(unknown)}; "
                         f"use {', '.join([*EAGLE3_KEYS, *EAGLE3_OTHER_KEYS])}")
    if params.get("spec", "auto") not in SPEC_MODES:
        raise ValueError(f"method {spec!r}: spec must be one of {', '.join(SPEC_MODES)}")
    try:
        kwargs = {EAGLE3_KEYS[k]: int(v) for k, v in params.items() if k in EAGLE3_KEYS}
    except ValueError:
        raise ValueError(f"method {spec!r}: steps, topk and draft_tokens must be integers") from None
    auto = AutoSpec(**kwargs)
    return auto.static() if params.get("spec") == "static" else auto


def method_spec_config(spec: str) -> SpecConfig:
    """The ``SpecConfig`` of an ``eagle3`` method string that names its shape (steps and topk, as
    ``sweep`` writes them); an incomplete one reads as ``SpecConfig()`` under its parameters."""
    request = method_spec_request(spec)
    return request if isinstance(request, SpecConfig) else request.static()


def method_decoder_spec(spec: str, drafter_path: str | None = None) -> DecoderSpec:
    """The ``DecoderSpec`` of an ``eagle3[:...]`` method; ``drafter=`` in the string wins over ``drafter_path``."""
    params = parse_method(spec)[1]
    for flag in ("adapt", "budget"):
        if params.get(flag, "0") not in ("0", "1"):
            raise ValueError(f"method {spec!r}: {flag} must be 0 or 1")
    ngram = params.get("ngram", "0")
    if not ngram.isdigit():
        raise ValueError(f"method {spec!r}: ngram must be a count of tokens (0: off), got {ngram!r}")
    try:
        return DecoderSpec(drafter=params.get("drafter") or drafter_path, config=method_spec_request(spec),
                           adapt=params.get("adapt") == "1", allow_plain=False, ngram=int(ngram),
                           verify_budget=params.get("budget") == "1",
                           drafter_weights=params.get("drafter_weights", "auto"))
    except ValueError as e:
        raise ValueError(f"method {spec!r}: {e}") from None


def _method_runner(spec: str, params: dict[str, str], session: Session) -> StepRunner:
    """A method's ``compile=on|off``: the session's compiled steps (made for it if it has none) or
    eager; the session's runner when not given."""
    value = params.get("compile")
    if value is None:
        return session.runner
    if value not in ("on", "off"):
        raise ValueError(f"method {spec!r}: compile must be on or off")
    if value == "off":
        return EAGER
    if session.world_size > 1:
        raise ValueError(f"method {spec!r}: compiled steps do not run under tensor parallelism")
    return session.building_steps()


def _no_params(spec: str, params: dict[str, str], allowed: tuple[str, ...] = ()) -> None:
    extra = set(params) - set(allowed)
    if extra:
        but = f" but {', '.join(allowed)}" if allowed else ""
        raise ValueError(f"method {spec.partition(':')[0]!r} takes no parameters{but} (got {params})")


def _check_compile(spec: str, params: dict[str, str]) -> None:
    if params.get("compile", "on") not in ("on", "off"):
        raise ValueError(f"method {spec!r}: compile must be on or off")


def _check_baseline(spec: str, params: dict[str, str]) -> None:
    _no_params(spec, params, ("compile",))
    _check_compile(spec, params)


def _check_eagle3(spec: str, params: dict[str, str]) -> None:
    _check_compile(spec, params)
    method_decoder_spec(spec)


def _check_served(spec: str, params: dict[str, str]) -> None:
    if "url" not in params or set(params) - {"url", "model"}:
        raise ValueError(f"method {spec!r}: give the server as served:url=http://HOST:PORT[,model=NAME]")


def _build_baseline(spec: str, params: dict[str, str], session: Session, drafter_path: str | None,
                    drafters: dict | None) -> Method:
    return BaselineMethod(spec, session.loaded, runner=_method_runner(spec, params, session))


def _build_eagle3(spec: str, params: dict[str, str], session: Session, drafter_path: str | None,
                  drafters: dict | None) -> Method:
    decoder = build_decoder(method_decoder_spec(spec, drafter_path), session, drafters)
    if not decoder.is_speculative:
        raise ValueError(f"method {spec!r} needs a drafter: pass --drafter PATH (or drafter=random)")
    return BaselineMethod(spec, session.loaded, decoder.decode, decoder.config, decoder.choice,
                          _method_runner(spec, params, session))


def _build_served(spec: str, params: dict[str, str], session: Session, drafter_path: str | None,
                  drafters: dict | None) -> Method:
    try:
        return ServedMethod(spec, params["url"], params.get("model"), os.environ.get("SPECDECODE_API_KEY"))
    except RemoteError as e:
        raise ValueError(f"method {spec!r}: {e} (is the server running?)") from None


@dataclass(frozen=True)
class MethodKind:
    """One kind of bench method: its grammar and what it measures (the --methods help and the unknown-method
    error are written from these), how its parameters are checked before anything loads, and how it is built."""

    grammar: str
    what: str
    check: Callable[[str, dict[str, str]], None]
    build: Callable[[str, dict[str, str], Session, str | None, dict | None], Method]


# Every method string bench takes, by name.
METHODS: dict[str, MethodKind] = {
    "baseline": MethodKind("baseline[:compile=on|off]", "our plain decoding (the usual reference)", _check_baseline,
                           _build_baseline),
    "eagle3": MethodKind(
        "eagle3[:steps=S,topk=K,draft_tokens=N,drafter=PATH,spec=auto|static,adapt=0|1,ngram=M,budget=0|1,"
        "compile=on|off,drafter_weights=auto|native|int8|q4]",
        "our EAGLE-3; no parameters: the shape --spec-config auto chooses for this run's steps (generate's, on the "
        "same steps); ngram=M: with up to M tokens a cycle copied from the request's text (generate --ngram); "
        "budget=1: each cycle verifies what pays (generate --verify-budget); drafter_weights: the drafter's "
        "format (generate --drafter-weights)", _check_eagle3, _build_eagle3),
    "hf": MethodKind("hf", "transformers' generate on the same weights", _no_params,
                     lambda spec, params, s, d, ds: HFMethod(spec, s.loaded, s.dtype, s.device)),
    "llamacpp": MethodKind(
        "llamacpp", "llama.cpp in process (llama-cpp-python) on the same GGUF", _no_params,
        lambda spec, params, s, d, ds: LlamaCppMethod(spec, s.loaded.source, s.threads,
                                                      s.loaded.tokenizer.eos_token_ids)),
    "llamaserver": MethodKind(
        "llamaserver[:spec=eagle3,n_max=N,drafter=PATH,server=PATH,ngram=TYPE+TYPE]",
        "llama.cpp's llama-server started by bench, plain or with its EAGLE-3 and our drafter, and with its own "
        "n-gram drafts (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache) beside it or alone",
        lambda spec, params: None,  # checked as it is built: its n-gram types need io.llamacpp (torch)
        lambda spec, params, s, d, ds: build_llamaserver(spec, params, s.loaded.source, s.threads, d,
                                                         s.loaded.tokenizer.eos_token_ids)),
    "openvino": MethodKind(
        "openvino[:spec=eagle3|prompt_lookup,draft_tokens=N,ngram=M,precision=default|f32,weights=gguf|f32,"
        "drafter=PATH]",
        "OpenVINO GenAI on the target (and our drafter) exported to OpenVINO IR once: plain, its EAGLE-3 or its "
        "prompt lookup; precision=default keeps its CPU defaults (not lossless), f32 asks for float32",
        check_openvino, lambda spec, params, s, d, ds: OpenVINOMethod(spec, params, s.loaded.source, s.threads, d)),
    "vllm": MethodKind(
        "vllm[:spec=eagle3,n=N,drafter=PATH,python=PATH,dtype=D]",
        "vLLM started by bench from its own environment (python=, $SPECDECODE_VLLM_PYTHON), plain or with its "
        "EAGLE-3 and our drafter drafting a chain of N; float32 on a CPU unless dtype= says otherwise",
        check_vllm, lambda spec, params, s, d, ds: build_vllm(spec, params, s.loaded.model_dir, s.threads, d,
                                                              s.loaded.tokenizer.eos_token_ids, s.device.type)),
    "served": MethodKind("served:url=URL[,model=NAME]", "a running OpenAI-compatible server, same token ids",
                         _check_served, _build_served),
}


def methods_help() -> str:
    return "; ".join(f"{kind.grammar} ({kind.what})" for kind in METHODS.values())


def check_method(spec: str) -> tuple[str, dict[str, str]]:
    """A method string's name and parameters, checked without loading anything (``bench`` checks every
    method before the model loads); ``build_method`` checks the same way."""
    name, params = parse_method(spec)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(k.grammar for k in METHODS.values())}")
    METHODS[name].check(spec, params)
    return name, params


def build_method(spec: str, session: Session, drafter_path: str | None = None,
                 drafters: dict[tuple[str, str], Eagle3Drafter] | None = None) -> Method:
    """Any method of ``METHODS`` from its string, checked first."""
    name, params = check_method(spec)
    return METHODS[name].build(spec, params, session, drafter_path, drafters)
