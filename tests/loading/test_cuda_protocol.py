"""The prefetcher's CUDA stream protocol (`memfit.loading.prefetch.Slots`) run on the CPU against fake streams and
events that log what each stream waits for: which ordering the code asks of the GPU, checked where no GPU is.
(tests/loading/test_minibatches.py checks the bytes on a real GPU under a slow consumer.)"""
from contextlib import contextmanager

import torch

from memfit.loading.prefetch import Inline, Slots
from memfit.loading.sources import make_source


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        # what a cudaStreamWaitEvent waits for: the event's latest record at the time of the call
        self.log.append(("wait", self.name, event, event.records[-1] if event.records else None))


class FakeEvent:
    def __init__(self):
        self.records: list[str] = []           # the streams it was recorded on, in order

    def record(self, stream) -> None:
        self.records.append(stream.name)

    def synchronize(self) -> None:
        pass


@contextmanager
def fake_cuda(monkeypatch, log: list):
    consumer, current = FakeStream("consumer", log), []
    real_empty = torch.empty

    @contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side", log))
        m.setattr(torch.cuda, "Event", FakeEvent)
        m.setattr(torch.cuda, "stream", on)
        m.setattr(torch.cuda, "current_stream", lambda device=None: current[-1] if current else consumer)
        m.setattr(torch.cuda, "set_device", lambda device: None)
        # the "device" and "pinned" buffers are plain CPU tensors here
        m.setattr(torch, "empty", lambda *a, device=None, pin_memory=False, **k: real_empty(*a, **k))
        m.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        yield


def test_the_side_stream_never_writes_a_slot_before_the_consumer_stream_let_it_go(monkeypatch):
    """Every copy into a slot on the side stream waits for an event the consumer's stream recorded: after its last
    read of the slot, and before the first copy, after the slot's allocation (its block may have been freed by the
    consumer with kernels still queued on it: without that wait the first copy races them)."""
    x = torch.arange(48, dtype=torch.uint8).reshape(12, 4)
    src = make_source((x, torch.arange(12) % 3))
    log: list = []
    blocks = [torch.tensor([5, 4, 3, 2]), torch.tensor([1, 0, 11, 10]), torch.tensor([9, 8, 7, 6])]
    with fake_cuda(monkeypatch, log):
        for count in (1, 2):
            slots = Slots(src, capacity=4, device=torch.device("cuda", 0), count=count)
            fetch, got = Inline(slots, blocks), []
            for _ in blocks:
                s = fetch.get()
                got.append(slots.batch(s, 0, 4)[0])
                fetch.release(s)
            assert torch.equal(torch.cat(got), torch.cat([x[i] for i in blocks]))     # the protocol moved the rows
            waits = [(event, by) for kind, stream, event, by in log if kind == "wait" and stream == "side"]
            assert len(waits) == len(blocks) and all(e in slots.freed for e, _ in waits)
            assert [by for _, by in waits] == ["consumer"] * len(blocks), waits
            log.clear()
