"""The `memfit` command line: info, demo, bench, plan, eval.

Exit codes: 0 on success, 2 on bad usage (the reason on stderr), 1 on a failure (a one-line cause;
the traceback only with --debug).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

EXAMPLES = {
    "info": "example:\n  memfit info\n  memfit info --json",
    "bench codecs": "example:\n  memfit bench codecs --sets mnist --device cpu",
}


class UsageError(Exception):
    """Bad usage found after parsing (exit code 2)."""


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

    bench = sub.add_parser("bench", help="benchmarks against the baselines users have today")
    bsub = bench.add_subparsers(dest="bench", metavar="{codecs}")
    bsub.required = True
    for name, summary in (("codecs", "bytes held and batch throughput of each codec vs a float32 gather"),):
        # options after the benchmark's name go to the benchmark's own parser (its --help too)
        b = bsub.add_parser(name, help=summary, add_help=False)
        b.set_defaults(func=cmd_bench, passthrough=True)
    return p


def cmd_info(args) -> int:
    import torch

    from memfit import __version__
    from memfit.budget import devices, format_bytes
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
    if args.bench == "codecs":
        from memfit.bench.codecs import main as run
    else:  # pragma: no cover - argparse restricts the choices
        raise UsageError(f"unknown benchmark {args.bench!r}")
    return run(args.extra)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return args.func(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"memfit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"memfit: error: {type(e).__name__}: {cause} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
