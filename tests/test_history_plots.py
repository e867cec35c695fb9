"""RunHistoryBackend's figures, drawn for real with matplotlib's Agg canvas: points a line cannot show, values that
cannot be drawn, keys with ``$`` in them, and more keys than a figure should hold."""

import io
import math

import numpy as np
import pytest

import instrument
from instrument import ConfigurationError, RunHistoryBackend

pytest.importorskip("matplotlib")

NAN, INF = math.nan, math.inf


def _history(tmp_path, series, timed=()):
    """A real session that logs ``series`` (key -> values, one per step) and times ``timed`` stages."""
    history = RunHistoryBackend()
    inst = instrument.Instrumentation(backends=[history], log_interval=1, log_dir=str(tmp_path), run_name="plots",
                                      overhead_budget=None)
    for step in range(max(len(v) for v in series.values())):
        with inst.step(step):
            for stage in timed:
                with inst.logger.timer(stage):
                    pass
            inst.logger.log_metrics({k: v[step] for k, v in series.items() if step < len(v)}, step=step)
    inst.close()
    return history


def _blue_pixels(fig):
    """Pixels of each axes drawn in the first line colour (C0), as the figure renders on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    blue = (np.abs(image - np.array([0x1F, 0x77, 0xB4])) < 40).all(axis=-1)
    height = image.shape[0]
    counts = []
    for ax in fig.axes:
        box = ax.get_window_extent()
        rows = slice(int(height - box.y1), int(height - box.y0))
        counts.append(int(blue[rows, int(box.x0):int(box.x1)].sum()))
    return counts


def test_single_points_and_points_between_nan_or_inf_are_drawn_and_values_left_out_are_said(tmp_path):
    """Lines only: a series of one value, or finite values each between NaN/inf (a run that diverged), drew no
    pixel, and nothing said that values were left out."""
    series = {"single": [3.0], "diverged": [1.0, NAN, 0.5, NAN, NAN], "spiky": [0.0, INF, 0.0, -INF, 0.0],
              "normal": [1.0, 2.0, 3.0]}
    history = _history(tmp_path, series)
    fig = history.plot_metrics(list(series))
    assert all(count > 0 for count in _blue_pixels(fig)), dict(zip(series, _blue_pixels(fig), strict=True))
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == ["single", "diverged  (3 of 5 values not drawn: 3 NaN)",
                      "spiky  (2 of 5 values not drawn: 1 +inf, 1 -inf)", "normal"]
    for ax in fig.axes:  # steps are whole: no tick at 0.5
        assert all(float(tick).is_integer() for tick in ax.get_xticks())

    timed = _history(tmp_path / "t", {"x": [1.0]}, timed=["only"])  # one point: a line alone draws nothing
    fig = timed.plot_timelog()
    assert _blue_pixels(fig)[0] > 0
    assert all(float(tick).is_integer() for tick in fig.axes[0].get_xticks())


def test_finite_values_whose_span_overflows_are_counted_not_drawn_and_the_figure_draws(tmp_path):
    """A diverging series at the float64 limit ([0, 1e308], or 1e308 beside -1e308) made matplotlib fail when the
    figure was drawn ('arange: cannot compute length'), losing every other panel too."""
    from instrument.backends.history_plot import plot_timelog

    series = {"grad_norm": [0.0, 1e308, -1e308, INF, 1.0], "wide": [0.0, 1e308], "edge": [-1e307, 1e307],
              "loss": [1.0, 0.5, 0.25]}
    history = _history(tmp_path, series)
    fig = history.plot_metrics(list(series))
    counts = _blue_pixels(fig)  # draws the figure on the Agg canvas
    assert all(count > 0 for count in counts), dict(zip(series, counts, strict=True))
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "grad_norm  (3 of 5 values not drawn: 1 +inf, 2 beyond +-1e+307)",
        "wide  (1 of 2 values not drawn: 1 beyond +-1e+307)", "edge", "loss"]
    fig = plot_timelog({"step": [(0, 0.1, 1), (1, 1e308, 1), (2, 0.2, 1)]}, None)
    assert _blue_pixels(fig)[0] > 0
    assert fig.axes[0].get_title(loc="left") == "stage timings  (1 of 3 values not drawn: 1 beyond +-1e+307)"


def test_a_step_committed_while_a_figure_reads_the_history_is_in_every_panel_or_in_none(tmp_path):
    """plot_metrics read each key under its own hold of the lock, so a step the writer committed between two keys
    was in the later panels only: panels of keys logged at every step ended at different steps. The hook commits
    a step right after the first key is read; with one hold for all keys the writer waits, whatever the timing."""
    import threading

    from instrument import StepRecord

    history = _history(tmp_path, {"a": [0.0, 1.0], "b": [0.0, 1.0]})
    read, writers = history.series, []

    def series_then_commit(key):
        out = read(key)
        if not writers:  # once: the writer thread commits step 2 (every key) while the figure reads
            writers.append(threading.Thread(target=history.write, args=(StepRecord(2, {"a": 2.0, "b": 2.0}),)))
            writers[0].start()
            writers[0].join(timeout=1.0)  # done by now unless it waits for the lock: either way the test holds
        return out

    history.series = series_then_commit
    fig = history.plot_metrics(["a", "b"])
    writers[0].join()
    ends = [ax.lines[0].get_xdata()[-1] for ax in fig.axes]
    assert ends == [1, 1], ends  # the step the writer committed meanwhile is in no panel
    del history.series
    assert [ax.lines[0].get_xdata()[-1] for ax in history.plot_metrics(["a", "b"]).axes] == [2, 2]


def test_keys_and_stage_names_are_drawn_as_written_never_as_math(tmp_path):
    """Two '$' made a key matplotlib mathtext: ``cost/$usd$`` was drawn as math, ``cost/$_$`` made savefig raise."""
    keys = ["cost/$usd$", "cost/$_$", "a_{b}/x^2"]
    history = _history(tmp_path, {key: [0.0, 1.0] for key in keys}, timed=["env$_$"])
    for fig in (history.plot_metrics(keys, title="run $_$"), history.plot_timelog(title="t $_$")):
        fig.savefig(io.BytesIO(), format="png")  # raised ValueError for '$_$'
        texts = [t for ax in fig.axes for t in (ax.title, ax._left_title, ax.yaxis.label)]
        texts += [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        texts += [fig._suptitle] if fig._suptitle is not None else []
        assert all(not t.get_parse_math() for t in texts if "$" in t.get_text() or "^" in t.get_text())
    assert [ax.get_title(loc="left") for ax in history.plot_metrics(keys).axes] == keys


def test_more_keys_than_max_panels_are_refused_with_the_way_to_select_them(tmp_path):
    """300 keys built a 6.4 x 660 inch figure that took minutes to save."""
    history = _history(tmp_path, {f"k/{i}": [float(i)] for i in range(30)})
    keys = history.keys()
    with pytest.raises(ConfigurationError, match=r"plot_metrics got 30 keys, more than max_panels=24 .*Select the "
                                                 r"keys to plot, e\.g\. .* or pass max_panels=30"):
        history.plot_metrics(keys)
    fig = history.plot_metrics(keys, max_panels=30)
    assert len(fig.axes) == 30
    assert len(history.plot_metrics(keys[:24]).axes) == 24
    with pytest.raises(ConfigurationError, match=r"max_panels must be an int >= 1 .* got 0"):
        history.plot_metrics(keys, max_panels=0)
