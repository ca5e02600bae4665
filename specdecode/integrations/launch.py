"""Scale out on the engines users already run: launch SGLang, vLLM or llama.cpp's llama-server with
the speculative flags, a launch profile's environment, and a recorded fingerprint.

``plan_launch`` settles everything (the command, its environment, the drafter in the
engine's aux-layer-id convention, exported if needed: see ``specdecode.integrations.export``);
``record_launch`` stores the launch in the results store; the CLI prints and runs it.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.bench.fingerprint import capture, interpreter_versions, redact_argv
from specdecode.bench.profiles import LaunchProfile, load_profile
from specdecode.bench.store import ResultsStore, Run, new_run_id
from specdecode.core.speculative import SpecConfig
from specdecode.integrations.export import ENGINES, recorded_convention
from specdecode.io.llamacpp import drafter_gguf, find_llama_server, llama_spec_args
from specdecode.io.loading import model_head_counts, resolve_model_dir
from specdecode.io.paths import shipped_drafter_for
from specdecode.io.vllm import VLLM_CPU_DTYPE, VLLM_DISTRIBUTIONS, VLLM_MODULE, vllm_command, vllm_drafter

LAUNCH_ENGINES = (*ENGINES, "llamacpp")
CHAIN_ENGINES = ("vllm", "llamacpp")  # engines whose EAGLE-3 drafts a chain only
PYTHON_ENGINES = ("sglang", "vllm")  # engines that run as a module of a Python that has them (--engine-python)
ENGINE_DISTRIBUTIONS = {"sglang": ("sglang",), "vllm": VLLM_DISTRIBUTIONS}
VLLM_KV_ENV, VLLM_CPU_KV_GB = "VLLM_CPU_KVCACHE_SPACE", "4"


def engine_installed(engine: str, python: str | None = None) -> bool:
    """Whether ``engine`` can run: SGLang or vLLM importable by ``python`` (its own environment, or ours), or
    else vLLM's ``vllm`` command on $PATH (llama.cpp: ``find_llama_server`` says where, or why not)."""
    import importlib.util
    import subprocess

    if engine == "llamacpp":
        try:
            find_llama_server()
        except FileNotFoundError:
            return False
        return True
    if python is None:
        return importlib.util.find_spec(engine) is not None or (engine == "vllm" and shutil.which("vllm") is not None)
    try:
        return subprocess.run([python, "-c", f"import {engine}"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _script_python(command: str) -> str | None:
    """The interpreter a console script on $PATH runs with (its ``#!`` line), or None."""
    found = shutil.which(command)
    try:
        first = Path(found).read_bytes()[:512].split(b"\n", 1)[0].decode() if found else ""
    except (OSError, UnicodeDecodeError):
        return None
    return first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else None


def engine_dtype(command: list[str]) -> str | None:
    """The ``--dtype`` a command passes its engine (the last one wins, as argparse reads it), or None."""
    found = None
    for i, a in enumerate(command):
        if a == "--dtype" and i + 1 < len(command):
            found = command[i + 1]
        elif a.startswith("--dtype="):
            found = a.split("=", 1)[1]
    return found


def tp_divisibility(heads: int | None, kv: int | None, tp: int) -> str | None:
    """Why ``heads`` attention and ``kv`` KV heads cannot be split ``tp`` ways, or None."""
    if heads and kv and (heads % tp or (kv % tp and tp % kv)):
        return f"the model has {heads} attention heads and {kv} KV heads, which do not split evenly {tp} ways"
    return None


def check_llamacpp_shape(tp: int, topk: int, speculative: bool) -> None:
    """What llama-server cannot run, refused with the reason."""
    if tp != 1:
        raise ValueError("llama-server runs the model in one process: --tp is for SGLang and vLLM")
    if speculative and topk != 1:
        raise ValueError("llama.cpp's EAGLE-3 drafts a chain (--spec-draft-n-max tokens, no tree): use --topk 1 "
                         "(trees: launch sglang)")


def engine_command(engine: str, model_dir: str, drafter_dir: str | None, *, tp: int, num_steps: int, topk: int,
                   num_draft_tokens: int | None, host: str, port: int, extra: list[str],
                   python: str | None = None, server: str | None = None, threads: int | None = None,
                   parallel: int | None = None, llama_ngram: tuple[str, ...] = ()) -> list[str]:
    """The server command line with the speculative flags of ``engine`` (SGLang run by ``python``: the
    interpreter of its own environment; default ours. vLLM: its server module run by ``python``, or without
    one the ``vllm`` command. llama.cpp: ``server`` is llama-server, ``model_dir``
    the target GGUF, ``drafter_dir`` the drafter's GGUF, ``threads`` and ``parallel`` its -t and -np,
    ``llama_ngram`` its n-gram draft types beside the drafter or alone)."""
    if engine == "llamacpp":
        check_llamacpp_shape(tp, topk, drafter_dir is not None)
        # --metrics: its speculative counters at /metrics, which `bench --endpoint` reads
        cmd = [server or "llama-server", "-m", model_dir, "--host", host, "--port", str(port), "--metrics"]
        cmd += ["-t", str(threads)] if threads else []
        cmd += ["-np", str(parallel)] if parallel else []
        return cmd + llama_spec_args(drafter_dir, num_steps, llama_ngram) + extra
    if engine == "sglang":
        cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--tp-size", str(tp),
               "--host", host, "--port", str(port)]
        if drafter_dir:
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
                    "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
                    "--speculative-num-draft-tokens", str(num_draft_tokens or num_steps + 1)]
        return cmd + extra
    if engine == "vllm":
        if drafter_dir and topk != 1:
            raise ValueError("vLLM's EAGLE-3 proposes a chain: use --topk 1 (trees: launch sglang)")
        return vllm_command(model_dir, drafter_dir, num_steps, python=python, tp=tp, host=host, port=port,
                            extra=extra)
    raise ValueError(f"unknown engine {engine!r}: {', '.join(LAUNCH_ENGINES)}")


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch. ``drafter=None``: the shipped one when the model is the default."""

    engine: str
    model: str | None = None
    drafter: str | None = None
    speculative: bool = True
    tp: int = 1
    spec: SpecConfig = field(default_factory=SpecConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    launch_profile: str | None = None
    engine_args: tuple[str, ...] = ()
    dry_run: bool = False  # plan only: export nothing, and the engine need not be installed
    engine_python: str | None = None  # SGLang's or vLLM's interpreter (each usually has an environment of its own)
    llama_server: str | None = None  # llama.cpp: the llama-server binary (default: find_llama_server)
    threads: int | None = None  # llama.cpp: -t
    parallel: int | None = None  # llama.cpp: -np, parallel slots (continuous batching)
    llama_ngram: tuple[str, ...] = ()  # llama.cpp: its n-gram draft types (--spec-type) beside the drafter or alone

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class LaunchPlan:
    command: list[str]
    env: dict[str, str]  # the whole environment to run it with
    env_changes: dict[str, str]  # what the launch profile sets ("" = unset)
    model_dir: Path  # what the engine loads: an HF directory, or the GGUF for llama.cpp
    drafter: str | None  # the drafter the engine reads (an export for vLLM; a GGUF for llama.cpp)
    profile: LaunchProfile | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        """The command as one shell line, the profile's environment first (``env K=V -u K ...``)."""
        shown = " ".join(f"{k}={shlex.quote(v)}" if v else f"-u {k}" for k, v in sorted(self.env_changes.items()))
        return (f"env {shown} " if shown else "") + shlex.join(self.command)


def plan_launch(cfg: LaunchConfig) -> LaunchPlan:
    """The command, environment and drafter for ``cfg``; exports a vLLM copy of a drafter in
    SGLang's convention (unless ``dry_run``)."""

    if cfg.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {cfg.tp}")
    if cfg.engine_python and cfg.engine not in PYTHON_ENGINES:
        raise ValueError("--engine-python names SGLang's or vLLM's interpreter; llama-server is a binary: "
                         "--llama-server PATH")
    if cfg.engine == "llamacpp":
        return _plan_llamacpp(cfg)
    if cfg.llama_server or cfg.threads or cfg.parallel or cfg.llama_ngram:
        raise ValueError("--llama-server, --threads, --parallel and --llama-ngram are llama.cpp's; pass SGLang's and "
                         "vLLM's own settings with --engine-args")
    if not cfg.dry_run and not engine_installed(cfg.engine, cfg.engine_python):
        where = f"for {cfg.engine_python}" if cfg.engine_python else "in this environment"
        raise ValueError(f"{cfg.engine} is not installed {where}; name the interpreter of its own environment with "
                         "--engine-python (vLLM: scripts/setup_vllm.sh makes one), or `--dry-run` prints the command "
                         "(and environment) to run where it is")
    source, model_dir = resolve_model_dir(cfg.model, convert=not cfg.dry_run)  # a dry run converts nothing
    warnings = []
    notes = []
    if cfg.dry_run and not model_dir.exists():
        notes.append(f"{model_dir} does not exist yet: the GGUF is converted there (an HF directory for "
                     f"{cfg.engine}) by the first launch without --dry-run, or by any specdecode command that loads "
                     "the model, e.g. `specdecode generate 'Hi' --max-new-tokens 1`")
    heads = tp_divisibility(*model_head_counts(source, model_dir), cfg.tp)
    if heads:
        warnings.append(f"{heads}; {cfg.engine} will refuse --tp {cfg.tp}")
    found = None if not cfg.speculative else (cfg.drafter or shipped_drafter_for(cfg.model))
    drafter = str(found) if found else None
    if drafter and not Path(drafter).is_dir():
        raise FileNotFoundError(f"drafter directory {drafter} not found")
    if drafter and cfg.engine == "vllm":
        # vLLM would read eagle_config's SGLang-convention ids one layer early: a copy with the top-level list too
        copy, note = vllm_drafter(drafter, model_dir, cfg.dry_run)
        notes += [note] if note else []
        drafter = str(copy)
    if drafter and cfg.engine == "sglang" and recorded_convention(drafter) == "vllm":
        warnings.append(f"{drafter}: its eagle_config ids are in vLLM's numbering (an export --format vllm of an "
                        "earlier version): SGLang adds 1 and would tap every layer one later, silently; re-export "
                        "it with `specdecode export --format sglang`")
    steps = _drafted_depth(cfg, notes)
    python = cfg.engine_python
    if cfg.engine == "vllm" and python is None and importlib.util.find_spec("vllm") is not None:
        python = sys.executable  # its server module: PyPI's CPU build has no working `vllm` command
    cpu = cfg.engine == "vllm" and not _has_cuda()
    extra = list(cfg.engine_args) + (_vllm_dtype(cfg, warnings, notes) if cpu else [])
    cmd = engine_command(cfg.engine, str(model_dir), drafter, tp=cfg.tp, num_steps=steps, topk=cfg.spec.topk,
                         num_draft_tokens=cfg.spec.num_draft_tokens, host=cfg.host, port=cfg.port,
                         extra=extra, python=python)
    plan = _with_profile(cfg, cmd, model_dir, drafter, warnings, notes)
    if cpu and VLLM_KV_ENV not in plan.env:
        # vLLM's CPU default gives its KV cache most of the machine's memory: beside a bench client that loads a
        # model its worker was killed for memory (2026-12-08); the variable set (here or by a profile) wins
        plan.env[VLLM_KV_ENV] = plan.env_changes[VLLM_KV_ENV] = VLLM_CPU_KV_GB
        notes.append(f"vLLM on a CPU: {VLLM_KV_ENV}={VLLM_CPU_KV_GB} GiB of KV cache (its default takes most of the "
                     "machine's memory); set it to choose")
    return plan


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _vllm_dtype(cfg: LaunchConfig, warnings: list[str], notes: list[str]) -> list[str]:
    """The ``--dtype`` to add for vLLM on a machine without CUDA: float32 unless --engine-args names one (and a
    warning where that one is bfloat16 compiled)."""
    chosen = engine_dtype(list(cfg.engine_args))
    if chosen is None:
        notes.append(f"vLLM on a CPU: --dtype {VLLM_CPU_DTYPE} (its compiled bfloat16 path gave wrong text here; "
                     "docs/interop.md); choose with --engine-args \"--dtype ...\"")
        return ["--dtype", VLLM_CPU_DTYPE]
    if chosen in ("bfloat16", "auto") and "--enforce-eager" not in cfg.engine_args:
        warnings.append(f"vLLM --dtype {chosen} on a CPU, compiled: vLLM 0.32 gave wrong text this way on SmolLM2 "
                        "(docs/interop.md); add --enforce-eager, or leave --dtype out for float32")
    return []


def _drafted_depth(cfg: LaunchConfig, notes: list[str]) -> int:
    """The depth to pass the engine: a chain verifies num_draft_tokens - 1 drafted tokens, and the engines
    would draft num_steps (SGLang's chain check, vLLM's num_speculative_tokens, llama.cpp's n-max)."""
    spec = cfg.spec
    if spec.topk == 1 and spec.max_depth < spec.num_steps:
        notes.append(f"a chain of --num-steps {spec.num_steps} with --num-draft-tokens {spec.num_draft_tokens} drafts "
                     f"{spec.max_depth} token(s) per cycle: passing {spec.max_depth} step(s) to {cfg.engine}")
        return spec.max_depth
    return spec.num_steps


def _with_profile(cfg: LaunchConfig, cmd: list[str], model_dir: Path, drafter: str | None, warnings: list[str],
                  notes: list[str]) -> LaunchPlan:

    profile = load_profile(cfg.launch_profile) if cfg.launch_profile else None
    env = profile.apply_to(dict(os.environ)) if profile else dict(os.environ)
    env_changes = dict(profile.env) if profile else {}
    return LaunchPlan(cmd, env, env_changes, model_dir, drafter, profile, warnings, notes)


def _plan_llamacpp(cfg: LaunchConfig) -> LaunchPlan:
    """llama-server on the target GGUF itself (no conversion), the drafter as its GGUF (exported on the
    fly and cached; a .gguf given goes as it is)."""

    check_llamacpp_shape(cfg.tp, cfg.spec.topk, cfg.speculative)
    notes: list[str] = []
    try:
        server = find_llama_server(cfg.llama_server)
    except FileNotFoundError as e:
        if not cfg.dry_run:
            raise
        server = "llama-server"
        notes.append(str(e))
    source, _ = resolve_model_dir(cfg.model, convert=False)
    if source.suffix.lower() != ".gguf":
        raise ValueError(f"{source}: llama-server runs a GGUF; convert the target with llama.cpp's "
                         "convert_hf_to_gguf.py and pass --model TARGET.gguf")
    found = None if not cfg.speculative else (cfg.drafter or shipped_drafter_for(cfg.model))
    drafter = str(found) if found else None
    if drafter:
        path, note = drafter_gguf(drafter, source, cfg.dry_run)
        drafter = str(path)
        notes.append(note)
    steps = _drafted_depth(cfg, notes) if drafter else 0
    cmd = engine_command("llamacpp", str(source), drafter, tp=1, num_steps=steps, topk=cfg.spec.topk,
                         num_draft_tokens=cfg.spec.num_draft_tokens, host=cfg.host, port=cfg.port,
                         extra=list(cfg.engine_args), server=server, threads=cfg.threads,
                         parallel=cfg.parallel, llama_ngram=cfg.llama_ngram)
    return _with_profile(cfg, cmd, source, drafter, [], notes)


def record_launch(cfg: LaunchConfig, plan: LaunchPlan, store: str | None = None) -> str:
    """Append the launch (fingerprint, redacted command, endpoint) to the results store; its run id."""

    dtype = engine_dtype(plan.command)
    python = plan.command[0] if plan.command[1:3] == ["-m", VLLM_MODULE] or cfg.engine == "sglang" else None
    if cfg.engine == "vllm" and python is None:
        python = _script_python(plan.command[0])
    fp = capture(threads=0, dtype=dtype or "(the engine's default)", device=f"{cfg.engine} tp={cfg.tp}",
                 model_path=plan.model_dir, drafter_paths=[plan.drafter] if plan.drafter else (),
                 launch_profile=plan.profile.record() if plan.profile else None) | {
        "launch": {"engine": cfg.engine, "command": redact_argv(plan.command), "endpoint": cfg.endpoint,
                   # the engine's own interpreter and packages, not ours (the fingerprint's python and torch)
                   "engine_versions": interpreter_versions(python, ENGINE_DISTRIBUTIONS[cfg.engine])
                   if cfg.engine in PYTHON_ENGINES else {}}}
    run = Run(new_run_id(), "launch", time.strftime("%Y-%m-%d %H:%M:%S"), fp, [], [], {"command": plan.line})
    ResultsStore(store).save(run)
    return run.run_id
