"""The library builds and runs stored graphs like the CLI (``runtime.builds``): a first ``start()`` on an empty
cache runs eager and ``build_missing`` stores what it ran eager, in the background; the second ``start()`` runs
those graphs, with no command in between, and decodes the same tokens (float64: exactly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specdecode.runtime import background
from tests.helpers import tiny_model_dir

# One start of the library in its own process, as a user's two runs are: what it decoded and how its steps ran.
START = """
import json, os, sys
from specdecode import DecoderSpec, Engine, GenerateOptions, RuntimeConfig, build_decoder, build_missing, start
config = RuntimeConfig(model=sys.argv[1], dtype="float64", kernels="static", threads=1)
spec = DecoderSpec(speculative=False)
prompt = [(7 * i) % 90 + 5 for i in range(20)]
session = start(config)
decoder = build_decoder(spec, session)
engine = Engine(session.loaded.model, session.loaded.tokenizer, decoder.decode)
tokens = engine.generate(prompt, GenerateOptions(max_new_tokens=12, stop_token_ids=())).token_ids
steps = session.compiled
built = build_missing(session, spec, decoder.config, len(prompt) + 12)
if built is not None and built.pid is not None:
    _, status = os.waitpid(built.pid, 0)  # the detached build is this process's child
    built = {"pid": built.pid, "exit": os.waitstatus_to_exitcode(status), "log": built.log.read_text()}
print(json.dumps({"stored_graphs": config.stored_graphs, "reason": session.compile_reason, "tokens": tokens,
                  "loaded": len(steps.loaded) if steps else 0, "eager": len(steps.eager) if steps else None,
                  "built": built if isinstance(built, dict) else None}))
"""


def test_the_second_start_runs_the_graphs_the_first_run_built_in_the_background(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model_dir(model_dir)
    env = os.environ | {"SPECDECODE_CACHE": str(tmp_path / "cache"), background.BACKGROUND_ENV: "1"}

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-c", START, str(model_dir)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run()
    assert first["stored_graphs"] and "stays eager" in first["reason"]  # the library's default, as generate's
    assert first["built"] is not None and first["built"]["exit"] == 0, first["built"]
    second = run()
    assert "graphs stored" in second["reason"], second
    assert second["loaded"] and second["eager"] == 0  # every step ran a stored graph
    assert second["tokens"] == first["tokens"]
    assert second["built"] is None  # nothing left to build
