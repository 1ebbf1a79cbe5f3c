"""Readers for the data users already have: IDX (MNIST), CIFAR-10 pickles, .npy/.npz, digits, synthetic.

Nothing here downloads anything: every reader takes a path to files on disk (or, for `digits`,
data scikit-learn ships) and returns plain numpy arrays, images as uint8 `(N, C, H, W)` and labels
as int64 `(N,)`, ready for `torch.from_numpy`. Each public function's docstring has an example.
A file is never trusted for its sizes: what a header or a pickle claims is checked against the bytes
the file holds before memory is taken for it (`memfit.bounded`), and a MemoryError is raised again
with the file named.

One module per source: `idx` (MNIST's IDX files), `cifar` (CIFAR-10 pickles and archive), `npy` (.npy/.npz),
`generated` (digits, synthetic data); every reader is imported from here (`memfit.readers.load_idx`).
"""

from memfit.readers.cifar import cifar10
from memfit.readers.generated import digits, synthetic
from memfit.readers.idx import load_idx, mnist, write_idx
from memfit.readers.npy import load_array

__all__ = ["cifar10", "digits", "load_array", "load_idx", "mnist", "synthetic", "write_idx"]
