"""`memfit plan MODULE:FACTORY --input 1,3,224,224`: print the activation memory plan of a model.

Run:
    memfit plan mymodels.py:make_net --input 1,3,224,224 --plot arena.png
    memfit plan pkg.models:resnet --input 8,3,64,64 --algorithm best --json
    memfit plan pkg.models:resnet --input 32,3,64,64 --train --optimizer adamw --budget 8GiB --plot train.png
    memfit plan pkg.models:resnet --input 32,3,64,64 --train --budget 8GiB --fit --plot fit.png
    memfit plan pkg.models:gpt --input 4,128 --dtype int64 --train --parallel fsdp --world-size 8
    memfit plan pkg.models:gpt --input 8,512 --dtype int64 --train --device cuda --device-memory 24GiB [--fit]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from memfit.cli.options import UsageError, budget_arg, device_arg, device_name_arg

__all__ = ["cli_plan", "load_factory"]

EXAMPLE = ("example:\n  memfit plan mymodels.py:make_net --input 1,3,224,224 --plot arena.png\n"
           "  memfit plan pkg.models:resnet --input 8,3,64,64 --algorithm best --json\n"
           "  memfit plan my_module:make_net --input 8,3,32,32 --all --device cuda\n"
           "  memfit plan my_module:make_net --input 64,3,32,32 --train --budget 8GiB --fit --plot fit.png")


def load_factory(spec: str) -> Callable:
    """The callable named by "module.path:func" or "path/to/file.py:func".

    Raises:
        ValueError: the spec is malformed, the module or file cannot be found, or it has no such name.

    Example:
        >>> load_factory("memfit.testing.zoo:mlp").__name__
        'mlp'
    """
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(spec.rpartition(":")[::2]):
        raise ValueError(f"expected MODULE:FACTORY such as 'mymodels.py:make_net' or 'pkg.models:resnet'; "
                         f"found {spec!r}")
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"{spec}: the file {str(path)!r} does not exist; give a path to a .py file or an "
                             "importable module (pkg.module:factory)")
        mod_spec = importlib.util.spec_from_file_location(f"_memfit_user_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            with _current_folder_on_path():
                module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"{spec}: cannot import module {where!r} ({e}); check the name or pass a file path "
                             "(path/to/file.py:factory)") from None
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))[:12]
        raise ValueError(f"{spec}: {where} has no attribute {name!r}; callables there: {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{spec}: {name!r} is a {type(fn).__name__}, not a callable that builds the model")
    return fn


@contextlib.contextmanager
def _current_folder_on_path() -> Iterator[None]:
    """Import from the current folder as `python -m memfit` does; the `memfit` console script puts
    only its own folder on sys.path, so `memfit plan my_module:make_net` would not find my_module."""
    cwd = os.getcwd()
    added = not any(p in ("", cwd) for p in sys.path)
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


class _PlanParser(argparse.ArgumentParser):
    """`--device` is checked against this machine, except for `--train`: a CUDA step is predicted from any machine."""

    def parse_args(self, args=None, namespace=None):
        out = super().parse_args(args, namespace)
        if not out.train:
            try:
                device_arg(out.device)
            except argparse.ArgumentTypeError as e:
                self.error(f"argument --device: {e} (a CUDA training step is predicted from here with --train)")
        if (out.device_memory or out.gpu) and not (out.train and torch.device(out.device).type == "cuda"):
            self.error("--device-memory and --gpu go with --train --device cuda (a CUDA step predicted from here)")
        return out


def _parser() -> argparse.ArgumentParser:
    from memfit.planner.arena import ALGORITHMS
    p = _PlanParser(prog="memfit plan", description="Print the activation memory plan of a model: "
                                "naive bytes, the planned arena, the lower bound and every tensor's place.",
                                epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="a function that builds the model, in an importable module or a .py file")
    p.add_argument("--input", action="append", required=True, metavar="SHAPE",
                   help="input shape with the batch, e.g. 1,3,224,224 (repeat for several inputs)")
    p.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    p.add_argument("--algorithm", default="greedy_by_size", choices=ALGORITHMS, help="offset algorithm")
    p.add_argument("--no-inplace", action="store_true", help="never let an op write over its input")
    p.add_argument("--all-in-arena", action="store_true",
                   help="every op with an out= kernel writes into the arena, even where running it eagerly "
                        "costs less memory (arena + unplanned)")
    p.add_argument("--graph-order", action="store_true",
                   help="run the ops in the exported graph's order, not the order of fewest bytes (planner.order)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a picture of the arena over time")
    p.add_argument("--device", default="cpu", type=device_name_arg,
                   help="plan on cpu, cuda, cuda:1 (default cpu: a plan's bytes do not depend on the device, "
                        "but which ops get an out= kernel does); with --train, cuda predicts the CUDA step from any "
                        "machine (the caching allocator's reserved bytes and the fixed costs)")
    p.add_argument("--device-memory", default=None, metavar="SIZE", type=budget_arg,
                   help="with --train --device cuda: the GPU's memory (e.g. 24GiB): the budget unless --budget is "
                        "given, and the GPU family whose stated fixed costs apply unless --gpu is")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="with --train --device cuda: the GPU whose stated fixed costs apply (H100, A100-40GB, "
                        "RTX 4090, ...; default: the GPU here, else the one with --device-memory)")
    p.add_argument("--train", action="store_true",
                   help="the memory of one training step instead (forward, loss, backward, optimizer step) by kind, "
                        "from a fake-tensor run; --plot draws bytes against the batch size")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS), help="with --train (default adamw)")
    p.add_argument("--budget", default=None, metavar="SIZE", type=budget_arg,
                   help="with --train: the largest batch within it, "
                   "and a line on the plot (e.g. 8GiB)")
    p.add_argument("--fit", action="store_true",
                   help="with --train --budget: the micro-batch and activation checkpointing that make one step on "
                        "the --input batch fit the budget fastest (memfit.fit), with its alternatives; --plot draws "
                        "their bytes and time against the budget")
    p.add_argument("--bf16", action="store_true", help="with --fit: allow bf16 autocast (levers=('bf16',))")
    p.add_argument("--threads", default=None, type=int, metavar="N",
                   help="with --fit: torch's intra-op threads while fitting (default: torch's, as a Python process "
                        "has them); the plan's times, and so its choice, are for this count: give the one your "
                        "training runs at")
    p.add_argument("--parallel", default=None, choices=["ddp", "fsdp"],
                   help="with --train: the bytes one rank holds under DDP or FSDP2 (fully_shard on every block of a "
                        "ModuleList or Sequential, and the root); the batch is per rank")
    p.add_argument("--world-size", default=2, type=int, metavar="N", help="with --parallel: the ranks (default 2)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                   help="with --parallel fsdp: gloo's collectives copy their buffers, NCCL's do not (default nccl)")
    p.add_argument("--all", action="store_true", help="list every tensor (default: the first 60)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--input: expected a shape of positive ints such as 1,3,224,224; found {text!r}")
    return shape


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _fit_report(args, model: torch.nn.Module, shapes, dtype) -> int:
    """`memfit plan --train --budget SIZE --fit`: the plan that makes the step fit, its alternatives, a plot; with
    `--device cuda` from a machine without it (or `--gpu`, `--device-memory`), the CUDA step's plan made here."""
    from memfit.fitting.fitter import fit
    from memfit.fitting.plot import plot_fit
    from memfit.memory.step import _loss
    # a CUDA step planned from a machine without the GPU (or for another GPU): the model stays on the CPU
    elsewhere = torch.device(args.device).type == "cuda" and (
        not torch.cuda.is_available() or args.gpu is not None or args.device_memory is not None)
    here = "cpu" if elsewhere else args.device
    model.train().to(here)
    opt = OPTIMIZERS[args.optimizer](model.parameters(), lr=1e-3)
    x = tuple(torch.zeros(s, dtype=dtype, device=here) for s in shapes)
    x = x[0] if len(x) == 1 else x
    loss = lambda out, y: _loss(out, None, None)        # the output's .loss, or the sum of the outputs
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads: expected a positive number of threads; found {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        plan = fit(model, opt, (x, None), loss, args.budget, levers=("bf16",) if args.bf16 else (),
                   exhaustive=bool(args.plot), **({"device": args.device, "gpu": args.gpu,
                                                   "device_memory": args.device_memory} if elsewhere else {}))
    finally:
        torch.set_num_threads(threads)
    path = plot_fit(plan, args.plot, name=args.factory) if args.plot else None
    if args.json:
        print(json.dumps({"micro_batch": plan.micro_batch, "checkpoint": list(plan.checkpoint),
                          "autocast": str(plan.autocast) if plan.autocast else None, "peak_bytes": plan.peak_bytes,
                          "relative_time": plan.relative_time, "budget": plan.budget, "device": str(plan.device),
                          "reason": plan.reason, "how_time": plan.how_time,
                          "alternatives": [{"micro_batch": a.micro_batch, "checkpoint": list(a.setting.checkpoint),
                                            "autocast": a.setting.autocast, "bytes": a.bytes, "time": a.time,
                                            "fits": a.fits(plan.budget)} for a in plan.alternatives],
                          "plot": str(path) if path else None}))
        return 0
    print(f"{args.factory}: one training step with {args.optimizer} on input "
          f"{' and '.join(str(list(s)) for s in shapes)}, loss = the output's .loss or the sum of the outputs, "
          f"{args.threads or threads} torch thread{'s' if (args.threads or threads) > 1 else ''}")
    print(plan.explain())
    if path:
        print(f"wrote {path}")
    return 0


def _train_report(args, model: torch.nn.Module, shapes, dtype) -> int:
    """`memfit plan --train`: the training step's bytes by kind at the given batch, a plot, the largest batch."""
    from memfit.budget import format_bytes, largest_fitting, parse_bytes
    from memfit.sizing import memory_model, plot_memory
    cuda = torch.device(args.device).type == "cuda"
    here = "cpu" if args.parallel or (cuda and not torch.cuda.is_available()) else args.device   # predicted from
    model.train().to(here)                                                                       # a CPU copy
    opt = OPTIMIZERS[args.optimizer](model.parameters(), lr=1e-3)
    example = tuple(torch.zeros(s, dtype=dtype, device=here) for s in shapes)
    gpu = args.gpu if args.gpu is not None else parse_bytes(args.device_memory) if args.device_memory else None
    on = {"device": args.device, "gpu": gpu} if cuda else {}
    if args.parallel:
        from memfit.memory.ranks import rank_memory_model
        if torch.device(args.device).type != "cpu" and args.parallel != "ddp":
            raise UsageError("--parallel fsdp predicts the CPU's bytes from a CPU copy of the model; leave out "
                             "--device (on CUDA only --parallel ddp is predicted)")
        mm = rank_memory_model(model, example, optimizer=opt, parallel=args.parallel, world_size=args.world_size,
                               backend=args.backend, **on)
    else:
        mm = memory_model(model, example, train=True, optimizer=opt, **on)
    n = shapes[0][0]
    budget = parse_bytes(args.budget) if args.budget else parse_bytes(args.device_memory) if args.device_memory \
        else None
    if budget is not None and cuda:         # what the caching allocator serves, with its retry
        largest = largest_fitting(lambda k: 0 if mm.serves(k, budget) else budget + 1, budget, 2**31)
    else:
        largest = largest_fitting(mm.total_bytes, budget, 2**31, below=getattr(mm, "lower_bytes", None)) \
            if budget is not None else None
    path = plot_memory(mm, args.plot, max(2 * n, 2 * (largest or 0), 8), budget, name=args.factory,
                       largest=largest) if args.plot else None
    if args.json:
        peak = mm.cuda(n) if cuda and hasattr(mm, "cuda") else None       # DDP: its breakdown has the figures
        print(json.dumps({"batch": n, "parallel": args.parallel, "world_size": args.world_size if args.parallel else 1,
                          "device": str(mm.device), "total_bytes": mm.total_bytes(n), "breakdown": mm.breakdown(n),
                          "cuda": None if peak is None else {"reserved": peak.reserved, "allocated": peak.allocated,
                                                             "outside_allocator": peak.outside},
                          "method": mm.method, "largest_batch": largest, "plot": str(path) if path else None}))
        return 0
    print(f"{args.factory}: one training step with {args.optimizer}, loss = the output's .loss or the sum of "
          f"the outputs, input {' and '.join(str(list(s)) for s in shapes)}")
    print(mm.explain(n))
    if budget is not None:
        print(f"largest batch within {format_bytes(budget)}: {largest}" + (
            " (the largest the caching allocator serves, after freeing its cache and retrying as c10 does)"
            if cuda else ""))
    if path:
        print(f"wrote {path}")
    return 0


def _eager_forward(model: torch.nn.Module, example: tuple):
    """The memory model of the user's own eager forward on `example` (what `memory_model` answers by default), or
    why it could not be made (a model fake tensors cannot run), as a string."""
    from memfit.messages import first_line
    from memfit.sizing import memory_model
    try:
        return memory_model(model, example if len(example) > 1 else example[0])
    except Exception as e:             # the plan below may still work: say why, and go on
        return first_line(e)


def cli_plan(argv: list[str]) -> int:
    """Run `memfit plan` with `argv` (the arguments after 'plan'); returns the exit code."""
    args = _parser().parse_args(argv)
    shapes = [_shape(s) for s in args.input]
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype: expected a torch dtype name such as float32 or bfloat16; found {args.dtype!r}")
    from memfit.planner.planned import plan
    model = load_factory(args.factory)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{args.factory} returned {type(model).__name__}; expected a torch.nn.Module")
    if (args.fit or args.bf16) and not (args.train and (args.budget or args.device_memory)):
        raise UsageError("--fit goes with --train and --budget or --device-memory (the plan that makes the step fit "
                         "that budget)"
                         if args.fit else "--bf16 goes with --fit")
    if args.threads is not None and not args.fit:
        raise UsageError("--threads goes with --fit (the thread count the plan's times are for)")
    if args.train and args.fit:
        return _fit_report(args, model, shapes, dtype)
    if args.train:
        return _train_report(args, model, shapes, dtype)
    if args.budget or args.parallel:
        raise UsageError("--budget and --parallel go with --train")
    model.eval().to(args.device)
    example = tuple(torch.zeros(s, dtype=dtype, device=args.device) for s in shapes)
    eager = _eager_forward(model, example)
    pm = plan(model, example, algorithm=args.algorithm, inplace=not args.no_inplace,
              eager_where_cheaper=not args.all_in_arena, reorder=not args.graph_order)
    rep = pm.report
    path = rep.plot(args.plot) if args.plot else None
    n = shapes[0][0]
    if args.json:
        mine = None if isinstance(eager, str) else {"total_bytes": eager.total_bytes(n),
                                                     "breakdown": eager.breakdown(n), "method": eager.method}
        print(json.dumps({**rep.to_dict(), "plot": str(path) if path else None, "eager_forward": mine,
                          "eager_forward_error": eager if isinstance(eager, str) else None}))
        return 0
    from memfit.budget import format_bytes
    print(f"{args.factory} with input {' and '.join(str(list(s)) for s in shapes)} (model put in eval mode)")
    if isinstance(eager, str):
        print(f"your own model(x) under torch.no_grad(): not predicted ({eager})")
    else:
        print(f"your own model(x) under torch.no_grad() (eager): {format_bytes(eager.total_bytes(n))} at the peak, "
              "predicted from a fake-tensor run (memfit.memory_model)")
    print(f"memfit.plan(model)'s planned forward: {format_bytes(rep.total_bytes)} at the peak (holds only where "
          "the planned module runs: pm = memfit.plan(model, (x,)); pm(x)); its plan:")
    print(rep.summary())
    print(rep.table(limit=None if args.all else 60).replace("(report.table(limit=None) lists all)",
                                                            "(--all lists them all)"))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_plan(sys.argv[1:]))
