#!/usr/bin/env python3
"""The cost of a grammar's token mask per decode step on the shipped model (49,152
tokens): greedy generations of --new-tokens tokens that never stop early, picking on the
host without a grammar (a neutral logit_bias, the path a grammar's generation takes)
against the same with grammars whose states allow many tokens: any text, the inside of
a JSON string (nearly every token fits: the trie walk's worst case) and a JSON array of
numbers (few tokens fit), and a JSON Schema's grammar (tinyloop.grammar.json_schema: an array of
records; such a generation may end before --new-tokens, so its time is per token it
made). Rounds alternate the sides; reported: the fastest of --repeat
rounds' decode milliseconds per token (the machine is shared: the fastest is the least
disturbed), and the difference to the host path: the mask's cost. A matcher keeps the
masks of its last few stack sets, and these grammars come back to the same set at every
step, so past the first steps the walk is skipped.

    python tools/bench/grammar.py --threads 2 --new-tokens 64 --repeat 3
"""

import argparse
import time

import tinyloop
from tinyloop.default_model import default_model_path

GRAMMARS = {
    "any text": "root ::= [^\\x00]*",
    "inside a JSON string": 'root ::= "\\"" ( [^"\\\\\\x00-\\x1f] | "\\\\" ["\\\\/bfnrt] )*',
    "JSON array of numbers": 'root ::= "[" num ( ", " num )*\nnum ::= [1-9] [0-9]*',
}
SCHEMAS = {
    "JSON schema: array of records": {
        "type": "array", "minItems": 3, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "year": {"type": "integer", "minimum": 0},
                                             "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "year"], "additionalProperties": False}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    with tinyloop.Model(default_model_path(), threads=args.threads) as model:
        started = time.perf_counter()
        grammars = {name: tinyloop.Grammar(model, text) for name, text in GRAMMARS.items()}
        grammars.update({name: tinyloop.Grammar.from_json_schema(model, schema) for name, schema in SCHEMAS.items()})
        print(f"vocabulary {model.info.vocab_size} tokens; {len(grammars)} grammars compiled in "
              f"{time.perf_counter() - started:.2f} s")
        sides = [("host picks, no grammar", dict(logit_bias={0: 0.0}))]
        sides += [(f"grammar: {name}", dict(grammar=g)) for name, g in grammars.items()]
        runs = {name: [] for name, _ in sides}
        for _ in range(args.repeat):
            for name, extra in sides:
                r = model.generate(args.prompt, max_tokens=args.new_tokens, temperature=0.0, eos=False, **extra)
                ends = name in SCHEMAS and r.stop_reason == "eos"
                assert len(r.tokens) == args.new_tokens or (ends and len(r.tokens) >= 8), (name, r.stop_reason)
                runs[name].append(1000.0 * r.decode_seconds / len(r.tokens))
        base = min(runs[sides[0][0]])
        for name, _ in sides:
            ms = min(runs[name])
            print(f"{name:34s} {ms:7.2f} ms/token   mask {ms - base:+6.2f} ms")
        for g in grammars.values():
            g.close()


if __name__ == "__main__":
    main()
