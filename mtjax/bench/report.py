"""What a `mtjax bench` run produces from its rows: the derived columns, a terminal table, JSON, a chart."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from mtjax.bench.timing import ROW_FIELDS

# Dense bf16 peak of one H200 (and H100) SXM by the datasheet: the denominator of MFU.
H200_BF16_PEAK_TFLOPS = 989.0


def complete(rows: Sequence[Mapping[str, Any]], ceilings: Mapping[str, float], peak_tflops: float) -> list[dict]:
    """Rows with ``speedup_vs_peer``, ``fraction_of_ceiling`` and ``mfu`` filled in.

    Raises ValueError when a suite's row lacks a field of `ROW_FIELDS` or has an unknown one, so a
    suite that drifts from the format is caught in CI.
    """
    rows = [dict(r) for r in rows]
    for r in rows:
        missing, unknown = set(ROW_FIELDS) - set(r), set(r) - set(ROW_FIELDS)
        if missing or unknown:
            raise ValueError(f"bench row {r.get('suite')}/{r.get('name')}: missing {sorted(missing)}, unknown "
                             f"{sorted(unknown)}; build rows with mtjax.bench.timing.row")
    by_key = {(r["suite"], r["name"], r["implementation"]): r for r in rows}
    for r in rows:
        if r["peer"] is not None:
            peer = by_key.get((r["suite"], r["name"], r["peer"]))
            timed = peer is not None and peer["time_ms"] is not None and r["time_ms"] is not None
            r["speedup_vs_peer"] = peer["time_ms"] / r["time_ms"] if timed else None  # None: a row that failed
        if r["ceiling"] is not None and ceilings.get(r["ceiling"]):
            rate = r["gbps"] if r["ceiling"] == "copy_gbps" else r["tflops"]
            r["fraction_of_ceiling"] = None if rate is None else rate / ceilings[r["ceiling"]]
        if r["tflops"] is not None:
            r["mfu"] = r["tflops"] / peak_tflops
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table, one line per row, grouped by suite."""
    header = ("suite", "case", "implementation", "ms", "TFLOP/s", "GB/s", "vs peer", "of ceiling", "MFU")
    lines = []
    for r in rows:
        lines.append((
            r["suite"], r["name"], r["implementation"], _fmt(r["time_ms"], ".3f"), _fmt(r["tflops"], ".1f"),
            _fmt(r["gbps"], ".0f"),
            "-" if r["speedup_vs_peer"] is None else f"{r['speedup_vs_peer']:.2f}x vs {r['peer']}",
            _fmt(r["fraction_of_ceiling"], ".0%"), _fmt(r["mfu"], ".1%"),
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    out = [" | ".join(str(x).ljust(w) for x, w in zip(header, widths)),
           "-+-".join("-" * w for w in widths)]
    out += [" | ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def write_json(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> None:
    """``{"meta": {...}, "results": [row, ...]}``."""
    with open(path, "w") as f:
        json.dump({"meta": dict(meta), "results": list(rows)}, f, indent=2)


def plot(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    """A horizontal bar chart: for each case, every implementation's speed relative to the case's peer.

    Rows without a peer in their case (ceilings) are shown as fraction of their ceiling instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    palette = {"mtjax": "tab:orange", "flax": "tab:blue", "xla": "tab:gray"}
    peers_of_case = {(r["suite"], r["name"]): r["peer"] for r in rows if r["peer"] is not None}
    for r in rows:
        case = (r["suite"], r["name"])
        if case in peers_of_case:
            is_peer = r["implementation"] == peers_of_case[case]
            value = 1.0 if is_peer else r["speedup_vs_peer"]
        else:
            value = r["fraction_of_ceiling"]
        if value is None:
            continue
        labels.append(f"{r['suite']}: {r['name']} [{r['implementation']}]")
        values.append(value)
        colors.append(palette.get(r["implementation"].split()[0], "tab:green"))
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(labels) + 1.5))
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed relative to the peer (ceilings: fraction of the measured ceiling)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
