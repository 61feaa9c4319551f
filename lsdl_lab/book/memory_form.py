"""The memory calculator as a form (ipywidgets) and as a table (HTML), for Chapter 8.

:func:`memory_table` renders what :func:`~lsdl_lab.memory.gpt_memory` computes, one row
per configuration and one column per category, as an HTML table: it shows in a static page
as it does in Jupyter. :func:`calculator_form` puts controls for every argument of the
calculator above such a table and redraws it on each change; the table lives in an
``Output`` widget, so the last one drawn is kept in the notebook's widget state and a
static page still shows it (as :func:`lsdl_lab.book.widgets.optimizer_explorer` keeps its
picture). :func:`trade_offs` computes the rows of the trade-off map: every ZeRO stage with
every recomputation policy.

ipywidgets is an optional dependency; only :func:`calculator_form` needs it.
"""

from __future__ import annotations

import html
from collections.abc import Mapping

from ..memory.calculator import OPTIMIZERS, PRECISIONS, RECOMPUTE, GPTShape, gpt_memory
from ..memory.zero import ZERO_STAGES

__all__ = ["COLUMNS", "calculator_form", "memory_table", "trade_offs"]

COLUMNS = ("params", "grads", "optimizer_state", "activations", "total")
_GIB = 2.0**30


def memory_table(rows: Mapping[str, Mapping[str, float]], unit: str = "GiB") -> str:
    """An HTML table of bytes: one row per ``rows`` item (label to the dict of
    :func:`~lsdl_lab.memory.gpt_memory` or :func:`~lsdl_lab.memory.zero_bytes`), one
    column per category of :data:`COLUMNS` that any row has, in GiB or GB (``unit``)."""
    if unit not in ("GiB", "GB"):
        raise ValueError(f"Invalid unit: {unit!r} (expected 'GiB' or 'GB')")
    if not rows:
        raise ValueError("Invalid rows: empty (expected at least one row)")
    divisor = _GIB if unit == "GiB" else 1e9
    columns = [c for c in COLUMNS if any(c in r for r in rows.values())]
    head = "".join(f"<th>{c.replace('_', ' ')} ({unit})</th>" for c in columns)
    body = ""
    for label, row in rows.items():
        cells = "".join(
            f"<td style='text-align:right'>{row[c] / divisor:,.2f}</td>"
            if c in row
            else "<td></td>"
            for c in columns
        )
        body += f"<tr><th style='text-align:left'>{html.escape(str(label))}</th>{cells}</tr>"
    return f"<table><thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>"


def trade_offs(shape: GPTShape, dp: int, **options) -> dict[str, dict[str, float]]:
    """:func:`~lsdl_lab.memory.gpt_memory` of ``shape`` on ``dp`` data-parallel ranks for
    every ZeRO stage and recomputation policy, labelled ``"ZeRO-s, recompute r"``;
    ``options`` go to ``gpt_memory`` (precision, optimizer, tp, ...)."""
    return {
        f"ZeRO-{stage}, recompute {policy}": gpt_memory(
            shape, zero_stage=stage, dp=dp, recompute=policy, **options
        )
        for stage in ZERO_STAGES
        for policy in RECOMPUTE
    }


def calculator_form(shape: GPTShape | None = None, dp: int = 8):
    """A form for :func:`~lsdl_lab.memory.gpt_memory`: integer boxes for the GPT's shape
    (layers, hidden size, heads, sequence length, micro-batch, vocabulary) and the
    data-parallel degree, dropdowns for the precision, the optimizer (8-bit Adam among
    them), the ZeRO stage and the recomputation policy, a box for FP8 linear layers; below
    them the table of bytes per rank. Returns an
    ipywidgets ``VBox`` with ``box.controls`` (name to widget) and ``box.output`` (the
    ``Output`` holding the table). A bad combination (heads that do not divide the hidden
    size) shows its error in place of the table."""
    import ipywidgets as widgets

    # GPT-3 XL, 1.3B parameters (16 heads of 128: Brown et al.'s Table 2.1 says 24 of 128,
    # which does not make its width 2048)
    shape = shape or GPTShape(24, 2048, 16, 2048, 1, 51200)
    style = {"description_width": "120px"}

    def box(name, value, low=1):
        return widgets.BoundedIntText(
            value=value, min=low, max=10**7, description=name, style=style
        )

    def choice(name, options, value):
        return widgets.Dropdown(options=options, value=value, description=name, style=style)

    controls = {
        "layers": box("layers", shape.layers),
        "hidden": box("hidden size", shape.hidden),
        "heads": box("heads", shape.heads),
        "seq_len": box("sequence length", shape.seq_len),
        "micro_batch": box("micro-batch", shape.micro_batch),
        "vocab": box("vocabulary", shape.vocab),
        "dp": box("data parallel", dp),
        "precision": choice("precision", PRECISIONS, "bf16"),
        "optimizer": choice("optimizer", OPTIMIZERS, "adam"),
        "zero_stage": choice("ZeRO stage", ZERO_STAGES, 0),
        "recompute": choice("recompute", RECOMPUTE, "none"),
        "fp8": widgets.Checkbox(value=False, description="FP8 linears", style=style),
    }  # fmt: skip
    output = widgets.Output()
    form = widgets.VBox(
        [widgets.HBox([widgets.VBox(list(controls.values())[:6]),
                       widgets.VBox(list(controls.values())[6:])]), output]
    )  # fmt: skip
    form.controls, form.output = controls, output

    def redraw(_=None):
        v = {name: c.value for name, c in controls.items()}
        try:
            gpt = GPTShape(v["layers"], v["hidden"], v["heads"], v["seq_len"], v["micro_batch"],
                           v["vocab"])  # fmt: skip
            options = {k: v[k] for k in ("precision", "optimizer", "zero_stage", "dp", "recompute",
                                         "fp8")}  # fmt: skip
            row = gpt_memory(gpt, **options)
            text = memory_table({"per rank": row})
        except (TypeError, ValueError) as error:
            text = f"<p><b>{html.escape(str(error))}</b></p>"
        output.outputs = ({"output_type": "display_data", "data": {"text/html": text},
                           "metadata": {}},)  # fmt: skip

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return form
