"""GPT training steps side by side: symgrad, torch eager, torch.compile, JAX and llm.c.

System `imported` is the torch twin of the model brought in with sg.from_torch (and its torch
AdamW with sg.optim.from_torch), compiled to C: the torch user's path to symgrad-c's step.

    python -m benchmarks.gpt                         # both configs, every system available here
    python -m benchmarks.gpt --configs small --llmc ~/llm.c --quick
    python -m benchmarks.gpt --configs small --systems symgrad-c --memory   # + step memory vs torch

Two configs of examples/gpt.py's model (issue 16): small (4 layers, 4 heads,
128 channels, T=64, vocab 256, batch 8) and nanoGPT's shakespeare-char size
(6 layers, 6 heads, 384 channels, T=256, vocab 256, batch 4), with GPT-2's
tanh GELU as llm.c has it (`--gelu none`: the exact one, torch's default nn.GELU and
nanoGPT's, in every system but llm.c, which has only the tanh form). Every system starts from symgrad's initial weights
(llm.c through its checkpoint format) and trains on the same batch with one
AdamW step per call (lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay,
no clipping: what llm.c's CPU update does), so the first losses agree. The
systems are timed side by side, in turns (benchmarks.timing); the table gives
ms per step, the ratio of symgrad-C to the fastest of torch eager,
torch.compile and jax, and to llm.c, and each system's first loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import THREADS, side_by_side, timing
from .gpt_models import jax_loss, load_example, parameters, torch_gpt, write_llmc_checkpoint
from .systems import Runner, Unavailable

LR, BETAS, EPS = 1e-4, (0.9, 0.999), 1e-8
ANCHORS = ("torch-eager", "torch-compile", "jax-jit")


@dataclass(frozen=True)
class Bench:
    """One row: a GPT config and its batch size."""

    name: str
    layers: int
    heads: int
    channels: int
    context: int
    vocab: int
    batch: int
    gelu: str = "tanh"   # "none": the exact GELU

    def config(self):
        return load_example().GPTConfig(vocab_size=self.vocab, block_size=self.context, n_layer=self.layers,
                                        n_head=self.heads, n_embd=self.channels, gelu=self.gelu)


CONFIGS = {"small": Bench("small", 4, 4, 128, 64, 256, 8), "nanogpt": Bench("nanogpt", 6, 6, 384, 256, 256, 4),
           "tiny": Bench("tiny", 1, 2, 16, 8, 256, 2)}


def setup(bench: Bench, seed: int = 0):
    """(symgrad model, its initial state_dict, one batch of token ids and targets)."""
    import symgrad as sg
    gpt = load_example()
    sg.manual_seed(seed)
    model = gpt.GPT(bench.config())
    text = np.frombuffer(gpt.standard_library_text(400_000), dtype=np.uint8)
    x, y = next(gpt.batches(text, bench.batch, bench.context, np.random.default_rng(seed + 1)))
    return model, model.state_dict(), x, y


def symgrad_step(bench: Bench, state, backend: str, autocast: str | None = None):
    """symgrad's train step of `bench` from `state` (its inputs: idx, targets)."""
    gpt = load_example()
    # A model of its own: the steps of one model train the same parameters (the model's), and
    # every system must start from the same initial state.
    model = gpt.GPT(bench.config()).load_state_dict(state)
    return gpt.build_step(model, bench.batch, bench.context, lr=LR, weight_decay=0.0, backend=backend,
                          betas=BETAS, clip=None, autocast=autocast)


def symgrad_runner(backend: str, autocast: str | None = None):
    def build(bench: Bench, model, state, x, y) -> Runner:
        step = symgrad_step(bench, state, backend, autocast)
        extra = f", autocast={autocast!r}" if autocast else ""
        return Runner(lambda: step(idx=x, targets=y), float, note=f"sg.train_step(backend={backend!r}{extra})")
    return build


def _torch_step(bench, state, compiled: bool, autocast: str | None = None, device: str = "cpu"):
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc})") from None
    torch.set_num_threads(THREADS)
    model = torch_gpt(bench.config(), state).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=getattr(torch, autocast or "float32"), enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, bench.vocab), y.view(-1))
        loss.backward()
        optimizer.step()
        return loss
    return torch.compile(step) if compiled else step


def imported_runner(bench: Bench, model, state, x, y) -> Runner:
    """The torch twin (gpt_models.torch_gpt) imported with sg.from_torch and its torch AdamW with
    sg.optim.from_torch, compiled to C: the torch user's front door to the step symgrad-c times."""
    import symgrad as sg
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc})") from None
    twin = torch_gpt(bench.config(), state)
    imported = sg.from_torch(twin, (torch.from_numpy(x),))
    idx, targets = sg.input("idx", x.shape, dtype="int64"), sg.input("targets", y.shape, dtype="int64")
    loss = sg.cross_entropy(imported(idx).reshape((-1, bench.vocab)), targets.reshape((-1,)))
    optimizer = sg.optim.from_torch(torch.optim.AdamW(twin.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                                      weight_decay=0.0))
    step = sg.train_step(loss, optimizer=optimizer, backend="c")
    return Runner(lambda: step(idx=x, targets=y), float, note="sg.from_torch(torch twin), sg.optim.from_torch(AdamW), C")


def torch_runner(compiled: bool, autocast: str | None = None, device: str = "cpu"):
    """torch's step (eager or torch.compile) on `device`, its batch already there."""
    def build(bench: Bench, model, state, x, y) -> Runner:
        import torch
        step = _torch_step(bench, state, compiled, autocast, device)
        xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        under = f", forward under torch.autocast({device!r}, {autocast})" if autocast else ""
        return Runner(lambda: step(xt, yt), lambda loss: loss.item(),
                      note=("torch.compile of zero_grad + forward + backward + AdamW" if compiled
                            else "PyTorch eager: zero_grad, forward, backward, AdamW") + under)
    return build


def jax_runner(bench: Bench, model, state, x, y) -> Runner:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise Unavailable(f"jax is not installed ({exc}); pip install jax jaxlib") from None
    loss_fn = jax_loss(bench.config())
    b1, b2 = BETAS

    def adamw(params, m, v, t, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        params = jax.tree.map(lambda p, a, b: p - LR * (a / c1) / (jnp.sqrt(b / c2) + EPS), params, m, v)
        return params, m, v, loss

    jitted = jax.jit(adamw, donate_argnums=(0, 1, 2))
    params = parameters(state)   # the tied matrix once
    zeros = {k: jnp.zeros_like(jnp.asarray(v)) for k, v in params.items()}
    box = {"p": {k: jnp.asarray(v) for k, v in params.items()}, "m": zeros,
           "v": {k: jnp.zeros_like(a) for k, a in zeros.items()}, "t": 0}
    xj, yj = jnp.asarray(x.astype(np.int32)), jnp.asarray(y.astype(np.int32))

    def step():
        box["t"] += 1
        box["p"], box["m"], box["v"], loss = jitted(box["p"], box["m"], box["v"], float(box["t"]), xj, yj)
        return loss
    return Runner(step, lambda loss: float(loss.block_until_ready()),
                  note=f"jax {jax.__version__} jit(value_and_grad + AdamW), buffers donated")


def llmc_runner(checkout: Path | None, workdir: Path):
    def build(bench: Bench, model, state, x, y) -> Runner:
        from . import llmc
        if bench.gelu != "tanh":
            raise Unavailable("llm.c's GPT-2 has the tanh GELU only")
        if checkout is None:
            raise Unavailable("no llm.c checkout: pass --llmc DIR (a clone of karpathy/llm.c)")
        library = llmc.build(checkout, workdir)
        checkpoint = workdir / f"gpt_{bench.name}.bin"
        write_llmc_checkpoint(checkpoint, bench.config(), state)
        net = llmc.LlmcModel(library, checkpoint, LR)
        xi, yi = np.ascontiguousarray(x, np.int32), np.ascontiguousarray(y, np.int32)
        return Runner(lambda: net.step(xi, yi), float, note="llm.c train_gpt2.c (-Ofast -march=native -fopenmp)")
    return build


# Memory: symgrad's planned step memory against torch's measured growth -----------------------


def _peak_rss_growth_worker(config: str) -> None:
    """In a fresh process: how much torch eager's resident memory peaks above what it was before the
    model existed, over two steps of `config` ("<name>:<gelu>", or the name alone for tanh): its
    parameters, gradients, AdamW state, activations and allocator caches. The kernel's peak-RSS
    mark is reset first (/proc/self/clear_refs), so the imports' own peak does not count."""
    import torch
    torch.set_num_threads(THREADS)
    name, _, gelu = config.partition(":")
    bench = dataclasses.replace(CONFIGS[name], gelu=gelu or "tanh")
    _, state, x, y = setup(bench)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    step = _torch_step(bench, state, compiled=False)
    for _ in range(2):
        step(xt, yt)
    print(json.dumps({"growth_bytes": (_status_kib("VmHWM") - before) * 1024}))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_rows(benches) -> list[dict]:
    """Per config: symgrad-C's step memory as step.report() plans it before any call (variables,
    inputs, outputs, arena, runtime scratch), and torch eager's measured peak RSS growth (Linux)."""
    import subprocess
    from symgrad.backends.report import step_memory
    rows = []
    for bench in benches:
        model, state, x, y = setup(bench)
        step = load_example().build_step(model, bench.batch, bench.context, lr=LR, weight_decay=0.0,
                                          backend="c", betas=BETAS, clip=None)
        program = step.program
        planned = sum(step_memory(program.graph, program.plan, program.memory_plan).values())
        child = subprocess.run([sys.executable, "-m", "benchmarks.gpt", "--rss-worker", f"{bench.name}:{bench.gelu}"],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        torch_growth = json.loads(child.stdout.strip().splitlines()[-1])["growth_bytes"] if child.returncode == 0 \
            else None
        rows.append({"config": bench.name, "symgrad_planned_bytes": planned, "torch_peak_rss_growth_bytes": torch_growth})
    return rows


def render_memory(rows) -> str:
    """The memory table (target: symgrad's planned step memory <= 0.8 of torch's growth, issue #38)."""
    out = ["| config | symgrad-C step memory (planned, report) | torch eager peak RSS growth | ratio (target <= 0.8) |",
           "| --- | --- | --- | --- |"]
    for r in rows:
        mib = r["symgrad_planned_bytes"] / 2**20
        torch_mib = r["torch_peak_rss_growth_bytes"] / 2**20 if r["torch_peak_rss_growth_bytes"] else None
        ratio = f"{mib / torch_mib:.2f}" if torch_mib else "n/a"
        out.append(f"| {r['config']} | {mib:.1f} MiB | " + (f"{torch_mib:.1f} MiB" if torch_mib else "unavailable")
                   + f" | {ratio} |")
    return "\n".join(out)


def systems(llmc_dir: Path | None, workdir: Path, autocast: str | None = None) -> dict:
    """Column order of the table: name -> builder(bench, model, state, x, y). With `autocast`
    ("bfloat16"), each of symgrad-c, torch-eager and torch-compile has a twin under it beside it
    (named with AUTOCAST_SUFFIX[autocast])."""
    plain = {"symgrad-c": symgrad_runner("c"), "imported": imported_runner, "symgrad-numpy": symgrad_runner("numpy"),
             "torch-eager": torch_runner(False), "torch-compile": torch_runner(True), "jax-jit": jax_runner,
             "llm.c": llmc_runner(llmc_dir, workdir)}
    if autocast is None:
        return plain
    twins = {"symgrad-c": symgrad_runner("c", autocast), "torch-eager": torch_runner(False, autocast),
             "torch-compile": torch_runner(True, autocast)}
    out = {}
    for name, builder in plain.items():
        out[name] = builder
        if name in twins:
            out[name + AUTOCAST_SUFFIX[autocast]] = twins[name]
    return out


# The column name of a system's twin under --autocast.
AUTOCAST_SUFFIX = {"bfloat16": "-bf16", "float16": "-f16"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="small,nanogpt", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--systems", default="symgrad-c,imported,symgrad-numpy,torch-eager,torch-compile,jax-jit,llm.c")
    parser.add_argument("--llmc", type=Path, help="a clone of karpathy/llm.c: its train_gpt2.c joins as system llm.c")
    parser.add_argument("--quick", action="store_true", help="5 blocks of 2 steps: a look, not a result")
    parser.add_argument("--blocks", type=int, default=11)
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument("--memory", action="store_true",
                        help="also compare symgrad's planned step memory with torch's peak RSS growth")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST_SUFFIX),
                        help="beside symgrad-c, torch-eager and torch-compile, each one's step under autocast in "
                             "this dtype (sg.train_step(autocast=), torch.autocast('cpu'))")
    parser.add_argument("--gelu", choices=("tanh", "none"), default="tanh",
                        help="the MLP's GELU: tanh (GPT-2's, llm.c's; the default) or none (exact: torch's default)")
    parser.add_argument("--rss-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_worker:
        _peak_rss_growth_worker(args.rss_worker)
        return 0
    benches = [dataclasses.replace(CONFIGS[c], gelu=args.gelu) for c in args.configs.split(",")]
    names = args.systems.split(",")
    if args.autocast:  # each twin beside its system
        names = [n for name in names for n in (name, name + AUTOCAST_SUFFIX[args.autocast])
                 if n == name or name in ("symgrad-c", "torch-eager", "torch-compile")]
    plan = timing.Plan(blocks=5, steps=2, warmup_steps=1, warmup_s=0.0) if args.quick else \
        timing.Plan(blocks=args.blocks, block_s=0.5, min_steps=1, warmup_steps=2, warmup_s=1.0)
    with tempfile.TemporaryDirectory(prefix="symgrad-gpt-bench-") as work:
        builders = systems(args.llmc, Path(work), args.autocast)
        print(f"GPT step benchmark: {len(benches)} config(s), {THREADS} threads", file=sys.stderr)
        rows = side_by_side.run(benches, names, builders, setup, plan, log=lambda s: print(s, file=sys.stderr),
                              preload=("torch",))
    print(side_by_side.render(rows, names, ANCHORS, "llm.c"))
    if args.memory:
        memory = memory_rows(benches)
        print("\nMemory of one step:\n")
        print(render_memory(memory))
        rows = {"steps": rows, "memory": memory}
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
