"""Scale out on the engines users already run: export a drafter for SGLang or vLLM, and launch
either with the speculative flags, a launch profile's environment, and a recorded fingerprint.

Both engines read the SpecForge key layout we write (``fc``, ``midlayer.*``, ``d2t``...);
they differ on ``eagle_aux_hidden_state_layer_ids``: SGLang adds 1 to explicit ids (id =
output of layer id), vLLM taps the input of layer id. An export for one engine read by the
other silently shifts every tap by one layer and costs all acceptance, so ``launch vllm``
exports a vLLM copy of a drafter written in SGLang's convention, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ENGINES = ("sglang", "vllm")


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=ENGINES, required=True, help="engine whose aux-layer-id convention to write")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--aux-layer-convention", choices=ENGINES, default=None,
                   help="how to read the SOURCE drafter's explicit aux ids when it does not record it")


def export_drafter(model: str | None, drafter: str | None, fmt: str, out: str | Path,
                   source_convention: str | None = None) -> dict:
    """Write ``drafter`` (validated against the target) in engine ``fmt``'s convention; the
    taps entering target layers stay the same. Returns what was written."""
    from specdecode.io.checkpoints import load_drafter, save_drafter
    from specdecode.io.paths import default_drafter_path
    from specdecode.io.loading import load_model

    path = drafter or default_drafter_path()
    if path is None:
        raise ValueError("no drafter given and no shipped drafter for this model: pass --drafter DIR")
    loaded = load_model(model, "float32", "cpu")
    head = load_drafter(path, loaded.model, convention=source_convention)
    src_cfg = json.loads((Path(path) / "config.json").read_text())
    dtype = {"bfloat16": "bfloat16", "float16": "float16"}.get(src_cfg.get("torch_dtype"), "float32")
    import torch

    save_drafter(head, out, dtype=getattr(torch, dtype), convention=fmt)
    written = json.loads((Path(out) / "config.json").read_text())
    return {"source": str(path), "out": str(out), "format": fmt,
            "aux_ids": written["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            "taps_entering_layers": list(head.config.aux_layer_ids)}


def cmd_export(args: argparse.Namespace) -> int:
    info = export_drafter(args.model, args.drafter, args.format, args.out, args.aux_layer_convention)
    print(f"wrote {info['out']} for {info['format']}: eagle_aux_hidden_state_layer_ids {info['aux_ids']} "
          f"(= hidden states entering target layers {info['taps_entering_layers']})")
    return 0


def recorded_convention(drafter_dir: str | Path) -> str | None:
    from specdecode.io.checkpoints import CONVENTION_KEY

    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (cfg.get("eagle_config") or {}).get(CONVENTION_KEY)


def engine_installed(engine: str) -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None if engine == "sglang" else shutil.which("vllm") is not None


def tp_divisibility(model_dir: Path, tp: int) -> str | None:
    """Why the model's heads cannot be split ``tp`` ways, or None."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if heads and kv and (heads % tp or (kv % tp and tp % kv)):
        return f"the model has {heads} attention heads and {kv} KV heads, which do not split evenly {tp} ways"
    return None


def engine_command(engine: str, model_dir: str, drafter_dir: str | None, *, tp: int, num_steps: int, topk: int,
                   num_draft_tokens: int | None, host: str, port: int, extra: list[str]) -> list[str]:
    """The server command line with the speculative flags of ``engine``."""
    if engine == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--tp-size", str(tp),
               "--host", host, "--port", str(port)]
        if drafter_dir:
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
                    "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
                    "--speculative-num-draft-tokens", str(num_draft_tokens or num_steps + 1)]
        return cmd + extra
    if engine == "vllm":
        if drafter_dir and topk != 1:
            raise ValueError("vLLM's EAGLE-3 proposes a chain: use --topk 1 (trees: launch sglang)")
        cmd = ["vllm", "serve", model_dir, "--tensor-parallel-size", str(tp), "--host", host, "--port", str(port)]
        if drafter_dir:
            spec = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": num_steps,
                    "draft_tensor_parallel_size": 1}
            cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        return cmd + extra
    raise ValueError(f"unknown engine {engine!r}: {', '.join(ENGINES)}")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("--model", default=None, help="target model: HF directory or GGUF (converted to an HF directory "
                                                 "the engines can read); default: the shipped SmolLM2")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (default: the shipped one)")
    p.add_argument("--no-spec", action="store_true", help="launch without speculative decoding (a baseline)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--num-steps", type=int, default=None, help="draft depth (default 2, the best chain in our sweep)")
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--launch-profile", default=None, metavar="NAME", help="environment to launch the engine with")
    p.add_argument("--store", default=None, help="results store for the launch record")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command; run nothing")
    p.add_argument("--engine-args", default="", help="more arguments for the engine, one shell-quoted string, "
                                                     "e.g. \"--mem-fraction-static 0.8\"")


def cmd_launch(args: argparse.Namespace) -> int:
    from specdecode.core.speculative import SpecConfig
    from specdecode.bench.fingerprint import capture, redact_argv
    from specdecode.io.paths import cache_root, default_drafter_path
    from specdecode.io.loading import resolve_model_dir
    from specdecode.bench.profiles import load_profile
    from specdecode.bench.store import ResultsStore, Run, new_run_id

    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if not args.dry_run and not engine_installed(args.engine):
        raise ValueError(f"{args.engine} is not installed in this environment; `--dry-run` prints the command "
                         f"(and environment) to run where it is")
    source, model_dir = resolve_model_dir(args.model)
    heads = tp_divisibility(model_dir, args.tp)
    if heads:
        print(f"WARNING: {heads}; {args.engine} will refuse --tp {args.tp}", file=sys.stderr)
    drafter = None if args.no_spec else (args.drafter or (None if args.model else default_drafter_path()))
    drafter = str(drafter) if drafter else None
    if drafter and not Path(drafter).is_dir():
        raise FileNotFoundError(f"drafter directory {drafter} not found")
    notes = []
    if drafter and args.engine == "vllm" and recorded_convention(drafter) != "vllm":
        # vLLM would read SGLang-convention ids one layer early: export a vLLM copy
        target = cache_root() / "exports" / (Path(drafter).name + "-vllm")
        if args.dry_run:
            notes.append(f"drafter ids are in SGLang's convention: would export a vLLM copy to {target}")
        else:
            export_drafter(args.model, drafter, "vllm", target)
            notes.append(f"drafter ids are in SGLang's convention: exported a vLLM copy to {target}")
        drafter = str(target)
    extra = shlex.split(args.engine_args)
    spec = SpecConfig(*(d if v is None else v for v, d in ((args.num_steps, SpecConfig().num_steps),
                                                            (args.topk, SpecConfig().topk))),
                      args.num_draft_tokens)
    cmd = engine_command(args.engine, str(model_dir), drafter, tp=args.tp,
                         num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens, host=args.host, port=args.port, extra=extra)
    profile = load_profile(args.launch_profile) if args.launch_profile else None
    env = profile.apply_to(os.environ) if profile else dict(os.environ)
    env_changes = {k: v for k, v in (profile.env if profile else {}).items()}

    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    shown_env = " ".join(f"{k}={shlex.quote(v)}" if v else f"-u {k}" for k, v in sorted(env_changes.items()))
    line = (f"env {shown_env} " if shown_env else "") + shlex.join(cmd)
    print(line)
    if args.dry_run:
        return 0
    fp = capture(threads=0, dtype="(engine)", device=f"{args.engine} tp={args.tp}", model_path=model_dir,
                 drafter_paths=[drafter] if drafter else (),
                 launch_profile=profile.record() if profile else None) | {
        "launch": {"engine": args.engine, "command": redact_argv(cmd), "endpoint": f"http://{args.host}:{args.port}"}}
    run = Run(new_run_id(), "launch", time.strftime("%Y-%m-%d %H:%M:%S"), fp, [], [], {"command": line})
    ResultsStore(args.store).save(run)
    print(f"launch recorded as run {run.run_id}; measure it with: specdecode bench --endpoint "
          f"http://{args.host}:{args.port}", file=sys.stderr)
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)  # the engine takes over this process (signals, exit code)
