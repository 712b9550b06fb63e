"""The schedule simulator reproduces the published bubbles and activation counts (pure Python)."""

import pytest

from mtjax.sharding import DualPipeV, ZeroBubbleH1, simulate
from mtjax.sharding.pipeline import main


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("f,b,w", [(1.0, 2.0, 1.0), (1.0, 2.5, 0.75), (2.0, 3.0, 1.0)])
def test_published_bubbles(pp, m, f, b, w):
    one_f_one_b = simulate("1f1b", pp, m, f, b, w)
    assert one_f_one_b.bubble == pytest.approx([(pp - 1) * (f + b)] * pp)
    assert one_f_one_b.peak_activations == tuple(pp - d for d in range(pp))
    gpipe = simulate("gpipe", pp, m, f, b, w)
    assert gpipe.bubble == pytest.approx([(pp - 1) * (f + b)] * pp)
    assert gpipe.peak_activations == (m,) * pp
    interleaved = simulate("interleaved-1f1b", pp, m, f, b, w)  # 2 stages per device
    assert interleaved.num_devices == pp // 2
    assert interleaved.bubble == pytest.approx([(pp // 2 - 1) * (f + b)] * (pp // 2))
    for f_and_b in (f + b, 0.8 * (f + b)):  # without and with overlap gain
        dualpipev = simulate("dualpipev", pp, m, f, b, w, f_and_b=f_and_b)
        assert dualpipev.num_devices == pp // 2
        assert max(dualpipev.bubble) == pytest.approx((pp // 2 - 1) * (f_and_b + b - 3 * w))
        assert max(dualpipev.peak_activations) == pp + 1  # DualPipe's PP + 1


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (8, 32)])
def test_zero_bubble_h1(pp, m):
    # The paper's setting: forward, input gradient and weight gradient take the same time.
    zb = simulate("zb-h1", pp, m, 1.0, 2.0, 1.0)
    assert zb.bubble == pytest.approx([(pp - 1) * (1.0 + 2.0 - 2 * 1.0)] * pp)
    assert max(zb.peak_activations) == pp  # 1F1B's memory


def test_dualpipev_bubble_below_half_of_1f1b_at_pp8():
    one_f_one_b, dualpipev = simulate("1f1b", 8, 32), simulate("dualpipev", 8, 32)
    assert max(dualpipev.bubble) < 0.5 * max(one_f_one_b.bubble)
    assert dualpipev.bubble_fraction < 0.5 * one_f_one_b.bubble_fraction


def test_simulator_errors_and_cli(capsys):
    with pytest.raises(ValueError, match="accepted: gpipe"):
        simulate("dualpipe", 8, 32)
    with pytest.raises(ValueError, match="at least 2 \\* pp = 8 micro-batches"):
        simulate("dualpipev", 8, 4)
    with pytest.raises(ValueError, match="w <= b"):
        simulate("zb-h1", 4, 8, 1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="pp divisible"):
        simulate("dualpipev", 3, 8)
    assert main(["1f1b", "dualpipev", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "1f1b: 4 stages on 4 devices, 8 micro-batches" in out and "dualpipev: 4 stages on 2 devices" in out


def test_schedules_check_their_arguments():
    with pytest.raises(ValueError, match="DualPipeV\\(num_chunks=3\\)"):
        DualPipeV(8, num_chunks=3)
    with pytest.raises(ValueError, match="ZB-H1 has one chunk"):
        ZeroBubbleH1(8, num_chunks=2)
    with pytest.raises(ValueError, match="at least 2 \\* pp = 8"):
        DualPipeV(6).timeline(4)
    # Every action once, on its stage's device, no deadlock, for a range of sizes.
    for p in (1, 2, 3, 4):
        for m in range(2 * p, 2 * p + 5):
            DualPipeV(m).timeline(p)
            ZeroBubbleH1(m).timeline(p)
