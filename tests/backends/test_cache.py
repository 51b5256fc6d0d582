"""The build cache: C source -> importable `_symgrad_<hash>` module, atomic, verified, shared.

One hand-written C function stands in for generated code. Every test gets its own
SYMGRAD_CACHE_DIR; tests that only need an existing entry copy one built once per
module (the key does not depend on the directory), so few tests pay for gcc.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from symgrad.backends.build import cache, cache_keys

SOURCE = textwrap.dedent("""\
    #ifndef SYMGRAD_TEST_BIAS
    #define SYMGRAD_TEST_BIAS 0
    #endif
    int add(int a, int b) { return a + b + SYMGRAD_TEST_BIAS; }
    """)
CDEF = "int add(int a, int b);"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache dir of the test's own, default flags, and no in-process memory of builds."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(directory))
    monkeypatch.delenv("SYMGRAD_CFLAGS", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setattr(cache_keys, "_COMPILER_IDS", {})
    return directory


@pytest.fixture
def compiles(monkeypatch):
    """Counts real compiler runs in this process."""
    calls = []
    real = cache._compile

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "_compile", counting)
    return calls


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A cache dir holding one entry for SOURCE with default flags, built once per module."""
    directory = tmp_path_factory.mktemp("template") / "cache"
    saved = {name: os.environ.get(name) for name in ("SYMGRAD_CACHE_DIR", "SYMGRAD_CFLAGS", "CC")}
    os.environ["SYMGRAD_CACHE_DIR"] = str(directory)
    os.environ.pop("SYMGRAD_CFLAGS", None)
    os.environ.pop("CC", None)
    try:
        built = cache.build(SOURCE, CDEF)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    return built


@pytest.fixture
def entry(fresh, template):
    """This test's cache dir, holding a copy of the template entry; returns its module name."""
    shutil.copytree(template.cache_dir, fresh)
    return template.module_name


def paths(directory: Path, name: str) -> cache._Paths:
    return cache._Paths(directory, name)


def run_python(code: str, env: dict[str, str | None], timeout: float = 120) -> str:
    """Run `code` in a fresh interpreter with `env` applied over ours; returns stdout."""
    full = dict(os.environ)
    for name, value in env.items():
        full.pop(name, None) if value is None else full.__setitem__(name, value)
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"subprocess failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


BUILD_AND_REPORT = textwrap.dedent("""\
    import json, sys
    from symgrad.backends.build import cache
    source, cdef = json.loads(sys.argv[1]) if len(sys.argv) > 1 else (SOURCE, CDEF)
    built = cache.build(source, cdef)
    print(json.dumps({"name": built.module_name, "sum": built.module.lib.add(2, 3),
                      "library": str(built.library_path)}))
    """)


def build_in_subprocess(env: dict[str, str | None]) -> dict:
    code = f"SOURCE = {SOURCE!r}\nCDEF = {CDEF!r}\n" + BUILD_AND_REPORT
    return json.loads(run_python(code, env).strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------


def test_build_makes_a_callable_module_with_its_source_beside_it(fresh, compiles):
    built = cache.build(SOURCE, CDEF)
    assert built.module.lib.add(2, 3) == 5
    assert built.module.ffi.typeof(built.module.lib.add).cname == "int(*)(int, int)"
    assert re.fullmatch(r"_symgrad_[0-9a-f]{32}", built.module_name)
    assert built.cache_dir == fresh
    assert built.library_path.parent == fresh and built.library_path.name.startswith(built.module_name + ".")
    assert built.source_path == fresh / (built.module_name + ".c")
    assert built.source_path.read_bytes() == SOURCE.encode()
    meta = json.loads((fresh / (built.module_name + ".json")).read_text())
    assert meta["key"].startswith(built.module_name.removeprefix("_symgrad_")) and len(meta["key"]) == 64
    assert meta["library_sha256"] == hashlib.sha256(built.library_path.read_bytes()).hexdigest()
    assert meta["flags"] == list(cache.DEFAULT_FLAGS)
    # Same key again: the very same object, no second compile; nothing temporary left behind.
    assert cache.build(SOURCE, CDEF) is built
    assert len(compiles) == 1
    assert not [p for p in fresh.rglob(".tmp-*")]


def test_module_imports_by_name_in_a_fresh_process_without_symgrad(entry, fresh):
    code = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(fresh)!r})
        import {entry} as m
        print(m.lib.add(40, 2), "symgrad" in sys.modules)
        """)
    assert run_python(code, {}).split() == ["42", "False"]


def test_cache_hit_in_a_fresh_process_does_not_compile(fresh, monkeypatch, tmp_path, compiles):
    # A compiler wrapper that logs its arguments: the hit may ask `--version`, never compile.
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "logging-cc"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("gcc")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    built = cache.build(SOURCE, CDEF)
    assert len(compiles) == 1
    first = log.read_text().splitlines()
    assert any(" -c " in f" {line} " for line in first), first  # the wrapper really compiled

    log.unlink()
    report = build_in_subprocess({"CC": str(wrapper)})
    assert report == {"name": built.module_name, "sum": 5, "library": str(built.library_path)}
    asked = log.read_text().splitlines() if log.exists() else []   # --version is kept in the cache: not asked
    assert all(line.strip() == "--version" for line in asked), asked


def test_cache_hit_in_a_fresh_process_with_no_compiler_at_all(entry, fresh):
    # No gcc on PATH and CC pointing nowhere: the entry is still loaded, as a binary needs no compiler.
    report = build_in_subprocess({"CC": "/nonexistent/cc", "PATH": str(Path(sys.executable).parent)})
    assert report["name"] == entry and report["sum"] == 5


def _truncate(p):
    data = p.library.read_bytes()
    p.library.write_bytes(data[: len(data) // 2])


def _flip_byte(p):
    data = bytearray(p.library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.library.write_bytes(bytes(data))


def _edit_meta(**changes):
    def damage(p):
        meta = json.loads(p.meta.read_text())
        meta.update(changes)
        p.meta.write_text(json.dumps(meta))
    return damage


DAMAGES = {
    "truncated-so": _truncate,
    "flipped-byte-in-so": _flip_byte,
    "missing-so": lambda p: p.library.unlink(),
    "wrong-sha-in-metadata": _edit_meta(library_sha256="0" * 64),
    "other-key-in-metadata": _edit_meta(key="f" * 64),
    "missing-metadata": lambda p: p.meta.unlink(),
    "garbage-metadata": lambda p: p.meta.write_text("{not json"),
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_damaged_entry_is_rebuilt_never_loaded(entry, fresh, damage, compiles, monkeypatch):
    p = paths(fresh, entry)
    damage(p)
    loaded = []
    real_load = cache._load

    def checking_load(name, so_path):
        loaded.append(hashlib.sha256(Path(so_path).read_bytes()).hexdigest())
        return real_load(name, so_path)

    monkeypatch.setattr(cache, "_load", checking_load)
    built = cache.build(SOURCE, CDEF)
    assert built.module.lib.add(2, 3) == 5
    assert len(compiles) == 1
    meta = json.loads(p.meta.read_text())
    assert loaded == [meta["library_sha256"]]  # only the rebuilt, verified binary was loaded
    assert meta["library_sha256"] == hashlib.sha256(p.library.read_bytes()).hexdigest()


def test_damaged_entry_without_a_compiler_is_refused_not_loaded(entry, fresh, monkeypatch):
    _truncate(paths(fresh, entry))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(cache.CompilerNotFound):
        cache.build(SOURCE, CDEF)


def test_edited_source_copy_is_restored_without_recompiling(entry, fresh, compiles):
    p = paths(fresh, entry)
    p.source.write_text("/* edited */")
    built = cache.build(SOURCE, CDEF)
    assert built.source_path.read_bytes() == SOURCE.encode()
    assert compiles == []


def test_two_processes_building_the_same_source_at_once_both_succeed(fresh, tmp_path):
    go = tmp_path / "go"
    code = textwrap.dedent(f"""\
        import json, os, sys, time
        from symgrad.backends.build import cache
        compiles = []
        real = cache._compile
        cache._compile = lambda *a, **k: (compiles.append(1), real(*a, **k))[1]
        open(sys.argv[1], "w").close()           # ready
        while not os.path.exists({str(go)!r}):   # start together
            time.sleep(0.002)
        built = cache.build({SOURCE!r}, {CDEF!r})
        print(json.dumps({{"name": built.module_name, "sum": built.module.lib.add(2, 3),
                          "compiles": len(compiles)}}))
        """)
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill() if proc.poll() is None else None
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert reports[0]["name"] == reports[1]["name"]
    assert [r["sum"] for r in reports] == [5, 5]
    # The per-key lock: the second builder waited and found the first one's entry.
    assert sum(r["compiles"] for r in reports) == 1
    assert cache._verified(paths(fresh, reports[0]["name"]), json.loads(
        paths(fresh, reports[0]["name"]).meta.read_text())["key"], SOURCE) is not None
    assert not list(fresh.rglob(".tmp-*"))


@pytest.mark.parametrize("cc, problem", [("/nonexistent/cc", "was not found"), ("false", "failed to run")])
def test_missing_compiler_raises_a_helpful_error(fresh, monkeypatch, cc, problem):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(cache.CompilerNotFound) as info:
        cache.build(SOURCE, CDEF)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert cc in message and problem in message
    assert "install gcc" in message and "CC" in message and 'backend="numpy"' in message


def test_compile_error_reports_compiler_output_and_kept_source(fresh, compiles):
    bad = "int add(int a, int b) {\n    return a + ;\n}\n"
    with pytest.raises(cache.BuildError) as info:
        cache.build(bad, CDEF)
    error = info.value
    assert error.source_path.read_text() == bad
    # Line numbers refer to the kept source, not to cffi's wrapper around it.
    assert f"{error.source_path}:2:" in str(error) and "error" in str(error)
    assert str(error.source_path) in str(error)
    assert not list(fresh.glob("*.json")) and not list(fresh.rglob(".tmp-*"))


def test_symgrad_cflags_are_honoured_and_change_the_key(entry, fresh, monkeypatch, compiles):
    assert cache.default_flags() == list(cache.DEFAULT_FLAGS)
    assert {"-O3", "-march=native", "-fopenmp"} <= set(cache.DEFAULT_FLAGS)
    assert "-ffast-math" not in cache.DEFAULT_FLAGS  # it would break NaN/inf semantics
    # Set but empty (or blank) is not "no flags": that would build without -O3 and OpenMP.
    for blank in ("", "  "):
        monkeypatch.setenv("SYMGRAD_CFLAGS", blank)
        assert cache.default_flags() == list(cache.DEFAULT_FLAGS)

    monkeypatch.setenv("SYMGRAD_CFLAGS", "-O1 '-DSYMGRAD_TEST_BIAS=100'")
    built = cache.build(SOURCE, CDEF)
    assert built.module_name != entry and len(compiles) == 1
    assert built.module.lib.add(2, 3) == 105  # the define reached the compiler
    assert json.loads(paths(fresh, built.module_name).meta.read_text())["flags"] == [
        "-O1", "-DSYMGRAD_TEST_BIAS=100"]


def test_key_covers_every_input(monkeypatch):
    import symgrad

    identity = {"cc": "gcc 12"}
    monkeypatch.setattr(cache_keys, "compiler_identity", lambda: identity["cc"])
    monkeypatch.delenv("CFLAGS", raising=False)

    def key(source=SOURCE, cdef=CDEF, flags=("-O2",)):
        return cache._key(cache._prekey(source, cdef, list(flags), "c"), list(flags))

    base = key()
    assert key() == base
    variants = [key(source=SOURCE + " "), key(cdef=CDEF + " "), key(flags=("-O3",)),
                key(flags=("-O2", "-g"))]
    identity["cc"] = "gcc 13"
    variants.append(key())
    identity["cc"] = "gcc 12"
    with monkeypatch.context() as m:
        m.setattr(symgrad.version, "__version__", "99.0")
        variants.append(key())
    with monkeypatch.context() as m:
        m.setattr(cache_keys, "_cffi_version", lambda: "0.0")
        variants.append(key())
    with monkeypatch.context() as m:
        m.setenv("CFLAGS", "-DX")  # setuptools adds it to the command line
        variants.append(key())
    assert key() == base
    assert len({base, *variants}) == len(variants) + 1


def test_cache_info_and_clear(entry, fresh):
    info = cache.cache_info()
    assert info["path"] == str(fresh)
    assert [e["module_name"] for e in info["entries"]] == [entry] and info["total_bytes"] > 0
    assert cache.clear_cache() == 1
    assert not list(fresh.glob("_symgrad_*")) and cache.cache_info()["entries"] == []


def test_unknown_kind_and_bad_types_are_rejected(fresh):
    with pytest.raises(ValueError, match="kind"):
        cache.build(SOURCE, CDEF, kind="fortran")
    with pytest.raises(TypeError):
        cache.build(SOURCE.encode(), CDEF)


def test_threads_building_the_same_source_share_one_module(fresh, compiles):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cache.build(SOURCE, CDEF), range(4)))
    assert all(r is results[0] for r in results) and len(compiles) == 1
    assert results[0].module.lib.add(2, 3) == 5


def test_a_cache_directory_deleted_under_a_running_process_is_rebuilt(fresh, compiles):
    first = cache.build(SOURCE, CDEF)
    shutil.rmtree(fresh)
    again = cache.build(SOURCE, CDEF)
    assert len(compiles) == 2
    assert again.library_path.is_file() and again.source_path.read_bytes() == SOURCE.encode()
    key = json.loads(paths(fresh, again.module_name).meta.read_text())["key"]
    assert cache._verified(paths(fresh, again.module_name), key, SOURCE) == again.library_path
    assert again.module is first.module and again.module.lib.add(2, 3) == 5
    assert cache.build(SOURCE, CDEF) is again and len(compiles) == 2


def test_a_compiled_function_recompiles_after_its_cache_directory_is_deleted(fresh, monkeypatch):
    import numpy as np
    import symgrad as sg

    # each build of the empty directory builds the C runtime too: at -O0, 2 s, not 13 s at -O3
    monkeypatch.setenv("SYMGRAD_CFLAGS", "-O0 -fopenmp -std=c11 -fno-math-errno")

    x = sg.input("x", (3,))
    compile_function = lambda: sg.function([x], sg.exp(x) * 3, backend="c")  # noqa: E731
    compile_function()
    shutil.rmtree(fresh)
    f = compile_function()
    assert f.source_path.read_text() == f.source and f.library_path.is_file()
    np.testing.assert_allclose(f(np.zeros(3, np.float32)), [3, 3, 3])


def test_a_cache_path_with_control_characters_and_c_escapes_compiles(monkeypatch, fresh, compiles):
    # ESC starts a terminal escape sequence; JSON would write it as \u001b, which C rejects. The
    # quote, backslash and "??/" (a trigraph under -std=c11) must not end or bend the literal.
    directory = fresh.parent / 'odd\x1b[31m "q" back\\slash ??/ é'
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(directory))
    assert cache.build(SOURCE, CDEF).module.lib.add(2, 3) == 5
    bad = "int add(int a, int b) {\n    return a + ;\n}\n"
    with pytest.raises(cache.BuildError) as info:
        cache.build(bad, CDEF)
    # The #line names the kept source byte for byte: the compiler's message points at it.
    assert info.value.source_path.parent == directory
    assert f"{info.value.source_path}:2:" in str(info.value)


def test_c_string_literal_escapes_every_byte_outside_printable_ascii():
    assert cache.c_string_literal(b'a\x1b"\\?\n\xc3\xa97') == '"a\\033\\"\\\\\\?\\012\\303\\2517"'


def test_compiler_version_is_asked_once_per_binary(fresh, monkeypatch, tmp_path):
    """`--version` is kept in the cache under the compiler's file: a new process asks nothing, and a
    compiler installed over it (another size, time and inode) is asked again, its new answer keyed."""
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "versioned-cc"

    def install(version: str) -> None:
        fresh_file = tmp_path / "new-cc"
        fresh_file.write_text(f'#!/bin/sh\necho "$*" >> {log}\necho "cc {version}"\n')
        fresh_file.chmod(0o755)
        fresh_file.replace(wrapper)   # as a package manager installs: a new file renamed over the old

    install("1.0")
    monkeypatch.setenv("CC", str(wrapper))
    assert cache_keys.compiler_identity() == f"{wrapper}\ncc 1.0"
    assert log.read_text().splitlines() == ["--version"]
    monkeypatch.setattr(cache_keys, "_COMPILER_IDS", {})   # a new process
    assert cache_keys.compiler_identity() == f"{wrapper}\ncc 1.0"
    assert log.read_text().splitlines() == ["--version"]   # not asked again
    install("2.0")
    monkeypatch.setattr(cache_keys, "_COMPILER_IDS", {})
    assert cache_keys.compiler_identity() == f"{wrapper}\ncc 2.0"
    assert log.read_text().splitlines() == ["--version"] * 2


def test_a_working_compiler_is_probed_once_and_a_failing_one_every_time(fresh, monkeypatch, tmp_path):
    """The default backend's check (an empty library built with the flags) is kept when it builds,
    for the compiler and flags it built with; a compiler that cannot build is asked again."""
    from symgrad.backends.build import toolchain
    builds = []
    real = toolchain._probe
    monkeypatch.setattr(toolchain, "_probe", lambda *args: builds.append(args) or real(*args))

    def new_process():
        monkeypatch.setattr(toolchain, "_PROBED", {})
        monkeypatch.setattr(cache_keys, "_COMPILER_IDS", {})

    new_process()
    cache.check_compiler()
    new_process()
    cache.check_compiler()
    assert len(builds) == 1
    monkeypatch.setenv("SYMGRAD_CFLAGS", "-O1 -fopenmp")   # other flags: probed again
    new_process()
    cache.check_compiler()
    assert len(builds) == 2

    broken = tmp_path / "broken-cc"   # answers --version, builds nothing
    broken.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "cc 0"; exit 0; fi\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    for _ in range(2):
        new_process()
        with pytest.raises(cache.CompilerNotFound, match="cannot build a shared library"):
            cache.check_compiler()
    assert len(builds) == 4
