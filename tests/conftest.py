import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _isolated_results(tmp_path_factory):
    """Runs measured by tests (and their subprocesses) go to a throwaway store and profile dir,
    never the user's, and start no background build of compiled graphs."""
    import os

    root = tmp_path_factory.mktemp("specdecode-home")
    saved = {k: os.environ.get(k) for k in ("SPECDECODE_RESULTS_DB", "SPECDECODE_PROFILE_DIR",
                                            "SPECDECODE_BACKGROUND_COMPILE")}
    os.environ["SPECDECODE_RESULTS_DB"] = str(root / "results.db")
    os.environ["SPECDECODE_PROFILE_DIR"] = str(root / "profiles")
    os.environ["SPECDECODE_BACKGROUND_COMPILE"] = "0"  # a generate test never leaves a build running
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
