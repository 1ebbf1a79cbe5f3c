"""memfit.fit and torch's global generators: fit neither draws from them nor saves and restores them (which
would rewind what another thread drew meanwhile), also where a memory model runs a checkpointed step on fake
tensors (torch.utils.checkpoint would set the global generator back around the recomputation)."""
import sys
import threading
import time

import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.fitting import host

N, D = 8, 16


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, D))
                           for _ in range(2)])


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)


def summary(plan):
    return (plan.micro_batch, plan.checkpoint, plan.peak_bytes,
            sorted((a.micro_batch, a.setting.checkpoint, a.bytes) for a in plan.alternatives))


def test_another_threads_draws_are_neither_taken_nor_rewound_and_the_plan_is_unchanged(monkeypatch):
    ref_model, model = mlp(), mlp()        # made first: their initialisation seeds and draws
    batch = data()
    ref = memfit.fit(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), batch, F.mse_loss, "1GiB",
                     exhaustive=True)      # every checkpoint set's memory model: fake runs that recompute
    monkeypatch.setattr(host, "_MACHINES", {})         # the host's costs measured again: its chain's weights
    resets = []
    for owner in (torch, torch.random):    # torch.utils.checkpoint and fork_rng set the state through these
        original = owner.set_rng_state
        monkeypatch.setattr(owner, "set_rng_state",
                            lambda s, original=original: (resets.append(threading.get_ident()), original(s))[1])
    torch.manual_seed(123)
    done, draws = threading.Event(), []

    def draw():                            # the other thread: draws from torch's generator all along
        while not done.is_set() or len(draws) < 3:
            draws.append(torch.rand(4))
            time.sleep(1e-4)               # lets go of the GIL: fit runs near its own speed between draws
    other = threading.Thread(target=draw, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)            # the threads take turns often: draws fall inside fit's every phase
    try:
        other.start()
        plan = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, F.mse_loss, "1GiB",
                          exhaustive=True)
        during = len(draws)
        done.set()
        other.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    assert not other.is_alive() and during > 0
    assert threading.get_ident() not in resets          # fit never set torch's generator back
    g = torch.Generator().manual_seed(123)
    expected = [torch.rand(4, generator=g) for _ in draws]
    assert all(torch.equal(a, b) for a, b in zip(draws, expected, strict=True))     # no repeat, none taken
    assert summary(plan) == summary(ref)
