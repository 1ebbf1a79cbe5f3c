"""`memfit eval MODULE:FACTORY --weights FILE --data SPEC`: exact metrics of a user's model on a test set."""

from __future__ import annotations

import json
import pickle

import torch

from memfit import CompactDataset, evaluate
from memfit.arrays import is_integer_data, normalisation
from memfit.budget import parse_bytes
from memfit.cli.data import open_data
from memfit.cli.options import UsageError
from memfit.cli.plan import load_factory
from memfit.device.machine import resolve_device


def run(args) -> int:
    """`memfit eval`: load the factory's model and weights, store the --data test split, evaluate, print."""
    budget = None if args.budget is None else parse_bytes(args.budget)   # checked by budget_arg
    chunk = args.chunk_size
    if chunk != "auto":
        if not chunk.isdigit() or int(chunk) < 1:
            raise UsageError(f"--chunk-size: expected 'auto' or a whole number >= 1; found {chunk!r}")
        chunk = int(chunk)
    metrics = None if args.metrics is None else [m.strip() for m in args.metrics.split(",") if m.strip()]
    model = load_factory(args.factory)()
    if not args.weights and not args.random_weights:
        raise UsageError(f"no --weights: {args.factory} would be evaluated with its initial random weights; pass "
                         "--weights FILE (a state_dict), or --random-weights to evaluate them on purpose")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{args.factory} returned {type(model).__name__}; expected a torch.nn.Module: make the "
                        "factory build and return the model (weights come from --weights)")
    if args.weights:
        load_weights(model, args.weights, args.factory)
    dev = resolve_device(args.device)
    model = model.to(dev)
    if args.test_fraction is not None and not 0 < args.test_fraction < 1:
        raise UsageError(f"--test-fraction: expected a fraction between 0 and 1 (e.g. 0.2); found {args.test_fraction}")
    d = open_data(args.data, test_fraction=args.test_fraction)
    integers = is_integer_data(d.x_test)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    norm = {"dataset": "dataset", "none": "none", "unit": (0.0, 255.0)}[args.normalize]
    if integers and (dtype is None or not dtype.is_floating_point):
        norm = "none"                   # token ids are passed as they are, never normalised
    stats = ""
    if norm == "dataset":
        stats = ("; normalised by the statistics of the evaluated set itself (the file has no training samples)"
                 if not d.own_train else "")
        norm = normalisation("dataset", d.x_train)     # every training sample (a streaming pass), as demo trains
    test = CompactDataset.from_arrays(d.x_test, d.y_test, normalize=norm, device="cpu", dtype=dtype,
                                      ignore_index=args.ignore_index)
    res = evaluate(model, test, metrics=metrics or "auto", budget=budget, device=dev, chunk_size=chunk,
                   progress=not args.json)
    if args.json:
        vals = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in res.metrics.items()}
        print(json.dumps({"metrics": vals, "n": res.n, "chunk_size": res.chunk_size, "chunks": res.chunks,
                          "retries": res.retries, "peak_bytes": res.peak_bytes, "seconds": res.seconds,
                          "runner": res.runner, "reason": res.reason, "set": d.test_name + stats,
                          "data": test.explain()}))
    else:
        print(f"set: {d.test_name}{stats}")
        print(f"data: {test.explain()}")
        print(res)
    return 0


def load_weights(model, path: str, factory: str) -> None:
    """Load a state_dict into `model`, with errors that name the file and say how to save one.

    Only `weights_only=True` loads are made: a whole pickled model is refused (unpickling runs code)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"--weights: no file at {path}") from None
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
        whole = "weights only load failed" in str(e).lower() or isinstance(e, pickle.UnpicklingError)
        found = ("a whole pickled model (torch.save(model)) or other Python objects, which memfit does not "
                 "unpickle: that can run code" if whole else f"a file torch cannot read ({type(e).__name__})")
        raise ValueError(f"{path}: expected a state_dict (saved with torch.save(model.state_dict(), '{path}')); "
                         f"found {found}. Save the state_dict where the model was trained and pass that file") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state_dict (a dict of parameter names to tensors); found "
                         f"{type(state).__name__}; save it with torch.save(model.state_dict(), '{path}')")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ValueError(f"{path} does not match the model of {factory}: "
                         f"{lines[1] if len(lines) > 1 else lines[0]}") from None
