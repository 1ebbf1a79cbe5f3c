"""The `memfit` command line: info, demo, bench, plan, eval.

Exit codes: 0 on success, 2 on bad usage (the option and the reason on stderr), 1 on a failure (a
one-line cause, or a budget's whole breakdown; the traceback only with --debug, accepted anywhere
on the line).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from memfit.cli.options import UsageError, budget_arg, data_arg, device_arg

EXAMPLES = {
    "info": "example:\n  memfit info\n  memfit info --json",
    "demo": ("example:\n  memfit demo\n  memfit demo --epochs 3 --budget 16MiB --plot demo-pictures --json\n"
             "  memfit demo --augment\n"
             "  memfit demo --data mnist:~/data/mnist --device cuda\n"
             "  torchrun --standalone --nproc-per-node=2 -m memfit demo --distributed"),
    "bench": ("example:\n  memfit bench codecs --quick\n  memfit bench loaders --plot loaders.png\n"
              "  memfit bench planner --quick\n  memfit bench evaluate --quick\n"
              "  (memfit bench NAME --help lists each benchmark's options)"),
    "eval": ("example:\n  memfit eval mymodels.py:make_net --weights net.pt --data mnist:~/data/mnist\n"
             "  memfit eval pkg.models:resnet --weights r.pt --data test.npz --budget 1GiB --json"),
}
BENCHMARKS = {
    "codecs": "bytes held and batch throughput of each codec vs a float32 gather",
    "loaders": "stream / resident / macro loaders vs torch DataLoader and a float32 gather; --augment: on-device "
               "augmentation vs DataLoader, a hand-written batched reference and cached fp16 copies",
    "planner": "activation arena of a model zoo: naive, eager peak, planned, lower bound, latency",
    "evaluate": "auto chunk size vs the largest that fits, OOMs, throughput vs unchunked",
    "distributed": "resident loader and exact evaluation with 1 and 2 processes (torch.distributed)",
    "train": "training-step memory model vs real steps; accumulate's gradient and step time vs a plain step",
    "fit": "memfit.fit's plans (micro-batch x checkpointing) vs a measured grid at three budgets per model",
    "gpu": "CUDA predictions vs a GPU: reserved, the out-of-memory boundary, fit's plans, loaders (make gpu-check)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Make deep-learning work fit in the memory you have.",
                                epilog="example:\n  memfit info\n  memfit demo --budget 64MiB",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = p.add_subparsers(dest="command", metavar="{info,demo,bench,plan,eval}")
    sub.required = True

    info = sub.add_parser("info", help="torch version, devices, their total/free memory and what memfit holds",
                          epilog=EXAMPLES["info"], formatter_class=argparse.RawDescriptionHelpFormatter)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="store, train, plan and evaluate on built-in digits in under a minute",
                          epilog=EXAMPLES["demo"], formatter_class=argparse.RawDescriptionHelpFormatter)
    from memfit.cli.demo import add_arguments
    add_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks against the baselines users have today",
                           epilog=EXAMPLES["bench"], formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = bench.add_subparsers(dest="bench", metavar="{" + ",".join(BENCHMARKS) + "}")
    bsub.required = True
    for name, summary in BENCHMARKS.items():
        # options after the benchmark's name go to the benchmark's own parser (its --help too)
        b = bsub.add_parser(name, help=summary, add_help=False)
        b.set_defaults(func=cmd_bench, passthrough=True)

    plan = sub.add_parser("plan", help="the activation memory plan of your model (MODULE:FACTORY --input ...)",
                          add_help=False)
    plan.set_defaults(func=cmd_plan, passthrough=True)

    ev = sub.add_parser("eval", help="evaluate your model on your data with auto chunking",
                        epilog=EXAMPLES["eval"], formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("factory", metavar="MODULE:FACTORY",
                    help="a function that builds the model, in an importable module or a .py file")
    ev.add_argument("--weights", default=None, help="a state_dict saved with torch.save(model.state_dict(), FILE)")
    ev.add_argument("--random-weights", action="store_true",
                    help="evaluate the factory's initial (random) weights on purpose, without --weights")
    ev.add_argument("--dtype", default=None, choices=("float32", "float64", "float16", "bfloat16", "int64"),
                    help="what the model takes (default: int64 for integer data such as token ids, float64 for "
                         "float64 data float32 cannot hold exactly, else float32)")
    ev.add_argument("--data", default="digits", type=data_arg,
                    help="digits, synthetic[:N], mnist:FOLDER, cifar10:FOLDER or FILE.npz (x_test, y_test "
                         "when it has them, else every sample of x, y; y: class ids, dense labels or float "
                         "targets); the output names the set and its size")
    ev.add_argument("--ignore-index", default=-100, type=int,
                    help="the label that marks a position without one in dense labels (default -100; 255 for many "
                         "segmentation sets): counted by no metric")
    ev.add_argument("--test-fraction", default=None, type=float,
                    help="evaluate a seeded random split of this fraction of an .npz holding only x, y "
                         "(default: all of it)")
    ev.add_argument("--normalize", default="dataset", choices=("dataset", "none", "unit"),
                    help="inputs as the model was trained: per-channel mean/std of the training split "
                         "(dataset), raw 0..255 (none) or 0..1 (unit)")
    ev.add_argument("--metrics", default=None,
                    help="comma-separated: accuracy, topk:K, loss, confusion, mse, mae, perplexity, iou "
                         "(default: accuracy,loss for class ids and labels, mse,mae for float targets)")
    ev.add_argument("--budget", default=None, type=budget_arg,
                    help="memory budget, e.g. 1GiB (default: free memory minus a margin)")
    ev.add_argument("--device", default=None, type=device_arg,
                    help="cpu, cuda, cuda:1 (default: first CUDA device, else cpu)")
    ev.add_argument("--chunk-size", default="auto", help="'auto' (default) or a number of samples")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(func=cmd_eval)
    return p


def cmd_info(args) -> int:
    import torch

    from memfit import __version__
    from memfit.budget import format_bytes
    from memfit.device.machine import devices
    rows = devices()
    if args.json:
        print(json.dumps({"memfit": __version__, "torch": torch.__version__, "python": platform.python_version(),
                          "cuda": torch.version.cuda, "devices": [r.__dict__ for r in rows]}))
        return 0
    print(f"memfit {__version__}, torch {torch.__version__} (CUDA {torch.version.cuda or 'not built'}), "
          f"python {platform.python_version()}")
    print(f"{'device':<8} {'name':<32} {'total':>11} {'free':>11} {'held here':>11}")
    for r in rows:
        print(f"{r.device:<8} {r.name[:32]:<32} {format_bytes(r.total):>11} {format_bytes(r.free):>11} "
              f"{format_bytes(r.held):>11}")
    if len(rows) == 1:
        print("no CUDA device: memfit runs on the CPU (a CUDA build of torch and a GPU enable 'cuda')")
    return 0


def cmd_bench(args) -> int:
    import importlib
    run = importlib.import_module(f"memfit.cli.bench.{args.bench}").main    # argparse restricts the names
    return run(args.extra)


def cmd_plan(args) -> int:
    from memfit.cli.plan import cli_plan
    return cli_plan(args.extra)


def cmd_demo(args) -> int:
    from memfit.cli import demo
    return demo.main(args)       # options checked by their argparse types, the output folder by demo.main


def cmd_eval(args) -> int:
    from memfit.cli.eval import run
    return run(args)


def _failure(e: BaseException) -> str:
    """What a failure prints: one line, except a budget's breakdown (what needed how much), kept whole."""
    from memfit.budget import BudgetExceeded
    from memfit.messages import first_line
    lines = str(e).strip().splitlines() or [type(e).__name__]
    if isinstance(e, BudgetExceeded) and len(lines) > 1:
        return "\n".join([f"memfit: error: {type(e).__name__}: {lines[0]}", *lines[1:],
                          "(run with --debug for the traceback)"])
    return f"memfit: error: {first_line(e)} (run with --debug for the traceback)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line (a benchmark's or plan's own parser does not know it)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return args.func(args)
    except UsageError as e:
        command = " ".join(filter(None, ("memfit", args.command, getattr(args, "bench", None))))
        print(f"{command}: error: {e}\n({command} --help lists the options)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(_failure(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
