"""Pipeline schedules: their tables (bubble, live activations) and the executor against the
unpipelined model, on 8 virtual CPU devices (pp = 2 and 4, with and without dp / tp)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtjax.sharding import Circular, DualPipeV, GPipe, MeshConfig, OneFOneB, Schedule, ZeroBubbleH1, pipeline_loss
from mtjax.sharding.pipeline import Action

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAYERS, WIDTH, BATCH, CLASSES = 8, 16, 16, 4


def layer(w, h):
    return jnp.tanh(h @ w["w"] + w["b"]) + h


def head_loss(head, h, labels):
    logp = jax.nn.log_softmax(h @ head)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def reference_loss(params, x, head, labels):
    h = jax.lax.scan(lambda h, w: (layer(w, h), None), x, params)[0]
    return head_loss(head, h, labels)


@pytest.fixture(scope="module")
def problem():
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w": jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
              "b": 0.1 * jax.random.normal(k[1], (LAYERS, WIDTH))}
    head = jax.random.normal(k[2], (WIDTH, CLASSES))
    x = jax.random.normal(k[3], (BATCH, WIDTH))
    labels = jax.random.randint(k[4], (BATCH,), 0, CLASSES)
    expected = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(params, x, head, labels)
    return params, x, head, labels, expected


# ------------------------------------------------------------------------------------------------
# Schedules (pure Python tables)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_bubble_fractions(p, m):
    gpipe = GPipe(m).timeline(p)
    assert gpipe.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # 1F1B has GPipe's bubble; its activations stay bounded, GPipe's grow with the micro-batches.
    one_f_one_b = OneFOneB(m).timeline(p)
    assert one_f_one_b.bubble_fraction == pytest.approx(gpipe.bubble_fraction)
    assert gpipe.peak_live_activations == m
    assert one_f_one_b.peak_live_activations == min(m, 2 * p - 1)
    # Circular with c chunks: the fill/drain shrinks c times.
    if m % p == 0:
        for c in (2, 4):
            assert Circular(m, c).timeline(p).bubble_fraction == pytest.approx((p - 1) / (c * m + p - 1))
            assert OneFOneB(m, c).timeline(p).bubble_fraction == pytest.approx((p - 1) / (c * m + p - 1))
            assert OneFOneB(m, c).timeline(p).peak_live_activations <= 2 * p - 1 + (c - 1) * p


def test_schedule_order_is_checked():
    class Broken(Schedule):
        def order(self, num_stages):
            return [[Action("F", 0, 0)], []]

    with pytest.raises(ValueError, match="each action must appear once"):
        Broken(1).timeline(2)

    class Deadlock(Schedule):  # stage 0 waits for a backward before running the forward it needs
        def order(self, num_stages):
            return [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]

    with pytest.raises(ValueError, match="deadlocks"):
        Deadlock(1).timeline(2)


def test_every_schedule_runs_to_the_end():
    """No order deadlocks; 1F1B keeps the bubble of the GPipe order with the same chunks."""
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 17):
            for c in (1, 2, 3):
                circular = Circular(m, c).timeline(p)
                if c == 1:
                    assert GPipe(m).timeline(p).bubble_fraction == pytest.approx(circular.bubble_fraction)
                if c == 1 or m % p == 0:
                    assert OneFOneB(m, c).timeline(p).bubble_fraction == pytest.approx(circular.bubble_fraction)
                else:
                    with pytest.raises(ValueError, match="multiples of the"):
                        OneFOneB(m, c).timeline(p)


@pytest.mark.parametrize("make", [lambda: GPipe(0), lambda: OneFOneB(4, num_chunks=0), lambda: GPipe(4, num_chunks=2)])
def test_schedule_rejects_bad_arguments(make):
    with pytest.raises(ValueError, match="num_microbatches|num_chunks"):
        make()


def test_pipeline_loss_rejects_bad_arguments(problem):
    params, x, head, labels, _ = problem
    mesh = MeshConfig(pp=4, dp=2).make_mesh()
    with pytest.raises(ValueError, match="8 layers do not split into pp=4 stages x num_chunks=4"):
        pipeline_loss(layer, params, x, head_loss, head, labels, mesh=mesh, schedule=Circular(4, 4))
    with pytest.raises(ValueError, match="batch 16 does not divide into 3 micro-batches"):
        pipeline_loss(layer, params, x, head_loss, head, labels, mesh=mesh, schedule=GPipe(3))
    with pytest.raises(TypeError, match="expected a Schedule"):
        pipeline_loss(layer, params, x, head_loss, head, labels, mesh=mesh, schedule="1f1b")
    no_pp = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="the mesh has no 'pp' axis"):
        pipeline_loss(layer, params, x, head_loss, head, labels, mesh=no_pp, schedule=GPipe(4))


# ------------------------------------------------------------------------------------------------
# Executor: loss and gradients equal the unpipelined model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_config,schedule", [
    (MeshConfig(pp=2, dp=4), GPipe(4)),
    (MeshConfig(pp=4, dp=2), Circular(4, num_chunks=2)),
    (MeshConfig(pp=4, tp=2), OneFOneB(8)),
    (MeshConfig(pp=2, dp=2, tp=2), OneFOneB(4, num_chunks=2)),
    (MeshConfig(pp=2, dp=4), ZeroBubbleH1(4)),
    (MeshConfig(pp=4, tp=2), ZeroBubbleH1(8)),
    (MeshConfig(pp=2, dp=2, tp=2), DualPipeV(4)),
    (MeshConfig(pp=4, dp=2), DualPipeV(8)),
], ids=["pp2-dp4-gpipe", "pp4-dp2-circular", "pp4-tp2-1f1b", "pp2-dp2-tp2-interleaved", "pp2-dp4-zbh1",
        "pp4-tp2-zbh1", "pp2-dp2-tp2-dualpipev", "pp4-dp2-dualpipev"])
def test_pipeline_matches_unpipelined(problem, mesh_config, schedule):
    params, x, head, labels, (expected_loss, expected_grads) = problem
    mesh = mesh_config.make_mesh()
    # Layers split over pp (contiguous, as the "layers" rule does), the columns of w over tp.
    params = jax.device_put(params, {"w": NamedSharding(mesh, P("pp", None, "tp")), "b": NamedSharding(mesh, P("pp"))})
    x = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"))))

    def loss(params, x, head):
        return pipeline_loss(layer, params, x, head_loss, head, labels, mesh=mesh, schedule=schedule)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, head)
    np.testing.assert_allclose(value, expected_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if isinstance(schedule, (OneFOneB, DualPipeV)):  # without differentiation only the forward actions run
        np.testing.assert_allclose(jax.jit(loss)(params, x, head), expected_loss, rtol=1e-5)



def test_dualpipev_computes_two_microbatches_forward_and_backward_in_one_step(problem):
    """DualPipeV's steady state: every tick runs the F of one (chunk, micro-batch) and the B and W of
    another in one loop body with no conditional between them (so XLA may overlap one's hand-offs with the other's
    compute); the only conditionals left are the loss's, in segments where some ticks have none."""
    params, x, head, labels, _ = problem
    schedule, mesh = DualPipeV(8), MeshConfig(pp=4, dp=2).make_mesh()
    timeline = schedule.timeline(4)
    segments = timeline.segments()
    steady = max(segments, key=lambda s: s.stop - s.start)
    assert (steady.forward, steady.backward, steady.weights) == (True, True, True)
    assert steady.stop - steady.start >= 8 and len(segments) <= 5
    both = [int(((timeline.f_mb[t] >= 0) & (timeline.b_mb[t] >= 0)).sum()) for t in range(steady.start, steady.stop)]
    assert min(both) >= 1 and max(both) == 4  # a device with an F and a B at every tick; all four at the peak
    grad = jax.grad(lambda p, x, h: pipeline_loss(layer, p, x, head_loss, h, labels, mesh=mesh, schedule=schedule),
                    argnums=(0, 1, 2))
    text = jax.jit(grad).lower(params, x, head).as_text()
    assert text.count("stablehlo.case") == sum(s.loss == "sometimes" for s in segments) == 1
    assert text.count("stablehlo.if") == 0

def test_1f1b_memory_stays_bounded():
    """Compiled temporary memory as the micro-batches go from 4 to 16 (of a fixed size): GPipe's
    grows by a stashed activation and an output gradient per micro-batch on top of what every
    schedule needs (the micro-batched input and its gradient), 1F1B's only by the latter."""
    mesh = MeshConfig(pp=4, dp=2).make_mesh()
    width, mb_rows = 64, 64
    params = {"w": jnp.zeros((4, width, width)), "b": jnp.zeros((4, width))}
    head = jnp.zeros((width, CLASSES))

    def temp_bytes(schedule):
        rows = schedule.num_microbatches * mb_rows
        x = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
        labels = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=NamedSharding(mesh, P("dp")))
        grad = jax.grad(lambda p, x, h, t: pipeline_loss(layer, p, x, head_loss, h, t, mesh=mesh, schedule=schedule),
                        argnums=(0, 1, 2))
        return jax.jit(grad).lower(params, x, head, labels).compile().memory_analysis().temp_size_in_bytes

    added = 12 * (mb_rows // 2) * width * 4  # 12 more micro-batch activations on a device (dp=2)
    gpipe = temp_bytes(GPipe(16)) - temp_bytes(GPipe(4))
    one_f_one_b = temp_bytes(OneFOneB(16)) - temp_bytes(OneFOneB(4))
    slack = added // 8  # the labels and the schedule's tables grow a little too
    assert one_f_one_b <= 2 * added + slack, one_f_one_b / added
    assert gpipe >= 4 * added, gpipe / added
