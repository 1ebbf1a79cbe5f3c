"""Model generators the tests and the benchmarks share: nothing here runs at import or in the library.

- `zoo`: a zoo of models written without torchvision (MLP, CNNs, ResNet and MobileNet layer plans, transformer
  blocks) and of `transformers` architectures built from configs with random weights (`build_real`).
- `fuzz`: random programs for differential fuzzing of the planner (views, broadcasts and in-place candidates).
- `ranks`: the one rank spawner: N gloo (or nccl) processes on 127.0.0.1, results or errors, bounded waits.
- `reads`: reads of a tensor's value by the host (each a sync on a GPU), counted while a block runs.
"""

__all__: list[str] = []
