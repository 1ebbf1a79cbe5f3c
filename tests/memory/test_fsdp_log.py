"""memfit.memory.fsdp_log: what its tagging puts on torch's classes is taken off as found."""

import torch

from memfit.memory.fsdp_log import RankLog, tagging


def test_tagging_puts_back_the_storage_resize_it_found():
    """The storage resize wrapper was deleted on the way out, not put back: a resize_ set on UntypedStorage before
    (a user's wrapper; torch's MemTracker leaves the base method set there) was lost."""
    def users(storage, size):
        return users.base(storage, size)
    inherited = torch.UntypedStorage.resize_
    users.base = inherited
    own = vars(torch.UntypedStorage).get("resize_")
    try:
        torch.UntypedStorage.resize_ = users
        with tagging(RankLog(torch.device("cpu"), 2)):
            assert torch.UntypedStorage.resize_ is not users          # the log's wrapper while it runs
            s = torch.UntypedStorage(8)
            s.resize_(16)
            assert s.nbytes() == 16
        assert vars(torch.UntypedStorage)["resize_"] is users
    finally:
        if own is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = own
    with tagging(RankLog(torch.device("cpu"), 2)):
        pass
    assert vars(torch.UntypedStorage).get("resize_") is own        # nothing set on it after, where nothing was
