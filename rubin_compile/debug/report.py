"""Turning a pass-manager report (the dict written to report.json) into tables for people."""

from __future__ import annotations

from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, dict):  # False / None entries say nothing in a table; report.json keeps them
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items() if v is not False and v is not None)
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _nodes(names: list[str]) -> str:
    """A node list short enough for a table cell; report.json keeps the whole list."""
    return ", ".join(names) if len(names) <= 6 else f"{len(names)} nodes: {', '.join(names[:4])}, ..."


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _spec(spec: dict[str, Any]) -> str:
    quant = spec.get("quant", "none")
    parts = [spec.get("act_dtype", "?") if quant == "none" else f"{quant} (act {spec.get('act_dtype')})"]
    if spec.get("block_shape"):
        parts.append("block " + "x".join(map(str, spec["block_shape"])))
    parts += [f"{k}={v}" for k, v in spec.get("shape", {}).items()]
    if spec.get("activation"):
        parts.append(spec["activation"])
    if spec.get("weight_layout", "plain") != "plain":
        parts.append(f"weights {spec['weight_layout']}")
    return " ".join(parts)


def _plan_tables(plans: list[dict[str, Any]]) -> list[str]:
    """select_kernels: the kernel per node, then every rejected candidate with its reason."""
    lines = _table(
        ["node", "canonical op", "spec", "kernel", "runs", "also supported", "forced"],
        [
            [
                p["node"],
                p["canonical_op"],
                _spec(p["spec"]),
                f"{p['kernel']} ({p['target']})",
                (p["entry"] or "-") + ("; lowered to ATen" if p.get("lowered") else ""),
                ", ".join(p.get("outranked", [])) or "-",
                "-" if p.get("forced") is None else p["forced"] + (" (rejected)" if p.get("forced_reason") else ""),
            ]
            for p in plans
        ],
    )
    rejected = [[p["node"], r["kernel"], r["reason"]] for p in plans for r in p["rejected"]]
    if rejected:
        lines += ["", *_table(["node", "rejected kernel", "why"], rejected)]
    lines.append("")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: one section per pass, a table of rewrites and one of what was left unchanged."""
    lines = [f"# rubin report for graph `{report['graph_id']}`", ""]
    lines.append(f"source: {report.get('source')}; options: {_cell(report.get('options', {}))}")
    lines.append("")
    target = report.get("target")
    if target:
        lines.append(f"target: {target['name']} ({target.get('description', '')})")
        lines.append("")
    for error in report.get("reporting_errors", []):
        lines.append(f"- reporting error (the compile went on): {error}")
    for p in report["passes"]:
        status = [f"{len(p['rewrites'])} rewritten"]
        if p.get("plans"):
            status.append(f"{len(p['plans'])} kernel(s) chosen")
        if p.get("decisions"):
            status.append(f"{len(p['decisions'])} decision(s)")
        if p["unchanged"]:
            status.append(f"{len(p['unchanged'])} left unchanged")
        status.append("graph changed" if p["changed"] else "graph unchanged")
        status.append(f"{p['seconds'] * 1e3:.1f} ms")
        lines.append(f"## {p['name']}: " + "; ".join(status))
        lines.append("")
        if p["rewrites"]:
            lines += _table(
                ["node", "canonical op", "source idiom", "replaced", "details"],
                [
                    [r["node"], r["canonical_op"], r["source_idiom"], _nodes(r["replaced"]), r["details"]]
                    for r in p["rewrites"]
                ],
            )
            lines.append("")
        if p.get("plans"):
            lines += _plan_tables(p["plans"])
        if p.get("decisions"):
            lines += _table(
                ["node", "canonical op", "decision", "why", "details"],
                [
                    [d["node"], d["canonical_op"], d["decision"], d["reason"], d.get("details") or "-"]
                    for d in p["decisions"]
                ],
            )
            lines.append("")
        if p["unchanged"]:
            lines += _table(
                ["node", "idiom", "left unchanged because"],
                [[u["node"], u["idiom"], u["reason"]] for u in p["unchanged"]],
            )
            lines.append("")
        for note in p["notes"]:
            lines.append(f"- {note}")
        if p["notes"]:
            lines.append("")
    return "\n".join(lines)
