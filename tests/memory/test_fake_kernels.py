"""What fake runs log beyond the fake kernels (`memfit.memory.fake_kernels`): here the RNG states torch makes through no
ATen op (`host_tensors_logged`), logged in the logging thread only, with torch's `get_rng_state` put back after."""
import threading

import pytest
import torch

from memfit.memory.fake_kernels import host_tensors_logged


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
