"""What is kept per model (`memfit.memory.cache`): a `ModelCache` entry lives as long as its model and no longer,
is dropped when the model's fingerprint changes or on `forget`, and a cached plan is lent to one caller at a
time."""
import gc
import weakref

import torch
from torch import nn

from memfit.memory import cache
from memfit.memory.cache import ModelCache, borrow_plan, give_back


def counter():
    calls = []

    def make():
        calls.append(1)
        return len(calls)
    return make, calls


def test_a_value_is_made_once_per_model_and_key():
    c, a, b = ModelCache(), nn.Linear(2, 2), nn.Linear(2, 2)
    make, calls = counter()
    assert c.get(a, "k", make) == 1 and c.get(a, "k", make) == 1
    assert c.get(a, "other", make) == 2 and c.get(b, "k", make) == 3      # another key, another model
    assert len(calls) == 3
    assert c.peek(a, "k") == 1 and c.peek(a, "missing", "none") == "none"
    c.put(a, "k", 7)
    assert c.get(a, "k", make) == 7 and len(calls) == 3


def test_peek_makes_nothing():
    c, m = ModelCache(), nn.Linear(2, 2)
    assert c.peek(m, "k") is None
    assert m not in c._entries                         # no empty entry for a model only looked at


def test_an_entry_goes_with_its_model_and_never_keeps_it_alive():
    c, m = ModelCache(), nn.Linear(2, 2)
    c.get(m, "k", lambda: torch.zeros(1000))
    ref = weakref.ref(m)
    assert len(c._entries) == 1
    del m
    gc.collect()
    assert ref() is None                               # the cache held the model weakly
    assert len(c._entries) == 0                        # and its entry went with it


def test_a_changed_fingerprint_drops_every_value_of_the_model():
    c, m = ModelCache(), nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    c.get(m, "a", lambda: "old a")
    c.get(m, "b", lambda: "old b")
    m[0].weight.data = torch.zeros(3, 2)               # a new shape: a plan or prediction for it is stale
    assert c.peek(m, "a") is None and c.peek(m, "b") is None
    assert c.get(m, "a", lambda: "new a") == "new a"
    for change in (lambda: m[0].to(torch.float64), lambda: m.eval(), lambda: setattr(m[1], "p", 0.5)):
        change()
        assert c.get(m, "a", lambda: "newer") == "newer"
        c.put(m, "a", "kept")
        assert c.peek(m, "a") == "kept"                # unchanged since: kept


def test_an_unfingerprinted_cache_keeps_values_through_changes():
    c, m = ModelCache(fingerprinted=False), nn.Linear(2, 2)
    c.get(m, "k", lambda: "kept")
    m.eval()
    m.weight.data = torch.zeros(3, 2)
    assert c.peek(m, "k") == "kept"


def test_forget_drops_one_model_from_one_cache_or_from_all():
    first, second = ModelCache(), ModelCache()
    m, other = nn.Linear(2, 2), nn.Linear(2, 2)
    for c in (first, second):
        c.put(m, "k", "m")
        c.put(other, "k", "other")
    first.forget(m)
    assert first.peek(m, "k") is None and second.peek(m, "k") == "m" and first.peek(other, "k") == "other"
    cache.forget(m)                                    # every cache
    assert second.peek(m, "k") is None and second.peek(other, "k") == "other"
    first.forget(nn.Linear(2, 2))                      # a model never seen: nothing to drop, no error


def test_a_cached_plan_is_lent_to_one_caller_at_a_time_and_lets_go_of_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    first = borrow_plan(model, torch.empty(8, 16))
    assert first.model is model
    second = borrow_plan(model, torch.empty(8, 16))   # while the first is out: its own plan from the same capture
    assert second is not first and second.captures[0] is first.captures[0]
    torch.testing.assert_close(second(x), model(x))
    give_back(second)
    torch.testing.assert_close(first(x), model(x))    # the other's give_back freed nothing of the first's
    give_back(first)
    assert first.model is None and first.arena_bytes == 0
    again = borrow_plan(model, torch.empty(8, 16))    # given back: the cached plan is lent again, no capture
    assert again is first
    give_back(again)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None                               # the kept plan does not keep its model alive


def test_a_plan_is_kept_per_input_layout_and_a_memory_model_per_sample_shape():
    model = nn.Sequential(nn.ReLU()).eval()
    a = borrow_plan(model, torch.empty(8, 16))
    give_back(a)
    b = borrow_plan(model, torch.empty(4, 16))         # another batch size, the same layout: the same plan
    give_back(b)
    c = borrow_plan(model, torch.empty(8, 32))         # another sample shape: another plan
    give_back(c)
    assert b is a and c is not a
    assert cache.known_memory_model(model, (16,), torch.float32) is None      # nothing made yet, nothing made here
    mm = cache.memory_model_of(model, (16,), torch.float32)
    assert cache.known_memory_model(model, (16,), torch.float32) is mm
    assert cache.memory_model_of(model, (16,), torch.float32) is mm
    assert cache.known_memory_model(model, (32,), torch.float32) is None


def test_plans_and_memory_models_made_at_another_thread_count_are_not_reused():
    """The kernels' workspaces a placement and a memory model count (oneDNN's scratch) are measured per
    intra-op thread count: what was made at one count must not answer at another (it used to)."""
    model = nn.Sequential(nn.ReLU()).eval()
    x = torch.empty(2, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        pm1 = borrow_plan(model, x)
        give_back(pm1)
        mm1 = cache.memory_model_of(model, (16,), torch.float32)
        fm1 = cache.forward_memory_of(model, x)
        torch.set_num_threads(2)
        assert cache.known_memory_model(model, (16,), torch.float32) is None
        pm2 = borrow_plan(model, x)
        give_back(pm2)
        assert pm2 is not pm1
        assert cache.memory_model_of(model, (16,), torch.float32) is not mm1
        assert cache.forward_memory_of(model, x) is not fm1
        torch.set_num_threads(1)                        # back at one thread: the values made there, kept
        pm = borrow_plan(model, x)
        give_back(pm)
        assert pm is pm1 and cache.known_memory_model(model, (16,), torch.float32) is mm1
        assert cache.forward_memory_of(model, x) is fm1
    finally:
        torch.set_num_threads(threads)
