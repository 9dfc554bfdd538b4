"""The server's prompt cache (python/tinyloop/prompt_cache.py, docs/server.md "Prompt
cache"): a request continues the kept sequence sharing the longest start with its prompt.

Checked: a cached request generates exactly the tokens of a fresh one (greedy, seeded
sampling, drafts), also when the kept sequence ran at a shallower depth and is deepened
first; what each request reuses (a conversation's next turn, the same prompt again, a
deeper or a shallower request, the best of several sequences); eviction beyond the
capacity; models that cannot keep loop states (a warm state init, no loop); a failed
request's sequence is emptied, and tokens the caller never saw are dropped."""

import pytest

import textmodel
import tinyloop
from device import DEVICE
from tinyloop.prompt_cache import PromptCache, shared_start
from tinyloop.fileformat.random_model import make_random_model


@pytest.fixture(scope="module")
def model(model_path):
    with tinyloop.Model(model_path, threads=1, device=DEVICE) as m:
        yield m


def run(cache, prompt, depth, **options):
    """One request through the cache: (generated tokens, prompt tokens it reused)."""
    lease = cache.acquire(prompt, depth)
    assert lease.rest == list(prompt)[lease.cached:] and lease.rest
    with lease.context.stream(lease.rest, depth=depth, **options) as stream:
        tokens = list(stream)
    cache.release(lease, list(prompt) + tokens)
    return tokens, lease.cached


def fresh(model, prompt, depth, **options):
    return model.generate(list(prompt), depth=depth, **options).tokens


def ids(model, text, bos=True):
    return model.tokenizer.encode(text, add_bos=bos)


OPTIONS = [dict(max_tokens=12, temperature=0, eos=False),
           dict(max_tokens=12, temperature=0.9, top_k=0, top_p=1.0, min_p=0, seed=11, eos=False),
           dict(max_tokens=12, temperature=0, draft_depth=1, n_draft=3, eos=False),
           dict(max_tokens=12, temperature=0.8, seed=3, draft_depth=1, n_draft=2, eos=False,
                repetition_penalty=1.3)]


@pytest.mark.parametrize("options", OPTIONS, ids=["greedy", "sampled", "drafts", "sampled-drafts"])
def test_a_conversation_continues_its_sequence_with_the_fresh_answer(model, options):
    cache = PromptCache(model, 1)
    first = ids(model, "The sea was calm")
    answer, cached = run(cache, first, 2, **options)
    assert cached == 0 and answer == fresh(model, first, 2, **options)
    second = first + answer + ids(model, " and then", bos=False)
    again, cached = run(cache, second, 2, **options)
    # the kept sequence holds the prompt and every answer token but the last (never run)
    assert cached == len(first) + len(answer) - 1
    assert again == fresh(model, second, 2, **options)
    cache.close()


@pytest.mark.parametrize("capacity", [1, 2])
def test_the_same_prompt_again_runs_only_its_last_token(model, capacity):
    cache = PromptCache(model, capacity)
    prompt = ids(model, "Once upon a time")
    first, _ = run(cache, prompt, 2, max_tokens=6, temperature=0)
    second, cached = run(cache, prompt, 2, max_tokens=6, temperature=0)
    assert cached == len(prompt) - 1 and second == first
    assert len(cache._idle) == 1        # reused, not a second context
    cache.close()


def test_a_shallower_sequence_is_deepened_and_a_deeper_one_is_not_reused(model):
    cache = PromptCache(model, 1)
    greedy = dict(max_tokens=10, temperature=0, eos=False)
    prompt = ids(model, "A looped model")
    shallow, _ = run(cache, prompt, 1, **greedy)
    deeper_prompt = prompt + shallow[:4]
    deep, cached = run(cache, deeper_prompt, textmodel.MAX_DEPTH, **greedy)
    assert cached == len(deeper_prompt) - 1
    assert deep == fresh(model, deeper_prompt, textmodel.MAX_DEPTH, **greedy)
    # a loop state cannot be undone: a shallower request starts over
    back, cached = run(cache, deeper_prompt, 2, **greedy)
    assert cached == 0 and back == fresh(model, deeper_prompt, 2, **greedy)
    # with room for another context, the deep sequence is left for a deep request
    roomy = PromptCache(model, 2)
    run(roomy, deeper_prompt, textmodel.MAX_DEPTH, **greedy)
    _, cached = run(roomy, deeper_prompt, 2, **greedy)
    assert cached == 0 and len(roomy._idle) == 2
    _, cached = run(roomy, deeper_prompt, textmodel.MAX_DEPTH, **greedy)
    assert cached == len(deeper_prompt) - 1
    cache.close()
    roomy.close()


def test_the_longest_shared_start_wins_and_the_capacity_holds(model):
    cache = PromptCache(model, 2)
    greedy = dict(max_tokens=4, temperature=0)
    a, b = ids(model, "Apples are red"), ids(model, "Bananas are yellow")
    run(cache, a, 2, **greedy)
    run(cache, b, 2, **greedy)
    b2 = b + ids(model, "; and long", bos=False)
    _, cached = run(cache, b2, 2, **greedy)
    assert cached == len(b)
    a2 = a + ids(model, "; and round", bos=False)
    _, cached = run(cache, a2, 2, **greedy)
    assert cached == len(a)
    # only BOS in common with both: the least recently used (b's) is taken and emptied
    _, cached = run(cache, ids(model, "Cherries"), 2, **greedy)
    assert cached == 1 and len(cache._idle) == 2
    _, cached = run(cache, a2, 2, **greedy)
    assert cached == len(a2) - 1        # a's sequence, the more recent one, was kept
    _, cached = run(cache, b2, 2, **greedy)
    assert cached == 1                  # b's was not
    cache.close()
    assert cache._idle == []


def test_a_failed_request_empties_its_sequence_and_unseen_tokens_are_dropped(model):
    cache = PromptCache(model, 1)
    prompt = ids(model, "Something went wrong")
    lease = cache.acquire(prompt, 2)
    with lease.context.stream(lease.rest, depth=2, max_tokens=5, temperature=0) as stream:
        list(stream)
    cache.release(lease, prompt, ok=False)
    assert len(cache._idle[0].context) == 0
    _, cached = run(cache, prompt, 2, max_tokens=5, temperature=0)
    assert cached == 0
    # the caller saw only the prompt: what the context ran after it is not kept
    lease = cache.acquire(prompt, 2)
    with lease.context.stream(lease.rest, depth=2, max_tokens=5, temperature=0) as stream:
        list(stream)
    cache.release(lease, prompt[:3])
    assert len(cache._idle[0].context) == 3 and cache._idle[0].tokens == prompt[:3]
    cache.close()


def test_a_full_context_is_reused_up_to_the_shared_start(model):
    cache = PromptCache(model, 1)
    prompt = [65 + i % 26 for i in range(textmodel.MAX_SEQ_LEN - 3)]
    tokens, _ = run(cache, prompt, 2, max_tokens=50, temperature=0, eos=False)
    assert len(tokens) == 4           # three positions left, plus the last token (not run)
    again, cached = run(cache, prompt[:-1] + [90], 2, max_tokens=3, temperature=0)
    assert cached == len(prompt) - 1
    assert again == fresh(model, prompt[:-1] + [90], 2, max_tokens=3, temperature=0)
    cache.close()


@pytest.mark.parametrize("arch", [dict(state_init="warm"), dict(n_core=0, default_depth=1, max_depth=1)],
                         ids=["warm-state-init", "no-loop"])
def test_models_that_cannot_keep_loop_states(tmp_path, arch):
    dims = dict(vocab_size=64, d_model=32, n_head=4, n_kv_head=2, head_dim=8, ffn_dim=64, n_pre=1,
                n_core=1, n_post=1, default_depth=2, max_depth=3, max_seq_len=64)
    dims.update(arch)
    path = tmp_path / "m.tinyloop"
    make_random_model(path, seed=3, **dims)
    greedy = dict(max_tokens=6, temperature=0, eos=False)
    with tinyloop.Model(path, threads=1, device=DEVICE) as m:
        cache = PromptCache(m, 1)
        prompt = [1, 5, 9, 13, 17]
        first, _ = run(cache, prompt, dims["default_depth"], **greedy)
        assert not cache._idle[0].keeps_loop_states
        longer = prompt + first
        again, cached = run(cache, longer, dims["default_depth"], **greedy)
        assert cached == len(longer) - 1 and again == fresh(m, longer, dims["default_depth"], **greedy)
        if dims["n_core"]:
            deeper, cached = run(cache, longer, dims["max_depth"], **greedy)
            assert cached == 0 and deeper == fresh(m, longer, dims["max_depth"], **greedy)
        cache.close()


def test_shared_start_and_capacity_argument():
    assert shared_start([1, 2, 3], [1, 2, 4]) == 2
    assert shared_start([], [1]) == 0 and shared_start([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError, match="capacity"):
        PromptCache(None, 0)


def test_a_negative_number_of_kept_sequences_is_refused(model):
    from tinyloop.server import ModelServer
    with pytest.raises(ValueError, match="prompt_cache is -1"):
        ModelServer(("127.0.0.1", 0), model, name="m", prompt_cache=-1)
