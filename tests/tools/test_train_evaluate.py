"""tools/train/evaluate.py on a tiny random model with a real tokenizer: the per-address
breakdown comes from the same pass as the headline perplexity and adds up to it."""

import json
import math

import numpy as np
import pytest

from textmodel import make_text_model
from tool_module import load_tool


@pytest.fixture(scope="module")
def evaluate():
    return load_tool("train/evaluate.py", "evaluate_tool")


def test_document_spans_cut_after_each_run_of_newlines(evaluate):
    tokens = np.array([5, 6, 10, 10, 7, 8, 9, 11, 4, 10])
    is_break = np.isin(tokens, [10, 11])
    assert evaluate.document_spans(tokens, is_break) == [(0, 4), (4, 8), (8, 10)]
    assert evaluate.document_spans(tokens, np.zeros(len(tokens), dtype=bool)) == [(0, 10)]


def test_per_address_perplexities_add_up_to_the_whole(evaluate, tmp_path):
    from tinyloop import Model

    path = tmp_path / "m.tinyloop"
    make_text_model(path, add_bos=False)
    text = "\n\n".join(["The first address is short.", "A second one, a little longer than the first.",
                        "Third."]) + "\n"  # how data.py writes eval_sotu.txt
    with Model(path) as model:
        ids = model.tokenizer.encode(text, add_bos=False)
    held_out = tmp_path / "held.u16"
    np.array(ids, dtype=np.uint16).tofile(held_out)
    out = tmp_path / "eval.json"
    evaluate.main(["--model", str(path), "--teacher-model", str(path), "--tokens", str(held_out),
                   "--n-tokens", "0", "--ctx", "32", "--depths", "1,2", "--agree-windows", "0",
                   "--threads", "1", "--by-document", "--json", str(out)])
    res = json.loads(out.read_text())
    docs = res["documents"]
    assert len(docs) == 3 and docs[0]["start"] == 0 and docs[-1]["end"] == len(ids)
    assert all(a["end"] == b["start"] for a, b in zip(docs, docs[1:]))
    predicted = [d["end"] - 1 - max(d["start"] - 1, 0) for d in docs]  # log-probs predict tokens[1:]
    assert sum(predicted) == len(ids) - 1
    whole = math.exp(sum(n * math.log(d["ppl"]) for n, d in zip(predicted, docs)) / sum(predicted))
    assert whole == pytest.approx(res["ppl"][str(res["default_depth"])], rel=1e-9)
    assert all(d["teacher_ppl"] == pytest.approx(d["ppl"], rel=1e-12) for d in docs)  # the same model
    assert len({round(d["ppl"], 6) for d in docs}) == 3


def test_by_document_needs_the_default_depth(evaluate, tmp_path):
    path = tmp_path / "m.tinyloop"
    make_text_model(path, add_bos=False)
    held_out = tmp_path / "held.u16"
    np.arange(40, dtype=np.uint16).tofile(held_out)
    with pytest.raises(SystemExit, match="default depth \\(2\\)"):
        evaluate.main(["--model", str(path), "--tokens", str(held_out), "--depths", "1",
                       "--agree-windows", "0", "--by-document"])


def test_agreement_of_drafts_among_a_draft_vocabulary(evaluate, tmp_path):
    """With a draft vocabulary of one token, a draft always picks that token, so its
    agreement is the share of default-depth greedy tokens that are that token."""
    from tinyloop import Model
    from tinyloop.fileformat.tinyloop_file import copy_file, read_file

    plain = tmp_path / "plain.tinyloop"
    make_text_model(plain, add_bos=False)
    with read_file(plain) as f:
        vocab = f.dims["vocab_size"]
    with Model(plain) as model:
        ids = model.tokenizer.encode("the cat sat on the mat and the dog sat on the log " * 3,
                                     add_bos=False)[:model.info.max_seq_len - 1]
        depth = model.info.default_depth
        with model.context() as ctx:   # the default depth's greedy tokens after the prefix
            ref = [int(np.argmax(ctx.append(ids[:8], depth)))]
            ref += [int(np.argmax(ctx.append([t], depth))) for t in ids[8:]]
    favourite = max(set(ref), key=ref.count)
    frequency = np.full(vocab, 1e-4, dtype=np.float32)
    frequency[favourite] = 0.5
    path = tmp_path / "counted.tinyloop"
    copy_file(plain, path, metadata={"draft.vocab_size": 1}, tensors={"vocab.frequency": frequency})
    held_out = tmp_path / "held.u16"
    np.array(ids, dtype=np.uint16).tofile(held_out)
    out = tmp_path / "eval.json"
    evaluate.main(["--model", str(path), "--tokens", str(held_out), "--n-tokens", "0", "--ctx", "32",
                   "--depths", f"1,{depth}", "--agree-windows", "1", "--agree-prefix", "8",
                   "--agree-span", str(len(ids) - 8), "--threads", "1", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["draft_vocab"] == 1
    assert res["agreement_draft_vocab"]["1"] == pytest.approx(ref.count(favourite) / len(ref))
    assert "most frequent tokens" in res["markdown"]
