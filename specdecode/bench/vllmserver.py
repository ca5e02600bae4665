"""vLLM as a bench method, started by bench itself: ``vllm`` (plain) or ``vllm:spec=eagle3,n=N`` (its EAGLE-3 with
our drafter in the form vLLM reads, ``io.vllm``), from the interpreter of vLLM's own environment
(``python=PATH``, else ``$SPECDECODE_VLLM_PYTHON``, else ours where it imports vllm; ``scripts/setup_vllm.sh``
makes one).

Each prompt's token ids go to its ``/v1/completions`` (streamed, greedy, ``return_token_ids``, our stop ids as
``stop_token_ids``), timed on the client, interleaved with the local methods. Prefix caching is off, so every
request pays its prefill as ours do. Its speculative counters (``/metrics``: drafts, drafted and accepted tokens)
are read before and after each request (one at a time), so a request's accept length is its own (bonus token
counted, baseline 1.0). On a CPU it runs float32 unless ``dtype=`` says otherwise (``io.vllm.VLLM_CPU_DTYPE``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from specdecode.bench.output import RunOutput
from specdecode.bench.servers import ServedMethod, ServerProcess, check_server_params, eagle3_drafter, free_port
from specdecode.io.vllm import VLLM_CPU_DTYPE, vllm_command, vllm_drafter

SPEC_KEYS = ("spec", "n", "drafter", "python", "dtype")
DTYPES = ("float32", "bfloat16", "float16", "auto")
STARTUP_S = 600.0  # vLLM compiles its model at start: about a minute for SmolLM2 on 2 cores
PYTHON_ENV = "SPECDECODE_VLLM_PYTHON"


def vllm_python(given: str | None) -> str:
    """The interpreter that runs vLLM: ``given``, ``$SPECDECODE_VLLM_PYTHON``, or ours where it imports vllm."""
    python = given or os.environ.get(PYTHON_ENV)
    if python:
        if not Path(python).is_file():
            raise ValueError(f"vLLM's python {python} does not exist; scripts/setup_vllm.sh makes "
                             ".venv-vllm/bin/python")
        return python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ValueError(f"vLLM is not installed here: run scripts/setup_vllm.sh (vLLM in .venv-vllm), then give its "
                     f"interpreter as vllm:python=.venv-vllm/bin/python or ${PYTHON_ENV}")


def check_vllm(spec: str, params: dict[str, str]) -> None:
    """The parameters of a ``vllm`` method string, checked before anything loads."""
    check_server_params(spec, params, SPEC_KEYS, "vLLM", "n", "tokens drafted a cycle")
    if params.get("dtype", VLLM_CPU_DTYPE) not in DTYPES:
        raise ValueError(f"method {spec!r}: dtype must be one of {', '.join(DTYPES)}")
    if "n" in params and params.get("spec") != "eagle3":
        raise ValueError(f"method {spec!r}: n is the EAGLE-3 chain's length: add spec=eagle3")


class VLLMMethod:
    """A vLLM server process on a free loopback port, stopped when bench ends."""

    def __init__(self, name: str, model_dir: Path, python: str, threads: int, stop_ids: Sequence[int],
                 drafter_dir: Path | None = None, n: int = 1, dtype: str = VLLM_CPU_DTYPE,
                 context: int = 4096) -> None:
        self.name = name
        port = free_port()
        extra = ["--dtype", dtype, "--max-model-len", str(context), "--no-enable-prefix-caching",
                 "--max-num-seqs", "1"]
        command = vllm_command(str(model_dir), str(drafter_dir) if drafter_dir else None, n, python=python,
                               port=port, extra=extra)
        # its OpenMP threads on the first `threads` cores, as ours run; its KV cache sized for one request
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.server = ServerProcess(name, "vllm", command, port, startup_s=STARTUP_S, env=env)
        self.command = command
        self.served = ServedMethod(name, self.server.base, str(model_dir),
                                   extra_body={"stop_token_ids": list(stop_ids)})
        self.stop_ids = tuple(stop_ids)

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        out = self.served.run(prompt_ids, max_new_tokens)
        out.stats["engine"] = "vllm"
        return out

    def close(self) -> None:
        self.server.close()


def build_vllm(spec: str, params: dict[str, str], model_dir: Path, threads: int, drafter_path: str | None,
               stop_ids: Sequence[int], device_type: str = "cpu") -> VLLMMethod:
    """``vllm[:spec=eagle3,n=N,drafter=PATH,python=PATH,dtype=D]``: the drafter defaults to ``--drafter``, else the
    shipped one (copied into vLLM's form where it lacks the top-level id list); dtype: float32 on a CPU, else the
    engine's own default."""
    check_vllm(spec, params)
    python = vllm_python(params.get("python"))
    source = eagle3_drafter(spec, params, drafter_path)
    drafter = vllm_drafter(source, model_dir)[0] if source is not None else None
    dtype = params.get("dtype") or (VLLM_CPU_DTYPE if device_type == "cpu" else "auto")
    return VLLMMethod(spec, model_dir, python, threads, stop_ids, drafter, int(params.get("n", "1")), dtype)
