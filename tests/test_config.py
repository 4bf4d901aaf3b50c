from pathlib import Path

import pytest

from trainyard.config import TrainyardConfig, load_config
from trainyard.errors import ConfigError

from tests_support import write_params

REPO_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def test_repository_params_are_valid_and_match_the_defaults():
    assert load_config(REPO_PARAMS) == TrainyardConfig()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.workers=0", r"train\.workers = 0: Input should be greater than or equal to 1"),
        ("train.lr=-0.1", r"train\.lr = -0\.1: Input should be greater than 0"),
        ("train.epochs=many", r"train\.epochs = 'many': Input should be a valid integer"),
        ("train.device=tpu", r"train\.device = 'tpu': Input should be 'auto', 'cpu' or 'cuda'"),
        ("train.epoch=3", r"unknown key 'train\.epoch'; did you mean 'epochs'\?"),
        ("trian.epochs=3", r"unknown key 'trian'; did you mean 'train'\?"),
        (
            "split.val_fraction=0.8",
            r"split: val_fraction \+ test_fraction = 0\.95; must be below 0\.9",
        ),
        (
            "data.path=../secrets.csv",
            r"data\.path = '\.\./secrets\.csv': must be a path inside the project's data/ folder",
        ),
        (
            "data.path=data/raw/x.json",
            r"data\.path = 'data/raw/x\.json': must be a table \(\.csv, \.parquet\), an image array",
        ),
        ("data.image_size=32", r"data\.image_size = 32: must be \[height, width\] in pixels"),
        ("data.channels=2", r"data\.channels = 2: Input should be 1 or 3"),
        (
            "data.augment=flip_crop",
            r"data: augment = 'flip_crop' applies to images, but path 'data/raw/digits\.csv' "
            r"holds table data; remove it or point data\.path at an image folder",
        ),
        ("storage.bucket=Bad_Bucket", r"storage\.bucket = 'Bad_Bucket': must be an S3 bucket name"),
        ("storage.endpoint=ftp://x", r"storage\.endpoint = 'ftp://x': must be 'embedded', 'aws'"),
    ],
)
def test_invalid_values_name_the_key_the_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO_PARAMS, [override])


def test_overrides_are_typed_like_yaml():
    config = load_config(
        REPO_PARAMS, ["train.workers=1", "model.options={hidden_sizes: [8], dropout: 0}"]
    )
    assert config.train.workers == 1
    assert config.model.options == {"hidden_sizes": [8], "dropout": 0}


@pytest.mark.parametrize(
    ("override", "nnodes", "bounds"),
    [
        ("train.nnodes=1:2", "1:2", (1, 2, True)),
        ("train.nnodes=02:16", "2:16", (2, 16, True)),
        ("train.nnodes=3:3", 3, (3, 3, False)),
        ("train.nnodes='3'", 3, (3, 3, False)),
        ("train.nnodes=4", 4, (4, 4, False)),
    ],
)
def test_nnodes_is_a_number_or_an_elastic_range(override, nnodes, bounds):
    """1:2 is a range, never YAML 1.1's base-60 integer 62; the world is sized by MAX."""
    train = load_config(REPO_PARAMS, [override, "train.workers=3"]).train
    assert train.nnodes == nnodes
    assert (train.min_nodes, train.max_nodes, train.elastic) == bounds
    assert train.world_size == 3 * bounds[1]


def test_an_elastic_range_in_params_yaml_reads_as_a_range(tmp_path):
    train = load_config(write_params(tmp_path, "train:\n  nnodes: 1:2\n")).train
    assert (train.nnodes, train.min_nodes, train.max_nodes) == ("1:2", 1, 2)


@pytest.mark.parametrize("value", ["2:1", "0:2", "1:4097", "1:2:3", "one", "0", "4097", "1.5"])
def test_a_bad_nnodes_is_one_line_saying_what_it_may_be(value):
    with pytest.raises(ConfigError) as info:
        load_config(REPO_PARAMS, [f"train.nnodes={value}"])
    assert "train.nnodes" in str(info.value)
    assert "must be a number of machines (1 to 4096) or MIN:MAX such as 1:2" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_node_rank_must_be_below_the_ranges_max():
    with pytest.raises(ConfigError, match="node_rank 2 must be below nnodes 1:2"):
        load_config(
            REPO_PARAMS, ["train.nnodes=1:2", "train.node_rank=2", "train.rdzv_endpoint=h:1"]
        )


def test_linear_scaling_rule_scales_lr_with_global_batch():
    one = load_config(REPO_PARAMS, ["train.workers=1"])
    two = load_config(REPO_PARAMS, ["train.workers=2"])
    assert two.global_batch_size == 2 * one.global_batch_size
    assert two.scaled_lr == pytest.approx(2 * one.scaled_lr)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "train: [1, 2",
            r"params\.yaml: not valid YAML: expected ',' or '\]', but got '<stream end>' at "
            r"line 1, column 13, while parsing a flow sequence at line 1, column 8$",
        ),
        (
            "train:\n\tepochs: 3\n",
            r"found character '\\t' that cannot start any token at line 2, column 1; YAML "
            r"indents with spaces, never tabs$",
        ),
        ("- a\n- b\n", r"params\.yaml: must be a mapping"),
        ("train:\n  workers: 0\n", r"train\.workers = 0"),
    ],
)
def test_malformed_params_files(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_params(tmp_path, text))


def test_malformed_override_syntax():
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(REPO_PARAMS, ["train.workers"])


def test_a_whole_section_rule_names_its_keys_without_dumping_the_section():
    with pytest.raises(
        ConfigError, match=r"^override train\.node_rank=1: train: .*node_rank 1 needs rdzv_endpoint"
    ) as info:
        load_config(REPO_PARAMS, ["train.nnodes=2", "train.node_rank=1"])
    assert "{" not in str(info.value)


def test_switching_the_model_leaves_out_the_files_options_with_one_line(capsys):
    config = load_config(REPO_PARAMS, ["model.name=transformer", "task.name=language_model"])
    assert config.model.options == {}, "mlp's hidden_sizes and dropout never reach it"
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "trainyard: model.name=transformer: params.yaml's model.options for mlp left out "
        "(hidden_sizes, dropout); give this model's own with -S model.options.KEY=VALUE"
    ]


@pytest.mark.parametrize(
    ("overrides", "options"),
    [
        (["model.options.dropout=0.2", "model.name=cnn"], {"dropout": 0.2}),
        (["model.name=cnn", "model.options.channels=[4]"], {"channels": [4]}),
        (
            ["model.name=cnn", "model.options={channels: [4], bogus: 1}"],
            {"channels": [4], "bogus": 1},
        ),
        (["model={name: linear}"], {}),
    ],
)
def test_options_given_with_the_switch_are_kept_as_given(overrides, options):
    assert load_config(REPO_PARAMS, overrides).model.options == options


def test_the_files_options_stay_with_the_files_model(tmp_path, capsys):
    params = write_params(
        tmp_path, "model:\n  name: cnn\n  options: {channels: [4], dropout: 0.3}\n"
    )
    assert load_config(params, ["train.epochs=1"]).model.options == {
        "channels": [4],
        "dropout": 0.3,
    }
    assert load_config(params, ["model.name=cnn"]).model.options["channels"] == [4]
    assert load_config(params, ["model.name=mlp"]).model.options == {
        "hidden_sizes": [128, 64],
        "dropout": 0.1,
    }, "back to mlp: its defaults, not the cnn's options"
    assert "channels, dropout" in capsys.readouterr().err


def test_a_model_named_without_options_gets_none_of_the_mlps(tmp_path):
    params = write_params(tmp_path, "model:\n  name: transformer\n")
    assert load_config(params).model.options == {}
    assert load_config(write_params(tmp_path, "train:\n  epochs: 1\n")).model.options == {
        "hidden_sizes": [128, 64],
        "dropout": 0.1,
    }


def test_a_sweep_dimension_is_set_or_changed_by_its_setting_name():
    """The space's keys are dotted setting names: `-S sweep.space.train.batch_size=...` sets
    that dimension, `-S sweep.space.train.lr.high=...` one field of it."""
    config = load_config(
        REPO_PARAMS,
        [
            "sweep.space.train.batch_size={type: categorical, choices: [8, 16]}",
            "sweep.space.train.lr.high=0.1",
            "sweep.space.model.options.dropout={type: float, low: 0.0, high: 0.2}",
        ],
    )
    space = config.sweep.space
    assert space["train.batch_size"].type == "categorical"
    assert space["train.batch_size"].choices == [8, 16]
    assert space["train.lr"].high == 0.1 and space["train.lr"].low == 0.005  # the file's rest
    assert space["model.options.dropout"].high == 0.2
    assert "train" not in space and "model" not in space
