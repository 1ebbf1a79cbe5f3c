"""The plans and planned memory models kept per model (`memfit.planner.kept`): a cached plan is lent to one caller at
a time and lets go of its model; values made at one intra-op thread count are not reused at another."""
import gc
import weakref

import torch
from torch import nn

from memfit.memory.step_model import step_memory_model
from memfit.planner import kept
from memfit.planner.kept import borrow_plan, give_back


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


def test_a_plan_is_kept_per_input_layout_and_a_planned_memory_model_per_sample_shape():
    model = nn.Sequential(nn.ReLU()).eval()
    a = borrow_plan(model, torch.empty(8, 16))
    give_back(a)
    b = borrow_plan(model, torch.empty(4, 16))         # another batch size, the same layout: the same plan
    give_back(b)
    c = borrow_plan(model, torch.empty(8, 32))         # another sample shape: another plan
    give_back(c)
    assert b is a and c is not a
    assert kept.known_planned_model(model, (16,), torch.float32) is None      # nothing made yet, nothing made here
    mm = kept.planned_model_of(model, (16,), torch.float32)
    assert kept.known_planned_model(model, (16,), torch.float32) is mm
    assert kept.planned_model_of(model, (16,), torch.float32) is mm
    assert kept.known_planned_model(model, (32,), torch.float32) is None


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
        mm1 = kept.planned_model_of(model, (16,), torch.float32)
        fm1 = step_memory_model(model, x, train=False)
        torch.set_num_threads(2)
        assert kept.known_planned_model(model, (16,), torch.float32) is None
        pm2 = borrow_plan(model, x)
        give_back(pm2)
        assert pm2 is not pm1
        assert kept.planned_model_of(model, (16,), torch.float32) is not mm1
        assert step_memory_model(model, x, train=False) is not fm1
        torch.set_num_threads(1)                        # back at one thread: the values made there, kept
        pm = borrow_plan(model, x)
        give_back(pm)
        assert pm is pm1 and kept.known_planned_model(model, (16,), torch.float32) is mm1
        assert step_memory_model(model, x, train=False) is fm1
    finally:
        torch.set_num_threads(threads)
