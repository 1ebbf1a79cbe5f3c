"""Every storage a fake-tensor run allocates and frees, logged per op (`StorageLog`), and the fake mode that hands
it every op the program runs (`LoggingFakeMode`): what `fake_run` turns into live bytes per op. Bytes are the real
kernels' where fake ones differ (`fake_kernels`), with the workspaces real kernels allocate inside and the 0-d
tensors autograd saves for Python numbers.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from numbers import Number

import torch

from memfit.device.cuda_kernels import flash_backward_workspaces
from memfit.device.measure import _storage_key
from memfit.device.torch_private import (
    READ_VALUE,
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    in_backward,
    op_schema,
    storage_key,
    tree_flatten,
)
from memfit.memory.fake_kernels import (
    BOUNDED_IN_BATCH,
    REAL_SIZE,
    WORKSPACE,
    bias_added_in_place,
    composites_as_real,
    real_bytes,
    workspace_bytes,
)
from memfit.memory.kernel_scratch import measured_here, spec_of
from memfit.memory.known_values import (
    DataDependentOnBatchSize,
    KnownValues,
    reads_stood_in,
    stand_in,
    transformers_reads_values,
)
from memfit.memory.step import autocast_entered_in_forward

__all__ = ["SAVES_SCALAR", "LoggingFakeMode", "StorageLog", "device_asked", "mask_check_answered_no",
           "refuse_sparse"]

# ops whose backward keeps their second argument: given a Python number, a 0-d tensor autograd wraps and saves
SAVES_SCALAR = frozenset({torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor})
# flash attention's backward on CUDA: the blocks it allocates inside (softmax_d, dq_accum), which no fake kernel shows
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers the storage's key (its address, reused once it is freed)."""
    __slots__ = ("key",)


def _fresh_outputs(func) -> bool:
    """Whether every output of `func` is a new storage: its schema aliases no input (not a view, not in place,
    not out=). `_unsafe_view` is a view whose schema says otherwise."""
    schema = op_schema(func)
    return schema is not None and func is not torch.ops.aten._unsafe_view.default \
        and not any(r.alias_info is not None for r in schema.returns)


class StorageLog:
    """Logs every storage allocated and freed on `device` as (op index, storage key, +bytes or -bytes).

    The lean cousin of `memfit.device.measure`'s live-bytes mode for fake runs, where its Python work per op is most
    of the cost: one weak reference per storage rather than a finalizer per tensor (a storage's Python object
    lives as long as the storage, so the reference dies with the last tensor on it), ops kept as objects, and
    an op's inputs looked at only when its schema says an output may alias one (a view of, or a write to, a
    tensor made outside: parameters, the batch).
    """

    FRESH: dict = {}                                  # op -> whether its outputs are always new storages

    def __init__(self, device: torch.device, scratch: bool = False, kernels: str | None = None):
        self.device = device
        # whose kernels the bytes are for: the fakes' device's, or 'cuda' for a CUDA step predicted on CPU fakes
        # (then the CPU kernels' own workspaces, scratch and wrapped numbers are left out)
        self.cpu_kernels = (kernels or device.type) == "cpu"
        self.cuda_kernels = (kernels or device.type) == "cuda"
        self.scratch = scratch and self.cpu_kernels   # note the ops whose kernels' scratch (and workspaces)
        #                                               the memory model measures at each batch
        self.scratch_ops: list[tuple[int, object, object]] = []   # (op index, op, ArgSpec): `_Run.scratch`
        self.ops: list = []                           # the OpOverload of every op, in order
        self.log: list[tuple[int, int, int]] = []
        self.live: dict[int, int] = {}                # storage key -> bytes, for storages allocated here
        self.refs: dict[int, _StorageRef] = {}        # storage key -> its weak reference (kept so it calls back)
        self.workspaces = 0                           # kernel workspaces logged, counted down as their keys
        self.saved_scalars: list[int] = []            # keys of the wrapped Python numbers autograd holds

    def free_saved_scalars(self) -> None:
        """Backward has ended: the Python numbers autograd saved are freed."""
        self.log += [(len(self.ops), k, -8) for k in self.saved_scalars]
        self.saved_scalars = []

    def _freed(self, ref: _StorageRef) -> None:
        nbytes = self.live.pop(ref.key, None)
        self.refs.pop(ref.key, None)
        if nbytes is not None:
            self.log.append((len(self.ops), ref.key, -nbytes))

    def _watch(self, s, key: int) -> None:
        ref = self.refs[key] = _StorageRef(s, self._freed)
        ref.key = key

    def record(self, func, out, args, kwargs) -> None:
        """Note op `func` and the new storages among its outputs `out`."""
        op = len(self.ops)
        self.ops.append(func)
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) or t is None for t in out):
            outs = out
        else:
            outs = tree_flatten(out)[0]
        fresh = self.FRESH.get(func)
        if fresh is None:
            fresh = self.FRESH[func] = _fresh_outputs(func)
        inputs = None
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # sparse or wrapper tensors own no plain storage
                refuse_sparse(func, (t,), "memfit's memory model")    # a sparse one made here would go uncounted
                continue
            key = storage_key(s)
            if key in self.refs:                          # allocated here, or known to be made outside
                continue
            nbytes = s.nbytes()
            if not nbytes and func not in REAL_SIZE:
                continue
            if not fresh:
                if inputs is None:
                    inputs = {k[0] for a in tree_flatten((args, kwargs))[0]
                              if isinstance(a, torch.Tensor) and (k := _storage_key(a))}
                if key in inputs:                         # a view of (or a write to) a tensor made outside
                    self._watch(s, key)
                    continue
            nbytes = real_bytes(func, i, t, nbytes, args, kwargs, self.cpu_kernels)
            if not nbytes:
                continue
            if i == 0 and bias_added_in_place(func) and (k := _storage_key(args[0])) and \
                    self.live.get(k[0]) == nbytes:
                # F.linear's bias add, in place for a real tensor (`fake_kernels.composites_as_real`): the matmul
                # result's storage is let go as the output is made, never both live (its own free then logs none)
                self.log.append((op, k[0], -self.live.pop(k[0])))
            self.live[key] = nbytes
            self.log.append((op, key, nbytes))
            self._watch(s, key)
        if func in SAVES_SCALAR and self.cpu_kernels and len(args) > 1 and isinstance(args[1], Number) \
                and isinstance(args[0], torch.Tensor) and args[0].requires_grad and torch.is_grad_enabled():
            # the Python number, wrapped in a 0-d tensor (8 bytes), is saved for backward by autograd, above
            # this dispatch level where no op returns it: held until backward ends (an upper bound)
            self.workspaces -= 1
            self.log.append((op, self.workspaces, 8))
            self.saved_scalars.append(self.workspaces)
        if func in WORKSPACE and self.scratch and func not in BOUNDED_IN_BATCH:
            # what the real kernel allocates inside is not a line in the batch (oneDNN picks its algorithm by size:
            # a 1x1 convolution's workspace is 0 B up to batch 13 and 1.4 MiB at 16): measured by the memory model
            # at each batch it is asked about, as the scratch below (`kernel_scratch`)
            self.scratch_ops.append((op, func, spec_of(args, kwargs)))
        elif func in WORKSPACE and self.cpu_kernels:
            # what the real kernel allocates inside and frees before it returns: live at this op only, as a part
            # the same at every batch and one that grows with it (the batch of this run: exact here)
            for extra in workspace_bytes(func, args, kwargs):
                if extra:
                    self.workspaces -= 1                  # a key no storage has
                    self.log += [(op, self.workspaces, extra), (op + 1, self.workspaces, -extra)]
        elif func is FLASH_BACKWARD and self.cuda_kernels:
            # what mha_bwd allocates inside, one block each, live at this op only (memfit.device.cuda_kernels)
            q, k = args[1], args[2]
            for extra in flash_backward_workspaces(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3],
                                                   q.dtype, k.shape[1], torch.are_deterministic_algorithms_enabled()):
                self.workspaces -= 1
                self.log += [(op, self.workspaces, extra), (op + 1, self.workspaces, -extra)]
        elif self.scratch and measured_here(func, args, kwargs):
            # kernels on half-precision arguments, matmuls copying an argument BLAS cannot read (`kernel_scratch`):
            # their scratch is not logged here: the memory model measures it at each batch it is asked about
            self.scratch_ops.append((op, func, spec_of(args, kwargs)))


# nn.TransformerEncoderLayer's fused eval kernel: its fast-path check looks at CUDA's autocast only, so under CPU
# autocast it runs, its inner matmuls autocast to bfloat16 and its output bfloat16, none of which its fake kernel
# shows (float32 out: an encoder layer's forward predicted 0.71x its real peak at batch 1)
_FUSED_ENCODER_LAYER = torch.ops.aten._transformer_encoder_layer_fwd.default
# a fake tensor's `.device`: no op of a real run, allocates nothing; autograd's engine asks it of every gradient it
# moves (~2,000 times a BERT 768x12 backward: 62% of what a run dispatched, a fifth of a memory model's time)
_DEVICE = torch.ops.prim.device.default
_WARNED: set[tuple[str, int]] = set()        # (file, line) of transformers' questions answered no and warned of


def refuse_sparse(func, tensors, counter: str) -> None:
    """ValueError where one of `tensors` is sparse: what `counter` counts is dense tensors' bytes (a sparse tensor's
    depend on its values: `x.to_sparse().to_dense()` in a forward was predicted 0.44x its real step, a sparse
    gradient crashed the run)."""
    layout = next((t.layout for t in tensors if isinstance(t, torch.Tensor) and t.layout != torch.strided), None)
    if layout is not None:
        raise ValueError(
            f"{counter} counts dense tensors only: {func} works on a {layout} tensor (in "
            f"{'backward' if in_backward() else 'the forward'}), whose bytes depend on its values (a sparse "
            "gradient's on the ids in the batch; it grows with every micro-batch added into it). Use dense tensors: "
            "for nn.Embedding or nn.EmbeddingBag, sparse=False; for a sparse buffer or .to_sparse(), its dense form")


def device_asked(func, args) -> torch.device | None:
    """A fake tensor's device where `func` is its `.device` (`prim.device`), as FakeTensorMode answers it without
    the dispatch a mode's hop costs; else None."""
    if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
        return args[0].fake_device
    return None


def mask_check_answered_no() -> bool:
    """Whether a yes/no question on values a fake run does not have is transformers' check of an attention mask
    (`if torch.all(mask == 1): return None` in 4.x's `_prepare_4d_attention_mask_for_sdpa`, `_ignore_causal_mask_sdpa`,
    `sdpa_mask`; `warn_if_padding_and_no_attention_mask`) or any question of 5.x's `masking_utils` (whether the
    position ids the user gave are packed: `find_packed_sequence_indices`): then it is answered no, the branch that
    keeps the mask (exact for the padded or packed batches a mask is for, an upper bound for a batch without), said
    with a warning once per process per line of transformers. Any other question (`if x.sum() > 0`) stays an error:
    its branches may differ in memory either way."""
    import sys
    import warnings
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("torch", "memfit"):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    if not (module == "transformers.masking_utils"
            or module.startswith("transformers.") and "mask" in frame.f_code.co_name):
        return False
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site not in _WARNED:                           # once per process per line: each run of each prediction asks
        _WARNED.add(site)
        question = "if the position ids are packed" if "packed" in frame.f_code.co_name else \
            "if the attention mask is all ones"
        warnings.warn_explicit(f"memfit memory model: transformers' {frame.f_code.co_name} asks {question}; values "
                               "unknown, answered no: the mask counts (exact if padded, else an upper bound)",
                               UserWarning, *site)
    return True


class LoggingFakeMode(FakeTensorMode):
    """A fake mode that hands every op the program runs, with its outputs, to a `StorageLog` while one is set:
    one dispatch layer instead of a logging mode on top of the fake one. The ops the fake mode runs to compute
    an op (its decompositions) are not logged: the real kernel does not allocate their outputs.

    A value read in a run is answered from `KnownValues` only where it is made alike in every run of the mode (one
    prediction's runs at several batch sizes share it, or share `first_reads`): a value made from the batch size is
    refused (`DataDependentOnBatchSize`), since its answer at the sizes run says nothing of the others."""

    def __init__(self, first_reads: list[tuple] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.storage_log: StorageLog | None = None
        self.known_values = KnownValues()             # the values the run knows while it logs
        self._reads: list[tuple] = []                 # (`KnownValues.lineage`, answer) of each value read in this run
        self._first_reads = [] if first_reads is None else first_reads   # ... in the first run that read any
        #                                               (a list the runs of one prediction share, in their modes)
        self._depth = 0
        self._answers = True                          # value reads answered from `known_values` (`logging_to`)
        self._cpu_autocast = None                     # the CPU autocast dtype the forward runs under (`logging_to`)
        self._stood_in: list | None = None            # value reads stood in (`step_reads`): None outside the step
        self._answer = 1.0                            # what they are answered (`known_values.READS_SCALARS`)
        self.stood_in = 0                             # value reads stood in in the last run's optimizer step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (device := device_asked(func, args)) is not None:
            return device                           # neither logged nor noted
        if self.storage_log is None or self._depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is READ_VALUE and self._stood_in is not None:
            reads, self._stood_in = self._stood_in, None
            try:
                return self.__torch_dispatch__(func, types, args, kwargs)
            except DataDependentOutputException:
                reads.append(func)
                return stand_in(args[0], self._answer)     # the optimizer's step: a scalar of its update
            finally:
                self._stood_in = reads
        # (autocast reads off inside a mode: the run's is known, one the user's forward enters is counted)
        if func is _FUSED_ENCODER_LAYER and (self._cpu_autocast is not None or autocast_entered_in_forward()):
            raise NotImplementedError(
                "nn.TransformerEncoderLayer's fused eval kernel under CPU autocast works in "
                f"{self._cpu_autocast or torch.get_autocast_dtype('cpu')} "
                "unseen by its fake kernel: turn the fast path off where you run it (torch.backends.mha."
                "set_fastpath_enabled(False): predicted exactly), or run without CPU autocast")
        if func is READ_VALUE and self._answers and (known := self.known_values.value(args[0])) is not None:
            # the read's lineage and its answer: a value made alike that still answers otherwise (a sum over
            # positions expanded to the batch) depends on the batch size as much, and the runs would branch apart
            read, at = (self.known_values.lineage(args[0]), known.item()), len(self._reads)
            if at < len(self._first_reads) and self._first_reads[at] != read:
                raise DataDependentOnBatchSize(f"value read #{at + 1} of the run (a {tuple(args[0].shape)} "
                                       f"{args[0].dtype} tensor) is made or answered otherwise than in the run at "
                                       "another batch size: the answer depends on the batch size, and the sizes "
                                       "run say nothing of the others")
            self._reads.append(read)
            return read[1]                            # made from no input (`KnownValues`): as in the real run
        if func is READ_VALUE and args[0].dtype == torch.bool:
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            except DataDependentOutputException:
                if not mask_check_answered_no():
                    raise
                return False
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
        self.storage_log.record(func, out, args, kwargs)
        self.known_values.note(func, args, kwargs or {}, out)
        return out

    @contextmanager
    def step_reads(self, optimizer=None):
        """Inside (the optimizer's step), a value read that nothing answers is stood in (`known_values.stand_in`)
        where the step of `optimizer` is one whose reads were read through (`known_values.reads_stood_in`), else
        refused as anywhere; `stood_in` counts them."""
        self._answer = reads_stood_in(optimizer)
        self._stood_in = [] if self._answer is not None else None
        try:
            yield
        finally:
            self.stood_in, self._stood_in = len(self._stood_in or ()), None

    @contextmanager
    def logging_to(self, storage_log: StorageLog, reads_values: bool = True, answers: bool = True,
                   cpu_autocast: torch.dtype | None = None):
        """Log to `storage_log` inside. reads_values=False: transformers' mask questions are not put to the run
        (a `torch.compile`d model's: under dynamo transformers skips them and builds the mask); answers=False: no
        value read is answered from `KnownValues` (the runs of a prediction where one depends on the batch size);
        cpu_autocast: the dtype of the CPU autocast the forward runs under (`_FUSED_ENCODER_LAYER` refused there; one
        entered inside the model's own forward is not seen)."""
        self.storage_log, self.known_values, self._reads = storage_log, KnownValues(), []
        self._answers, self._cpu_autocast = answers, cpu_autocast
        try:
            with transformers_reads_values() if reads_values else nullcontext(), composites_as_real():
                yield
        finally:
            self.storage_log, self.known_values = None, KnownValues()
            if not self._first_reads:
                self._first_reads += self._reads
