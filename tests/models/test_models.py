import pytest
import torch

from trainyard.config import ModelConfig
from trainyard.errors import ConfigError
from trainyard.models.registry import build_model, check_model_builds, table_spec


def test_registered_mlp_produces_class_logits():
    model = build_model(
        ModelConfig(name="mlp", options={"hidden_sizes": [16, 8]}), table_spec(64, 10)
    )
    assert model(torch.zeros(5, 64)).shape == (5, 10)


def test_user_factory_by_import_path():
    model = build_model(
        ModelConfig(name="tests_support:tiny_model", options={"width": 3}), table_spec(6, 2)
    )
    assert model(torch.zeros(1, 6)).shape == (1, 2)


# model_construct skips the settings check, as a stale record or hand-built spec would:
# build_model must refuse these itself.
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ModelConfig.model_construct(name="resnet", options={}),
            r"model\.name = 'resnet': unknown model; use one of mlp, linear, cnn, transformer",
        ),
        (
            ModelConfig(name="transformer", options={}),
            r"model\.name = 'transformer': the factory raised ValueError: model transformer "
            r"needs token data",
        ),
        (
            ModelConfig.model_construct(name="no_such_module:f", options={}),
            r"model\.name = 'no_such_module:f': no module 'no_such_module' on the Python path",
        ),
        (
            ModelConfig(name="mlp", options={"hiden_sizes": [3]}),
            r"model\.options = .*unexpected keyword argument 'hiden_sizes'",
        ),
    ],
)
def test_bad_model_settings_fail_before_launch(spec, message):
    with pytest.raises(ConfigError, match=message):
        check_model_builds(spec, table_spec(64, 10))


def test_check_allocates_no_weights():
    huge = ModelConfig(name="mlp", options={"hidden_sizes": [200_000, 200_000]})
    # 40G parameters (160 GB) could not be allocated on this machine: counted on the meta device.
    assert (
        check_model_builds(huge, table_spec(64, 10))
        == 64 * 200_000 + 200_000 + 200_000**2 + 200_000 + 200_000 * 10 + 10
    )


def test_checkpoint_for_another_architecture_is_refused_naming_the_difference():
    from trainyard.errors import CheckpointError
    from trainyard.models.registry import check_same_architecture, describe

    spec = ModelConfig(name="mlp", options={"hidden_sizes": [16]})
    saved = describe(spec, table_spec(64, 10))
    check_same_architecture(saved, describe(spec, table_spec(64, 10)), "ckpt")  # same: accepted
    with pytest.raises(CheckpointError, match=r"num_classes=10 there, 12 here"):
        check_same_architecture(
            saved, describe(spec, table_spec(64, 12)), "s3://b/runs/x/checkpoints/step-00000010"
        )
    other = ModelConfig(name="mlp", options={"hidden_sizes": [32]})
    with pytest.raises(
        CheckpointError,
        match=r"options=\{'hidden_sizes': \[16\]\} there, \{'hidden_sizes': \[32\]\} here",
    ):
        check_same_architecture(saved, describe(other, table_spec(64, 10)), "ckpt")


def test_an_mlp_without_dropout_calls_no_identity_layers_and_keeps_the_dropout_models_keys():
    spec = table_spec(8, 3)
    bare = build_model(ModelConfig(options={"hidden_sizes": [16, 16], "dropout": 0}), spec)
    dropping = build_model(ModelConfig(options={"hidden_sizes": [16, 16], "dropout": 0.1}), spec)

    assert not any(isinstance(layer, torch.nn.Identity) for layer in bare.modules())
    assert bare.state_dict().keys() == dropping.state_dict().keys()
    dropping.load_state_dict(bare.state_dict())  # a checkpoint moves between the two
    dropping.eval()
    inputs = torch.randn(5, 8)
    assert torch.equal(bare(inputs), dropping(inputs))
