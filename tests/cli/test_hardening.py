"""Hostile and odd input (issue 8): every refusal is one short line, exit code 2, and nothing
is imported, expanded or written on the way. The CLI runs as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import trainyard
from trainyard.cli import main as cli
from trainyard.config import config_from_dict
from trainyard.data.tables import read_table
from trainyard.errors import ConfigError, DataError, TrainyardError
from trainyard.models.registry import check_model_builds, table_spec
from trainyard.runs.record import check_run_id

from conftest import BIN, trainyard_cli

ZEN = "Beautiful is better than ugly"
# Nine levels of nine aliases: 9**9 (387 million) strings once expanded.
BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{','.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcdefgh", "bcdefghi", strict=True)
)


def refusal(done: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refused command."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainyard: error: "), done.stderr
    assert "Traceback" not in done.stderr and len(lines[0]) <= cli.ERROR_LINE_MAX
    return lines[0]


def bare_folder(tmp_path: Path, params: str = "{}\n") -> Path:
    """A folder with only a params.yaml: settings are refused before anything else is needed."""
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "params.yaml").write_text(params)
    return folder


# --- YAML anchors and aliases, long lines -------------------------------------------------


def test_billion_laughs_params_file_is_one_short_line(tmp_path):
    assert len(BILLION_LAUGHS) < 400
    line = refusal(trainyard_cli("run", cwd=bare_folder(tmp_path, BILLION_LAUGHS)))
    assert line == (
        "trainyard: error: params.yaml: YAML anchors and aliases (&name / *name) are not "
        "allowed (line 1); write the values out"
    )


def test_an_alias_names_its_line(tmp_path):
    params = "train:\n  epochs: 3\nsplit: &s {seed: 1}\n"
    line = refusal(trainyard_cli("run", cwd=bare_folder(tmp_path, params)))
    assert "are not allowed (line 3)" in line


@pytest.mark.parametrize("value", ["{a: &x [1], b: *x}", "*x", "&x 3", "{<<: *x}"])
def test_aliases_in_overrides_are_refused(tmp_path, value):
    line = refusal(trainyard_cli("run", "-S", f"model.options={value}", cwd=bare_folder(tmp_path)))
    assert f"-S 'model.options={value}': YAML anchors and aliases" in line


def test_an_error_line_is_cut_at_500_characters(tmp_path):
    line = refusal(trainyard_cli("run", "-S", "x" * 5000, cwd=bare_folder(tmp_path)))
    assert len(line) == cli.ERROR_LINE_MAX and line.endswith("…")


def test_a_huge_value_is_shown_cut_short():
    huge = list(range(100_000))
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"train": {"epochs": huge}, "storage": {"bucket": "b" * 10_000}})
    message = str(caught.value)
    assert message.startswith("params: train.epochs = [0, 1, 2,") and "…: " in message
    assert len(message) < 200


def test_a_multi_line_message_becomes_one_line():
    line = cli.error_line(TrainyardError("first\n  second\nthird"))
    assert line == "trainyard: error: first second third"


# --- model.name: found statically, never imported while checked ---------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("this:x", "'this' is part of Python's standard library, not a model factory"),
        ("builtins:eval", "'builtins' is part of Python's standard library"),
        ("os:system", "'os' is part of Python's standard library"),
        ("sys:exit", "'sys' is part of Python's standard library"),
        ("antigravity:fly", "'antigravity' is part of Python's standard library"),
        ("json.decoder:JSONDecoder", "'json' is part of Python's standard library"),
        ("no_such_module:f", "no module 'no_such_module' on the Python path"),
        ("sideeffect:nope", "has no top-level def, class or assignment named 'nope'"),
        ("sidepkg.mod:nope", "has no top-level def, class or assignment named 'nope'"),
        ("sidepkg.missing:f", "no module 'sidepkg.missing' on the Python path"),
        ("sideeffect.sub:f", "'sideeffect' is a module, not a package"),
        ("resnet", "unknown model; use one of mlp, linear"),
        ("a:b:c", "unknown model; use one of mlp, linear"),
    ],
)
def test_a_model_name_that_is_no_project_factory_is_refused_without_importing(
    tmp_path, name, expected
):
    modules, marker = side_effect_modules(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(modules)}
    done = trainyard_cli("run", "-S", f"model.name={name}", cwd=bare_folder(tmp_path), env=env)
    line = refusal(done)
    assert line.startswith(f"trainyard: error: override model.name={name}: model.name = {name!r}: ")
    assert expected in line
    if "standard library" in line:
        assert (
            "use mlp, linear, cnn, transformer or package.module:factory from your project" in line
        )
    assert ZEN not in done.stdout + done.stderr, "`this` was imported"
    assert not marker.exists(), "a project module was imported while checking"


def side_effect_modules(tmp_path: Path) -> tuple[Path, Path]:
    """Project modules that leave a file behind when imported."""
    modules, marker = tmp_path / "modules", tmp_path / "imported"
    effect = f"from pathlib import Path\nPath({str(marker)!r}).write_text(__name__)\n"
    factory = "def factory(in_features, num_classes):\n    import torch\n"
    factory += "    return torch.nn.Linear(in_features, num_classes)\n"
    (modules / "sidepkg").mkdir(parents=True)
    (modules / "sideeffect.py").write_text(effect + factory)
    (modules / "sidepkg" / "__init__.py").write_text(effect + "from .impl import *\n")
    (modules / "sidepkg" / "impl.py").write_text(effect + factory)
    (modules / "sidepkg" / "mod.py").write_text(effect + "helper = 1\n")
    return modules, marker


@pytest.mark.parametrize("name", ["sideeffect:factory", "sidepkg:factory", "sidepkg.impl:factory"])
def test_a_project_factory_passes_the_check_unimported_then_builds(tmp_path, monkeypatch, name):
    modules, marker = side_effect_modules(tmp_path)
    monkeypatch.syspath_prepend(str(modules))
    config = config_from_dict({"model": {"name": name, "options": {}}})
    assert not marker.exists() and not {"sideeffect", "sidepkg"} & set(sys.modules)
    try:
        assert (
            check_model_builds(config.model, table_spec(4, 3)) == 4 * 3 + 3
        )  # imported for real now
        assert marker.exists()
    finally:
        for module in [m for m in sys.modules if m.split(".")[0] in {"sideeffect", "sidepkg"}]:
            del sys.modules[module]


FACTORIES = """
import torch

def wrong_options(in_features, num_classes, width):
    return torch.nn.Linear(in_features, width)

def raises_value_error(in_features, num_classes, depth=1):
    raise ValueError(f"depth must be below 3, got {depth}")

def raises_type_error_inside(in_features, num_classes):
    return len(5)

def not_a_module(in_features, num_classes):
    return "linear"

not_callable = 7
"""


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        (
            "wrong_options",
            {"depth": 2},
            r"^model\.options = \{'depth': 2\}: missing a required argument: 'width'",
        ),
        (
            "raises_value_error",
            {"depth": 4},
            r"^model\.name = 'userfactories:raises_value_error': the factory raised "
            r"ValueError: depth must be below 3, got 4 \(model\.options = \{'depth': 4\}\)",
        ),
        (
            "raises_type_error_inside",
            {},
            r"^model\.name = '[^']+': the factory raised TypeError: object of type 'int'",
        ),
        ("not_a_module", {}, r"^model\.name = '[^']+': factory returned str, not nn\.Module"),
        ("not_callable", {}, r"^model\.name = '[^']+': not_callable is not callable"),
    ],
)
def test_factory_errors_blame_options_only_for_arguments(
    tmp_path, monkeypatch, name, options, expected
):
    (tmp_path / "userfactories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = config_from_dict({"model": {"name": f"userfactories:{name}", "options": options}})
    with pytest.raises(ConfigError, match=expected):
        check_model_builds(spec.model, table_spec(4, 3))
    sys.modules.pop("userfactories", None)


def test_the_tests_support_factories_still_resolve():
    config = config_from_dict({"model": {"name": "tests_support:tiny_model", "options": {}}})
    assert check_model_builds(config.model, table_spec(6, 2)) > 0


# --- run ids, endpoints: matched whole ---------------------------------------------------


@pytest.mark.parametrize("run_id", ["abc\n", "abc\n\n", "a" * 65, "../x", "-a", ""])
def test_run_ids_are_matched_whole(run_id):
    with pytest.raises(TrainyardError, match="is not valid"):
        check_run_id(run_id)


def test_a_run_id_with_a_trailing_newline_is_one_line_from_the_cli(tmp_path):
    line = refusal(trainyard_cli("run", "--run-id", "abc\n", cwd=bare_folder(tmp_path)))
    assert "run id 'abc\\n' is not valid" in line


@pytest.mark.parametrize(
    "override",
    [
        "storage.endpoint=http://s3.example\n",
        "storage.bucket=bucket\n",
        "train.rdzv_endpoint=node0:29400\n",
    ],
)
def test_endpoints_and_names_are_matched_whole(override):
    key, _, value = override.partition("=")
    section, leaf = key.split(".")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({section: {leaf: value}})


# --- labels ---------------------------------------------------------------------------


def test_numeric_labels_are_one_class_however_written(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,label\n1,1\n2,1.0\n3,01\n4,2\n5,2.00\n6,+2\n7,1e1\n")
    assert read_table(path, "label")["label"].tolist() == ["1", "1", "1", "2", "2", "2", "10"]


def test_fractional_labels_are_written_one_way(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,label\n1,0.5\n2,.50\n3,1\n4,1.0\n")
    assert read_table(path, "label")["label"].tolist() == ["0.5", "0.5", "1.0", "1.0"]


def test_text_labels_stay_as_written(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,label\n1,1\n2,1.0\n3,cat\n")
    assert read_table(path, "label")["label"].tolist() == ["1", "1.0", "cat"]


def test_parquet_float_labels_become_integer_classes(tmp_path):
    path = tmp_path / "t.parquet"
    pd.DataFrame({"a": [1.0, 2.0, 3.0], "label": [0.0, 1.0, 0.0]}).to_parquet(path)
    assert read_table(path, "label")["label"].tolist() == ["0", "1", "0"]


def test_a_continuous_label_column_is_refused_as_a_regression_target(tmp_path):
    path = tmp_path / "prices.csv"
    path.write_text("a,price\n" + "".join(f"{i},{i * 1.37:.2f}\n" for i in range(200)))
    with pytest.raises(DataError) as caught:
        read_table(path, "price")
    message = str(caught.value)
    assert message.startswith(f"{path}: label column 'price' holds 200 distinct numbers")
    assert "(e.g. '1.37')" in message
    assert "classification task needs discrete class labels" in message
    assert "this looks like a regression target" in message


def test_a_few_fractional_codes_are_classes(tmp_path):
    path = tmp_path / "grades.csv"
    grades = [f"{g / 2:.1f}" for g in range(1, 11)]  # 0.5 .. 5.0: ten classes
    path.write_text("a,grade\n" + "".join(f"{i},{grades[i % 10]}\n" for i in range(300)))
    assert read_table(path, "grade")["grade"].nunique() == 10


def test_a_regression_target_is_one_line_from_the_cli(project):
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{i},{i * 0.731:.3f}\n" for i in range(300))
    (project / "data/raw/houses.csv").write_text("area,label\n" + rows)
    line = refusal(trainyard_cli("run", "-S", "data.path=data/raw/houses.csv", cwd=project))
    assert "houses.csv: label column 'label' holds 300 distinct numbers" in line
    assert "this looks like a regression target" in line


# --- start-up: settings before the engine -----------------------------------------------


def test_a_settings_error_imports_no_heavy_module(tmp_path):
    probe = (
        "import sys\n"
        "from trainyard.cli.main import main\n"
        "code = main(['run', '-S', 'train.epochs=-1'])\n"
        "code2 = main(['run', '-S', 'model.name=os:system'])\n"
        "heavy = [m for m in ('torch', 'prefect', 's3fs', 'pandas', 'numpy') if m in sys.modules]\n"
        "print(code, code2, heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=bare_folder(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "2 2 []", done.stderr
    assert "train.epochs = -1" in done.stderr and "'os' is part of" in done.stderr


def test_engine_entry_modules_do_not_import_torch():
    probe = (
        "import sys\n"
        "import trainyard, trainyard.cli.main, trainyard.config, trainyard.errors, trainyard.project\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_version():
    done = subprocess.run([str(BIN / "trainyard"), "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == f"trainyard {trainyard.__version__}\n"


@pytest.mark.parametrize("args", [["runs", "list"], ["--help"]])
def test_a_closed_pipe_ends_quietly(project, args):
    """`trainyard runs list | head -1`: the reader is gone before trainyard writes."""
    proc = subprocess.Popen(
        [str(BIN / "trainyard"), *args],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert err == b"", err.decode()
    assert proc.returncode in (0, 141)


def test_runs_list_through_head_prints_its_header(project):
    done = subprocess.run(
        f"{BIN / 'trainyard'} runs list | head -1",
        shell=True,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.startswith("RUN ID") and done.stderr == ""


# --- the embedded store writes nothing to /tmp --------------------------------------------


def test_the_embedded_store_logs_into_its_home(s3_server):
    server, state = s3_server
    logs = sorted(p.name for p in (server.home / "logs").iterdir())
    assert any(name.startswith("weed.") and name.endswith(str(state.pid)) for name in logs), logs
    assert not list(Path("/tmp").glob(f"weed.*.{state.pid}"))
    assert (server.home / "s3.sock").exists()  # its unix socket too


def test_a_factory_check_parses_again_after_cpythons_spurious_depth_mismatch(monkeypatch):
    """CPython 3.11's ast can raise "AST constructor recursion depth mismatch" when another
    thread's parse left its counter off (gh-106905); the check parses again instead of
    failing the run, and any other SystemError still propagates."""
    import ast

    from trainyard import factories

    real_parse, calls = ast.parse, []

    def flaky_parse(source, filename="<unknown>"):
        calls.append(filename)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=60, after=76)")
        return real_parse(source, filename)

    monkeypatch.setattr(factories.ast, "parse", flaky_parse)
    assert factories.locate_factory("tests_support:slow_mlp") is not None
    assert len(calls) >= 2
    monkeypatch.setattr(factories.ast, "parse", lambda *a: (_ for _ in ()).throw(SystemError("x")))
    with pytest.raises(SystemError, match="x"):
        factories.locate_factory("tests_support:held_mlp")
