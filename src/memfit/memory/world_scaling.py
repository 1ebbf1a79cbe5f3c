"""One FSDP2 rank's bytes at any world size, computed from a fake run at another: which storages scale, and how.

FSDP2 shards every parameter's dim 0 with `torch.chunk`: of a parameter of `rows` rows of `inner` elements,
rank 0 of W ranks holds the first ceil(rows / W) rows (its chunk is always whole; the padding falls on the last
ranks), and FSDP2's all-gather output, its unsharded parameters and its reduce-scatter input hold W such padded
chunks. So every storage of a step whose size depends on W (rank 0's shards and their optimizer state and
gradients, the all-gather and reduce-scatter buffers, the unsharded parameters in flight) is, in bytes,

    itemsize * (W if whole else 1) * sum(ceil(rows / W) * inner)      over some parameters      (`Scaled`)

and nothing else in the step depends on W: the ops run in the same order, the activations are the per-rank
batch's. `memfit.memory.fsdp_log` gives each storage its `Scaled` as the run allocates it (by what FSDP2 holds
it as, or by the collective it is made in); `WorldScaling` turns them into each op's bytes at any W, as
`live(W) = live(W0) + shift(W)`: per (rows, whole) one matrix of bytes per unit, so any W costs a few array
operations, not a run (FSDP2's own sharding of every parameter into W chunks on fake tensors took 56 s at 1,024
ranks). Beside them: the CPU `fsdp.chunk_cat`'s padded copies (`transients`: whether a gradient is padded
depends on W dividing its rows, not a sum of chunks), the device meshes' rank tensors (W int32 each) and the
buffers gloo's race may keep (`race`).

Exactness is checked against the fake run at the world size itself, every op and kind to the byte
(tests/memory/test_world_scaling.py: an MLP whose rows do not split evenly at 3 and 300 ranks on gloo, a
transformer encoder with a frozen unit at 5, bf16 parameters reduced in float32 at 6; `memfit bench distributed
--memory`: an MLP, a CNN, an encoder and GPT-2 at 3, 8 and 64 ranks), and against real steps
(tests/memory/test_ranks.py: 2 gloo ranks, 8 ranks under a fake process group).

Example:
    >>> lin = Scaled(itemsize=4, whole=False, terms=((255, 256),))    # a 255 x 256 float32 weight
    >>> lin.bytes_at(2), lin.bytes_at(1000)                            # 128 rows; 1 row
    (131072, 1024)
    >>> Scaled(4, True, ((255, 256),)).bytes_at(2)                    # two chunks of 128 rows: padded to 256
    262144
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Scaled", "WorldScaling"]


@dataclass(frozen=True)
class Scaled:
    """A storage's bytes at any world size W: `itemsize * (W if whole else 1) * sum(ceil(rows / W) * inner)`."""
    itemsize: int
    whole: bool                                   # W chunks (a collective's buffer) or rank 0's one
    terms: tuple[tuple[int, int], ...]            # (rows, elements per row) of each parameter

    def bytes_at(self, world: int) -> int:
        return self.itemsize * (world if self.whole else 1) * sum(-(-r // world) * inner for r, inner in self.terms)


def _atom(rows: int, whole: bool, world: int) -> int:
    """Rows of one parameter a storage holds at `world` ranks: rank 0's chunk, or W of them."""
    return (world if whole else 1) * -(-rows // world)


@dataclass
class WorldScaling:
    """What changes in one FSDP2 rank's step with the world size, from a run at `world` ranks (see the module).

    Attributes:
        world: the world size of the run it was read off.
        atoms: (rows, whole) -> (ops, kinds) bytes live after each op per row of such a parameter (`_atom`).
        transients: (op, kind column, bytes at W) of pseudo-ops live at one op only (fsdp.chunk_cat's copies).
        meshes: device meshes whose rank tensor (W int32, communication buffers) is held through the step.
        race: (gloo) the buffers one collective holds, of which `race_at(W)` is the largest.
    """
    world: int
    shape: tuple[int, int]
    atoms: dict[tuple[int, bool], np.ndarray]
    transients: list[tuple[int, int, Callable[[int], int]]]
    meshes: int
    mesh_column: int
    race: list[Scaled]

    @classmethod
    def from_events(cls, events, start: int, n_ops: int, n_kinds: int, column: Callable[[int], int],
                    scaled: dict[int, Scaled], world: int, **parts) -> WorldScaling:
        """From a run's (op, allocation id, +-bytes) events, each op index from `start` on a row (events before
        it count at the first row, as held), and the `Scaled` of every allocation whose size depends on W.
        Raises ValueError where an event of such an allocation is not its whole size (a partial resize)."""
        delta: dict[tuple[int, bool], np.ndarray] = {}
        for op, aid, d in events:
            s = scaled.get(aid)
            if s is None or not d:
                continue
            full = s.bytes_at(world)
            if abs(d) != full:
                raise ValueError(f"a storage of {full} bytes at {world} ranks ({s}) grew or shrank by {d} bytes at op "
                                 f"{op - start}: only whole allocations, frees and resizes to 0 scale")
            row = min(max(op - start, 0), n_ops)
            for rows, inner in s.terms:
                per = delta.setdefault((rows, s.whole), np.zeros((n_ops + 1, n_kinds), dtype=np.int64))
                per[row, column(aid)] += (1 if d > 0 else -1) * s.itemsize * inner
        atoms = {k: np.cumsum(v, axis=0)[:n_ops] for k, v in delta.items()}
        return cls(world, (n_ops, n_kinds), {k: v for k, v in atoms.items() if v.any()}, **parts)

    def shift(self, world: int) -> np.ndarray | int:
        """(ops, kinds) bytes to add to the run's to get `world` ranks' (0 at the run's own world size)."""
        if world == self.world:
            return 0
        out = np.zeros(self.shape, dtype=np.int64)
        for (rows, whole), per in self.atoms.items():
            if d := _atom(rows, whole, world) - _atom(rows, whole, self.world):
                out += per * d
        for row, col, at in self.transients:
            out[row, col] += at(world) - at(self.world)
        out[:, self.mesh_column] += self.meshes * 4 * (world - self.world)     # int32 rank tensors
        return out

    def race_at(self, world: int) -> int:
        """(gloo) the largest buffer one collective holds at `world` ranks: what gloo's race may keep."""
        return max((s.bytes_at(world) for s in self.race), default=0)
