"""The step cache (symgrad/step/step_cache.py): a train step built again from the same model,
optimizer and options takes its step graph from the cache instead of running autodiff and the
optimizer, and trains exactly as the step that made it; anything that changes the step graph
changes the key, and a damaged entry is a miss."""

import pickle

import numpy as np
import pytest

import symgrad as sg
from symgrad import autodiff, nn
from symgrad.api import effects, sources
from symgrad.backends.build import cache
from symgrad.ir import fingerprint as fingerprints
from symgrad.ir import graph_pickle
from symgrad.ir.graph import Graph
from symgrad.ir.value import Value
from symgrad.step import step_cache, training
from symgrad.step.call_checks import collect_inputs

IN, HIDDEN, OUT, BATCH = 6, 11, 4, 16   # HIDDEN: a structure no other test compiles
BATCHES = [{"sc_x": np.random.default_rng(k).standard_normal((BATCH, IN)),
            "sc_y": np.random.default_rng(k + 10).integers(0, OUT, BATCH)} for k in range(3)]


def _model_and_loss(state=None):
    """A classifier with BatchNorm (running statistics: updates of its own) and Dropout (a random
    stream's counter), the same masks from the same seed; its loss, and its eval-mode logits."""
    sg.manual_seed(3)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.GELU(), nn.Dropout(0.25),
                          nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()
    if state is not None:
        model.load_state_dict(state)
    x, y = sg.input("sc_x", (BATCH, IN), "float64"), sg.input("sc_y", (BATCH,), "int64")
    loss = nn.functional.cross_entropy(model(x), y)
    model.eval()
    logits = model(x)
    model.train()
    return model, loss, logits


def _optimizer(model, lr=0.01, weight_decay=0.1, betas=(0.9, 0.99)):
    """AdamW over two parameter groups (no decay for the biases and BatchNorm's weights)."""
    decayed = [p for name, p in model.named_parameters() if name.endswith("weight") and len(p.shape) == 2]
    others = [p for name, p in model.named_parameters() if not (name.endswith("weight") and len(p.shape) == 2)]
    return sg.optim.AdamW([{"params": decayed}, {"params": others, "weight_decay": 0.0}], lr=lr,
                          weight_decay=weight_decay, betas=betas)


def _step(state, **options):
    model, loss, logits = _model_and_loss(state)
    step = sg.train_step(loss, optimizer=_optimizer(model), backend="c", clip_grad_norm=1.0, predict=logits,
                         **options)
    return step, model


@pytest.fixture(scope="module")
def miss_and_hit():
    """One step made with no step-cache entry, then the same model built again (from the same
    initial state) and its step, which must come from the cache with autodiff never called."""
    state = _model_and_loss()[0].state_dict()
    for path in (cache.cache_dir() / "steps").glob("*.pickle"):
        path.unlink()
    miss, miss_model = _step(state)
    real_grad = autodiff.grad

    def refused(*args, **kwargs):
        raise AssertionError("autodiff ran for a step the step cache holds")
    autodiff.grad = refused
    try:
        hit, hit_model = _step(state)
    finally:
        autodiff.grad = real_grad
    return (miss, miss_model), (hit, hit_model), state


def test_the_second_step_comes_from_the_cache(miss_and_hit):
    (miss, _), (hit, _), _ = miss_and_hit
    assert not miss.from_step_cache and "graph" in miss.timings
    assert hit.from_step_cache and set(hit.timings) == {"step_cache"}
    assert "step_cache" in str(hit.report().compile_time)
    # The same step graph, and the same program: the program cache finds the miss's.
    assert fingerprints.fingerprint(hit.graph) == fingerprints.fingerprint(miss.graph)
    assert hit.program.from_program_cache and hit.source == miss.source


def test_the_hit_trains_exactly_as_the_miss(miss_and_hit):
    """Losses, parameters, AdamW's moments, BatchNorm's running statistics and the predict values,
    step by step, bit for bit: the same graph from the same state (lr, betas, clipping and the
    groups' weight decay as the miss compiled them)."""
    (miss, miss_model), (hit, hit_model), _ = miss_and_hit
    for batch in BATCHES:
        assert hit(**batch) == miss(**batch)
        np.testing.assert_array_equal(hit.predict(sc_x=batch["sc_x"]), miss.predict(sc_x=batch["sc_x"]))
    assert sorted(hit.state) == sorted(miss.state)
    for name in miss.state:
        np.testing.assert_array_equal(hit.state[name], miss.state[name], err_msg=name)
    for (name, mine), (_, theirs) in zip(hit_model.state_dict().items(), miss_model.state_dict().items()):
        np.testing.assert_array_equal(mine, theirs, err_msg=name)   # the models' own values trained


def test_the_hit_trained_its_own_models_parameters(miss_and_hit):
    (_, _), (hit, hit_model), state = miss_and_hit
    trained = hit_model.state_dict()
    assert any(not np.array_equal(trained[name], state[name]) for name in state)
    for name, value in hit.state_dict().items():
        np.testing.assert_array_equal(trained[name], value)


_NEW_PROCESS_HIT = """
import json, sys
sys.path[:0] = [sys.argv[1]]
from test_step_cache import BATCHES, _step
from symgrad.ir import fingerprint
step, _ = _step(None)
print(json.dumps({"hit": step.from_step_cache, "loss": step(**BATCHES[0]),
                  "kept": vars(step.graph)["_fingerprint"], "recomputed": fingerprint._fingerprint(step.graph)}))
"""


def test_a_hit_in_a_new_process_is_the_step_graph_the_miss_made(miss_and_hit):
    """In a process where autodiff never ran, the stored derived ops print as the miss's did: the
    fingerprint recomputed from the loaded graph is the stored one, and the first step's loss is
    a miss's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    *_, state = miss_and_hit
    with pytest.MonkeyPatch.context() as patch:   # a miss: the step made afresh, from the same state
        patch.setattr(step_cache, "load", lambda *args: None)
        fresh = _step(state)[0]
    assert not fresh.from_step_cache
    expected = fresh(**BATCHES[0])
    done = subprocess.run([sys.executable, "-c", _NEW_PROCESS_HIT, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["hit"] and child["kept"] == child["recomputed"]
    assert child["loss"] == expected


def test_accumulate_and_apply_on_a_hit_match_the_miss(miss_and_hit):
    """accumulate() sums the gradients the cache stored with the step graph; apply() runs the
    optimizer (built afresh from the same options) on them."""
    (miss, _), (hit, _), _ = miss_and_hit
    for batch in BATCHES[:2]:
        assert hit.accumulate(**batch) == miss.accumulate(**batch)
    hit.apply()
    miss.apply()
    for name in miss.params:
        np.testing.assert_array_equal(hit.params[name], miss.params[name], err_msg=name)


def test_the_loaded_graph_keeps_its_fingerprint(miss_and_hit):
    """The fingerprint stored with the graph (so that the program's key is not computed again) is
    the one its structure has."""
    (_, _), (hit, _), _ = miss_and_hit
    assert vars(hit.graph)["_fingerprint"] == fingerprints._fingerprint(hit.graph)
    predict = hit._programs["predict"].graph
    assert vars(predict)["_fingerprint"] == fingerprints._fingerprint(predict)


def _key(model, loss, logits, optimizer, max_norm=1.0, params=None):
    groups = optimizer.groups_for_step(params)
    params = [p for group in groups for p in dict.__getitem__(group, "params")]
    options = [group for group in groups for _ in dict.__getitem__(group, "params")]
    forward = step_cache.forward_of(loss, [logits], collect_inputs([loss, logits]), effects.collect([loss]), [])
    return step_cache.key(forward, params, options, optimizer, max_norm)


CHANGES = {
    "lr": dict(optimizer=lambda m: _optimizer(m, lr=0.02)),
    "weight decay": dict(optimizer=lambda m: _optimizer(m, weight_decay=0.2)),
    "betas": dict(optimizer=lambda m: _optimizer(m, betas=(0.8, 0.99))),
    "one group": dict(optimizer=lambda m: sg.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1,
                                                         betas=(0.9, 0.99))),
    "optimizer class": dict(optimizer=lambda m: sg.optim.Adam([{"params": list(m.parameters())}], lr=0.01)),
    "one group's own option": dict(optimizer=lambda m: sg.optim.AdamW(
        [{"params": _optimizer(m).param_groups[0]["params"]},
         {"params": _optimizer(m).param_groups[1]["params"], "weight_decay": 0.05}],
        lr=0.01, weight_decay=0.1, betas=(0.9, 0.99))),
    "clipping": dict(max_norm=2.0),
    "no clipping": dict(max_norm=None),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_whatever_changes_the_step_graph_changes_the_key(change):
    model, loss, logits = _model_and_loss()
    base = _key(model, loss, logits, _optimizer(model))
    assert base is not None
    spec = CHANGES[change]
    optimizer = spec.get("optimizer", _optimizer)(model)
    assert _key(model, loss, logits, optimizer, spec.get("max_norm", 1.0)) != base


def test_the_same_model_built_again_has_the_same_key():
    first, second = _model_and_loss(), _model_and_loss()
    assert _key(*first, _optimizer(first[0])) == _key(*second, _optimizer(second[0])) is not None


def test_which_group_holds_a_parameter_is_in_the_key():
    """Two groups with equal options, split after a different parameter: each group has a learning
    rate of its own (a runtime variable), so the steps differ in which one a parameter's update reads."""
    model, loss, logits = _model_and_loss()
    params = list(model.parameters())

    def split(k):
        return sg.optim.SGD([{"params": params[:k]}, {"params": params[k:]}], lr=0.1)
    assert _key(model, loss, logits, split(2)) != _key(model, loss, logits, split(3))
    assert _key(model, loss, logits, split(2)) == _key(model, loss, logits, split(2))


def test_the_parameters_order_is_in_the_key():
    model, loss, logits = _model_and_loss()
    params = list(model.parameters())
    forward = sg.optim.SGD(params, lr=0.1), sg.optim.SGD(params[::-1], lr=0.1)
    assert _key(model, loss, logits, forward[0]) != _key(model, loss, logits, forward[1])


def test_an_autocast_in_force_is_in_the_key():
    model, loss, logits = _model_and_loss()
    base = _key(model, loss, logits, _optimizer(model))
    with sg.autocast("bfloat16"):
        assert _key(model, loss, logits, _optimizer(model)) != base


def test_an_optimizer_defined_outside_symgrad_is_not_cached():
    """Its update() is code the key does not hold: a change to it must not find the old graph."""
    class Halved(sg.optim.SGD):
        def update(self, param, grad):
            return super().update(param, grad * 0.5)
    model, loss, logits = _model_and_loss()
    assert _key(model, loss, logits, Halved(model.parameters(), lr=0.1)) is None


def test_a_parameter_the_loss_does_not_read_is_not_cached():
    """It is no node of the forward graph, so the stored graph could not refer to it: a copy would
    be trained instead of the model's parameter."""
    model, loss, logits = _model_and_loss()
    unused = sg.param("sc_unused", (3,), init="ones", dtype="float64")
    assert _key(model, loss, logits, sg.optim.SGD([*model.parameters(), unused], lr=0.1)) is None


def test_a_damaged_entry_is_a_miss_and_is_written_again(miss_and_hit):
    *_, state = miss_and_hit
    entries = list((cache.cache_dir() / "steps").glob("*.pickle"))
    assert entries
    for path in entries:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    again, _ = _step(state)
    assert not again.from_step_cache
    rewritten, _ = _step(state)
    assert rewritten.from_step_cache   # stored again by the miss
    assert again(**BATCHES[0]) == rewritten(**BATCHES[0])


def test_an_entry_whose_checksum_does_not_match_is_a_miss(miss_and_hit):
    """The pickle intact, the checksum line another: not loaded (the checksum is what vouches for
    the bytes, not whether they happen to unpickle)."""
    *_, state = miss_and_hit
    _step(state)   # the entry (written again if an earlier test damaged it)
    for path in (cache.cache_dir() / "steps").glob("*.pickle"):
        _, _, compiled = path.read_bytes().partition(b"\n")
        path.write_bytes(b"0" * 64 + b"\n" + compiled)
    assert not _step(state)[0].from_step_cache


def test_an_entry_of_something_else_with_a_good_checksum_is_a_miss(miss_and_hit):
    """What a foreign entry holds is checked: a graph computing this loss, one gradient a parameter,
    the predict graph of these values. Anything else is a miss, not an error."""
    import hashlib
    *_, state = miss_and_hit
    _step(state)
    model, loss, logits = _model_and_loss(state)
    reference = step_cache.forward_of(loss, [logits], collect_inputs([loss, logits]), effects.collect([loss]),
                                      effects.collect([logits])).graph
    for payload in (("a", "b", "c", "d"), ([], Graph(reference.inputs, [logits]), [], None)):
        compiled = graph_pickle.dumps(payload, reference)
        for path in (cache.cache_dir() / "steps").glob("*.pickle"):
            path.write_bytes(hashlib.sha256(compiled).hexdigest().encode() + b"\n" + compiled)
        step, _ = _step(state)
        assert not step.from_step_cache
        assert np.isfinite(step(**BATCHES[0]))


def test_which_value_carries_a_layers_update_is_in_the_key():
    """The fingerprint holds the forward graph's values, not which of them carries an update: a
    loss updating a counter and a predict= returning the same two values are different steps."""
    def build(carried: bool):
        x = sg.input("sc_fx", (4,), "float32")
        w = sg.param("sc_fw", (4,), init="ones")
        counter = sources.variable("sc_counter", np.array(0.0, np.float32), role="optimizer")
        loss, bumped = sg.sum(w * x), counter + 1.0
        if carried:
            return sg.train_step(effects.attach(loss, [(counter, bumped)]), [w], sg.optim.SGD(lr=0.1),
                                 backend="numpy")
        return sg.train_step(loss, [w], sg.optim.SGD(lr=0.1), backend="numpy", predict=[counter, bumped])
    updating, returning = build(True), build(False)
    assert not returning.from_step_cache
    keys = [step_cache.key(step_cache.forward_of(step.graph.outputs[0], list(step._predict or []),
                                                 list(step.graph.inputs), step._effects,
                                                 effects.collect(list(step._predict or []))),
                           step._param_values, [{}], step.optimizer, None) for step in (updating, returning)]
    assert None not in keys and keys[0] != keys[1]
    for _ in range(3):
        updating(sc_fx=np.ones(4, np.float32))
        returning(sc_fx=np.ones(4, np.float32))
    assert float(updating.state["sc_counter"]) == 3.0 and float(returning.state["sc_counter"]) == 0.0


def test_an_op_with_a_backward_of_its_own_is_not_cached():
    """Its VJP is the user's code, which neither the fingerprint nor the key holds: a straight-through
    estimator redefined with another backward must not find the old step graph."""
    import sympy
    from symgrad.api.functional import apply_elementwise
    from symgrad.ir import registry
    from symgrad.ir.elementwise import ARGS, define

    def build(scale):
        op = define("sc_ste_round", sympy.floor(ARGS[0] + sympy.Rational(1, 2)), 1, "float",
                    vjp=lambda node, g, wants: [g * scale])
        try:
            x = sg.input("sc_sx", (4,), "float32")
            w = sg.param("sc_sw", (4,), init=np.full(4, 0.3, np.float32))
            step = sg.train_step(sg.sum(apply_elementwise(op, [w * x])), [w], sg.optim.SGD(lr=0.1), backend="numpy")
        finally:
            del registry.REGISTRY["sc_ste_round"]
        step(sc_sx=np.ones(4, np.float32))
        return step
    first, second = build(1.0), build(5.0)
    assert not first.from_step_cache and not second.from_step_cache
    np.testing.assert_allclose(second.params["sc_sw"], np.full(4, 0.3 - 0.1 * 5.0, np.float32), rtol=1e-6)


def test_a_foreign_entry_that_does_not_unpickle_is_a_miss(miss_and_hit, monkeypatch):
    *_, state = miss_and_hit

    def broken(*args, **kwargs):
        raise pickle.UnpicklingError("a stand-in for an entry of another symgrad")
    monkeypatch.setattr(graph_pickle, "loads", broken)
    step, _ = _step(state)
    assert not step.from_step_cache


# ---- graph_pickle ---------------------------------------------------------------------------

def test_a_filled_array_is_stored_as_its_value():
    """An optimizer's moments start as zero-stride arrays of a parameter's shape: the pickle holds
    one element, and loads the same values back."""
    x = sg.input("gp_x", (4,), "float32")
    state = sources.variable("gp_state", sources.filled((1000, 1000), 0.5, np.float32), role="optimizer")
    reference = Graph([x], [x])
    data = graph_pickle.dumps(state, reference)
    assert len(data) < 10_000
    loaded = graph_pickle.loads(data, reference)
    init = loaded.attrs["init"]
    assert init.shape == (1000, 1000) and init.dtype == np.float32 and np.all(init == np.float32(0.5))


def test_an_input_or_parameter_outside_the_reference_refuses_the_pickle():
    """A copy would be another input or parameter: the caller stores nothing instead."""
    x = sg.input("gp_in", (4,), "float32")
    w = sg.param("gp_w", (4,), init="ones")
    reference = Graph([x], [x * 2])
    assert graph_pickle.loads(graph_pickle.dumps(x * 3, reference), reference).inputs[0] is x
    for outside in (sg.input("gp_other", (4,), "float32"), w):
        with pytest.raises(pickle.PicklingError):
            graph_pickle.dumps(x * outside, reference)

    class Marked(Value):   # a Value of a class of its own, outside the reference: not rebuilt as a plain one
        pass
    marked = Marked((x * 2).op, (x,), {}, x.shape, x.dtype)
    with pytest.raises(pickle.PicklingError, match="Marked"):
        graph_pickle.dumps(marked, reference)


def test_references_are_resolved_once_each_and_a_plain_value_is_not_asked_about(monkeypatch):
    """A node, op or Dim of the reference is stored once and met again through the pickle's memo,
    however many times the pickled structure names it; the pickler's override is asked of the
    objects that are not plain data only (a plan's ints, strings and tuples, most of its 200,000
    objects, are the C pickler's alone), and the loaded references are the reference's own."""
    B = sg.Dim("gp_B")
    x = sg.input("gp_refs", (B, 4), "float32")
    y = sg.exp(x)
    reference = Graph([x], [y])
    asked = []
    override = graph_pickle._Pickler.reducer_override
    monkeypatch.setattr(graph_pickle._Pickler, "reducer_override", lambda self, obj: asked.append(type(obj)) or override(self, obj))
    made = [(y, x, y.op, B, k, f"name{k}", (k, k + 1)) for k in range(500)]
    data = graph_pickle.dumps(made, reference)
    assert not {int, str, tuple, list} & set(asked) and len(asked) <= 10
    loads = []
    resolve = graph_pickle._Unpickler._resolve
    monkeypatch.setattr(graph_pickle._Unpickler, "_resolve", lambda self, *key: loads.append(key) or resolve(self, *key))
    loaded = graph_pickle.loads(data, reference)
    assert len(loads) == 4   # y, x, exp, B: each resolved once
    assert all(row[0] is y and row[1] is x and row[2] is y.op and row[3] is B for row in loaded)
    assert [row[4:] for row in loaded] == [row[4:] for row in made]


def test_train_step_calls_the_cache_with_the_clip_value(monkeypatch):
    """The clip value reaches the key as the number given (a changed clip_grad_norm must miss)."""
    seen = []
    real = step_cache.key

    def spy(forward, params, options, optimizer, max_norm):
        seen.append(max_norm)
        return real(forward, params, options, optimizer, max_norm)
    monkeypatch.setattr(step_cache, "key", spy)
    model, loss, logits = _model_and_loss()
    training.train_step(loss, optimizer=_optimizer(model), backend="numpy", clip_grad_norm=0.75)
    assert seen == [0.75]


def test_clearing_the_cache_clears_the_step_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "entry.pickle").write_bytes(b"an entry")
    cache.clear_cache()
    assert not (tmp_path / "steps").exists()
