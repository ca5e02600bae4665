"""`specdecode launch`: SGLang or vLLM with EAGLE-3 flags, a launch profile and a recorded
fingerprint (a front end to ``specdecode.integrations.launch``); the engine then takes over
this process."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.cli.common import add_store_args, spec_config
from specdecode.core.speculative import SpecConfig
from specdecode.integrations.launch import CHAIN_ENGINES, LAUNCH_ENGINES

VLLM_TOPK = 1  # vLLM's and llama.cpp's EAGLE-3 propose chains only: their branching


def launch_spec(args: argparse.Namespace) -> SpecConfig:
    """SpecConfig() for SGLang; for vLLM and llama.cpp the same with topk 1 (the only shape they draft)."""
    if args.topk is None and args.engine in CHAIN_ENGINES:
        args = argparse.Namespace(**vars(args) | {"topk": VLLM_TOPK})
    spec = spec_config(args)
    return spec if isinstance(spec, SpecConfig) else spec.static()  # nothing to measure the engine's machine with


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = SpecConfig()
    p = sub.add_parser("launch", help=SUBCOMMANDS["launch"][1],
                       description="Build the engine's server command (speculative flags, tensor parallel size), "
                                   "apply the launch profile's environment, record the launch in the results store, "
                                   "and run it (--dry-run prints it). Measure it with `specdecode bench --endpoint`.")
    p.add_argument("engine", choices=LAUNCH_ENGINES, help="the server to launch")
    p.add_argument("--model", default=None, help="target model: HF directory or GGUF (converted to an HF directory "
                                                 "the engines can read); default: the shipped SmolLM2")
    p.add_argument("--drafter", default=None,
                   help="EAGLE-3 drafter directory, or for llama.cpp its GGUF (default: the shipped one)")
    p.add_argument("--no-spec", action="store_true", help="launch without speculative decoding (a baseline)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size: the engine's GPUs")
    p.add_argument("--num-steps", type=int, default=None, help=f"draft depth (default {d.num_steps}, SpecConfig's)")
    p.add_argument("--topk", type=int, default=None,
                   help=f"branching per draft step (default: SGLang {d.topk}, SpecConfig's; vLLM and llama.cpp "
                        f"{VLLM_TOPK}, the only shape they draft)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"tree nodes verified, root included (default: SpecConfig's rule, {d.num_draft_tokens} "
                        "for the default)")
    p.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    p.add_argument("--port", type=int, default=30000, help="port the server listens on")
    p.add_argument("--launch-profile", default=None, metavar="NAME", help="environment to launch the engine with")
    add_store_args(p, writes=False)  # the launch is always recorded
    p.add_argument("--dry-run", action="store_true", help="print the environment and command; run nothing")
    p.add_argument("--engine-python", default=None, metavar="PYTHON",
                   help="the Python of SGLang's or vLLM's own environment (default: this one's where it has the "
                        "engine; vLLM: else the `vllm` command on $PATH). scripts/setup_vllm.sh makes vLLM's")
    g = p.add_argument_group("llama.cpp (launch llamacpp: llama-server on the target GGUF, the drafter exported "
                             "as its EAGLE-3 GGUF and cached)")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary (default: $SPECDECODE_LLAMA_SERVER, the [llamacpp] extra's, $PATH)")
    g.add_argument("--threads", type=int, default=None, help="llama-server -t")
    g.add_argument("--parallel", type=int, default=None, help="llama-server -np: parallel slots (continuous batching)")
    g.add_argument("--llama-ngram", default="", metavar="TYPES",
                   help="llama.cpp's own n-gram drafts beside the drafter (alone with --no-spec): comma-separated "
                        "--spec-type names, e.g. ngram-simple or ngram-map-k,ngram-mod")
    p.add_argument("--engine-args", default="", help="more arguments for the engine, one shell-quoted string, "
                                                     "e.g. \"--mem-fraction-static 0.8\"")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.integrations.launch import LaunchConfig, plan_launch, record_launch

    cfg = LaunchConfig(engine=args.engine, model=args.model, drafter=args.drafter, speculative=not args.no_spec,
                       tp=args.tp, spec=launch_spec(args), host=args.host, port=args.port,
                       launch_profile=args.launch_profile, engine_args=tuple(shlex.split(args.engine_args)),
                       dry_run=args.dry_run, engine_python=args.engine_python, llama_server=args.llama_server,
                       threads=args.threads, parallel=args.parallel,
                       llama_ngram=tuple(filter(None, args.llama_ngram.split(","))))
    plan = plan_launch(cfg)
    for w in plan.warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    for n in plan.notes:
        print(f"note: {n}", file=sys.stderr)
    print(plan.line)
    if args.dry_run:
        return 0
    run_id = record_launch(cfg, plan, args.store)
    print(f"launch recorded as run {run_id}; measure it with: specdecode bench --endpoint {cfg.endpoint}",
          file=sys.stderr)
    sys.stdout.flush()
    os.execvpe(plan.command[0], plan.command, plan.env)  # the engine takes over this process (signals, exit code)
