"""The router's pure parts: routing policies (round-robin, least-load, prefix
with consistent hashing and load fallback), prompt keys, backend URL checks,
reading a kvserve server's /metrics, and the replicas' command lines."""

from __future__ import annotations

import random

import pytest

from kvserve.router.backends import Backend, check_backend_url
from kvserve.router.data_parallel import child_argv
from kvserve.router.policy import (
    Candidate,
    HashRing,
    LeastLoadPolicy,
    PrefixAwarePolicy,
    PrefixKey,
    RoundRobinPolicy,
    make_policy,
    prefix_key,
)
from kvserve.router.prompt_key import PromptKeyer

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def idle(urls: list[str] = URLS) -> list[Candidate]:
    return [Candidate(url, 0.0) for url in urls]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def test_prefix_key_chains_full_blocks() -> None:
    base = tokens(0, 40)
    key = prefix_key(base, block_size=16)
    assert len(key.block_hashes) == 2  # the partial third block is not hashed
    longer = prefix_key([*base, *tokens(1, 30)], block_size=16)
    assert longer.block_hashes[:2] == key.block_hashes and len(longer.block_hashes) == 4
    other = prefix_key([base[0] + 1, *base[1:]], block_size=16)
    assert not set(other.block_hashes) & set(key.block_hashes)  # chained: all differ
    short = prefix_key(base[:5], block_size=16)
    assert short.block_hashes == () and short.ring_hash == prefix_key(base[:5], 16).ring_hash
    assert prefix_key(tokens(0, 64), 16, max_blocks=2).block_hashes == key.block_hashes


def test_round_robin_cycles_and_skips_the_unavailable() -> None:
    policy = RoundRobinPolicy(URLS)
    assert [policy.choose(idle(), PrefixKey()).url for _ in range(4)] == [*URLS, URLS[0]]
    chosen = {policy.choose(idle(URLS[1:]), PrefixKey()).url for _ in range(4)}
    assert chosen == set(URLS[1:])


def test_least_load_takes_the_smallest_load() -> None:
    candidates = [Candidate("http://a:1", 3.2), Candidate("http://b:1", 1.9),
                  Candidate("http://c:1", 2.0)]
    decision = LeastLoadPolicy(URLS).choose(candidates, PrefixKey())
    assert (decision.url, decision.reason) == ("http://b:1", "least_load")


def test_prefix_policy_sends_a_prefix_and_its_extensions_to_one_backend() -> None:
    policy = PrefixAwarePolicy(URLS, balance_threshold=4)
    system = tokens(7, 64)
    first = policy.choose(idle(), prefix_key([*system, *tokens(1, 20)], 16))
    assert first.reason == "prefix_new"
    for turn in range(2, 6):  # a conversation growing turn by turn
        decision = policy.choose(idle(), prefix_key([*system, *tokens(1, 20 * turn)], 16))
        assert decision.url == first.url and decision.reason == "prefix_hit"
        assert decision.matched_blocks >= 4
    # a prefix seen on two backends goes to the less loaded of them
    policy.choose(idle([URLS[2]]), prefix_key(system, 16))
    owners = {first.url, URLS[2]}
    loads = [Candidate(url, 3.0 if url == first.url else 1.0) for url in URLS]
    decision = policy.choose(loads, prefix_key([*system, *tokens(9, 20)], 16))
    assert decision.reason == "prefix_hit" and decision.url == URLS[2] and URLS[2] in owners


def test_prefix_policy_yields_to_load_beyond_the_threshold() -> None:
    policy = PrefixAwarePolicy(URLS, balance_threshold=4)
    key = prefix_key(tokens(3, 48), 16)
    home = policy.choose(idle(), key).url
    busy = [Candidate(url, 8.0 if url == home else 5.0) for url in URLS]
    assert policy.choose(busy, key).url == home  # 8 <= the least load 5 + threshold 4
    busier = [Candidate(url, 20.0 if url == home else 1.0) for url in URLS]
    decision = policy.choose(busier, key)
    assert decision.url != home and decision.reason == "load_fallback"


def test_a_short_shared_prefix_is_worth_less_than_balance() -> None:
    policy = PrefixAwarePolicy(URLS, balance_threshold=100, min_match=0.5)
    system = tokens(11, 32)  # 2 blocks shared by every conversation
    home = policy.choose(idle(), prefix_key([*system, *tokens(1, 64)], 16)).url
    loads = [Candidate(url, 3.0 if url == home else 0.0) for url in URLS]
    # a new conversation matches 2 of its 6 blocks: the least-loaded backend takes it
    decision = policy.choose(loads, prefix_key([*system, *tokens(2, 64)], 16))
    assert decision.url != home and decision.reason == "least_load"
    # the first conversation's next turn matches 6 of 7 blocks: it stays home
    decision = policy.choose(loads, prefix_key([*system, *tokens(1, 64), *tokens(3, 16)], 16))
    assert decision.url == home and decision.reason == "prefix_hit"


def test_prefix_policy_without_a_key_balances_load() -> None:
    policy = PrefixAwarePolicy(URLS)
    loads = [Candidate("http://a:1", 2.0), Candidate("http://b:1", 0.5),
             Candidate("http://c:1", 1.0)]
    decision = policy.choose(loads, PrefixKey())
    assert (decision.url, decision.reason) == ("http://b:1", "least_load")


def test_consistent_hashing_moves_few_prefixes_when_a_backend_joins() -> None:
    keys = [prefix_key(tokens(seed, 16), 16).ring_hash for seed in range(2000)]
    before = HashRing(URLS)
    after = HashRing([*URLS, "http://d:1"])
    moved = [k for k in keys if before.walk(k)[0] != after.walk(k)[0]]
    assert all(after.walk(k)[0] == "http://d:1" for k in moved)  # only to the newcomer
    assert 0.1 < len(moved) / len(keys) < 0.4  # about 1/4
    spread = {url: sum(before.walk(k)[0] == url for k in keys) for url in URLS}
    assert min(spread.values()) > len(keys) / len(URLS) * 0.6


def test_forget_drops_a_backend_from_the_prefix_table() -> None:
    policy = PrefixAwarePolicy(URLS, max_entries=3)
    key = prefix_key(tokens(5, 80), 16)  # 5 blocks, only 3 remembered
    url = policy.choose(idle(), key).url
    assert policy.num_entries == 3
    policy.forget(url)
    assert policy.num_entries == 0


def test_policy_and_url_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--policy='random' is invalid"):
        make_policy("random", URLS, 1.0, 10)
    with pytest.raises(ValueError, match="balance_threshold=-1"):
        make_policy("prefix", URLS, -1.0, 10)
    with pytest.raises(ValueError, match="min_match=2"):
        make_policy("prefix", URLS, 1.0, 10, min_match=2)
    assert check_backend_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for bad in ("127.0.0.1:8000", "ftp://h:1", "http://h:99999", "http://h:1/v1"):
        with pytest.raises(ValueError, match="--backend"):
            check_backend_url(bad)


def test_prompt_keys_without_a_tokenizer() -> None:
    keyer = PromptKeyer(None, block_size=4)
    text = keyer.key("/v1/completions", {"prompt": "the quick brown fox jumps"})
    batch = keyer.key("/v1/completions", {"prompt": ["the quick brown fox jumps", "x"]})
    assert text == batch and len(text.block_hashes) == 6
    ids = keyer.key("/v1/completions", {"prompt": [[5, 6, 7, 8, 9]]})
    assert ids == prefix_key([5, 6, 7, 8, 9], 4)
    turn1 = [{"role": "system", "content": "be brief " * 8},
             {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    key1 = keyer.key("/v1/chat/completions", {"messages": turn1})
    key2 = keyer.key("/v1/chat/completions", {"messages": turn2})
    assert key2.block_hashes[:len(key1.block_hashes) - 1] == key1.block_hashes[:-1]
    assert keyer.key("/v1/completions", {"prompt": 3}) == PrefixKey()
    assert keyer.key("/v1/chat/completions", {"messages": "no"}) == PrefixKey()


def test_backend_reads_a_kvserve_servers_metrics() -> None:
    from kvserve.server.metrics import ServerMetrics

    stats = {"num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_usage": 0.25}
    backend = Backend("http://a:1", in_flight=1)
    backend.read_metrics(ServerMetrics("m", lambda: stats).render().decode())
    assert (backend.running, backend.waiting, backend.kv_usage) == (3.0, 2.0, 0.25)
    assert backend.load == 5.25
    backend.in_flight = 9  # the router's own count when the scrape lags
    assert backend.load == 9.25


def test_child_argv_drops_the_parent_only_flags() -> None:
    argv = ["--log-level", "INFO", "serve", "m", "--data-parallel-size", "2", "--port=9000",
            "--host", "0.0.0.0", "--router-policy", "round_robin", "--max-num-seqs", "8"]
    assert child_argv(argv, 1234) == ["--log-level", "INFO", "serve", "m", "--max-num-seqs",
                                      "8", "--host", "127.0.0.1", "--port", "1234"]
