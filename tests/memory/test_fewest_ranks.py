"""The fewest FSDP2 ranks that fit a budget: every world size from the lower bound tried, each read off one run."""
import pytest
import torch

import memfit.memory.fewest_ranks as fewest
from memfit.memory.cache import forget
from memfit.memory.fewest_ranks import NoWorldFits, ranks_needed
from memfit.memory.ranks import rank_memory_model


def test_ranks_needed_is_the_fewest_that_fit_and_runs_only_at_one_world_size(monkeypatch):
    """The answer against each world size's prediction, and the runs it takes: FSDP2 on fake tensors at 2 ranks
    only (and 1, where 1 is tried), whatever the sizes tried (it ran once per size tried before: 54 s to find
    that nothing fits up to 40 ranks)."""
    import memfit.memory.ranks as ranks
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(m.parameters())
    base = rank_memory_model(m, (256,), optimizer=opt, world_size=2, probes=(4,))
    need = {w: base.at_world(w).total_bytes(4) for w in range(1, 9)}
    assert need[1] > need[2] > need[8]
    worlds = []
    run = ranks.fsdp_fake_run
    monkeypatch.setattr(ranks, "fsdp_fake_run", lambda *a, **k: worlds.append(k["world_size"]) or run(*a, **k))
    forget(m)                                            # the runs of `base` are kept for m: each call its own
    assert ranks_needed(m, (256,), need[2], 4, optimizer=opt) == 2
    forget(m)
    with pytest.raises(NoWorldFits, match="world size <= 40"):
        ranks_needed(m, (256,), 1, 4, optimizer=opt, max_world=40)
    assert worlds == [2, 1, 2, 1]                        # per call one run at 2 ranks, and one at 1


@pytest.mark.parametrize("unscalable", ["", "a stand-in reason"])
def test_ranks_needed_finds_the_fewest_where_padding_makes_the_peak_rise_again(monkeypatch, unscalable):
    """A per-rank peak that falls, rises and falls again with the world size (FSDP2's padded shards): 5 ranks fit,
    6 do not, 7 do; doubling then bisection would answer 7. Every size from the lower bound is tried: 5. Where
    each size is a run of its own (`unscalable`), every size near the lower bound, then doubling."""
    curve = {1: 100, 2: 90, 3: 85, 4: 80, 5: 60, 6: 75, 7: 65, 8: 50}
    tried = []

    class Model:
        def __init__(self, w):
            self.w, self.unscalable = w, unscalable

        def at_world(self, w):
            tried.append(w)
            return Model(w)

        def total_bytes(self, n):
            return curve.get(self.w, 40)
    monkeypatch.setattr(fewest, "rank_memory_model", lambda *a, world_size, **k: Model(world_size))
    assert ranks_needed(torch.nn.Linear(2, 2), (2,), 70, 4) == min(w for w, b in curve.items() if b <= 70) == 5
    assert ranks_needed(torch.nn.Linear(2, 2), (2,), 60, 4, at_least=3) == 5
    assert tried[-3:] == [3, 4, 5]                      # from the lower bound, none below it
    assert ranks_needed(torch.nn.Linear(2, 2), (2,), 45, 4) == 9   # beyond the curve: 40 from 9 ranks on
    with pytest.raises(NoWorldFits, match="world size <= 32"):
        ranks_needed(torch.nn.Linear(2, 2), (2,), 10, 4, max_world=32)
    if unscalable:                                      # runs of their own stop at DIRECT_MAX, and say why
        with pytest.raises(NoWorldFits, match=f"up to {fewest.DIRECT_MAX} ranks.*a stand-in reason"):
            ranks_needed(torch.nn.Linear(2, 2), (2,), 10, 4)
    else:
        tried.clear()
        with pytest.raises(NoWorldFits, match="world size <= 1024"):
            ranks_needed(torch.nn.Linear(2, 2), (2,), 10, 4)
        assert tried == list(range(1, 1025))
