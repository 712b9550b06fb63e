"""TransformerEngine-JAX's single-device examples, ported to mtjax (examples/), train on the CPU:
tiny settings, the loss falls."""

import importlib.util
import pathlib
import re
import sys

import pytest

pytestmark = pytest.mark.usefixtures("fast_compiles")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(relative_path):
    path = EXAMPLES / relative_path
    sys.path.insert(0, str(path.parent))  # the examples import their folder's modules, as when run as scripts
    try:
        spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _train_losses(output):
    return [float(loss) for loss in re.findall(r"Train Loss: ([0-9.]+)", output)]


@pytest.mark.slow
def test_single_gpu_encoder_learns(capsys):
    example = _load("encoder/single_gpu_encoder.py")
    args = example.encoder_parser(["--epochs", "2", "--batch-size", "16", "--test-batch-size", "16", "--max-seq-len",
                                   "8", "--train-size", "64", "--test-size", "16", "--lr", "1e-3"])
    example.train_and_evaluate(args)
    losses = _train_losses(capsys.readouterr().out)
    assert len(losses) == 2 and losses[1] < 0.7 * losses[0], losses


@pytest.mark.slow
def test_single_gpu_mnist_learns_with_te_layers():
    example = _load("mnist/single_gpu_mnist.py")
    args = example.mnist_parser(["--use-te", "--epochs", "2", "--batch-size", "32", "--test-batch-size", "32",
                                 "--train-size", "96", "--test-size", "32", "--lr", "0.05"])
    train_losses, _, _, _ = example.train_and_evaluate(args)
    assert train_losses[1] < 0.95 * train_losses[0], train_losses


def test_mnist_te_layers_trace_fp8_gemms_under_autocast():
    """What ``--use-fp8`` does before training, traced only: under ``te.autocast(enabled=True, ...)``
    the TE dense layers' GEMMs are FP8 (the example's own check_fp8)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import mtjax as te

    example = _load("mnist/single_gpu_mnist.py")
    recipe = example.get_quantization_recipe_from_name_string("DelayedScaling")
    input_shape, label_shape = [4, example.IMAGE_H, example.IMAGE_W, example.IMAGE_C], [4]
    with te.autocast(enabled=True, recipe=recipe, mesh_resource=te.sharding.MeshResource()):
        cnn = example.Net(use_te=True)
        var_collect = cnn.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                               jnp.empty(input_shape, jnp.bfloat16))
        assert te.fp8.FP8_COLLECTION in var_collect
        state = train_state.TrainState.create(apply_fn=cnn.apply, params=var_collect["params"], tx=optax.sgd(0.01))
        example.check_fp8(state, var_collect, input_shape, label_shape)


def test_a_recipe_mtjax_lacks_is_named():
    example = _load("mnist/single_gpu_mnist.py")
    args = example.mnist_parser(["--use-fp8", "--fp8-recipe", "MXFP8BlockScaling", "--dry-run"])
    with pytest.raises(ValueError, match="Invalid quantization_recipe, got MXFP8BlockScaling"):
        example.train_and_evaluate(args)
