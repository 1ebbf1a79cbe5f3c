"""memfit.memory.fsdp_log: the storage resizes FSDP2 makes are logged in the tagging thread only, and
`UntypedStorage.resize_` is left as found."""

import torch

from device.threads import in_thread
from memfit.memory.fsdp_log import RankLog, tagging


def test_resizes_are_logged_in_the_tagging_thread_and_the_resize_found_is_put_back():
    """The resize wrapper was set on torch.UntypedStorage for the whole process and deleted on the way out: another
    thread's resizes were logged into this run's log, and a resize_ set on the class before (a user's wrapper; torch's
    MemTracker leaves the base method set there) was lost."""
    calls = []

    def users(storage, size):
        calls.append(size)
        return users.base(storage, size)
    users.base = torch.UntypedStorage.resize_
    own = vars(torch.UntypedStorage).get("resize_")
    log = RankLog(torch.device("cpu"), 2)
    try:
        torch.UntypedStorage.resize_ = users
        with tagging(log):
            s = torch.UntypedStorage(8)
            s.resize_(16)                                   # logged, through the user's wrapper
            logged = len(log.log)
            t = torch.UntypedStorage(8)
            in_thread(lambda: t.resize_(32))                # another thread: not this run's
            assert s.nbytes() == 16 and t.nbytes() == 32 and len(log.log) == logged > 0
        assert vars(torch.UntypedStorage)["resize_"] is users and calls == [16, 32]
    finally:
        if own is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = own
    with tagging(log):
        pass
    assert vars(torch.UntypedStorage).get("resize_") is own        # nothing set on it after, where nothing was
