"""A torch function replaced for the threads inside only, and put back (`memfit.device.replacements`): the threads
inside get the replacement, every other thread torch's own function, and the last to leave (on an exception too)
puts torch's back."""
import threading
import types

import pytest

from device.threads import in_thread
from memfit.device.replacements import ScopedContext, ScopedReplacement


def test_a_scoped_replacement_acts_in_the_entering_thread_only_and_is_put_back():
    owner = types.SimpleNamespace(f=lambda: "torch's")
    original = owner.f
    r = ScopedReplacement(lambda: owner, "f", lambda orig: "ours, over " + orig())
    with r.active():
        assert owner.f() == "ours, over torch's"
        assert in_thread(owner.f) == "torch's"                       # another thread: torch's own
        with r.active():                                             # nested: still ours
            assert owner.f() == "ours, over torch's"
        assert owner.f() == "ours, over torch's"
    assert owner.f is original
    with pytest.raises(KeyError), r.active():
        raise KeyError("inside")
    assert owner.f is original                                      # put back on an exception


def test_a_scoped_replacement_stays_until_the_last_thread_leaves():
    owner = types.SimpleNamespace(f=lambda: "torch's")
    original = owner.f
    r = ScopedReplacement(lambda: owner, "f", lambda orig: "ours")
    entered, leave = threading.Event(), threading.Event()

    def other():
        with r.active():
            entered.set()
            leave.wait(10)
            return owner.f()
    t = threading.Thread(target=lambda: seen.append(other()))
    seen = []
    t.start()
    entered.wait(10)
    with r.active():
        assert owner.f() == "ours"
    assert owner.f is not original and owner.f() == "torch's"      # the other thread is still inside
    leave.set()
    t.join()
    assert seen == ["ours"] and owner.f is original


def test_a_scoped_replacement_refuses_a_name_torch_no_longer_has():
    r = ScopedReplacement(lambda: types.SimpleNamespace(), "gone", lambda orig: None)
    with pytest.raises(RuntimeError, match="expected torch to define .*gone.*needs updating"), r.active():
        pass


def test_an_inherited_method_is_replaced_on_the_class_and_uncovered_again():
    """torch.UntypedStorage inherits resize_ from its C base: replaced on the class for the threads inside (bound as
    a method), the base one uncovered after; a method the class holds itself (a user's wrapper) is put back."""
    class Base:
        def size(self):
            return "base"

    class Storage(Base):
        pass
    r = ScopedReplacement(lambda: Storage, "size", lambda orig, self: "ours, over " + orig(self))
    s = Storage()
    with r.active():
        assert s.size() == "ours, over base" and in_thread(s.size) == "base"
    assert "size" not in vars(Storage) and s.size() == "base"
    users = lambda self: "user's"          # noqa: E731
    Storage.size = users
    with r.active():
        assert s.size() == "ours, over user's"
    assert vars(Storage)["size"] is users


def test_a_replacement_left_installed_by_another_library_is_not_wrapped_again():
    """A library that saves the function while memfit's replacement is in and puts it back after (torch's MemTracker
    does so with UntypedStorage.resize_) leaves memfit's replacement installed: the next entry wraps what it wraps,
    not it (each call ran `inside` twice: FSDP2's storage resizes logged twice, a free counted twice)."""
    owner = types.SimpleNamespace(f=lambda: 1)
    calls = []
    r = ScopedReplacement(lambda: owner, "f", lambda orig: calls.append("inside") or orig())
    with r.active():
        saved = owner.f                      # another library's save...
    owner.f = saved                          # ...and restore after memfit left
    with r.active():
        assert owner.f() == 1
    assert calls == ["inside"]


def test_a_scoped_context_is_entered_in_the_threads_inside_only_and_left_as_entered():
    """DTensor's sharding lock is an object torch enters, not a function: a thread inside enters `inside(torch's)`
    and leaves the same; another thread, entering while the first is still in, enters torch's own."""
    entered = []

    class Lock:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(f"enter {self.name}")
            return self.name

        def __exit__(self, *exc):
            entered.append(f"exit {self.name}")

    owner = types.SimpleNamespace(lock=Lock("torch's"))
    original = owner.lock

    def enter():
        with owner.lock as name:
            return name
    r = ScopedContext(lambda: owner, "lock", lambda orig: Lock("ours over " + orig.name))
    with r.active():
        with owner.lock as mine:
            theirs = in_thread(enter)                           # another thread, while this one is in
    assert (mine, theirs) == ("ours over torch's", "torch's") and owner.lock is original
    assert entered == ["enter ours over torch's", "enter torch's", "exit torch's", "exit ours over torch's"]
    assert enter() == "torch's"
