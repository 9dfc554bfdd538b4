"""Batched decoding (docs/api.md, "Batched decoding"): tl_context_append_batch runs one
decode step of several sequences as one forward pass, and tl_generate_batch steps all its
prompts' sequences together.

Checked, for every architecture option and weight type: each sequence's logits after a
batched step are the float64 oracle's at its position, and those of the same sequence
stepped alone (within the same-backend bound: a matmul over several rows may sum in
another order than over one); sequences of different lengths, depths and max_seq_len in
one step; batched generation gives each prompt's own greedy tokens and seeded samples;
streams stepped together (Model.next_batch, and the server's DecodeBatcher from several
threads) give each stream's own tokens; the calls' errors leave every context as it
was."""

import threading

import numpy as np
import pytest

import tinyloop
from tinyloop.server.decode_batcher import DecodeBatcher
from test_parity import CASES, DEVICE, ON_CPU, SAME, TOLERANCES, DEVICE_TOLERANCE, arithmetic, \
    assert_close, case_config, case_tokens
from tinyloop.errors import ContextFullError, InvalidArgumentError


def case_depth(config):
    return config["max_depth"] if config["n_core"] else 0


def oracle_tolerance(config):
    return TOLERANCES[arithmetic(config)] if ON_CPU else DEVICE_TOLERANCE


@pytest.mark.parametrize("name", list(CASES))
def test_a_batched_step_gives_each_sequence_its_own_logits(files, name):
    """Three sequences of different lengths (prefixes of the case's tokens) each take one
    more token in one batched step; every row is the oracle's logits at its position and
    the logits of that sequence stepped alone."""
    config = case_config(name)
    tokens = case_tokens(config)
    depth = case_depth(config)
    reference_logits = files.reference(name).logits(tokens, depth)
    lengths = [3, len(tokens) - 1, 6]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        contexts = [model.context() for _ in lengths]
        for ctx, n in zip(contexts, lengths):
            ctx.append(tokens[:n], depth=depth)
        batched = model.append_batch(contexts, [int(tokens[n]) for n in lengths])
        alone = []
        for n in lengths:
            with model.context() as ctx:
                ctx.append(tokens[:n], depth=depth)
                alone.append(ctx.append([int(tokens[n])], depth=depth))
        assert [len(ctx) for ctx in contexts] == [n + 1 for n in lengths]
        for ctx in contexts:
            ctx.close()
    for row, n in enumerate(lengths):
        assert_close(batched[row], reference_logits[n], oracle_tolerance(config),
                     f"{name}: batched row {row} (position {n}) vs oracle")
        assert_close(batched[row], np.asarray(alone[row], dtype=np.float64), SAME,
                     f"{name}: batched row {row} vs the sequence stepped alone")


@pytest.mark.parametrize("name", ["base", "init-noise", "injection-concat", "huginn-q4"])
def test_one_step_mixes_depths_lengths_and_context_sizes(files, name):
    """Sequences at different depths (one pass, each row leaving the loop at its depth), contexts of other
    max_seq_len and max_depth (the coda's KV slots move with max_depth), one that keeps its
    loop states, all in one call; then decoding goes on alone as after plain appends."""
    config = case_config(name)
    tokens = case_tokens(config)
    top = config["max_depth"]
    setups = [(1, 5, {}), (top, 7, {"max_seq_len": 16}), (top, 4, {"keep_loop_states": True}),
              (2, 9, {"max_depth": 2}), (top, 2, {"max_depth": top})]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        contexts = []
        for depth, n, options in setups:
            ctx = model.context(**options)
            ctx.append(tokens[:n], depth=depth)
            contexts.append(ctx)
        batched = model.append_batch(contexts, [int(tokens[n]) for _, n, _ in setups])
        follow = [ctx.append([int(tokens[n + 1])]) for ctx, (_, n, _) in zip(contexts, setups)]
        for row, (depth, n, options) in enumerate(setups):
            with model.context(**options) as ctx:
                ctx.append(tokens[:n], depth=depth)
                step = ctx.append([int(tokens[n])], depth=depth)
                after = ctx.append([int(tokens[n + 1])], depth=depth)
            assert_close(batched[row], np.asarray(step, dtype=np.float64), SAME, f"{name}: row {row} {options}")
            assert_close(follow[row], np.asarray(after, dtype=np.float64), SAME,
                         f"{name}: row {row}'s next step {options}")
        kept = contexts[2]
        deeper = kept.deepen(top)   # the batched step kept its loop state like an append
        with model.context() as ctx:
            expected = ctx.append(tokens[:6], depth=top)
        assert_close(deeper, np.asarray(expected, dtype=np.float64), SAME, f"{name}: deepened after a batched step")
        for ctx in contexts:
            ctx.close()


def test_a_warm_state_init_steps_each_sequence_in_turn(files):
    config = case_config("init-warm")
    tokens = case_tokens(config)
    depth = config["max_depth"]
    reference_logits = files.reference("init-warm").logits(tokens, depth)
    with tinyloop.Model(files.path("init-warm"), device=DEVICE) as model:
        contexts = [model.context(), model.context()]
        contexts[0].append(tokens[:4], depth=depth)
        contexts[1].append(tokens[:8], depth=depth)
        batched = model.append_batch(contexts, [int(tokens[4]), int(tokens[8])])
        for ctx in contexts:
            ctx.close()
    assert_close(batched[0], reference_logits[4], oracle_tolerance(config), "warm row 0")
    assert_close(batched[1], reference_logits[8], oracle_tolerance(config), "warm row 1")


@pytest.mark.parametrize("name", ["base", "plain-llama", "q4-g64", "huginn-q4", "init-warm"])
def test_batched_generation_is_each_prompts_own(files, name):
    """generate_batch gives every prompt the tokens generate gives it alone: greedy, and
    seeded sampling (each sequence draws from its own sampler), with prompts of different
    lengths that stop at different steps."""
    config = case_config(name)
    tokens = case_tokens(config).tolist()
    prompts = [tokens[:3], tokens[2:9], tokens[:1], tokens[4:6]]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        for options in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                               "seed": 7}):
            stops = [model.generate(p, max_tokens=6, **options).tokens[2:3] for p in prompts]
            for kwargs in ({"max_tokens": 6}, {"max_tokens": 6, "stop": [stops[1]]}):
                batch = model.generate_batch(prompts, **options, **kwargs)
                for i, prompt in enumerate(prompts):
                    alone = model.generate(prompt, **options, **kwargs)
                    if ON_CPU or options["temperature"] == 0.0:
                        assert batch[i].tokens == alone.tokens, f"{name} {options} {kwargs}: prompt {i}"
                    assert batch[i].stop_reason == alone.stop_reason or not ON_CPU
                    assert batch[i].prompt_tokens == len(prompt)


def test_batched_generation_runs_drafts_on_their_own(files):
    """With drafting asked for, each sequence's speculative rounds run as tl_generate's do
    (the greedy tokens are plain greedy decoding's either way)."""
    tokens = case_tokens(case_config("base")).tolist()
    prompts = [tokens[:4], tokens[1:7]]
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        batch = model.generate_batch(prompts, max_tokens=8, temperature=0.0, draft_depth=1, n_draft=2)
        for prompt, result in zip(prompts, batch):
            assert result.tokens == model.generate(prompt, max_tokens=8, temperature=0.0).tokens
            assert result.drafted_tokens > 0


def test_batch_errors_leave_every_context_as_it_was(files):
    tokens = case_tokens(case_config("base"))
    with tinyloop.Model(files.path("base"), device=DEVICE) as model, \
            tinyloop.Model(files.path("base"), device=DEVICE) as other:
        vocab = model.info.vocab_size
        a, b = model.context(), model.context(max_seq_len=4)
        a.append(tokens[:3])
        b.append(tokens[:4])   # full
        assert model.append_batch([], []).shape == (0, vocab)
        with pytest.raises(ContextFullError, match="context 1 is full"):
            model.append_batch([a, b], [1, 2])
        with pytest.raises(InvalidArgumentError, match="contexts 0 and 1 are the same"):
            model.append_batch([a, a], [1, 2])
        with pytest.raises(ValueError, match="out of range"):
            model.append_batch([a], [vocab])
        with pytest.raises(InvalidArgumentError, match="one token each"):
            model.append_batch([a], [1, 2])
        with other.context() as foreign:
            with pytest.raises(InvalidArgumentError, match="not a context of this model"):
                model.append_batch([a, foreign], [1, 2])
        assert (len(a), len(b)) == (3, 4)
        np.testing.assert_array_equal(model.append_batch([a], [int(tokens[3])]),
                                      model.score_last_token(tokens[:4])[None, :])
        with pytest.raises(TypeError):
            model.generate_batch("one prompt")
        assert model.generate_batch([]) == []
        with pytest.raises(ContextFullError):
            model.generate_batch([tokens[:2], [1] * 10_000], max_tokens=2)
        a.close()
        b.close()


SAMPLED = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 3}


@pytest.mark.parametrize("name", ["base", "q4-g64", "init-warm"])
def test_streams_stepped_together_give_their_own_tokens(files, name):
    """Model.next_batch steps streams of different prompts, lengths and options (greedy,
    seeded sampling, drafts, a stop sequence) together until each ends; every stream's
    tokens and result are those of iterating it alone."""
    tokens = case_tokens(case_config(name)).tolist()
    requests = [(tokens[:3], {"max_tokens": 7, "temperature": 0.0}),
                (tokens[1:9], {"max_tokens": 5, **SAMPLED}),
                (tokens[:2], {"max_tokens": 9, "temperature": 0.0, "draft_depth": 1, "n_draft": 2}),
                (tokens[4:6], {"max_tokens": 9, "temperature": 0.0})]
    with tinyloop.Model(files.path(name), device=DEVICE) as model:
        stop = model.generate(requests[3][0], **requests[3][1]).tokens[1:3]
        requests[3][1]["stop"] = [stop]
        streams = [model.stream(p, **o) for p, o in requests]
        while any(s.result is None for s in streams):
            out = model.next_batch(streams)
            assert all(t is None or isinstance(t, int) for t in out), out
        assert model.next_batch(streams) == [None] * len(streams)   # ended streams stay ended
        for stream, (prompt, options) in zip(streams, requests):
            alone = model.generate(prompt, **options)
            assert stream.tokens == alone.tokens and stream.result.stop_reason == alone.stop_reason
        assert streams[3].result.stop_reason == "stop_sequence"
        with pytest.raises(InvalidArgumentError, match="twice"):
            model.next_batch([streams[0], streams[0]])
        with tinyloop.Model(files.path(name), device=DEVICE) as other:
            with pytest.raises(InvalidArgumentError, match="not a stream of this model"):
                model.next_batch([other.stream(tokens[:2], max_tokens=2)])


def test_the_decode_batcher_steps_threads_together(files):
    """Four threads, each iterating its own stream through one DecodeBatcher, get the
    tokens they would alone, in fewer steps than tokens; one that stops early (closing
    its iterator) holds nobody up; the closed batcher refuses new steps."""
    tokens = case_tokens(case_config("base")).tolist()
    prompts = [tokens[:3], tokens[2:8], tokens[1:2], tokens[5:9]]
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        expected = [model.generate(p, max_tokens=12, **SAMPLED).tokens for p in prompts]
        # a window wide enough that the four threads join on a loaded 2-core machine
        batcher = DecodeBatcher(model, gather_s=0.2)
        got, barrier = {}, threading.Barrier(len(prompts))

        def one(i):
            stream = model.stream(prompts[i], max_tokens=12, **SAMPLED)
            barrier.wait()
            got[i] = []
            iterator = batcher.tokens(stream)
            for token in iterator:
                got[i].append(token)
                if i == 2 and len(got[i]) == 4:
                    iterator.close()   # leaves the batch; the others go on
                    break
            stream.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [got[i] for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
        assert got[2] == expected[2][:4]
        assert batcher.stepped > batcher.steps * 2, (batcher.stepped, batcher.steps)
        batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            next(batcher.tokens(model.stream(prompts[0], max_tokens=2)))


def test_the_batch_benchmark_and_its_gpu_check_rows(tmp_path):
    """tools/bench/batch.py runs both ways (generate_batch and the server) and checks the
    sides agree; tools/gpu/report.py puts its rows (gpu_check's `batch` step) into
    gpu_check.json and a table of gpu_check.md."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import textmodel
    tools = Path(__file__).resolve().parents[2] / "tools"
    path = tmp_path / "text.tinyloop"
    textmodel.make_text_model(path)
    with tinyloop.Model(path) as model:
        vocab = model.info.vocab_size
    text = tmp_path / "text.u16"
    np.random.default_rng(0).integers(3, vocab, 400).astype(np.uint16).tofile(text)
    steps = tmp_path / "out" / "steps"
    steps.mkdir(parents=True)
    common = [sys.executable, str(tools / "bench" / "batch.py"), "--model", str(path), "--text", str(text),
              "--threads", "1", "--batches", "1,3", "--repeat", "2", "--prompt-tokens", "8", "--new-tokens", "6"]
    for extra, out in (([], steps / "batch.result.json"), (["--server"], tmp_path / "server.json")):
        subprocess.run(common + extra + ["--json", str(out)], check=True, timeout=300, capture_output=True)
        report = json.loads(out.read_text())
        assert [row["batch"] for row in report["rows"]] == [1, 3] and report["server"] == bool(extra)
        assert all(row["batched_tok_s"] > 0 and row["alone_tok_s"] > 0 for row in report["rows"])
    (steps / "batch.json").write_text(json.dumps({"name": "batch", "rc": 0, "seconds": 1, "timed_out": False}))
    subprocess.run([sys.executable, str(tools / "gpu" / "report.py"), str(tmp_path / "out"), "--device", "cpu"],
                   check=True, timeout=60, capture_output=True)
    assert [row["batch"] for row in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["batch"]["rows"]] \
        == [1, 3]
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "batched decoding on cpu" in md
    assert len([line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]) == 2


def test_the_batch_peer_step_and_its_report(tmp_path, model_path):
    """tools/gpu/bench.py batch (gpu_check's batch-peer step, TinyLoop's side) measures
    generate_batch per batch size; tools/gpu/report.py puts it beside the PyTorch peer's
    rows (tools/bench/torch_peer.py, which needs a GPU: its JSON is written here)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[2] / "tools"
    steps = tmp_path / "out" / "steps"
    steps.mkdir(parents=True)
    ours = steps / "batch-peer-tinyloop.result.json"
    subprocess.run([sys.executable, str(tools / "gpu" / "bench.py"), "batch", str(model_path), "--device", "cpu",
                    "--batches", "1,3", "--prompt-tokens", "8", "--new-tokens", "6", "--out", str(ours)],
                   check=True, timeout=600, capture_output=True)
    rows = json.loads(ours.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["decode_tok_s"] > 0 for r in rows)
    peer = {"peer": "a peer", "torch": "x", "rows": [{"batch": 1, "decode_tok_s": 10.0}, {"batch": 3, "error": "E"}]}
    (steps / "batch-peer-torch.result.json").write_text(json.dumps(peer))
    (steps / "batch-peer.json").write_text(json.dumps({"name": "batch-peer", "rc": 0, "seconds": 1, "timed_out": False}))
    subprocess.run([sys.executable, str(tools / "gpu" / "report.py"), str(tmp_path / "out"), "--device", "cpu"],
                   check=True, timeout=60, capture_output=True)
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "batched decoding, loop-1b q4 g64 (f32 KV" in md
    table = [line for line in md.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(table) == 2 and "peer error: E" in table[1]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["batch_peer"]["torch"]["rows"][0]["batch"] == 1


def test_an_interrupted_wait_never_leaves_its_stream_with_the_worker(files, monkeypatch):
    """A wait broken by a signal handler's exception (as Ctrl-C breaks it in the main
    thread) takes its stream back when the worker has not taken it yet, and otherwise
    returns only once the worker's step of it has ended, so the caller may free it."""
    import signal
    import time

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    tokens = case_tokens(case_config("base")).tolist()
    with tinyloop.Model(files.path("base"), device=DEVICE) as model:
        real, events = tinyloop.Model.next_batch, []

        def slow(self, streams):
            events.append(("start", len(streams)))
            time.sleep(0.4)
            out = real(self, streams)
            events.append(("end", len(streams)))
            return out

        monkeypatch.setattr(tinyloop.Model, "next_batch", slow)
        previous = signal.signal(signal.SIGALRM, interrupt)
        batcher = DecodeBatcher(model)
        try:
            # taken by the worker: the interrupted wait lasts until the step has ended
            stream = model.stream(tokens[:3], max_tokens=4, temperature=0.0)
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(Interrupted):
                next(batcher.tokens(stream))
            assert events == [("start", 1), ("end", 1)]
            stream.close()
            # still queued behind another stream's step: taken back at once, never stepped
            other = model.stream(tokens[:2], max_tokens=4, temperature=0.0)
            helper = threading.Thread(target=lambda: next(batcher.tokens(other)))
            helper.start()
            while len(events) < 3:
                time.sleep(0.01)
            queued = model.stream(tokens[:4], max_tokens=4, temperature=0.0)
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(Interrupted):
                next(batcher.tokens(queued))
            assert events[-1] == ("start", 1)   # interrupted while the other step still ran
            queued.close()
            helper.join(10)
            assert events[3:] == [("end", 1)] and batcher.steps == 2
            other.close()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            batcher.close()


def test_streams_of_two_models_are_refused_whatever_comes_first(files):
    """tl_stream_next_batch compares the models of the streams that still have a context,
    also when the first stream's context was freed, and refuses the call (TL_OK would
    mean the streams were stepped)."""
    tokens = case_tokens(case_config("base")).tolist()
    with tinyloop.Model(files.path("base"), device=DEVICE) as a, tinyloop.Model(files.path("base"), device=DEVICE) as b:
        native, ffi = a._native, a._native.ffi
        with a.context() as ctx:
            ended = ctx.stream(tokens[:2], max_tokens=4)
        first, second = a.stream(tokens[:3], max_tokens=4), b.stream(tokens[:3], max_tokens=4)
        next(first)
        next(second)
        tok, reasons, statuses = ffi.new("int32_t[]", 3), ffi.new("tl_stop_reason[]", 3), ffi.new("tl_status[]", 3)
        handles = ffi.new("tl_stream *[]", [ended._handle, first._handle, second._handle])
        assert native.lib.tl_stream_next_batch(handles, 3, tok, reasons, statuses) != 0
        assert "streams[2] belongs to another model" in native.last_error()
        assert (len(first.tokens), len(second.tokens)) == (1, 1)
        assert next(first) >= 0 and next(second) >= 0   # neither was stepped or ended
        for stream in (ended, first, second):
            stream.close()
