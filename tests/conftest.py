import pytest
import torch

from specdecode.core.model import ModelConfig, Transformer


@pytest.fixture(autouse=True, scope="session")
def _isolated_results(tmp_path_factory):
    """Runs measured by tests (and their subprocesses) go to a throwaway store and profile dir,
    never the user's."""
    import os

    root = tmp_path_factory.mktemp("specdecode-home")
    saved = {k: os.environ.get(k) for k in ("SPECDECODE_RESULTS_DB", "SPECDECODE_PROFILE_DIR")}
    os.environ["SPECDECODE_RESULTS_DB"] = str(root / "results.db")
    os.environ["SPECDECODE_PROFILE_DIR"] = str(root / "profiles")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
                num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # larger than default init: logits far from uniform
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def smollm():
    from specdecode.io.loading import load_model

    torch.set_num_threads(2)
    return load_model(None, "float32", "cpu")


@pytest.fixture(scope="session")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    from specdecode.io.paths import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def run_specdecode(*args, env=None, check=True, timeout=300):
    """The console script in a fresh process; ``env`` entries set (or, with None, remove)
    variables on top of this process's environment."""
    import os
    import subprocess
    import sys

    full_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    proc = subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc
