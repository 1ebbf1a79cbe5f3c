"""What is kept per model (`memfit.memory.cache`): a `ModelCache` entry lives as long as its model and no longer,
is dropped when the model's fingerprint changes or on `forget`, and a cached plan is lent to one caller at a
time."""
import gc
import weakref

import torch
from torch import nn

from memfit.memory import cache
from memfit.memory.cache import ModelCache


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


def test_same_names_one_living_object_and_no_later_one_at_its_reused_id():
    """A key part by identity: equal while its object lives; once collected, an object at the same address (the
    allocator reuses it; found here by making objects until one lands there) equals it no more. Objects that take
    no weak reference keep their id, as before."""
    from memfit.memory.cache import Same

    class A:
        pass

    class B:
        pass
    a = A()
    key, address = Same(a), id(a)
    assert key == Same(a) and hash(key) == hash(Same(a)) and key != Same(A())
    del a
    gc.collect()
    made = [B() for _ in range(10000)]
    assert any(id(b) == address for b in made)             # the address was reused
    assert all(key != Same(b) for b in made)
    numbers = [1, 2]
    assert Same(numbers) == Same(numbers) and Same(numbers) != Same([1, 2])
