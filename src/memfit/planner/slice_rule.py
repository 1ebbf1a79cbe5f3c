"""Which segments run in slices of the batch, and in slices of how many samples, at each batch size
(`planner.slicing` finds the segments that may, `planner.sliced.SlicedSegment` runs them and asks `SliceRule.size`).

One capture plans every batch size, and slicing pays at some sizes only: a ResNet-18 stem at 64x64 is where the
call peaks at batch 37 (sliced: 10.6 MB, whole: 19.4 MB) but not at 8 (the last stage's convolutions, a weight
reordered to 9.4 MB, peak above it), and at batch 2 a round of per-sample kernel calls costs time for little
memory. So the choice is a function of the batch n, the same whoever asks (the plan of a call at n, the memory
model's placement at n, from captures made at any batch): sizes at n, no timing, nothing random.

At batch n (every size taken with the symbolic batch set to n):
1. a segment whose peak run whole is above every op outside it (a stem) is sliced; the others are weighed together
   and sliced, those of them above the level the others leave, where together they lower the call's peak by
   `MIN_JOINT_SAVING` (RegNet's first block once its stem is sliced; MobileViT's equal blocks);
2. each runs in the largest exact slices (at least `MIN_SLICE_BYTES` in their largest tensor, chosen in
   `planner.slicing`; two slices or more at n) that peak no higher than the call then does;
3. time: a slice is a round of kernel calls (each about `CALL_SECONDS` beyond its work: 35-54 us a step per extra
   slice measured on MobileViT, MobileNetV2 and RegNet's segments) and a copy of its result; while the rounds cost
   more than `MAX_SLICING_TIME` of the call's estimated time (`planner.op_cost`: a rate a call, a FLOP and a byte
   read or written, fitted to eager's thread time on six models at batch 2, 8 and 37, within 30%), the segment whose
   next wider slices (or no slicing) raise the call's peak least is widened, but never above where the call would
   peak as torch.compile runs it (`_compiled_level`: elementwise ops fused, and no convolution holding its result
   twice, oneDNN's copy into an NCHW output, which inductor's channels-last convolutions do without): down to
   there slicing is worth its time, or the plan needs more than inductor's (RegNet, GPT-2's MLP);
4. what is left is kept where it lowers the call's peak by `MIN_CALL_SAVING`, else nothing is sliced at n.

Example:
    >>> import torch
    >>> from memfit.planner.captured import capture_model
    >>> stem = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 7, 2, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    >>> cap = capture_model(stem.eval(), torch.randn(4, 3, 64, 64))
    >>> seg = next(n.target for n in cap.ep.graph.nodes if n.op == "call_function")
    >>> seg.size(8) is not None          # slices of `seg.size(8)` samples at batch 8
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memfit.planner.graph import Meta
from memfit.planner.op_cost import BYTE_SECONDS, CALL_SECONDS, OpCost

__all__ = ["MAX_SLICING_TIME", "MIN_CALL_SAVING", "MIN_JOINT_SAVING", "Live", "Option", "SliceRule", "peak_outside"]

# the most of the call's estimated time slicing may add. In the slices of the least peak, MobileViT at batch 8 ran
# 1.07-1.12x eager's time (its rounds: 13% of eager's), zoo MobileNetV2 1.08-1.09x. Paired thread time at 5%:
# MobileViT 0.99 but MobileNetV2 at 4.79 MB, above torch.compile's 3.93; at 10%: MobileNetV2 0.97 at 3.15 MB,
# MobileViT 1.04; at 8%: MobileViT 0.99-1.02 at 3.41 MB (compiled 5.24), MobileNetV2 0.97 at 3.74 MB
MAX_SLICING_TIME = 0.08
# segments beyond those above every other op: sliced together where they lower the call's peak by this fraction.
# RegNet's first block and shortcut once its stem is sliced: 21% (2.49 -> 1.97 MiB, below torch.compile's 2.44);
# a block that buys a tenth runs whole
MIN_JOINT_SAVING = 0.15
# what slicing must lower the call's peak by, all of it at a batch, after step 3 (else that batch runs whole)
MIN_CALL_SAVING = 0.10
# batch sizes probed at capture: a segment sliced at none of them is left as ops of the graph
PROBES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Option:
    """A run of steps that may run in slices: its segment (sizes at any batch), the names of the graph's nodes it
    replaces, and the slice sizes it is exact at and that hold `MIN_SLICE_BYTES` (ascending)."""
    segment: object             # a SlicedSegment of its steps (any k: `held` sets it)
    names: frozenset
    sizes: tuple
    over_input: bool = False    # its output may be written over its input (a residual block: the same layout)
    input_held: bool = True     # its input is an activation (False: the caller's input, counted as inputs)

    def held(self, k: int, env: dict, n: int) -> int:
        """The most bytes it holds in slices of k at a batch of n: its input and output whole (one tensor where the
        output is written over the input), one slice's bytes."""
        seg = self.segment.with_size(k)
        inp = Meta.of(seg.input_val, env).nbytes if self.input_held else 0
        out = Meta.of(seg.steps[-1].val, env).nbytes
        if self.over_input and len(seg.slices(n)) > 1:
            return max(inp, out) + seg.slice_bytes(env, n, into=True)
        return inp + out + seg.slice_bytes(env, n)

    def extra_seconds(self, k: int, env: dict, n: int) -> float:
        """What slices of k cost beyond the whole run: a round of calls per slice after the first (the steps and
        the copy of its result) and the copy's bytes (read and written)."""
        slices = len(self.segment.with_size(k).slices(n))
        calls = sum(not st.alias for st in self.segment.steps)          # views cost next to nothing
        return (slices - 1) * (calls + 1) * CALL_SECONDS \
            + 2 * Meta.of(self.segment.steps[-1].val, env).nbytes * BYTE_SECONDS


@dataclass(frozen=True)
class Live:
    """The bytes alive at each op of the unsliced graph at one batch (`planner.graph.analyze`'s lifetimes, with its
    in-place writes, and what each kernel allocates inside: the planner's own byte model of an eager call)."""
    at: dict                    # op name -> bytes alive at it: its operands, its outputs, all alive across it
    free: dict                  # op name -> of those, tensors made without the inputs (masks, tables, positions)
    pos: dict                   # op name -> its index in the call
    spans: tuple                # (bytes, first index, last index) of each allocation

    def across(self, names) -> int:
        """Bytes alive from before the first op of `names` to after the last (a residual stream beside a block)."""
        idx = [self.pos[n] for n in names if n in self.pos]
        if not idx:
            return 0
        a, b = min(idx), max(idx)
        return sum(size for size, first, last in self.spans if first < a and last > b)


@dataclass
class SliceRule:
    """The slice size of each option at each batch size (None: whole), as the module docstring says; one per
    capture, shared by its segments, each choice made once per batch size."""
    ops: list[OpCost]
    options: list[Option]
    symbol: object              # the graph's symbolic batch (None: a static capture)
    ref: int                    # the batch kernels' inside bytes are measured at (`OpCost.at`)
    installed: frozenset | None = None   # the options the graph runs sliced where chosen (None: all)
    live: object = None         # env -> `Live` (None: each op's operands and outputs only, nothing alive across it)
    _chosen: dict = field(default_factory=dict)
    _costs: dict = field(default_factory=dict)
    _lives: dict = field(default_factory=dict)

    def env(self, n: int) -> dict:
        return {} if self.symbol is None else {self.symbol: n}

    def costs(self, n: int) -> tuple[dict[str, int], float]:
        """(op name -> bytes alive at it, for the ops that hold activations; the call's estimated seconds)."""
        if n not in self._costs:
            peaks, total = {}, 0.0
            for op in self.ops:
                p, s = op.at(self.env(n), self.env(self.ref), n / self.ref)
                total += s
                if op.held:
                    peaks[op.name] = p
            live = self.lives(n)
            if live is not None:         # an op holds what is alive at it, not only its operands
                peaks = {name: max(p, live.at.get(name, 0)) for name, p in peaks.items()}
            self._costs[n] = peaks, total
        return self._costs[n]

    def lives(self, n: int):
        """The `Live` bytes at batch n (None without a `live` model)."""
        if self.live is None:
            return None
        if n not in self._lives:
            self._lives[n] = self.live(self.env(n))
        return self._lives[n]

    def size(self, index: int, n: int) -> int | None:
        if n not in self._chosen:
            self._chosen[n] = self._choose(n)
        return self._chosen[n].get(index)

    def _choose(self, n: int) -> dict[int, int]:
        env = self.env(n)
        peaks, total = self.costs(n)
        held: dict = {}

        live = self.lives(n)

        def hold(i: int, k: int) -> int:
            if (i, k) not in held:      # and what is alive across it (a transformer's residual stream)
                held[i, k] = self.options[i].held(k, env, n) + (live.across(self.options[i].names) if live else 0)
            return held[i, k]

        def level(sizes: dict[int, int]) -> int:
            out = set().union(*(self.options[i].names for i in sizes)) if sizes else set()
            return max([peak_outside(peaks, out), *(hold(i, k) for i, k in sizes.items())])

        allowed = {i: [k for k in o.sizes if n >= 2 * k] for i, o in enumerate(self.options)
                   if self.installed is None or i in self.installed}
        allowed = {i: ks for i, ks in allowed.items() if ks}
        whole = {i: max((peaks.get(name, 0) for name in self.options[i].names), default=0) for i in allowed}
        narrow = {i: ks[0] for i, ks in allowed.items()}
        stems = [i for i in allowed if whole[i] > _outside(peaks, self.options[i])]
        more = [i for i in allowed if i not in stems]
        taken = stems
        joint = level({i: narrow[i] for i in stems + more})
        if more and joint <= (1 - MIN_JOINT_SAVING) * level({i: narrow[i] for i in stems}):
            taken = stems + [i for i in more if whole[i] > joint]
        if not taken:
            return {}
        peak = level({i: narrow[i] for i in taken})
        sizes = {i: max(k for k in allowed[i] if k == narrow[i] or hold(i, k) <= peak) for i in taken}
        budget, must = MAX_SLICING_TIME * total, self._compiled_level(n)
        while sizes and sum(self.options[i].extra_seconds(k, env, n) for i, k in sizes.items()) > budget:
            moves = []
            for i, k in sizes.items():
                new = dict(sizes)
                wider = [w for w in allowed[i] if w > k]
                if wider:
                    new[i] = wider[0]
                else:
                    del new[i]
                saved = self.options[i].extra_seconds(k, env, n) - (
                    self.options[i].extra_seconds(new[i], env, n) if i in new else 0.0)
                moves.append((level(new), -saved, i, new))
            move = min(moves, key=lambda m: m[:3])
            if move[0] > must >= level(sizes):     # time never takes the call above the level torch.compile's would be
                break
            sizes = move[3]
        if sizes and level(sizes) > (1 - MIN_CALL_SAVING) * level({}):
            return {}
        return sizes


    def _compiled_level(self, n: int) -> int:
        """Where the call would peak run as torch.compile (inductor) runs it: elementwise ops fused into their
        neighbours (their intermediates never exist: a GPT-2 MLP's tanh GELU is five such ops), tensors made
        without the inputs computed inside their readers (an attention mask), and no convolution holding its result
        twice (oneDNN's copy of it into an NCHW output; inductor's channels-last convolutions hold it once).
        Slicing lowers the call to this level whatever it costs in time, or the plan needs more than inductor's
        (RegNet: 2.54 MiB unsliced, torch.compile 2.33; GPT-2's MLP and attention)."""
        from memfit.planner.per_sample import elementwise
        peaks, _ = self.costs(n)
        live = self.lives(n)
        free = live.free if live is not None else {}
        grows = {op.name: int(op._inside[1] * n / self.ref) for op in self.ops
                 if op.target is torch.ops.aten.convolution.default and op._inside is not None}
        fused = {op.name for op in self.ops if elementwise(op.target)}
        return max((p - grows.get(name, 0) - free.get(name, 0) for name, p in peaks.items() if name not in fused),
                   default=0)


def peak_outside(peaks: dict[str, int], names) -> int:
    """The most bytes any op not among `names` holds at once (`peaks`: op name -> its peak)."""
    return max((v for name, v in peaks.items() if name not in names), default=0)


def _outside(peaks: dict, option: Option) -> int:
    return peak_outside(peaks, option.names)
