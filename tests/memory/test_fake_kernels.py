"""What fake runs log beyond the fake kernels (`memfit.memory.fake_kernels`): here the RNG states torch makes through no
ATen op (`host_tensors_logged`), logged in the logging thread only, with torch's `get_rng_state` put back after; and
linear's bias add, in place for real (`composites_as_real`)."""
import threading

import pytest
import torch
import torch.nn.functional as F

from memfit.device.torch_private import storage_key
from memfit.memory.fake_kernels import host_tensors_logged
from memfit.memory.storage_log import LoggingFakeMode, StorageLog


def test_rng_states_are_logged_in_the_logging_thread_only_and_torchs_function_is_put_back():
    original = torch.get_rng_state
    logged, other = [], []
    with host_tensors_logged(lambda name, t: logged.append((name, t.nbytes))):
        state = torch.get_rng_state()
        worker = threading.Thread(target=lambda: other.append(torch.get_rng_state()))
        worker.start()
        worker.join()
    assert logged == [("<torch.get_rng_state>", state.nbytes)]      # the other thread's call: torch's own, unlogged
    assert torch.equal(other[0], state)
    assert torch.get_rng_state is original
    with pytest.raises(ValueError), host_tensors_logged(lambda name, t: None):
        raise ValueError("inside")
    assert torch.get_rng_state is original                            # put back on an exception too


def peak_of(log) -> int:
    """The most bytes live at once over a `StorageLog`'s allocations and frees, in the order logged."""
    live = peak = 0
    for _, _, delta in log.log:
        live += delta
        peak = max(peak, live)
    return peak


def test_linears_bias_add_on_a_transposed_input_is_logged_in_place_and_torchs_linear_is_put_back():
    """Real ATen adds linear's bias into the matmul's result (`add_`), a fake run's kernel out of place: logged as the
    real one, the result's storage let go as the output is made. F.linear is torch's own outside the block, and in
    any other thread inside it."""
    original = F.linear
    mode, log = LoggingFakeMode(), StorageLog(torch.device("cpu"))
    with mode:
        x, w, b = torch.zeros(4, 16, 8), torch.zeros(32, 16), torch.zeros(32)
        with mode.logging_to(log):
            assert F.linear is not original
            y = F.linear(x.transpose(1, 2), w, b)           # (4, 8, 32): bmm's result (4 KiB), the bias added
            other = []
            worker = threading.Thread(target=lambda: other.append(F.linear(torch.ones(2, 3, 1).transpose(1, 2),
                                                                           torch.ones(1, 3), torch.ones(1))))
            worker.start()
            worker.join()
    assert peak_of(log) == y.nbytes                              # 8 KiB with the add out of place
    assert log.live == {storage_key(y.untyped_storage()): y.nbytes}
    assert torch.equal(other[0], torch.full((2, 1, 1), 4.0))     # a real tensor, not logged, in another thread
    assert F.linear is original
