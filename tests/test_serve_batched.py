"""Continuous batching (`hybrid serve -np N`): the scheduler's step plan (decode first, then prompt chunks), a ragged
batch of sequences giving each the very tokens it gets alone, and over HTTP: concurrent greedy requests at -np 4
answered as at -np 1, a client that leaves freeing its slot, and the slots back in the free pool on /metrics.

Tolerance: a ragged batch of fewer than 64 rows runs the same integer dots per row as a sequence alone, and the
attention per sequence through the same kernel, so the greedy tokens are identical (asserted exactly). A step of 64
rows or more goes op by op, where a matrix may take the float32 GEMM (kernels_cpu.matmul.gemm_min_tokens: 64 without
VNNI), as a long prompt alone does: there a decode row shares the prompt's rounding, and a reply may part from the
solo one (not asserted here)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybrid.generate.loop import generate
from hybrid.generate.sampling import SamplingParams
from hybrid.server.scheduler import BatchScheduler, Request, plan_step

from serve_helpers import engine_for, metrics, post, server, wait_for  # noqa: E402
from test_serve_load import raw_request, read_until  # noqa: E402

GREEDY = SamplingParams(temp=0)
TEXTS = ["The sea is", "Once upon a time", "def fib(n):", "Paris is the capital of", "1, 2, 3, 4,",
         "My favourite colour is", "Water boils at", "The quick brown fox"]


def test_plan_step_decodes_first_then_fills_the_budget_with_prompt_chunks():
    # two decoding sequences (0) take one token each; the prompts share the rest in admission order
    assert plan_step([0, 30, 0, 50], 16) == [1, 14, 1, 0]
    assert plan_step([0, 5, 0, 50], 16) == [1, 5, 1, 9]  # only the last prompt served is cut short
    assert plan_step([0, 0, 0], 2) == [1, 1, 1]  # decoding never waits, even past the budget
    assert plan_step([40, 3], 64) == [40, 3]  # a budget that allows it serves several whole prompts
    assert plan_step([], 8) == []


def _run_all(sched: BatchScheduler, prompts: list[list[int]], n_predict: int) -> tuple[list[list[int]], list]:
    """Every prompt through the scheduler (admitted as slots free up) -> the tokens of each, and per step the
    token count each sequence got (to see the chunks)."""
    out: dict[int, list[int]] = {}
    index: dict[int, int] = {}
    pending = list(range(len(prompts)))
    while pending or sched.running:
        while pending and sched.free_slots:
            i = pending.pop(0)
            index[id(sched.admit(Request(prompts[i], GREEDY, n_predict)))] = i
        for ev in sched.step():
            if ev.token is not None:
                out.setdefault(index[id(ev.seq)], []).append(ev.token)
    return [out.get(i, []) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


@pytest.mark.parametrize("n_slots,n_batch", [(4, 8), (1, 2048)])
def test_scheduler_gives_each_sequence_its_solo_greedy_tokens(engine, n_slots, n_batch):
    """8 prompts through 4 slots with an 8-token budget (prompts chunked, decodes mixed with prefill), and through
    one slot: the first 32 tokens of each equal generate()'s (what `hybrid run` prints) for the prompt alone."""
    prompts = [engine.tokenizer.encode(t, add_special=True) for t in TEXTS]
    solo = [list(generate(engine, p, GREEDY, 32, engine.new_cache(256))) for p in prompts]
    sched = BatchScheduler(engine, n_slots, n_batch, 256)
    got = _run_all(sched, prompts, 32)
    assert got == solo
    assert sched.free_slots == n_slots and sched.busy_cells == 0
    assert all(s.pc.cache.n_past > 0 for s in sched.slots)  # each slot keeps its last tokens for prefix reuse
    # /metrics' decode-only steps: at least the 31 steps after a lone slot's prompt, never more than all the steps
    assert 31 <= sched.decode_steps and 0 < sched.decode_seconds < sched.eval_seconds
    if n_slots == 1:  # each prompt one step (its first token), then a step for each of its next tokens
        assert sum(len(g) - 1 for g in got) <= sched.decode_steps <= sum(len(g) for g in got)


def test_a_shared_prefix_is_copied_from_another_slot_not_evaluated(engine):
    """Requests sharing a system prompt (4 slots, all but one busy or holding other text): each later request takes
    the shared rows from the slot that evaluated them (a running one included) instead of evaluating them, and
    still gives exactly its solo greedy tokens; the counters say what was reused, copied and evaluated."""
    system = engine.tokenizer.encode("You are a helpful assistant who answers in short sentences about the "
                                     "history of science, art and the sea. ", add_special=True)
    prompts = [system + engine.tokenizer.encode(t, add_special=False) for t in TEXTS[:4]]
    solo = [list(generate(engine, p, GREEDY, 12, engine.new_cache(256))) for p in prompts]
    sched = BatchScheduler(engine, 4, 16, 256)
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    seqs = {}

    def step() -> None:
        for ev in sched.step():
            if ev.token is not None:
                out[seqs[id(ev.seq)]].append(ev.token)

    first = sched.admit(Request(prompts[0], GREEDY, 12))
    seqs[id(first)] = 0
    while first.remaining:  # the first request's prompt evaluated in 16-token chunks
        step()
    for i in (1, 2, 3):  # admitted while the first one decodes: each copies the shared rows
        seq = sched.admit(Request(prompts[i], GREEDY, 12))
        assert seq.n_cached >= len(system) and seq.slot is not first.slot, (i, seq.n_cached, len(system))
        seqs[id(seq)] = i
    while sched.running:
        step()
    assert [out[i] for i in range(4)] == solo
    assert sched.copied_tokens >= 3 * len(system)
    assert sched.evaluated_tokens <= len(prompts[0]) + sum(len(p) - len(system) for p in prompts[1:])


def test_scheduler_reuses_a_slots_prefix_and_stops_at_n_predict(engine):
    prompt = engine.tokenizer.encode(TEXTS[0], add_special=True)
    sched = BatchScheduler(engine, 2, 64, 128)
    first = _run_all(sched, [prompt], 5)[0]
    seq = sched.admit(Request(prompt, GREEDY, 5))
    assert seq.n_cached == len(prompt) - 1 and seq.slot.index == 0  # the slot that held it, all but one token
    events = []
    while sched.running:
        events += sched.step()
    assert [e.token for e in events] == first and events[-1].finish == "length"


@pytest.fixture(scope="module")
def batched(engine):
    with server(engine, n_parallel=4) as s:
        yield s


def _complete(url: str, text: str, max_tokens: int = 32) -> dict:
    status, _, raw = post(url, "/v1/completions", {"prompt": text, "max_tokens": max_tokens, "temperature": 0,
                                                   "cache_prompt": False})
    assert status == 200, raw
    return json.loads(raw)


def test_concurrent_greedy_requests_match_one_slot(engine, batched):
    with server(engine) as one:  # -np 1: today's single slot
        alone = [_complete(one.url, t)["choices"][0]["text"] for t in TEXTS]
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(pool.map(lambda t: _complete(batched.url, t), TEXTS))
    assert [r["choices"][0]["text"] for r in together] == alone
    assert all(r["usage"]["completion_tokens"] > 0 for r in together)
    m = metrics(batched.url)
    assert m["hybrid_slots_total"] == 4
    assert m["hybrid_slots_busy"] == 0 and m["hybrid_requests_processing"] == 0
    assert m["hybrid_kv_cache_busy_cells"] == 0 and m["hybrid_requests_deferred"] == 0
    # the worker's time, idle between steps: eval_batch's share within the steps', the decode-only steps within it
    assert 0 < m["hybrid_worker_eval_seconds"] <= m["hybrid_worker_step_seconds_total"]
    assert 0 < m["hybrid_worker_decode_eval_seconds"] < m["hybrid_worker_eval_seconds"]
    assert 0 < m["hybrid_worker_decode_steps"] < m["hybrid_worker_steps_total"]


def test_a_client_that_leaves_frees_its_slot(batched):
    before = metrics(batched.url)["hybrid_requests_cancelled_total"]
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 1000, "temperature": 0, "stream": True}
    sock = raw_request(batched.url, "/v1/completions", body)
    other = _complete(batched.url, TEXTS[0], 8)  # runs beside it
    assert other["usage"]["completion_tokens"] > 0
    assert b"data: " in read_until(sock, b"data: ", 3)
    sock.close()
    wait_for(lambda: metrics(batched.url)["hybrid_requests_cancelled_total"] == before + 1, what="the cancellation")
    wait_for(lambda: metrics(batched.url)["hybrid_slots_busy"] == 0, what="the slot to be freed")
    m = metrics(batched.url)
    assert m["hybrid_kv_cache_busy_cells"] == 0 and m["hybrid_requests_processing"] == 0


def test_each_request_keeps_its_own_sampler_stop_strings_and_logprobs(engine, batched):
    """Seeded sampling, a stop string and logprobs, four requests at once at -np 4: each answer as at -np 1."""
    bodies = [
        {"prompt": TEXTS[1], "max_tokens": 24, "temperature": 0.9, "seed": 1},
        {"prompt": TEXTS[1], "max_tokens": 24, "temperature": 0.9, "seed": 2},
        {"prompt": TEXTS[4], "max_tokens": 24, "temperature": 0, "stop": ["7"]},
        {"prompt": TEXTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 2},
    ]

    def ask(url, body):
        status, _, raw = post(url, "/v1/completions", {**body, "cache_prompt": False})
        assert status == 200, raw
        c = json.loads(raw)["choices"][0]
        return c["text"], c["finish_reason"], c.get("logprobs")

    with server(engine) as one:
        alone = [ask(one.url, b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: ask(batched.url, b), bodies))
    assert [t[:2] for t in together] == [a[:2] for a in alone]
    assert together[2][1] == "stop" and "7" not in together[2][0]
    assert together[0][0] != together[1][0]  # two seeds, two samples
    lp_a, lp_b = alone[3][2], together[3][2]
    assert lp_b["tokens"] == lp_a["tokens"] and lp_b["token_logprobs"] == lp_a["token_logprobs"]


SYSTEM = ("You are a careful assistant. Answer in one short sentence, in plain words, without lists, and say so "
          "when you do not know. The user asks about science, history, art, cooking and the sea. Keep to what is well "
          "known, give numbers with their units, name the places and the people, and never invent a source. If the "
          "question is unclear, answer the most likely reading of it. ")


def test_concurrent_requests_sharing_a_system_prompt_evaluate_it_once(engine):
    """4 clients at once, one long system prompt (past MIN_SHARED_WAIT tokens) before different questions, at -np 4:
    the first admitted evaluates it, the others wait for its rows and take them (its whole blocks shared from the
    prefix cache, the rest copied; or all copied, with a cache a slot): the prompt tokens evaluated are one whole
    prompt plus the other questions, and every reply is the one -np 1 gives."""
    texts = [SYSTEM + t for t in TEXTS[:4]]
    ids = [engine.tokenizer.encode(t, add_special=True) for t in texts]
    shared = min(len(engine.tokenizer.encode(SYSTEM, add_special=True)) - 1, *(len(p) - 1 for p in ids))
    assert shared >= 64, shared  # long enough to be waited for
    body = lambda t: {"prompt": t, "max_tokens": 8, "temperature": 0, "cache_prompt": True}  # noqa: E731
    with server(engine, n_parallel=4) as s:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda t: json.loads(post(s.url, "/v1/completions", body(t))[2]), texts))
        m = metrics(s.url)
    # whichever request the server admitted first evaluated the system prompt (nothing cached); -np 1 serves the
    # requests in that order, so that each prompt row is evaluated as it was at -np 4 (the first whole, the others'
    # questions after the rows it left)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    first = cached.index(min(cached))
    order = [first] + [i for i in range(len(texts)) if i != first]
    with server(engine) as one:
        alone = {i: json.loads(post(one.url, "/v1/completions", body(texts[i]))[2])["choices"][0]["text"]
                 for i in order}
    assert [r["choices"][0]["text"] for r in replies] == [alone[i] for i in range(len(texts))]
    assert m["hybrid_prompt_tokens_evaluated"] <= len(ids[first]) + sum(len(ids[i]) - shared for i in order[1:]), m
    # taken from a cache, not evaluated: whole blocks from the paged prefix cache, the rest copied (every layer on
    # the CPU here: server/paged_scheduler.py); with a cache a slot (GPU layers) all copied from the first's slot
    assert m["hybrid_prompt_tokens_reused"] >= 3 * shared, m


def test_many_clients_disconnects_and_oversized_prompts_leave_nothing_behind(engine):
    """Two rounds of 48 requests from 12 clients at once at -np 4 (slots of 512 cells): random prompt and reply
    lengths, one in six leaving after its first bytes, one in twelve with a prompt past a slot's context. Each
    oversized request gets a clean error naming the context; every other request that stays gets its whole
    answer; afterwards the slots, busy KV cells and requests in flight are back at 0, and the process's resident
    memory grows by less than 64 MiB from the first round's end to the second's."""
    import random

    import psutil

    def client(args):
        url, i, rng = args
        words = " ".join(rng.choice(("sea", "salt", "wind", "stone", "light")) for _ in range(rng.randint(1, 60)))
        if i % 12 == 7:
            words = "tide " * 700  # more tokens than a slot's 512 cells
        body = {"prompt": words, "max_tokens": rng.randint(1, 12), "temperature": 0, "stream": True}
        if i % 6 == 5:
            sock = raw_request(url, "/v1/completions", body)
            read_until(sock, b"data: ", 1)
            sock.close()
            return "left", None
        status, _, raw = post(url, "/v1/completions", body, timeout=120)
        return status, raw.decode("utf-8", "replace")

    with server(engine, n_parallel=4) as s:
        rss = []
        for round_ in range(2):
            rng = random.Random(round_)
            jobs = [(s.url, i, random.Random(rng.random())) for i in range(48)]
            with ThreadPoolExecutor(12) as pool:
                results = list(pool.map(client, jobs))
            for i, (status, text) in enumerate(results):
                if i % 6 == 5:
                    continue
                if i % 12 == 7:
                    assert status == 400 and "context" in text and "Traceback" not in text, (status, text[:300])
                    continue
                assert status == 200, text[:300]
                frames = [b[len("data: "):] for b in text.split("\n\n") if b.startswith("data: ")]
                assert frames[-1] == "[DONE]", frames[-3:]
                assert json.loads(frames[-2])["choices"][0]["finish_reason"] in ("stop", "length")
            wait_for(lambda: metrics(s.url)["hybrid_requests_processing"] == 0, 60, "the requests to end")
            m = metrics(s.url)
            assert m["hybrid_slots_busy"] == 0 and m["hybrid_kv_cache_busy_cells"] == 0, m
            assert m["hybrid_requests_deferred"] == 0, m
            rss.append(psutil.Process().memory_info().rss)
        assert rss[1] - rss[0] < 64 << 20, rss
