"""Loading HF directories (checked against transformers) and clear errors for bad files."""

import json

import pytest
import torch

from specdecode.io.errors import ModelLoadError
from specdecode.io.hf import load_hf_dir
from specdecode.io.loading import load_model, resolve_model_dir
from tests.helpers import save_tiny_hf


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
])
def test_hf_directory_matches_transformers(tmp_path, kind, overrides):
    ref = save_tiny_hf(tmp_path, kind, **overrides)
    ours = load_hf_dir(tmp_path, torch.float32, "cpu")
    tokens = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        expected = ref(tokens).logits
    got = ours(tokens, torch.arange(40), ours.new_cache(1, 64)).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope.gguf")


def test_unsupported_file_type(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expected a .gguf file"):
        resolve_model_dir(f)


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="broken.gguf: not a readable GGUF"):
        load_model(f)


def test_directory_without_weights(tmp_path):
    save_tiny_hf(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_hf_dir(tmp_path, torch.float32, "cpu")


def test_truncated_safetensors(tmp_path):
    save_tiny_hf(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_hf_dir(tmp_path, torch.float32, "cpu")


def test_config_weight_mismatch(tmp_path):
    save_tiny_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match config.json"):
        load_hf_dir(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture(tmp_path):
    save_tiny_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_hf_dir(tmp_path, torch.float32, "cpu")


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_hf_dir(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("keep", [1000, 20_000_000])  # cut inside the header, then inside the tensor data
def test_truncated_gguf_says_truncated_everywhere_it_is_read(tmp_path, monkeypatch, keep):
    """The default GGUF cut short (a copy or download that stopped): loading it and counting its 4-bit
    layers (``--weights auto``) both say what is wrong and what to do, not gguf's IndexError."""
    from specdecode.io.gguf import q4_layer_count
    from specdecode.io.paths import default_model_path

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as src:
        cut.write_bytes(src.read(keep))
    for read in (load_model, q4_layer_count):
        with pytest.raises(ModelLoadError, match=r"cut.gguf: not a readable GGUF file, truncated or corrupt .*again"):
            read(cut)


def test_the_converted_gguf_directory_loads_in_engines_on_transformers_4(tmp_path, monkeypatch):
    """The HF directory a GGUF becomes (what `launch` hands SGLang and vLLM) says its dtype, and names a
    tokenizer class transformers 4 knows, which reads the same ids here."""
    import json

    from safetensors import safe_open
    from transformers import AutoTokenizer

    from specdecode.io.gguf import gguf_cache_dir, gguf_cache_path
    from specdecode.io.paths import default_model_path

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    earlier = gguf_cache_path(default_model_path()).with_name(
        gguf_cache_path(default_model_path()).name.rsplit("-", 1)[0] + "-c1")
    earlier.mkdir(parents=True)  # an earlier conversion of the same GGUF: replaced, not left beside it
    out = gguf_cache_dir(default_model_path())
    assert not earlier.exists() and out.is_dir()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"  # transformers 4 refuses a safetensors file without it
    local = str(default_model_path().parent)
    assert not any(local in v for v in meta.values())  # no path of this machine
    assert not any(local in p.read_text() for p in out.glob("*.json"))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("Hello, world")["input_ids"] == [19556, 28, 905]


@pytest.mark.model
def test_the_generic_fast_tokenizer_is_what_autotokenizer_gives():
    """load_tokenizer reads a tokenizer_config.json naming the generic fast class (the converted GGUF's)
    without AutoTokenizer: the same tokens, text, chat prompt and stop ids as AutoTokenizer's."""
    from transformers import AutoTokenizer

    from specdecode.io.loading import resolve_model_dir
    from specdecode.io.tokenizer import GENERIC_FAST, Tokenizer, _tokenizer_class, load_tokenizer

    _, model_dir = resolve_model_dir(None)
    assert _tokenizer_class(model_dir) in GENERIC_FAST  # the fast path is the one taken
    ours = load_tokenizer(model_dir)
    auto = Tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), ours.eos_token_ids)
    texts = ["Hello, world!", "  two  spaces\tand a tab\n\nnew lines", "<|im_start|>user\nhi<|im_end|>",
             "déjà vu: 東京, emoji 🙂, math ∑x²", "def f(x):\n    return x ** 2  # code", ""]
    for text in texts:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    assert ours.chat_prompt(chat) == auto.chat_prompt(chat) and ours.chat_prompt("hi") == auto.chat_prompt("hi")
    assert ours.eos_token_ids == (2,) and int(auto.hf.eos_token_id) in ours.eos_token_ids


@pytest.mark.model
def test_incremental_text_is_the_whole_decode_on_the_real_tokenizer():
    """The text layer decodes a window of the last tokens each step (``TextAssembler._decode``): on SmolLM2's
    tokenizer, fed in chunks of 1-5 tokens, the text released equals decoding every token at once, multi-byte
    characters split across tokens, spaces, code and special tokens included."""
    import random

    from specdecode.core.requests import GenerateOptions, TextAssembler
    from specdecode.io.loading import resolve_model_dir
    from specdecode.io.tokenizer import load_tokenizer

    _, model_dir = resolve_model_dir(None)
    tok = load_tokenizer(model_dir)
    text = ("déjà vu: 東京タワー, emoji 🙂🙂 and ∑x² = ½; "
            "def f(x):\n    return x ** 2  # code\n\n\t  spaces  <|im_end|> after a special token. " * 3)
    ids = tok.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        asm = TextAssembler(tok, GenerateOptions(max_new_tokens=len(ids) + 1, stop_token_ids=()))
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 5)
            out.append(asm.add(ids[i:i + n]).text)
            i += n
        assert "".join(out) + (asm._decode()[len(asm.text):]) == tok.decode(ids)
