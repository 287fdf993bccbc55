"""Hugging Face ``generate()`` with a static KV cache under ``backend="rubin"``, family by family, on tiny models.

    python -m rubin_compile.debug.generate_families [--write docs/generate-families.md] [--only TYPE,...]

The families are the MoE families ``moe_families`` finds in the installed transformers that have a causal LM,
and a few dense decoders (``DENSE``). Each is built from the same tiny random configuration as the MoE survey
(``moe_families.tiny_config``: hidden size 64, one decoder layer, 8 experts top-2, vocabulary 128; fp32, seed
0), with its cache on, and generates ``NEW_TOKENS`` greedy tokens after a random prompt of ``PROMPT`` tokens with
``cache_implementation="static"``: once eager, once with ``model.forward = torch.compile(model.forward,
backend="rubin", dynamic=False)`` (prefill and decode each compile once, as examples/generate.py does it). The row
says whether the ids are eager's, how many graphs were compiled (2 is prefill + decode; more means the model's
forward recompiles while it decodes, which happens under any backend, e.g. transformers' sliding-window cache), and
what rubin did in the decode step's graph: the attention over the static cache rewritten into ``rubin.attention``
(from an SDPA call, or from the model's eager attention written out as ops, with attention sinks where it has
them; or left alone, with the reason from the report) and the MoE blocks rewritten into ``rubin.moe``.

``--write PATH`` writes the table as markdown; nothing in it depends on the machine (no timings, no paths). No test
compares the whole file (about ten minutes on two cores); ``tests/cpu/test_generate_families.py`` runs a few
families through ``survey_one`` and checks the same findings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from rubin_compile.debug import moe_families

PROMPT, NEW_TOKENS = 12, 8
# Dense decoders beside the MoE families (model types; each builds from the same tiny values).
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere2", "granite")


@dataclasses.dataclass
class Row:
    model_type: str
    kind: str  # "moe" or "dense"
    built: str = "-"
    status: str = ""  # "ids equal eager's", "ids differ ...", "skipped: ...", "eager failed: ...", "failed: ..."
    equal: Optional[bool] = None
    graphs: int = 0  # graphs compiled over the whole generate()
    attention: str = "-"  # in the decode graph
    moe: str = "-"  # in the decode graph
    seconds: float = 0.0


def families(only: Optional[Sequence[str]] = None) -> list[tuple[str, str, str]]:
    """(model type, the model type to build, "moe" / "dense") for every family surveyed."""
    found, _ = moe_families.discover()
    out = [(f.model_type, f.build_type, "moe") for f in found if f.build_type is not None]
    out += [(t, t, "dense") for t in DENSE]
    if only:
        out = [f for f in out if f[0] in only]
    return out


def _generate(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,  # transformers' own compile of the forward (on a GPU) is not what is surveyed
    )
    with torch.inference_mode():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)


def _decode_reports(dump_dir: Path) -> list[dict]:
    """The reports of the graphs of the first decode step. Dump folders are named ``g<n>-<frame>_<compile>``: the
    prefill compiles each frame first (``_0``) and the first decode step compiles it again (``_1``, the static
    shapes changed), one graph per frame where the model's forward breaks into several. A forward that compiles
    once per decode step keeps its later graphs out (``_2`` and on)."""
    graphs = sorted(p for p in dump_dir.iterdir() if p.is_dir() and (p / "report.json").exists())
    first_step = [g for g in graphs if g.name.endswith("_1")]
    return [json.loads((g / "report.json").read_text()) for g in first_step]


def _merged(reports: list[dict], name: str) -> dict:
    """One pass's rewrites and unchanged records over several graphs."""
    passes = [p for r in reports for p in r["passes"] if p["name"] == name]
    return {
        "rewrites": [w for p in passes for w in p["rewrites"]],
        "unchanged": [u for p in passes for u in p["unchanged"]],
    }


def _attention_text(reports: list[dict]) -> str:
    p = _merged(reports, "match_attention")
    rewrites = p["rewrites"]
    parts = []
    if rewrites:
        cache = [r["details"].get("kv_cache", "") for r in rewrites]
        static = sum(c.startswith("static cache") for c in cache)
        text = f"rewritten: {len(rewrites)}, static cache read by {static}"
        eager = sum(r["source_idiom"].startswith("eager attention") for r in rewrites)
        sinks = sum(r["details"].get("sinks") is not None for r in rewrites)
        if eager:  # matmul -> softmax -> matmul (the model's eager attention), not an SDPA call
            text += f", {eager} written out as ops" + (f" ({sinks} with attention sinks)" if sinks else "")
        parts.append(text)
    for reason in sorted({u["reason"] for u in p["unchanged"]}):
        count = sum(u["reason"] == reason for u in p["unchanged"])
        parts.append(f"left unchanged ({count}): {reason}")
    return "; ".join(parts) or "no attention seen"


def _moe_text(reports: list[dict]) -> str:
    p = _merged(reports, "match_moe")
    n, left = len(p["rewrites"]), p["unchanged"]
    text = f"rewritten: {n}" if n else ""
    if left:
        text += (
            "; " if text else ""
        ) + f"left unchanged: {len(left)} ({moe_families._first_clause(left[0]['reason'])})"
    return text or "-"


def survey_one(model_type: str, build_type: str, kind: str) -> Row:
    """Build one family's tiny model, generate eager and under rubin; its row."""
    start = time.perf_counter()
    row = Row(model_type, kind)
    try:
        return _survey(row, build_type)
    finally:
        torch._dynamo.reset()
        row.seconds = time.perf_counter() - start


def _survey(row: Row, build_type: str) -> Row:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = moe_families.tiny_config(CONFIG_MAPPING[build_type]())
        config.use_cache = True  # the MoE survey's tiny values turn it off
        cls = moe_families.model_class(config)
        if cls is None or not cls.__name__.endswith("ForCausalLM"):
            row.status = f"skipped: no causal LM ({cls.__name__ if cls else 'no model class'} takes the ids)"
            return row
        row.built = cls.__name__
        torch.manual_seed(0)
        model = cls(config).float().eval()
        model.generation_config.pad_token_id = 0
        prompt = torch.randint(1, moe_families.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))
        want = _generate(model, prompt)
    except Exception as exc:  # noqa: BLE001  (the survey reports every family, whatever fails)
        row.status = f"eager failed: {moe_families._error(exc)}"
        return row
    with tempfile.TemporaryDirectory(prefix="rubin-generate-families-") as tmp:
        dump_dir = Path(tmp)
        try:
            torch._dynamo.reset()
            options = {"dump_dir": str(dump_dir), "inductor": {"compile_threads": 1}}
            model.forward = torch.compile(model.forward, backend="rubin", dynamic=False, options=options)
            got = _generate(model, prompt)
        except Exception as exc:  # noqa: BLE001
            row.status = f"failed: {moe_families._error(exc)}"
            return row
        row.graphs = sum(1 for p in dump_dir.glob("*/report.json"))
        decode = _decode_reports(dump_dir)
    if decode:
        row.attention, row.moe = _attention_text(decode), _moe_text(decode)
    row.equal = bool(torch.equal(got, want))
    if row.equal:
        row.status = "ids equal eager's"
    else:
        col = int((got != want).nonzero()[:, 1].min()) - PROMPT if got.shape == want.shape else -1
        row.status = f"ids differ from new token {col}" if col >= 0 else f"ids of shape {tuple(got.shape)}"
    return row


def survey(only: Optional[Sequence[str]] = None, progress: Any = None) -> list[Row]:
    rows = []
    for model_type, build_type, kind in families(only):
        row = survey_one(model_type, build_type, kind)
        rows.append(row)
        if progress:
            progress(row)
    return rows


def render(rows: list[Row]) -> str:
    import transformers

    ran = [r for r in rows if r.equal is not None]
    lines = [
        "# generate() with a static cache under rubin, family by family",
        "",
        "Generated by `python -m rubin_compile.debug.generate_families --write docs/generate-families.md` (do not edit",
        "by hand). Tiny random models (the MoE survey's, docs/models.md; hidden size 64, one decoder layer, fp32), greedy",
        f'generate() of {NEW_TOKENS} tokens after {PROMPT} with `cache_implementation="static"`, eager and with',
        '`model.forward = torch.compile(model.forward, backend="rubin", dynamic=False)`, on the CPU.',
        "",
        f"Versions: transformers {transformers.__version__}, torch {torch.__version__}.",
        "",
        "Columns: *graphs*: compiled over the whole generate() (2 = prefill + decode; more: the forward recompiles "
        "while decoding, under any backend); *attention* and *MoE*: what rubin's report says of the decode step's "
        "graph (*static cache read by N*: how many of the rewritten attentions take the cache buffers themselves "
        "as keys / values, so that a decode kernel reads only the written positions; 0 where the keys / values "
        "are computed from the cache each step; *N written out as ops*: rewritten from the model's eager attention, "
        "`softmax(q @ k^T) @ v` as ops, not an SDPA call, with attention sinks where it says so); *ids*: against "
        "eager's.",
        "",
        f"Families: {len(rows)}; generated under rubin: {len(ran)}; ids equal eager's: "
        f"{sum(bool(r.equal) for r in ran)}.",
        "",
        "| model type | kind | built | graphs | attention (decode graph) | MoE (decode graph) | ids |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r.model_type}`", r.kind, r.built, str(r.graphs or "-"), r.attention, r.moe, r.status]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the markdown table here (docs/generate-families.md)")
    parser.add_argument("--only", help="comma-separated model types")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else None
    rows = survey(only, progress=lambda r: print(f"{r.model_type}: {r.status} ({r.seconds:.0f} s)", flush=True))
    text = render(rows)
    if args.write:
        Path(args.write).write_text(text)
    else:
        print(text)
    return 0 if all(r.equal is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
